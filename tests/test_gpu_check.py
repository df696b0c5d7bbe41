"""``bench/gpu_check.sh``: its dry run on the CPU end to end (every row of the summary produced, in order), its
time guard, the rows it reads back (the race, the blocks bench), its fp16 overflow probe and the docs' table."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT
from test_bench import _load

check = _load("gpu_check")
SCRIPT = ROOT / "bench" / "gpu_check.sh"
# the rows that must pass on a CPU (the others: the data row has nothing to decode; the blocks bench and the timm
# model may be "not available" on a revision without them)
MUST_PASS = ("race", "bf16_compile", "fp16_overflow", "channels_last", "sigterm_resume", "maps_autocast",
             "torchrun_nccl")


def _sh(tmp_path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], env={**os.environ, "PY": sys.executable, **env},
                          capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_the_dry_run_writes_every_row_and_prints_the_summary(tmp_path):
    out = tmp_path / "out"
    done = _sh(tmp_path, GPU_CHECK_DRY="1", OUT=str(out))
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    result = json.loads((out / "gpu_check.json").read_text())
    assert result["dry"] is True and result["torch"] == torch.__version__
    assert {"device", "cuda", "date", "git", "budget_seconds"} <= result.keys()
    rows = {r["name"]: r for r in result["rows"]}
    assert [r["name"] for r in result["rows"]] == list(check.ROWS)
    assert all(r["status"] in check.STATUSES and r["detail"] for r in result["rows"])
    failed = {n: rows[n]["detail"] for n in MUST_PASS if rows[n]["status"] != "pass"}
    assert not failed, f"{failed}; log: {(out / 'gpu_check.log').read_text()[-3000:]}"
    assert rows["data"]["status"] == "skipped on the CPU"
    assert rows["blocks"]["status"] in ("pass", "not available") and rows["timm"]["status"] in ("pass", "not available")
    # the probes saw what they check: the forced fp16 overflow skipped and counted, the SIGTERM's saved state
    assert rows["fp16_overflow"]["probe"]["weights_unchanged"] is True and rows["fp16_overflow"]["skipped_steps"] >= 1
    assert rows["sigterm_resume"]["saved_step"] >= check.SIGTERM_AT
    assert rows["maps_autocast"]["tensorboard"]["map_images"] > 0
    race = json.loads((out / "gpu_race.json").read_text())
    assert race["complete"] is True and [r["recipe"] for r in race["runs"]] == ["airbench94", "visattn"]
    # the summary at the end: the device line, then every row in order
    tail = done.stdout.split("\nGPU check (DRY RUN")[1].splitlines()[1:len(check.ROWS) + 1]
    assert [line.split()[0] for line in tail] == list(check.ROWS)
    table = _sh(tmp_path, "--table", str(out / "gpu_check.json"))
    assert table.returncode == 0 and all(f"| `{name}` |" in table.stdout for name in check.ROWS)


def _check(tmp_path, budget: float = 100.0, dry: bool = False):
    return check.Check(tmp_path, tmp_path, "data.tar.gz", dry, budget, 3)


def test_rows_past_the_budget_are_not_run_and_the_json_is_written_after_each(tmp_path):
    """A row that spends the budget leaves the later ones "not run"; a row that raises is a fail row and the
    check goes on; the JSON is rewritten after every row."""
    c, result, writes = _check(tmp_path, budget=1000), {"rows": []}, []

    def spend(c, limit):
        assert limit == check.CAPS["race"]  # its own cap, less than the budget left
        return {"status": "pass", "detail": "ran"}

    def broken(c, limit):
        c.deadline = time.monotonic() + 5  # less than MIN_START left after this row
        raise RuntimeError("the row broke")

    rows = {"race": spend, "bf16_compile": broken, "timm": spend}
    check.run_rows(c, list(rows), result, lambda: writes.append(len(result["rows"])), rows=rows)
    assert [(r["name"], r["status"]) for r in result["rows"]] == [("race", "pass"), ("bf16_compile", "fail"),
                                                                  ("timm", "not run")]
    assert "RuntimeError: the row broke" in result["rows"][1]["detail"] and writes == [1, 2, 3]
    assert "the row broke" in (tmp_path / "gpu_check.log").read_text()  # its traceback


def test_a_child_past_its_limit_is_stopped_with_its_process_group(tmp_path):
    c = _check(tmp_path)
    pid_file = tmp_path / "grandchild.pid"
    code = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    r = c.spawn("sleeper", [sys.executable, "-c", code], limit=3)
    assert r["rc"] is None and check.failed(r)["status"] == "timed out"
    status = f"/proc/{int(pid_file.read_text())}/status"
    time.sleep(0.2)  # the whole group went, not only the process the check started (a zombie counts as gone)
    assert not os.path.exists(status) or "State:\tZ" in open(status).read()
    assert "=== sleeper: stopped at its limit" in (tmp_path / "gpu_check.log").read_text()


def _race_run(recipe: str, seed: int, acc: float, t) -> dict:
    return {"recipe": recipe, "seed": seed, "final_val_acc": acc, "seconds_to_target": t, "compile_seconds":
            30.0 if recipe == "visattn" else 0.0, "graphs_compiled_in_training": 0}


def test_the_race_row_reads_a_finished_or_a_cut_race():
    runs = [_race_run(r, s, 0.905, t) for s in range(3) for r, t in (("airbench94", 4.0), ("visattn", 3.6))]
    race = {"complete": True, "runs": runs, "ratio_visattn_over_airbench94": 0.9,
            "median_seconds_to_target": {"visattn": 3.6, "airbench94": 4.0}}
    row = check.race_row(race, timed_out=False, dry=False)
    assert row["status"] == "pass" and "visattn / airbench94 = **0.90**" in row["detail"]
    assert "3.60 s vs 4.00 s" in row["detail"] and row["val_acc"]["visattn"] == [90.5, 90.5, 90.5]
    cut = dict(race, complete=False, runs=runs[:3])  # stopped after the second seed's first run
    assert check.race_row(cut, timed_out=True, dry=False)["status"] == "timed out"
    assert check.race_row(cut, timed_out=False, dry=False)["status"] == "partial"
    assert "not a claim" in check.race_row(race, timed_out=False, dry=True)["detail"]


@pytest.mark.parametrize("dry", [True, False])
def test_the_blocks_row_calls_blocks_py_with_the_devices_flags(tmp_path, monkeypatch, dry):
    """The dry run: ``--quick`` on the CPU. On the GPU: eager, 5 repeats of 5 steps, and the "before" blocks from
    ``--prepare``'s folder, since the tree reaches the device without its git history; the JSON beside the others."""
    (tmp_path / "bench").mkdir()  # python -m bench.blocks there: the stand-in
    (tmp_path / "bench" / "__init__.py").write_text("")
    (tmp_path / "bench" / "blocks.py").write_text("import sys\nprint('| ' + ' '.join(sys.argv[1:]) + ' |')\n")
    before = tmp_path / "data" / "gpu_check" / "before"
    before.mkdir(parents=True)
    monkeypatch.setattr(check, "ROOT", tmp_path)
    row = check.row_blocks(_check(tmp_path, dry=dry), 30)
    out = f"--out {tmp_path / 'block_speed.json'}"
    only = "--only " + " ".join(check.TARGET_BLOCKS)  # the eight blocks with targets: all would overrun the cap
    assert row["status"] == "pass"
    if dry:
        assert f"--device cpu --quick {only} {out}" in row["table"] and "not a claim" in row["detail"]
    else:
        assert f"--device cuda --no-compile --repeats 5 --steps 5 {only} --before {before} {out}" in row["table"]


