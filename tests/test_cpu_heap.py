"""``cpu_heap``: glibc keeps a CPU run's freed memory for the next step (visattn/cpu_heap.py). The setting belongs to
the whole process, so what it does is probed in processes of their own (conftest keeps this one's as it is)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from visattn import cli, cpu_heap
from visattn.config import load_config
from visattn.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.yaml"
GLIBC = cpu_heap._glibc() is not None and hasattr(cpu_heap._glibc(), "mallinfo2")
needs_glibc = pytest.mark.skipif(not GLIBC, reason="glibc 2.33+ on Linux (mallopt, mallinfo2) not here")

# in a fresh process: allocate and free a tensor of each size twice, reporting the bytes glibc maps for it (mmapped
# chunks) while it lives and the free bytes its heap keeps after
PROBE = textwrap.dedent("""
    import ctypes, json, sys
    import torch
    from visattn import cpu_heap

    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                  "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = Info
    applied = cpu_heap.apply(sys.argv[1])
    out = {}
    for mib in (1, 64):
        rounds = []
        for _ in range(2):
            before = libc.mallinfo2().hblkhd
            t = torch.ones(mib * 2**20, dtype=torch.uint8)
            live = libc.mallinfo2().hblkhd - before
            del t
            rounds.append({"mmapped_live": live, "heap_free_after": libc.mallinfo2().fordblks})
        out[mib] = rounds
    print(json.dumps({"applied": applied, "in_effect": cpu_heap.in_effect(), "sizes": out}))
