"""``cpu_heap``: glibc keeps a CPU run's freed memory for the next step (visattn/cpu_heap.py)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from visattn import cli, cpu_heap
from visattn.config import load_config
from visattn.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
GLIBC = cpu_heap._glibc() is not None and hasattr(cpu_heap._glibc(), "mallinfo2")
needs_glibc = pytest.mark.skipif(not GLIBC, reason="glibc 2.33+ on Linux (mallopt, mallinfo2) not here")

# in a fresh process (the settings are process-wide): allocate and free a 64 MiB tensor twice, reporting the bytes
# glibc holds in mmapped chunks while it lives and the free bytes its heap keeps after
PROBE = textwrap.dedent("""
    import ctypes, json, sys
    import torch
    from visattn import cpu_heap

    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                  "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = Info
    set_ = {"keep": cpu_heap.keep_freed_memory, "system": cpu_heap.system_defaults, "none": lambda: None}
    applied = set_[sys.argv[1]]()
    out = []
    for _ in range(2):
        t = torch.ones(64 * 2**20, dtype=torch.uint8)
        live = libc.mallinfo2().hblkhd
        del t
        out.append({"mmapped_live": live, "heap_free_after": libc.mallinfo2().fordblks})
    print(json.dumps({"applied": applied, "rounds": out}))
""")


def probe(mode: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@needs_glibc
def test_keep_serves_a_large_tensor_from_the_heap_and_keeps_it_when_freed():
    MiB = 2**20
    keep = probe("keep")
    assert keep["applied"] is True
    for r in keep["rounds"]:
        assert r["mmapped_live"] < 64 * MiB  # not a fresh mmap
        assert r["heap_free_after"] >= 64 * MiB  # freed into the heap, kept there for the next one
    for mode in ("none", "system"):  # glibc's own settings (untouched, or set back): a fresh mmap, given back
        got = probe(mode)
        assert got["applied"] is (True if mode == "system" else None)
        assert got["rounds"][0]["mmapped_live"] >= 64 * MiB
        assert got["rounds"][0]["heap_free_after"] < 64 * MiB


def test_the_config_takes_keep_or_system_and_refuses_others_in_one_line():
    assert load_config(ROOT / "configs" / "smoke.yaml").cpu_heap == "keep"  # the default
    assert load_config(ROOT / "configs" / "smoke.yaml", ["cpu_heap=system"]).cpu_heap == "system"
    with pytest.raises(ConfigError, match="cpu_heap") as e:
        load_config(ROOT / "configs" / "smoke.yaml", ["cpu_heap=always"])
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="unknown mode 'always'"):
        cpu_heap.apply("always")


@pytest.mark.parametrize("device, mode, expect", [("cpu", "keep", ["keep"]), ("cpu", "system", ["system"]),
                                                   ("cuda", "keep", [])])
def test_train_py_sets_the_heap_of_its_own_process_for_a_cpu_run(monkeypatch, device, mode, expect):
    """train.py (cli.main) makes the setting for a run on a CPU; the trainer itself leaves its caller's process
    alone (it is not called there)."""
    calls = []
    monkeypatch.setattr(cpu_heap, "apply", lambda m: calls.append(m) or m == "keep")
    monkeypatch.setattr("visattn.options.resolve_device", lambda name: __import__("torch").device(device))
    monkeypatch.setattr("visattn.trainer.run", lambda cfg: {"best_val_acc": 0.1, "epochs": 0, "wall_seconds": 0.0,
                                                            "eval_split": "val", "run_dir": cfg.run_dir})
    assert cli.main(["--config", str(ROOT / "configs" / "smoke.yaml"), f"cpu_heap={mode}", f"device={device}"]) == 0
    assert calls == expect


def test_the_trainer_does_not_touch_the_heap(monkeypatch, tmp_path, tiny_overrides):
    from visattn.trainer import run

    monkeypatch.setattr(cpu_heap, "apply", lambda m: pytest.fail("trainer.run changed the process's allocator"))
    monkeypatch.setattr(cpu_heap, "keep_freed_memory", lambda: pytest.fail("trainer.run changed the allocator"))
    run(load_config(ROOT / "configs" / "smoke.yaml", tiny_overrides),
        log=lambda *a, **k: None)