def test_blocks_py_reads_the_before_blocks_from_a_prepared_folder(tmp_path):
    """``--before`` may name a folder of a revision's ``visattn/attention`` files (what ``gpu_check.sh --prepare``
    exports): the same classes load as from git, and the JSON names the revision its REVISION file records."""
    blocks = _load("blocks")
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode:
        pytest.skip("not a git checkout")
    for name in ("channel", "spatial", "self_attn2d", "functional", "tap"):
        (tmp_path / f"{name}.py").write_text(blocks.before_source(blocks.BEFORE, name))
    (tmp_path / "REVISION").write_text(blocks.BEFORE + "\n")
    loaded = blocks.load_before(str(tmp_path))
    assert set(blocks.TARGETS) <= set(loaded) and blocks.before_label(str(tmp_path)) == blocks.BEFORE
    x = torch.randn(2, 16, 5, 5, dtype=torch.float64)
    torch.manual_seed(0)
    a = blocks.load_before(blocks.BEFORE)["cbam"](16).double()
    b = loaded["cbam"](16).double()
    b.load_state_dict(a.state_dict())
    torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)
    (tmp_path / "tap.py").write_text("def broken(:\n")  # damaged: one line naming the file, not its traceback
    with pytest.raises(SystemExit, match=r"--before .*: \w+\.py does not load \(SyntaxError: .*tap\.py"):
        blocks.load_before(str(tmp_path))
    (tmp_path / "spatial.py").unlink()
    with pytest.raises(SystemExit, match="the folder has no spatial.py"):
        blocks.load_before(str(tmp_path))