""")


def probe(mode: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@needs_glibc
def test_keep_serves_tensors_from_the_heap_and_keeps_them_when_freed():
    MiB = 2**20
    keep = probe("keep")
    assert keep["applied"] is True and keep["in_effect"] == "keep"
    for mib, rounds in keep["sizes"].items():
        for r in rounds:
            assert r["mmapped_live"] < int(mib) * MiB  # not a fresh mmap
            assert r["heap_free_after"] >= int(mib) * MiB  # freed into the heap, kept there for the next one
    # glibc left alone: 64 MiB is above any threshold its own rule reaches (a fresh mmap each time, given back when
    # freed); 1 MiB may already be below the threshold that rule raised while torch loaded
    system = probe("system")
    assert system["applied"] is False and system["in_effect"] == "system"
    for r in system["sizes"]["64"]:
        assert r["mmapped_live"] >= 64 * MiB and r["heap_free_after"] < 64 * MiB


def test_the_config_takes_keep_or_system_and_refuses_others_in_one_line():
    assert load_config(SMOKE).cpu_heap == "keep"  # the default
    assert load_config(SMOKE, ["cpu_heap=system"]).cpu_heap == "system"
    with pytest.raises(ConfigError, match="cpu_heap") as e:
        load_config(SMOKE, ["cpu_heap=always"])
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="unknown mode 'always'"):
        cpu_heap.apply("always")


@pytest.mark.parametrize("device, mode, expect", [("cpu", "keep", ["keep"]), ("cpu", "system", ["system"]),
                                                   ("cuda", "keep", [])])
def test_train_py_sets_the_heap_before_a_cpu_run_starts(monkeypatch, device, mode, expect):
    calls, seen = [], []

    def fake_run(cfg):
        seen.append(list(calls))  # what had been set when the run began
        return {"best_val_acc": 0.1, "epochs": 0, "wall_seconds": 0.0, "eval_split": "val", "run_dir": cfg.run_dir}

    monkeypatch.setattr(cpu_heap, "apply", lambda m: calls.append(m) or m == "keep")
    monkeypatch.setattr("visattn.options.resolve_device", lambda name: torch.device(device))
    monkeypatch.setattr("visattn.trainer.run", fake_run)
    assert cli.main(["--config", str(SMOKE), f"cpu_heap={mode}", f"device={device}"]) == 0
    assert seen == [expect]


@pytest.mark.parametrize("made", [False, True])
def test_the_trainer_leaves_its_callers_allocator_alone_and_records_it(monkeypatch, tiny_overrides, made):
    """run_info.json says whether this process had the setting made (by train.py, or the caller) when the run began."""
    from visattn.trainer import run

    monkeypatch.setitem(cpu_heap._state, "keep", made)

    def refuse(*_):
        pytest.fail("trainer.run changed the process's allocator")

    for name in ("apply", "keep_freed_memory", "_glibc"):
        monkeypatch.setattr(cpu_heap, name, refuse)
    cfg = load_config(SMOKE, [*tiny_overrides, "train.epochs=1"])
    run(cfg, log=lambda *a, **k: None)
    assert json.loads((Path(cfg.run_dir) / "run_info.json").read_text())["cpu_heap"] == ("keep" if made else "system")


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.cpu_heap", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=600)


@needs_glibc
def test_the_bench_compares_fresh_processes_and_adds_each_run_to_its_file(tmp_path):
    out = tmp_path / "heap.json"
    earlier = {"speedup": {"none": 1.0}, "command": "an earlier run"}
    out.write_text(json.dumps({"runs": [earlier]}))
    small = ["--blocks", "none", "--pairs", "1", "--repeats", "1", "--steps", "1", "--batch", "8", "--threads", "1"]
    done = bench(*small, "--out", str(out))
    assert done.returncode == 0, done.stderr
    first, run = json.loads(out.read_text())["runs"]  # added after the earlier run, which is kept as it was
    assert first == earlier
    assert {(r["block"], r["setting"]) for r in run["rows"]} == {("none", "keep"), ("none", "system")}
    assert [(p["setting"], p["applied"]) for p in run["processes"]] == [("system", False), ("keep", True)]
    assert run["speedup"]["none"] > 0 and run["batch_size"] == 8 and run["command"].startswith("python -m bench")
    other = tmp_path / "other.json"
    other.write_text('{"rows": []}')
    for args, words in ((["--out", str(other)], "not a results file of bench.cpu_heap"), (["--steps", "0"], "--steps"),
                        (["--pairs", "0"], "--pairs")):
        done = bench("--blocks", "none", *args)  # refused before anything is measured
        assert done.returncode == 2 and words in done.stderr and len(done.stderr.strip().splitlines()) == 1, args
    assert other.read_text() == '{"rows": []}'


def test_docs_training_tells_the_measured_runs():
    """docs/training.md's figures are bench/results/cpu_heap.json's runs, as ``python -m bench.cpu_heap --doc``
    writes them."""
    from bench import cpu_heap as bench_heap

    runs = bench_heap.read_runs(bench_heap.RESULTS)
    assert runs and all(r["batch_size"] == 512 and r["pairs"] >= 3 and r["precision"] == "bf16" for r in runs)
    assert all(p["applied"] is (p["setting"] == "keep") for r in runs for p in r["processes"])
    page = bench_heap.DOC.read_text()
    begin, end = bench_heap.MARKERS
    assert page.split(begin)[1].split(end)[0].strip() == bench_heap.summary(runs), "run python -m bench.cpu_heap --doc"


def test_the_bf16_line_quotes_the_last_run_as_the_file_gives_it():
    from bench import cpu_heap as bench_heap

    run = bench_heap.read_runs(bench_heap.RESULTS)[-1]
    rows = {(r["block"], r["setting"]): r for r in run["rows"]}
    page = (ROOT / "docs" / "blocks.md").read_text()
    text = " ".join(page[page.index("**Memory between steps**"):].split())[:1200]  # line breaks as spaces
    assert f"`none`'s step from {rows[('none', 'system')]['page_faults_per_step'] / 1000:.1f}k page faults" in text
    assert f"ran it {run['speedup']['none']:.2f}x as fast" in text and f"non-local's {run['speedup']['nonlocal']:.2f}x" in text
    assert (f"ratio read {rows[('nonlocal', 'system')]['ratio']:.3f} with glibc left alone and "
            f"{rows[('nonlocal', 'keep')]['ratio']:.3f} with `keep`") in text
    assert rows[("none", "keep")]["page_faults_per_step"] < 1000  # "to none": fewer than a thousand a step
