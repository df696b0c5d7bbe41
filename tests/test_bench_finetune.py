"""bench/finetune.py: the paired summary, the docs table it generates, and its one-line errors (no training)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

from bench import finetune
from visattn.errors import run_main


def _row(block: str, seed: int, acc: float, lr: float = 0.25) -> dict:
    return {"block": block, "seed": seed, "lr": lr, "epochs": 2, "base": f"b{seed}.pt", "base_epoch": 4,
            "base_val_acc": 0.86, "step0_val_acc": 0.86, "val_acc": acc, "train_seconds": 90.0,
            "precision": "bf16", "cpu": "cpu", "threads": 2, "git": "x", "run_dir": "r"}


def test_paired_differences_have_a_95_percent_t_interval():
    runs = [_row("none", s, a) for s, a in enumerate([0.870, 0.872, 0.868])]
    runs += [_row("cbam", s, a) for s, a in enumerate([0.873, 0.874, 0.874])]  # +0.3, +0.2, +0.6 points
    (p,) = finetune.paired(runs)
    assert p["block"] == "cbam" and p["seeds"] == [0, 1, 2]
    assert p["mean_diff"] == pytest.approx(0.3667, abs=1e-3)
    # t(0.975, 2) = 4.303 times the standard error of the three differences
    assert p["ci95"] == pytest.approx(4.303 * 0.2082 / 3 ** 0.5, abs=2e-3)
    table = finetune.table({"runs": runs, "paired": [p]})
    assert "| cbam | 0.25 | 0, 1, 2 | 86.00 ± 0.00 | 86.00 ± 0.00 | 87.37 ± 0.14 | +0.37 (-0.15 to +0.88) |" in table
    assert finetune.paired(runs[:3] + [_row("cbam", 5, 0.9)]) == []  # no none run on that seed: no pair


def test_the_docs_table_is_the_one_the_results_give():
    page = (ROOT / "docs" / "results.md").read_text()
    block = page.split(finetune.BEGIN + "\n")[1].split(finetune.END)[0]
    assert block.strip() == finetune.table(finetune.read()).strip()


def _script(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "bench.finetune", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def _main(*args: str, capsys) -> tuple:
    """The script's entry point in-process (as ``python -m bench.finetune ARGS`` runs it): (exit status, stderr)."""
    try:
        run_main(lambda: finetune.main(list(args)), "finetune.py")
        rc = 0
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


def test_report_rewrites_only_the_marked_block(tmp_path, capsys):
    results, doc = tmp_path / "ft.json", tmp_path / "doc.md"
    results.write_text(json.dumps({"runs": [_row("none", 0, 0.87), _row("se", 0, 0.871)], "paired": []}))
    doc.write_text(f"# page\n\n{finetune.BEGIN}\nold\n{finetune.END}\n\nafter\n")
    rc, err = _main("--report", "--results", str(results), "--doc", str(doc), capsys=capsys)
    assert rc == 0, err
    text = doc.read_text()
    assert text.startswith("# page\n\n") and text.endswith(f"{finetune.END}\n\nafter\n") and "old" not in text
    assert "| se | 0.25 | 0 | 86.00 | 86.00 | 87.10 | +0.10 |" in text


def test_bad_results_files_and_arguments_are_one_line(tmp_path, capsys):
    results, doc = tmp_path / "ft.json", tmp_path / "doc.md"
    doc.write_text(f"{finetune.BEGIN}\n{finetune.END}\n")
    results.write_text("{")
    r = _script("--report", "--results", str(results), "--doc", str(doc))  # the process: exit status, one line
    assert r.returncode == 2 and "unreadable results file" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "Traceback" not in r.stderr and doc.read_text() == f"{finetune.BEGIN}\n{finetune.END}\n"
    results.write_text("[]")
    rc, err = _main("--report", "--results", str(results), "--doc", str(doc), capsys=capsys)
    assert rc == 2 and "not a mapping with a list of runs" in err and len(err.strip().splitlines()) == 1
    results.write_text(json.dumps({"runs": [_row("none", 0, 0.87)], "paired": []}))
    rc, err = _main("--report", "--results", str(results), "--doc", str(tmp_path / "nodoc.md"), capsys=capsys)
    assert rc == 2 and "nodoc.md: the table's markers are missing (<!-- finetune table" in err  # (bench.common.splice)
    rc, err = _main("--report", "--results", str(tmp_path / "none.json"), "--doc", str(doc), capsys=capsys)
    assert rc == 2 and "none.json holds no fine-tune runs" in err  # never a "no runs yet" table over the page's
    assert doc.read_text() == f"{finetune.BEGIN}\n{finetune.END}\n"
    rc, err = _main("--seeds", "0", "--blocks", "none", "--results", str(tmp_path / "new.json"), capsys=capsys)
    assert rc == 2 and "--lr" in err  # training needs the fine-tune's lr
    rc, err = _main("--lr", "0.1", "--seeds", "0", "--blocks", "none", "--results", str(tmp_path / "new.json"),
                    "--base", str(tmp_path / "base_s{seed}.pt"), capsys=capsys)
    assert rc == 2 and "base_s0.pt not found" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "new.json").exists()


def _example():
    """``examples/finetune_torchvision.py`` as a module (it is no bench script: not on bench's path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("finetune_torchvision", ROOT / "examples" / "finetune_torchvision.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_worked_example_table_in_the_blocks_page_is_the_one_its_results_give():
    """docs/blocks.md's torchvision fine-tune table is ``examples/finetune_torchvision.py --report`` of its JSON,
    every arm's step-0 score equals the base's (the blocks went in at identity), and every row says what made it."""
    ftv = _example()

    res = ftv.read()
    assert res, "bench/results/finetune_torchvision.json is missing"
    page = (ROOT / "docs" / "blocks.md").read_text()
    assert page.split(ftv.BEGIN + "\n")[1].split(ftv.END)[0].strip() == ftv.table(res).strip()
    assert {a["block"] for a in res["arms"]} == set(ftv.ARMS)
    assert all(a["step0_val_acc"] == res["base"]["val_acc"] for a in res["arms"])
    assert all(r["command"].startswith("python ") and r["git"] for r in [res["base"], *res["arms"]])


@pytest.mark.parametrize("args, says", [(["--base-epochs", "0"], "must be at least 1"),
                                        (["--epochs", "-1"], "must be at least 1")])
def test_the_worked_example_refuses_a_budget_below_one_epoch(args, says):
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "finetune_torchvision.py"), *args], cwd=ROOT,
                       capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr


def test_the_worked_example_report_without_results_is_one_line(tmp_path, monkeypatch, capsys):
    ftv = _example()

    doc = ROOT / "docs" / "blocks.md"
    before = doc.read_text()
    monkeypatch.setattr(ftv, "RESULTS", tmp_path / "none.json")
    with pytest.raises(SystemExit) as e:
        run_main(lambda: ftv.main(["--report"]), "finetune_torchvision.py")
    err = capsys.readouterr().err
    assert e.value.code != 0 and "holds no run" in err and len(err.strip().splitlines()) == 1
    assert doc.read_text() == before  # the page is not touched