def test_the_forced_fp16_overflow_is_skipped_and_backs_the_scale_off():
    """The fp16 row's scaler: its chosen step's gradients overflow, so the step leaves the weights as they were
    and halves the scale; the other steps train."""
    report = {}
    scaler = check._forced_overflow(2, report)(torch.device("cpu"), "fp16")
    assert check._forced_overflow(2, report)(torch.device("cpu"), "bf16") is None
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    weights = []
    for _ in range(3):
        opt.zero_grad()
        scaler.scale(model(torch.ones(8, 4)).square().mean()).backward()
        scaler.step(opt)
        scaler.update()
        weights.append(model.weight.detach().clone())
    assert report["weights_unchanged"] is True and report["scale_after"] == report["scale_before"] / 2
    assert torch.equal(weights[0], weights[1]) and not torch.equal(weights[1], weights[2])


def _result(*rows) -> dict:
    return {"device": "NVIDIA H200", "torch": "2.11.0", "cuda": "13.0", "date": "2026-12-02T10:00:00+00:00",
            "git": "abc123", "dry": False, "rows": [dict(r, seconds=1.0) for r in rows]}


def test_the_table_and_the_summary_have_a_line_per_row():
    result = _result({"name": "race", "status": "pass", "detail": "visattn / airbench94 = **0.95**"},
                     {"name": "timm", "status": "not available", "detail": "a | b"})
    table = check.table(result).splitlines()
    assert table[0].startswith("On NVIDIA H200 (torch 2.11.0, CUDA 13.0), 2026-12-02, git abc123")
    assert table[2:4] == ["| check | what | result | detail |", "|---|---|---|---|"]
    assert table[4] == f"| `race` | {check.WHAT['race']} | pass | visattn / airbench94 = **0.95** |"
    assert table[5].endswith("| not available | a / b |")  # a "|" in a detail does not split the cell
    lines = check.summary(result).splitlines()
    assert "NVIDIA H200" in lines[0] and [ln.split()[0] for ln in lines[1:]] == ["race", "timm"]


def test_a_rerun_of_some_rows_merges_into_the_first_calls_json(tmp_path, monkeypatch, capsys):
    from test_bench import _script_main

    first = _result({"name": "race", "status": "pass", "detail": "r"}, {"name": "timm", "status": "timed out", "detail": "t"})
    rerun = dict(_result({"name": "timm", "status": "pass", "detail": "again"}), date="2026-12-02T11:00:00+00:00")
    for name, result in (("first.json", first), ("rerun.json", rerun)):
        (tmp_path / name).write_text(json.dumps(result))
    code, out, _ = _script_main("gpu_check.py", monkeypatch, capsys, "--merge", str(tmp_path / "first.json"),
                                str(tmp_path / "rerun.json"))
    merged = json.loads(out)
    assert code == 0 and [(r["name"], r["detail"]) for r in merged["rows"]] == [("race", "r"), ("timm", "again")]
    assert merged["date"] == rerun["date"] and merged["merged_from"] == [first["date"], rerun["date"]]
    code, out, _ = _script_main("gpu_check.py", monkeypatch, capsys, "--table", str(tmp_path / "first.json"),
                                str(tmp_path / "rerun.json"))
    assert code == 0 and "| `timm` |" in out and "| pass | again |" in out


def test_the_shell_entry_refuses_an_unknown_argument(tmp_path):
    done = _sh(tmp_path, "--bogus")
    assert done.returncode == 2 and "usage: bash bench/gpu_check.sh" in done.stdout


def test_the_results_pages_gpu_check_table_is_the_recorded_one():
    """docs/results.md#gpu shows ``python -m bench.gpu_check --table bench/results/gpu/gpu_check.json``, or says
    no check is recorded yet."""
    marker = "<!-- gpu check table: python -m bench.gpu_check --table bench/results/gpu/gpu_check.json -->\n"
    block = (ROOT / "docs" / "results.md").read_text().split(marker)[1].split("<!-- end of gpu check table -->")[0]
    recorded = ROOT / "bench" / "results" / "gpu" / "gpu_check.json"
    if not recorded.is_file():
        assert "not recorded yet" in block.lower()
        return
    assert block.strip() == check.table(json.loads(recorded.read_text())).strip()


def test_the_gpu_blocks_row_measures_the_blocks_with_targets():
    """The GPU check's blocks row runs ``bench/blocks.py --only`` the blocks with targets (all 28 would not fit
    its cap): the list it spells out is bench/blocks.py's."""
    from bench import blocks, gpu_check

    assert tuple(gpu_check.TARGET_BLOCKS) == tuple(blocks.TARGETS)
