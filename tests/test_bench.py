"""The attention table's statistics and bookkeeping (``bench/attention_table.py``): pairing by seed, the t
intervals, the verdicts, which runs' times are quoted, and a resumable sweep that never loses a result."""
from __future__ import annotations

import importlib
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT


def _load(name: str):
    """The bench script ``bench/NAME.py`` as the module ``bench.NAME`` (what ``python -m bench.NAME`` imports)."""
    return importlib.import_module(f"bench.{name}")


table = _load("attention_table")  # the runner (trains)
report = _load("attention_report")  # the statistics, tables and summary


def _r(name: str, seed: int, acc: float, seconds: float = 100.0, load=None) -> dict:
    return {"config": f"configs/{name}.yaml", "name": name, "seed": seed, "epochs": 4, "val_acc": acc,
            "train_seconds": seconds, "images_per_s": 180000 / seconds, "parameters": 2_000_000,
            "eval_split": "validation", "git": "x", "load_mean": load}


def _script_main(script: str, monkeypatch, capsys, *args) -> tuple:
    """``python -m bench.SCRIPT ARGS`` (``SCRIPT``: its file's name) in this process: (exit code, stdout, stderr) as
    the process would end (``run_main``'s one-line errors; a ``sys.exit(message)`` prints the message, status 1)."""
    monkeypatch.setattr(sys, "argv", [script, *args])
    try:
        run_module(script)
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    if isinstance(code, str):
        code, err = 1, err + code + "\n"
    return code, out, err


def run_module(script: str) -> None:
    """``bench/SCRIPT`` run as ``__main__`` the way ``python -m bench.NAME`` runs it (``sys.argv[0]`` its file's
    path), though this process has imported it already."""
    import runpy
    import warnings

    with warnings.catch_warnings():  # runpy's note that bench.NAME is imported already: the tests import it
        warnings.filterwarnings("ignore", r"'bench\.", RuntimeWarning)
        runpy.run_module(f"bench.{Path(script).stem}", run_name="__main__", alter_sys=True)


def _table_main(monkeypatch, capsys, *args) -> tuple:
    return _script_main("attention_table.py", monkeypatch, capsys, *args)


def _report_main(monkeypatch, capsys, *args) -> tuple:
    return _script_main("attention_report.py", monkeypatch, capsys, *args)


def _description(help_text: str) -> str:
    """The description paragraph of an argparse ``--help`` (the one after the usage lines), on one line."""
    return " ".join(help_text.split("\n\n")[1].split())


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "bench").glob("*.py")
                                           if p.name not in ("__init__.py", "common.py")))  # (modules, not scripts)
def test_every_bench_script_says_in_one_whole_sentence_what_it_does(script, monkeypatch, capsys):
    """``--help`` opens with the script's first docstring paragraph in full, not a line cut mid-sentence."""
    code, out, _ = _script_main(script, monkeypatch, capsys, "--help")
    text = _description(out)
    assert code == 0 and text[0].isupper() and text.endswith(".") and "``" not in text, text


@pytest.mark.parametrize("module", ["evaluate", "visualize"])
def test_the_map_and_evaluation_tools_say_what_they_do(module, capsys):
    import importlib

    with pytest.raises(SystemExit) as e:
        importlib.import_module(f"visattn.{module}").main(["--help"])
    text = _description(capsys.readouterr().out)
    assert e.value.code == 0 and text[0].isupper() and text.endswith(".") and "``" not in text, text
    assert "python -m" not in text  # the usage line above says how to call it


def test_t_quantiles_are_students():
    stats = pytest.importorskip("scipy.stats")
    for df, q in enumerate(report.T95, start=1):
        assert q == pytest.approx(stats.t.ppf(0.975, df), abs=1e-3)


def test_differences_pair_by_seed_and_skip_unpaired_seeds():
    base = [_r("resnet_fast_none", s, a) for s, a in [(0, 0.860), (1, 0.870), (2, 0.865)]]
    other = [_r("resnet_fast_se", s, a) for s, a in [(0, 0.865), (2, 0.875), (5, 0.99)]]  # seed 5 has no pair
    m, h, n = report.paired(base + other, "resnet_fast_se")
    diffs = [0.5, 1.0]
    assert n == 2 and m == pytest.approx(statistics.mean(diffs))
    assert h == pytest.approx(12.706 * statistics.stdev(diffs) / math.sqrt(2))
    assert report.paired(base, "resnet_fast_eca") is None


@pytest.mark.parametrize("d,word", [(None, "too few seeds"), ((1.0, math.inf, 1), "too few seeds"),
                                    ((-0.43, 0.13, 2), "too few seeds"),
                                    ((0.8, 0.3, 5), "better"), ((-0.8, 0.3, 5), "worse"),
                                    ((0.1, 0.4, 5), "no difference resolved"),
                                    ((0.1, 0.9, 3), "undecided (interval too wide)")])
def test_verdicts(d, word):
    assert report.verdict(d) == word


def test_pairs_needed_follows_the_t_interval():
    base = [_r("resnet_fast_none", s, 0.86) for s in range(3)]
    tight = [_r("resnet_fast_se", s, 0.86 + d) for s, d in enumerate([0.001, 0.002, 0.0015])]  # sd 0.05 points
    wide = [_r("resnet_fast_eca", s, 0.86 + d) for s, d in enumerate([0.0, 0.01, -0.005])]  # sd 0.76 points
    n = report.pairs_needed(base + wide, "resnet_fast_eca")
    sd = statistics.stdev([0.0, 1.0, -0.5])
    assert report.T95[n - 2] * sd / math.sqrt(n) <= 0.5 < report.T95[n - 3] * sd / math.sqrt(n - 1)
    assert report.pairs_needed(base + tight, "resnet_fast_se") == 2
    assert report.pairs_needed(base[:1] + tight[:1], "resnet_fast_se") is None


def test_times_come_from_runs_on_a_quiet_machine():
    rs = [_r("resnet_fast_none", 0, 0.86, 100, load=2.3), _r("resnet_fast_none", 1, 0.86, 300, load=3.4),
          _r("resnet_fast_none", 2, 0.86, 110, load=None)]
    assert [report.quiet(r) for r in rs] == [True, False, True]
    assert not report.quiet(dict(rs[2], contended="6 runs at once on one GPU"))  # unrecorded load, but shared
    assert report.timing(rs, "train_seconds") == 105
    busy = [_r("resnet_fast_se", 0, 0.86, 300, load=3.5)]
    assert report.timing(busy, "train_seconds") == 300  # none quiet: all of them, and the table says so
    assert "300 (busy)" in report.table(rs + busy)


def test_an_adaptive_sweep_adds_seeds_only_where_the_interval_is_still_wide():
    none, tight, wide = "resnet_fast_none", "resnet_fast_se", "resnet_fast_gc"
    configs = [f"configs/{n}.yaml" for n in (none, tight, wide)]
    accs = {none: [0.860, 0.862, 0.858], tight: [0.861, 0.863, 0.859], wide: [0.850, 0.870, 0.852]}
    rs = [_r(n, s, a) for n, a_s in accs.items() for s, a in enumerate(a_s)]
    assert report.paired(rs, tight)[1] <= 0.5 < report.paired(rs, wide)[1]
    assert table.plan(rs[:1], configs, 0, 0.5) == configs[1:]  # what already ran is never repeated
    assert table.plan(rs, configs, 1, 0.5) == []
    assert table.plan(rs, configs, 3, 0.5) == [configs[0], configs[2]]  # the baseline pairs the wide one
    assert table.plan(rs, configs[:2], 3, 0.5) == []  # every interval tight: the sweep stops
    assert table.plan(rs[:4], configs, 3, 0.5) == configs  # seeds under MIN_PAIRS: every config runs


def test_a_backbone_variant_pairs_with_the_baseline_of_its_own_backbone():
    """``--backbone`` variants (``CONFIG/wide``) pair with ``resnet_fast_none/wide``, never with the narrow
    baseline; a block's own variant (a placement) still pairs with ``resnet_fast_none``; and the wide baseline
    itself pairs with the narrow one: what the backbone change alone does."""
    none = [_r("resnet_fast_none", s, a) for s, a in enumerate([0.860, 0.870, 0.865])]
    wide_none = [_r("resnet_fast_none/wide", s, a) for s, a in enumerate([0.900, 0.905, 0.910])]
    wide_se = [_r("resnet_fast_se/wide", s, a) for s, a in enumerate([0.905, 0.905, 0.905])]
    placed = [_r("resnet_fast_se/group_act", s, a) for s, a in enumerate([0.865, 0.870, 0.860])]
    rs = none + wide_none + wide_se + placed
    assert report.baseline_of(rs, "resnet_fast_se/wide") == "resnet_fast_none/wide"
    assert report.differences(rs, "resnet_fast_se/wide") == pytest.approx([0.5, 0.0, -0.5])
    assert report.differences(rs, "resnet_fast_se/group_act") == pytest.approx([0.5, 0.0, -0.5])
    assert report.differences(rs, "resnet_fast_none/wide") == pytest.approx([4.0, 3.5, 4.5])
    # a tag the baseline never ran under is a block's own variant, paired with the plain baseline
    assert report.baseline_of(none + wide_se, "resnet_fast_se/wide") == "resnet_fast_none"
    # the table's row for the wide baseline shows its gain over the narrow one
    row = next(line for line in report.table(rs).splitlines() if "`resnet_fast_none/wide`" in line)
    assert "+4.00 ±" in row


def test_a_transformers_variant_pairs_with_the_transformer():
    """``vit_cpu/TAG`` (a lever tried on the transformer) is measured against ``vit_cpu``, which itself is
    measured against the CNN baseline."""
    none = [_r("resnet_fast_none", s, a) for s, a in enumerate([0.860, 0.870, 0.865])]
    vit = [_r("vit_cpu", s, a) for s, a in enumerate([0.800, 0.805, 0.800])]
    distilled = [_r("vit_cpu/distill", s, a) for s, a in enumerate([0.810, 0.810, 0.815])]
    rs = none + vit + distilled
    assert report.baseline_of(rs, "vit_cpu/distill") == "vit_cpu"
    assert report.differences(rs, "vit_cpu/distill") == pytest.approx([1.0, 0.5, 1.5])
    assert report.differences(rs, "vit_cpu") == pytest.approx([-6.0, -6.5, -6.5])


def test_a_backbone_sweep_runs_the_baseline_under_the_variants_tag():
    configs = [f"configs/attention/resnet_fast_{a}.yaml" for a in ("none", "se")]
    narrow = [_r("resnet_fast_none", 0, 0.86), _r("resnet_fast_se", 0, 0.86)]
    # a block variant: the baseline already ran untagged at seed 0, only the block is left
    assert table.plan(narrow, configs, 0, 0.5, tag="group_act") == configs[1:]
    # a backbone variant: the baseline must run under the tag too
    assert table.plan(narrow, configs, 0, 0.5, tag="wide", backbone=True) == configs
    wide = narrow + [_r("resnet_fast_none/wide", 0, 0.9)]
    assert table.plan(wide, configs, 0, 0.5, tag="wide", backbone=True) == configs[1:]
    assert table.variant(configs[0], "wide") == "" and table.variant(configs[0], "wide", backbone=True) == "wide"


def test_backbone_without_overrides_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    code, _, err = _table_main(monkeypatch, capsys, "--tag", "wide", "--backbone", "--results", str(tmp_path / "r.json"))
    assert code == 2 and "--backbone: give the backbone's overrides with --set" in err
    assert "Traceback" not in err and not (tmp_path / "r.json").exists()


def test_a_sweep_runs_records_and_resumes_without_repeating(tmp_path, monkeypatch, capsys):
    out, runs = tmp_path / "results.json", tmp_path / "runs"
    argv = ["--configs", "configs/smoke.yaml", "--seeds", "0", "--epochs", "1", "--results", str(out), "--runs", str(runs)]
    code, stdout, stderr = _table_main(monkeypatch, capsys, *argv)
    assert code == 0, stderr[-2000:]
    assert "smoke seed 0: val" in stdout
    (r,) = json.loads(out.read_text())
    assert r["name"] == "smoke" and r["seed"] == 0 and r["epochs"] == 1 and 0 <= r["val_acc"] <= 1
    assert r["train_seconds"] > 0 and r["parameters"] > 0 and r["cpu"]
    assert r["kernels"] == table.kernels()
    num = report.numerics(r).replace(" on ", "-")  # one run folder per precision and kernel family
    assert (runs / f"smoke-e1-s0-{num}" / "last.pt").is_file()
    code, stdout, _ = _table_main(monkeypatch, capsys, *argv)  # nothing left to run: the result is kept, not redone
    assert code == 0 and "smoke seed 0" not in stdout
    assert json.loads(out.read_text()) == [r]
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_killed_sweep_run_goes_on_from_its_checkpoint_or_starts_again(tmp_path, capsys):
    """A sweep stopped at a session's end keeps its part-trained run: the next sweep resumes it (exactly, as the
    trainer does); a checkpoint it cannot resume (made under other settings, or corrupt) means a fresh start,
    never a mixed run and never a deleted one (the old folder is set aside, said so), and a resumed run's time
    (two sittings) is not quoted."""
    runs = tmp_path / "runs"
    first = table.run_one("configs/smoke.yaml", 0, 1, runs, None)
    (run_dir,) = runs.iterdir()
    assert "resumed" not in first and report.quiet(first) == (first["load_mean"] is None or first["load_mean"] <= 2.8)
    again = table.run_one("configs/smoke.yaml", 0, 1, runs, None)  # its last.pt is a finished run's
    assert again["resumed"] and not report.quiet(again)
    assert again["val_acc"] == first["val_acc"] and len((run_dir / "metrics.jsonl").read_text().splitlines()) == 1
    other = tmp_path / "other"  # a folder trained for 1 epoch where the run now asks for 2: other settings
    other.mkdir()
    (run_dir / "last.pt").rename(other / "last.pt")
    longer_dir = runs / run_dir.name.replace("-e1-", "-e2-")
    run_dir.rename(longer_dir)
    (other / "last.pt").rename(longer_dir / "last.pt")
    old_state = (longer_dir / "last.pt").read_bytes()
    capsys.readouterr()
    longer = table.run_one("configs/smoke.yaml", 0, 2, runs, None)
    assert "resumed" not in longer and longer["epochs"] == 2
    assert [json.loads(r)["epoch"] for r in (longer_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    aside = longer_dir.with_name(longer_dir.name + ".set-aside-1")  # the 1-epoch training is kept, not deleted
    assert (aside / "last.pt").read_bytes() == old_state and (aside / "metrics.jsonl").is_file()
    err = capsys.readouterr().err
    assert "trained with other settings for" in err and "train.epochs" in err and aside.name in err
    (longer_dir / "last.pt").write_bytes(b"not a checkpoint")  # a corrupt one: started again, same result
    fresh = table.run_one("configs/smoke.yaml", 0, 2, runs, None)
    assert "resumed" not in fresh and fresh["val_acc"] == longer["val_acc"]
    assert (longer_dir.with_name(longer_dir.name + ".set-aside-2") / "last.pt").read_bytes() == b"not a checkpoint"


def test_a_sweep_resumes_a_run_saved_before_a_config_key_was_added(tmp_path):
    """A key added to the config schema since a run was saved (at its default) is no change of settings: the
    part-trained run resumes instead of starting again (a 16-epoch run was once lost that way)."""
    import yaml

    runs = tmp_path / "runs"
    first = table.run_one("configs/smoke.yaml", 0, 1, runs, None)
    (run_dir,) = runs.iterdir()
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    del saved["train"]["distill"]  # as written before train.distill existed
    (run_dir / "config.yaml").write_text(yaml.safe_dump(saved))
    again = table.run_one("configs/smoke.yaml", 0, 1, runs, None)
    assert again["resumed"] and again["val_acc"] == first["val_acc"]
    assert [p.name for p in runs.iterdir()] == [run_dir.name]
    saved["train"]["label_smoothing"] = 0.3  # a real change still starts again
    (run_dir / "config.yaml").write_text(yaml.safe_dump(saved))
    assert "resumed" not in table.run_one("configs/smoke.yaml", 0, 1, runs, None)
    assert sorted(p.name for p in runs.iterdir()) == [run_dir.name, run_dir.name + ".set-aside-1"]


def test_time_to_accuracy_reads_the_first_epoch_at_each_target(tmp_path, capsys):
    tta = _load("time_to_accuracy")
    rd = tmp_path / "run"
    rd.mkdir()
    lines = [{"epoch": 1, "epoch_seconds": 10.0, "wall_seconds": 10.0, "val_acc": 0.90},
             {"epoch": 2, "epoch_seconds": 11.0, "wall_seconds": 22.0},  # not evaluated
             {"epoch": 3, "epoch_seconds": 12.0, "wall_seconds": 35.0, "val_acc": 0.945},
             {"epoch": 4, "epoch_seconds": 10.0, "wall_seconds": 46.0, "val_acc": 0.951}]
    (rd / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"epoch": 5, "ep')
    rs = tta.rows(rd)
    assert len(rs) == 4  # the torn last line of a running run is skipped
    assert tta.time_to(rs, 0.94) == {"epoch": 3, "train_seconds": 33.0, "wall_seconds": 35.0, "val_acc": 0.945}
    assert tta.time_to(rs, 0.95)["epoch"] == 4 and tta.time_to(rs, 0.96) is None
    assert tta.main([str(rd), "--targets", "0.94", "0.96"]) == 0
    out = capsys.readouterr().out
    assert "94.0%: epoch 3 (94.50%), training 33.0 s, wall 35.0 s" in out and "96.0%: not reached" in out
    assert tta.main([str(tmp_path / "nowhere")]) == 2
    assert tta.main([str(rd), "--targets", "94"]) == 2
    assert capsys.readouterr().err.count("error: ") == 2


def test_runs_pair_only_at_the_same_budget_and_precision():
    bf16 = [_r("resnet_fast_none", s, 0.868) for s in range(3)]  # recorded before precision was: bf16
    fp32 = [dict(_r("resnet_fast_none", s, 0.864), precision="fp32") for s in range(3)]
    longer = [dict(_r("resnet_fast_none", s, 0.92), epochs=12, precision="fp32") for s in range(3)]
    block = [dict(_r("resnet_fast_se/identity-unit_bn", s, 0.870), precision="fp32") for s in range(3)]
    rs = bf16 + fp32 + longer + block
    assert report.differences(rs, "resnet_fast_se/identity-unit_bn") == pytest.approx([0.6] * 3)
    assert report.differences(rs, "resnet_fast_se/identity-unit_bn", epochs=12) == []
    assert table.ran(rs, "configs/resnet_fast_none.yaml", 0, 4, prec="fp32 on avx2")
    assert not table.ran(rs, "configs/resnet_fast_none.yaml", 3, 4, prec="fp32 on avx2")
    assert not table.ran(rs, "configs/resnet_fast_se.yaml", 0, 4, "identity-unit_bn", prec="bf16 on amx")
    assert table.ran(rs, "configs/resnet_fast_se.yaml", 0, 4, "identity-unit_bn", prec="fp32 on avx2")
    assert table.plan(rs, ["configs/resnet_fast_none.yaml", "configs/resnet_fast_se.yaml"], 0, 0.5, 4,
                      "identity-unit_bn", "bf16 on amx") == ["configs/resnet_fast_se.yaml"]


def test_runs_pair_only_on_the_same_kernel_family():
    """The same seed and precision on another CPU's kernels is another draw: it is not paired, and the
    planner runs the baseline again there."""
    amx = [_r("resnet_fast_none", s, 0.868) for s in range(3)]  # recorded before kernels were: AMX
    here = [dict(_r("resnet_fast_se/identity-unit_bn", s, 0.870), kernels="avx512_bf16") for s in range(3)]
    assert [report.numerics(r) for r in amx[:1] + here[:1]] == ["bf16 on amx", "bf16 on avx512_bf16"]
    assert report.differences(amx + here, "resnet_fast_se/identity-unit_bn") == []
    base = [dict(r, kernels="avx512_bf16", val_acc=0.866) for r in amx]
    assert report.differences(amx + here + base, "resnet_fast_se/identity-unit_bn") == pytest.approx([0.4] * 3)
    assert table.plan(amx + here, ["configs/resnet_fast_none.yaml", "configs/resnet_fast_se.yaml"], 0, 0.5, 4,
                      "identity-unit_bn", "bf16 on avx512_bf16") == ["configs/resnet_fast_none.yaml"]
    assert table.kernels() in ("amx", "avx512_bf16", "avx512", "avx2", "cpu")


def test_merge_adds_another_machines_runs_once_and_never_replaces_one(tmp_path, monkeypatch, capsys):
    here = [dict(_r("resnet_fast_none", s, 0.90), kernels="avx512_bf16", epochs=32) for s in range(2)]
    gpu = [dict(r, kernels="NVIDIA H100 80GB HBM3", val_acc=0.91) for r in here]
    clash = dict(here[0], val_acc=0.5)  # the same run on the same numerics: the committed one stays
    out, other = tmp_path / "results.json", tmp_path / "gpu.json"
    out.write_text(json.dumps(here))
    other.write_text(json.dumps(gpu + [clash, gpu[0]]))
    argv = ["--results", str(out), "--merge", str(other)]
    code, stdout, stderr = _report_main(monkeypatch, capsys, *argv)
    assert code == 0, stderr[-2000:]
    assert "added 2 runs" in stdout and "bf16 on NVIDIA H100 80GB HBM3" in stdout
    assert json.loads(out.read_text()) == here + gpu
    code, stdout, _ = _report_main(monkeypatch, capsys, *argv)
    assert code == 0 and "added 0 runs" in stdout and json.loads(out.read_text()) == here + gpu
    other.write_text("{not json")
    code, _, stderr = _report_main(monkeypatch, capsys, *argv)
    assert code == 2 and stderr.count("\n") == 1 and "gpu.json: not a readable JSON file" in stderr
    assert json.loads(out.read_text()) == here + gpu  # nothing written on bad input
    other_block = dict(here[0], model={"attention": "se", "attn_kwargs": {"init": "default"}})
    # the same name, seed, budget and numerics built with other model options is another run: it is added
    assert report.merge(here + gpu, [other_block, here[1]]) == [other_block]


def test_a_sweep_neither_counts_nor_pairs_a_same_named_run_built_with_other_model_options():
    """A results file keeps earlier rounds' runs under the configs' names (e.g. round 2's paper-initialised
    ``resnet_fast_se``, on an AMX machine); a sweep run there must train the config as it builds now, not take
    the old run as done or pair with it."""
    se, none = "configs/attention/resnet_fast_se.yaml", "configs/attention/resnet_fast_none.yaml"
    now = {c: report.planned_options(c) for c in (se, none)}
    old = dict(now[se], attn_kwargs={"init": "default"}, attn_position="unit_bn")
    rs = ([dict(_r("resnet_fast_none", s, 0.86), model=now[none]) for s in range(3)]
          + [dict(_r("resnet_fast_se", s, 0.85), model=old) for s in range(3)]  # round 2's, same names
          + [dict(_r("resnet_fast_se", 0, 0.87), model=now[se]), _r("resnet_fast_se", 1, 0.80)]  # no model recorded
          + [_r("vit_tiny", 0, 0.6)])  # another config's run is not the sweep's business
    live = table.current(rs, [none, se])
    assert [(r["name"], r["seed"], r["val_acc"]) for r in live] == [
        ("resnet_fast_none", 0, 0.86), ("resnet_fast_none", 1, 0.86), ("resnet_fast_none", 2, 0.86),
        ("resnet_fast_se", 0, 0.87), ("vit_tiny", 0, 0.6)]
    assert table.plan(rs, [none, se], 1, 0.5) == []  # by name alone, round 2's runs would count as done
    assert table.plan(live, [none, se], 1, 0.5) == [se]
    m, _, n = report.paired(live, "resnet_fast_se")
    assert (m, n) == (pytest.approx(1.0), 1)  # paired with the one current run only (round 2's: -1.0 each)
    tagged = table.current([dict(_r("resnet_fast_se/w", 0, 0.9), model=now[se])], [se], "w", ["model.widths=[8,8,8]"])
    assert tagged == []  # a variant's runs must carry its overrides


def test_a_sweep_at_one_budget_neither_counts_nor_pairs_the_runs_of_another_budget_or_machine():
    """After a 16-epoch sweep (or another machine's runs), the 4-epoch sweep still plans its own runs: a run at
    16 epochs is not the 4-epoch run, and pairs at 16 epochs or on other kernels do not close its interval."""
    none, gc = "configs/attention/resnet_fast_none.yaml", "configs/attention/resnet_fast_gc.yaml"
    now = {c: report.planned_options(c) for c in (none, gc)}

    def run(config, s, acc, epochs=4, kernels="avx512_bf16"):
        return dict(_r(Path(config).stem, s, acc), config=config, model=now[config], epochs=epochs,
                    kernels=kernels)

    short = [run(none, s, 0.86) for s in range(3)] + [run(gc, s, a) for s, a in enumerate([0.85, 0.87, 0.86])]
    longer = [run(c, s, 0.91, epochs=16) for c in (none, gc) for s in range(6)]  # tight: +0.00 at 16 epochs
    elsewhere = [run(c, s, 0.87, kernels="amx") for c in (none, gc) for s in range(3, 9)]  # tight on AMX
    here = "bf16 on avx512_bf16"
    rs = short + longer + elsewhere
    assert table.plan(rs, [none, gc], 3, 0.5, 4, prec=here) == [none, gc]  # 4 epochs: wide, so a 4th seed
    assert table.plan(rs, [none, gc], 3, 0.5, {none: 4, gc: 4}, prec=here) == [none, gc]  # budgets per config
    assert table.plan(rs, [none, gc], 3, 0.5, 16, prec=here) == []  # 16 epochs: tight, and seed 3 ran
    assert table.plan(rs, [none, gc], 6, 0.5, 16, prec=here) == []
    assert table.plan(short + longer, [none, gc], 2, 0.5, 16, prec=here) == []


def test_a_sweep_of_the_shipped_configs_counts_the_placement_runs_that_built_them():
    """The placement ablation ran ``resnet_fast_se/identity-unit_bn``, which is what ``resnet_fast_se`` ships:
    a sweep of the shipped configs takes those runs as its own (as the README's summary does) instead of
    training them again, and a run under another placement is not taken."""
    none, se = "configs/attention/resnet_fast_none.yaml", "configs/attention/resnet_fast_se.yaml"
    now = {c: report.planned_options(c) for c in (none, se)}
    other = dict(now[se], attn_position="group_act")

    def run(name, config, s, acc, model, overrides=()):
        return dict(_r(name, s, acc), config=config, model=model, overrides=list(overrides))

    rs = ([run("resnet_fast_none", none, s, 0.860, now[none]) for s in range(3)]
          + [run("resnet_fast_se/identity-unit_bn", se, s, 0.865, now[se], ["model.attn_position=unit_bn"])
             for s in range(3)]
          + [run("resnet_fast_se/identity-group_act", se, s, 0.80, other, ["model.attn_position=group_act"])
             for s in range(3)])
    live = table.current(rs, [none, se])
    assert sorted((r["name"], r["seed"]) for r in live if r["name"] == "resnet_fast_se") == [
        ("resnet_fast_se", 0), ("resnet_fast_se", 1), ("resnet_fast_se", 2)]
    assert report.paired(live, "resnet_fast_se") == (pytest.approx(0.5), pytest.approx(0.0), 3)
    assert table.plan(live, [none, se], 0, 0.5, 4) == []  # nothing to train again
    again = table.current(rs + [run("resnet_fast_se", se, 0, 0.865, now[se])], [none, se])
    assert report.paired(again, "resnet_fast_se")[2] == 3  # the same seed under two names pairs once
    assert table.plan(table.current(rs, [none, se], "x", ["model.attn_position=unit_act"]), [none, se], 0,
                      0.5, 4, "x") == [se]  # a tagged sweep is a new variant: nothing of the ablation counts


def test_the_report_never_averages_or_pairs_same_named_runs_of_different_models(tmp_path):
    """An earlier round's runs under a config's name (other model options) get their own row,
    ``NAME/earlier-1``, paired with the baseline's earlier runs where it has them; the runs built as the
    config builds now keep the name. Nothing is averaged across the two."""
    se, none = "configs/attention/resnet_fast_se.yaml", "configs/attention/resnet_fast_none.yaml"
    now = {c: report.planned_options(c) for c in (se, none)}
    old_se = dict(now[se], attn_kwargs={"init": "default"})
    old_none = dict(now[none], bn_momentum=0.5)

    def run(name, config, s, acc, model):
        return dict(_r(name, s, acc), config=config, model=model)

    rs = ([run("resnet_fast_se", se, s, 0.80, old_se) for s in range(3)]  # the earlier round first in the file
          + [run("resnet_fast_none", none, s, 0.84, old_none) for s in range(3)]
          + [run("resnet_fast_none", none, s, a, now[none]) for s, a in enumerate([0.86, 0.87, 0.88])]
          + [run("resnet_fast_se", se, s, a, now[se]) for s, a in enumerate([0.87, 0.87, 0.89])])
    split = report.split_by_options(rs)
    assert [r["name"] for r in split] == (["resnet_fast_se/earlier-1"] * 3 + ["resnet_fast_none/earlier-1"] * 3
                                          + ["resnet_fast_none"] * 3 + ["resnet_fast_se"] * 3)
    rows = {line.split("|")[1].strip(): line for line in report.table(rs).splitlines()[2:]}
    assert set(rows) == {"`resnet_fast_none`", "`resnet_fast_se`", "`resnet_fast_none/earlier-1`",
                         "`resnet_fast_se/earlier-1`"}
    assert "| 87.67 ± 1.15 | +0.67 ± 1.43 (3 pairs) |" in rows["`resnet_fast_se`"]  # 87, 87, 89 against 86, 87, 88
    assert "| 80.00 ± 0.00 | -4.00 ± 0.00 (3 pairs) |" in rows["`resnet_fast_se/earlier-1`"]  # against 84 each
    # a config that no longer loads: the newest runs keep the name
    gone = [dict(r, config="configs/gone.yaml") for r in rs if r["name"] == "resnet_fast_se"]
    assert [r["name"] for r in report.split_by_options(gone)] == ["resnet_fast_se/earlier-1"] * 3 + ["resnet_fast_se"] * 3
    assert report.split_by_options(rs[6:]) == rs[6:]  # one set of options per name: unchanged
    drawn = report.plot(rs, tmp_path / "plot.png", report.numerics(rs[0]))  # the plot: one marker per model too
    assert drawn == {"resnet_fast_none": 3, "resnet_fast_none/earlier-1": 3, "resnet_fast_se": 3,
                     "resnet_fast_se/earlier-1": 3}


@pytest.mark.parametrize("recipe", ["cpu", "vit_cpu"])
def test_every_ablation_variant_is_a_valid_config_of_its_recipe(recipe):
    """A misspelt key or value in a variant is caught here, not hours into a sweep."""
    from visattn.config import load_config

    ablation = _load("recipe_ablation")
    config, variants, results = ablation.RECIPES[recipe]
    assert "recipe" in variants and variants["recipe"][1] == []
    base = load_config(config).to_dict()
    for name, (what, overrides) in variants.items():
        assert what, name
        cfg = load_config(config, list(overrides)).to_dict()
        assert (cfg == base) == (not overrides), f"{name}: its overrides change nothing"


def test_an_eval_only_variant_scores_the_recipe_runs_checkpoint_instead_of_training_again(tmp_path, monkeypatch, capsys):
    """``no_tta`` changes only the scoring: its row is the recipe run's checkpoint scored with one view (the
    recipe trained first where it has no row), rescored with the recipe's own views as a check that matches
    the trainer's figure; nothing trains twice, and a recipe run whose checkpoint is gone is one clear error."""
    import yaml

    from visattn.errors import CheckpointError
    from visattn.evaluate import evaluate_checkpoint

    ablation = _load("recipe_ablation")
    smoke = yaml.safe_load((ROOT / "configs" / "smoke.yaml").read_text())
    smoke["train"]["epochs"], smoke["log"] = 1, {"maps_every": 0}
    smoke["data"].update(synthetic_size=400, val_size=100)
    config, results_file = tmp_path / "tiny.yaml", tmp_path / "results.json"
    config.write_text(yaml.safe_dump(smoke))
    variants = {"recipe": ("as written", []), "no_tta": ("one view", ["eval.tta=none"])}
    assert ablation.eval_only(variants["no_tta"][1]) and not ablation.eval_only([]) and not ablation.eval_only(
        ["eval.tta=none", "train.epochs=2"])
    monkeypatch.setitem(ablation.RECIPES, "tiny", (config, variants, results_file))
    argv = ["recipe_ablation.py", "--recipe", "tiny", "--variants", "no_tta", "--runs", str(tmp_path / "runs")]
    monkeypatch.setattr(sys, "argv", argv)
    ablation.main()
    recipe, no_tta = json.loads(results_file.read_text())
    assert [recipe["variant"], no_tta["variant"]] == ["recipe", "no_tta"]
    (run_dir,) = (tmp_path / "runs").iterdir()  # one training, the recipe's
    assert run_dir.name == no_tta["scored_from"] and run_dir.name.startswith("recipe-s0-")
    assert no_tta["recipe_rescored"] == recipe["val_acc"]  # the scoring path gives the trainer's figure
    assert no_tta["val_acc"] == evaluate_checkpoint(str(run_dir / "last.pt"), tta="none")["acc"]
    assert no_tta["train_seconds"] == recipe["train_seconds"] and no_tta["overrides"] == ["eval.tta=none"]
    row = ablation.table([recipe, no_tta], variants).splitlines()[3].split(" | ")
    assert row[1] == "one view (the recipe run, rescored)"
    assert row[6] == f"{100 * (no_tta['val_acc'] - recipe['val_acc']):+.2f}"
    capsys.readouterr()
    ablation.main()  # nothing left to do: no run, no new row
    assert "== " not in capsys.readouterr().out and len(json.loads(results_file.read_text())) == 2
    (run_dir / "last.pt").unlink()
    with pytest.raises(CheckpointError, match=f"no_tta: the recipe run it scores, .*{run_dir.name}, has no last.pt"):
        ablation.score_recipe_run("tiny", "no_tta", 0, tmp_path / "runs", None, [recipe])


def test_the_manuals_transformer_ablation_table_is_the_one_the_results_give():
    ablation = _load("recipe_ablation")
    _, variants, results_file = ablation.RECIPES["vit_cpu"]
    doc = (ROOT / "docs" / "results.md").read_text()
    block = doc.split("<!-- vit ablation: python -m bench.recipe_ablation --recipe vit_cpu --table -->\n")[1]
    block = block.split("<!-- end of vit ablation -->")[0]
    assert block.strip() == ablation.table(json.loads(results_file.read_text()), variants), (
        "docs/results.md's transformer ablation is stale: paste `python -m bench.recipe_ablation --recipe vit_cpu --table`")


def test_the_manuals_cpu_recipe_ablation_table_is_the_one_the_results_give():
    ablation = _load("recipe_ablation")
    _, variants, results_file = ablation.RECIPES["cpu"]
    doc = (ROOT / "docs" / "results.md").read_text()
    block = doc.split("<!-- cpu ablation: python -m bench.recipe_ablation --table -->\n")[1]
    block = block.split("<!-- end of cpu ablation -->")[0]
    assert block.strip() == ablation.table(json.loads(results_file.read_text()), variants), (
        "docs/results.md's CPU recipe ablation is stale: paste `python -m bench.recipe_ablation --table`")


def test_the_ablation_table_names_each_rows_budget_and_kernel_family():
    """Rows from different budgets or machines sit in one ablation file: each row says which it is (rows
    recorded before these were kept are 4-epoch bf16 runs on AMX)."""
    ablation = _load("recipe_ablation")
    rows = [{"variant": "recipe", "seed": 0, "precision": "bf16", "val_acc": 0.8676, "train_seconds": 178,
             "images_per_s": 1002},
            {"variant": "epochs_16", "seed": 0, "epochs": 16, "precision": "bf16", "kernels": "avx512_bf16",
             "val_acc": 0.9096, "train_seconds": 736, "images_per_s": 969}]
    lines = ablation.table(rows, ablation.CPU_VARIANTS).splitlines()
    assert lines[2].split(" | ")[2:5] == ["0", "4", "bf16 on amx"]
    assert lines[3].split(" | ")[2:6] == ["0", "16", "bf16 on avx512_bf16", "90.96"]


def test_summary_tables_the_placement_and_both_budgets_from_one_kernel_family_and_a_gpu_column_from_its_own():
    fam = dict(kernels="avx512_bf16", config="configs/attention/resnet_fast_none.yaml", model={"attention": "none"})
    none = [dict(_r("resnet_fast_none", s, 0.866 + s / 1000), **fam) for s in range(3)]
    se = dict(fam, config="configs/attention/resnet_fast_se.yaml", model={"attention": "se", "attn_position": "unit_act"},
              overrides=["model.attn_position=unit_act"])
    placed = [dict(_r("resnet_fast_se/identity-unit_act", s, 0.870 + s / 1000), **se) for s in range(3)]
    other = [dict(_r("resnet_fast_se/identity-group_act", s, 0.80), **dict(se, kernels="amx")) for s in range(3)]
    eca = dict(fam, config="configs/attention/resnet_fast_eca.yaml", model={"attention": "eca"})
    long = report.BUDGETS[1]
    longer = [dict(_r(n, 0, acc), epochs=long, **kw)
              for n, acc, kw in (("resnet_fast_none", 0.93, fam), ("resnet_fast_eca", 0.935, eca))]
    stale = [dict(_r("resnet_fast_eca", 0, 0.99), epochs=long,
                  **dict(eca, model={"attention": "eca", "x": 1}))]
    ships = {"none": {"attention": "none"}, "se": se["model"], "eca": eca["model"]}
    # the GPU column: 32 epochs on an H100, paired only with the H100's none; a CPU run at 32 epochs stays out
    gpu = dict(kernels="NVIDIA H100 80GB HBM3")
    at32 = ([dict(_r("resnet_fast_none", s, 0.91), epochs=32, **dict(fam, **gpu)) for s in range(3)]
            + [dict(_r("resnet_fast_eca", s, 0.92 + s / 1000), epochs=32, **dict(eca, **gpu)) for s in range(3)]
            + [dict(_r("resnet_fast_eca", 3, 0.50), epochs=32, **eca)])
    cols = ((32, "bf16 on NVIDIA H100 80GB HBM3", "32 epochs, H100"),)
    text = report.summary(none + placed + other + longer + stale + at32, "bf16 on avx512_bf16", ships, cols, speed={})
    assert 'Runs in bf16 on avx512_bf16, the "32 epochs, H100" column in bf16 on NVIDIA H100 80GB HBM3;' in text
    placement, blocks = text.split("\n\n")[1:]
    assert "| 4 epochs | verdict | 16 epochs | verdict | 32 epochs, H100 | verdict | cost: images/s" in blocks
    rows = {line.split(" | ")[0]: line for line in blocks.splitlines() if line.startswith("| `")}
    se_row = next(line for line in placement.splitlines() if line.startswith("| `se`"))
    assert se_row.removesuffix(" |").split(" | ")[1:] == ["—", "+0.40 ± 0.00 (3)", "—"]
    assert "86.70% ± 0.10 (3) | — | 93.00% (1) | — | 91.00% ± 0.00 (3) | —" in rows["| `none` (accuracy ± std)"]
    assert "+0.40 ± 0.00 (3) | better | — | — | — | —" in rows["| `se`"]  # the variant it ships
    # not the stale model's run at 16 epochs; at 32 the H100's three pairs (+1.0, +1.1, +1.2), not the CPU's run
    assert "— | — | +0.50 (1, no interval) | too few seeds | +1.10 ± 0.25 (3) | better" in rows["| `eca`"]
    assert rows["| `gc`"].count("—") == 7
    assert report.summary(none, "bf16 on avx512_bf16", ships, (), speed={}).count("verdict") == 2  # no other column
    two = report.summary(none, "bf16 on avx512_bf16", ships, ((16, cols[0][1], "16 epochs, H100"),) + cols, speed={})
    assert '"16 epochs, H100" and "32 epochs, H100" columns in bf16 on NVIDIA H100 80GB HBM3;' in two  # one family
    assert text.startswith(report.README_BEGIN) and text.endswith(report.README_END)


def test_the_shipped_positions_placement_cell_counts_the_same_runs_as_the_blocks_row():
    """A seed run under the config's own name (no tag) is a run of the shipped position: the placement table
    counts it there, so the two tables never show one configuration with two different figures."""
    fam = dict(kernels="avx512_bf16", config="configs/attention/resnet_fast_none.yaml", model={"attention": "none"})
    se = dict(fam, config="configs/attention/resnet_fast_se.yaml", model={"attention": "se", "attn_position": "unit_bn"},
              overrides=["model.attn_position=unit_bn"])
    none = [dict(_r("resnet_fast_none", s, 0.866), **fam) for s in range(4)]
    tagged = [dict(_r("resnet_fast_se/identity-unit_bn", s, 0.870), **se) for s in range(3)]
    own = dict(_r("resnet_fast_se", 3, 0.876), **dict(se, overrides=[]))
    other = [dict(_r("resnet_fast_se/identity-unit_act", s, 0.860), **dict(se, model=dict(se["model"], attn_position="unit_act")))
             for s in range(3)]
    ships = {"none": fam["model"], "se": se["model"]}
    text = report.summary(none + tagged + [own] + other, "bf16 on avx512_bf16", ships, (), speed={})
    placement, blocks = text.split("\n\n")[1:]
    se_place = next(line for line in placement.splitlines() if line.startswith("| `se`")).removesuffix(" |").split(" | ")
    se_block = next(line for line in blocks.splitlines() if line.startswith("| `se`")).split(" | ")
    assert se_place[1] == se_block[1] == "+0.55 ± 0.48 (4)"  # seeds 0-2 tagged, seed 3 under the config's name
    assert se_place[2] == "-0.60 ± 0.00 (3)" and se_place[3] == "—"


def test_the_summarys_cost_column_is_one_process_step_ratio_not_the_runs_images_per_s():
    """The training runs' images/s come from different sittings (the machine ran 380-925 images/s for `none`
    alone), so the cost column is the eager training step's ratio from one process (``bench/blocks.py --out``)."""
    fam = dict(kernels="avx512_bf16", config="configs/attention/resnet_fast_none.yaml", model={"attention": "none"})
    se = dict(fam, config="configs/attention/resnet_fast_se.yaml", model={"attention": "se"})
    runs = ([dict(_r("resnet_fast_none", s, 0.866, seconds=100), **fam) for s in range(3)]
            + [dict(_r("resnet_fast_se", s, 0.87, seconds=400), **se) for s in range(3)])  # a slow sitting
    ships = {"none": fam["model"], "se": se["model"]}
    row = {"path": "-", "precision": "bf16"}
    speed = {"cpu": "Some CPU", "kernels": "avx512_bf16", "threads": 2, "date": "2026-11-28",
             "rows": [dict(row, config="configs/attention/resnet_fast_none.yaml", step="eager", images_per_s=1000.0),
                      dict(row, config="configs/attention/resnet_fast_none.yaml", step="compiled", images_per_s=5.0),
                      dict(row, config="configs/attention/resnet_fast_se.yaml", step="eager", images_per_s=900.0),
                      dict(row, config="configs/attention/resnet_fast_cbam.yaml", step="eager", images_per_s=600.0)]}
    assert report.speed_ratios(speed) == {"none": 1.0, "se": 0.9, "cbam": 0.6}
    text = report.summary(runs, "bf16 on avx512_bf16", ships, (), speed=speed)
    rows = {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| `")}
    assert rows["| `se`"].endswith(" | 0.90 |") and rows["| `none` (accuracy ± std)"].endswith(" | 1.00 |")
    assert rows["| `cbam`"].endswith(" | 0.60 |") and rows["| `gc`"].endswith(" | — |")
    assert "measured in one process on Some CPU (bf16 on avx512_bf16, 2 threads, 2026-11-28" in text
    bare = report.summary(runs, "bf16 on avx512_bf16", ships, (), speed={})
    assert "Cost:" not in bare and all(line.endswith(" | — |") for line in bare.splitlines() if line.startswith("| `"))
    assert report.speed_ratios({"rows": speed["rows"][2:]}) == {}  # no `none` row, no ratios


def test_the_cost_column_reads_the_blocks_as_they_are_now_eager_and_compiled():
    """``bench/blocks.py`` measures each block as it is ("after") and as an earlier revision had it ("before") in
    one process: the summary shows the "after" ratios, eager / compiled, and says when bf16 was not native."""
    fam = dict(kernels="avx512_bf16", config="configs/attention/resnet_fast_none.yaml", model={"attention": "none"})
    se = dict(fam, config="configs/attention/resnet_fast_se.yaml", model={"attention": "se"})
    runs = ([dict(_r("resnet_fast_none", s, 0.866), **fam) for s in range(3)]
            + [dict(_r("resnet_fast_se", s, 0.87), **se) for s in range(3)])
    none, cfg = "configs/attention/resnet_fast_none.yaml", "configs/attention/resnet_fast_se.yaml"
    rows = [{"config": none, "path": "-", "step": s, "images_per_s": 1000.0, "precision": "fp32"}
            for s in ("eager", "compiled")]
    rows += [{"config": cfg, "path": p, "step": s, "images_per_s": v, "precision": "fp32"}
             for p, s, v in (("before", "eager", 500.0), ("after", "eager", 950.0), ("before", "compiled", 600.0),
                             ("after", "compiled", 990.0))]
    speed = {"cpu": "Some CPU", "kernels": "avx2", "threads": 2, "date": "2026-12-02", "native_bf16": False, "rows": rows}
    assert report.speed_ratios(speed) == {"none": 1.0, "se": 0.95}  # not the "before" row
    assert report.speed_ratios(speed, "compiled") == {"none": 1.0, "se": 0.99}
    text = report.summary(runs, "bf16 on avx512_bf16", {"none": fam["model"], "se": se["model"]}, (), speed=speed)
    cells = {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| `")}
    assert cells["| `se`"].endswith(" | 0.95 / 0.99 |") and cells["| `none` (accuracy ± std)"].endswith(" | 1.00 / 1.00 |")
    assert cells["| `gc`"].endswith(" | — |") and "cost: images/s vs `none`, eager / compiled |" in text
    assert "the eager / compiled training step's images/s" in text and "(fp32 on avx2, 2 threads" in text
    assert "no native bf16" in text


def test_throughput_out_writes_every_row_of_one_process(tmp_path, monkeypatch, capsys):
    """``python -m bench.speed flops --out``: every row of one process, stamped with the command that made it."""
    out = tmp_path / "speed.json"
    code, stdout, err = _script_main("speed.py", monkeypatch, capsys, "flops", "--config", "configs/smoke.yaml",
                                     "configs/smoke.yaml", "--set", "model.attention=none", "--no-compile",
                                     "--steps", "1", "--repeats", "1", "--matmul", "64", "--batch-size", "4",
                                     "--out", str(out))
    assert code == 0, err
    data = json.loads(out.read_text())
    assert [(r["config"], r["path"], r["step"]) for r in data["rows"]] == [("configs/smoke.yaml", "-", "eager")] * 2
    assert all(r["images_per_s"] > 0 and r["batch_size"] == 4 for r in data["rows"])
    assert data["threads"] >= 1 and data["kernels"] and "--out" in data["command"]
    assert data["command"].startswith("python -m bench.speed flops --config configs/smoke.yaml")
    assert "images/s vs first config" in stdout and f"wrote {out}" in stdout
    first = next(line for line in stdout.splitlines() if line.startswith("| smoke |"))
    assert first.endswith(" | 1.00 |")  # the first config against itself


def test_shipped_runs_match_the_configs_model_and_only_model_overrides():
    from visattn.config import load_config

    cfg = "configs/attention/resnet_fast_se.yaml"
    model = load_config(table.ROOT / cfg).model.options()
    run = dict(_r("resnet_fast_se/identity-x", 0, 0.87), config=cfg, model=model, overrides=["model.attn_position=unit_bn"])
    assert [r["name"] for r in report.shipped([run], cfg)] == ["resnet_fast_se"]
    assert report.shipped([dict(run, overrides=["optim.lr=0.1"])], cfg) == []  # another recipe
    assert report.shipped([dict(run, model=dict(model, attention="eca"))], cfg) == []
    own = dict(run, name="resnet_fast_se", overrides=[], val_acc=0.86)  # the same seed under the config's name
    assert [r["val_acc"] for r in report.shipped([run, own], cfg)] == [0.86]  # counted once, as its own


def test_the_results_pages_attention_summary_is_the_one_the_results_give():
    doc = (ROOT / "docs" / "results.md").read_text()
    start, end = doc.index(report.README_BEGIN), doc.index(report.README_END) + len(report.README_END)
    assert doc[start:end] == report.summary(json.loads(report.RESULTS.read_text())), \
        "docs/results.md's attention summary is stale: run `python -m bench.attention_report --summary --write`"


def test_the_plot_draws_one_budget_on_one_kernel_family(tmp_path):
    pytest.importorskip("matplotlib")
    amx = [_r("resnet_fast_none", s, 0.868) for s in range(3)] + [_r("resnet_fast_se", s, 0.86) for s in range(3)]
    here = [dict(_r("resnet_fast_none", s, 0.866), kernels="avx512_bf16") for s in range(2)]
    longer = [dict(_r("resnet_fast_none", 0, 0.93), epochs=10)]
    drawn = report.plot(amx + here + longer, tmp_path / "p.png")  # the family with the most 4-epoch runs
    assert drawn == {"resnet_fast_none": 3, "resnet_fast_se": 3} and (tmp_path / "p.png").stat().st_size > 0
    assert report.plot(amx + here + longer, tmp_path / "q.png", "bf16 on avx512_bf16") == {"resnet_fast_none": 2}
    assert report.plot(amx + here + longer, tmp_path / "r.png", epochs=10) == {"resnet_fast_none": 1}


def test_gpu_table_gathers_finished_runs_into_one_file_and_stops_only_its_own(tmp_path, monkeypatch, capsys):
    """``bench/gpu_table.sh`` (here on the CPU, two tiny runs at once on synthetic images): each job's result
    comes back in one ``results.json`` that ``--merge`` takes, the logs in one ``logs.tgz``, and the deadline's
    clean-up leaves another ``python -m bench.attention_table`` process (a sweep on the same machine) running. The
    runs are a backbone variant (``--backbone``, narrower groups), so ``none`` runs under the tag too and the list value
    reaches the model as written."""
    import tarfile

    out, runs = tmp_path / "out", tmp_path / "runs"
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "-m", "bench.attention_table"])
    try:
        env = {**os.environ, "OUT": str(out), "RUNS": str(runs), "PY": sys.executable,
               "CONFIGS": "se none", "SEEDS": "0", "EPOCHS": "1", "JOBS": "2", "DEADLINE": "240", "DATA": "unused",
               "ARGS": "--tag dry --backbone --set data.source=synthetic data.synthetic_size=700 data.val_size=100 "
                       "train.batch_size=64 eval.tta=none model.widths=[16,32,32]"}
        done = subprocess.run(["bash", str(ROOT / "bench" / "gpu_table.sh")], env=env, capture_output=True,
                              text=True, timeout=300, cwd=ROOT)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        assert bystander.poll() is None, "the script's clean-up stopped a process it did not start"
    finally:
        bystander.kill()
    rs = json.loads((out / "results.json").read_text())
    assert sorted((r["name"], r["seed"], r["epochs"]) for r in rs) == [
        ("resnet_fast_none/dry", 0, 1), ("resnet_fast_se/dry", 0, 1)]
    assert all(r["model"]["widths"] == [16, 32, 32] for r in rs)
    assert len(report.differences(rs, "resnet_fast_se/dry")) == 1  # paired with the variant's own none
    with tarfile.open(out / "logs.tgz") as tar:
        assert {"./se-s0.log", "./none-s0.log"} <= set(tar.getnames())
    assert "=== 2 finished runs" in done.stdout
    assert all("2 runs at once" in r["contended"] and not report.quiet(r) for r in rs)  # times never quoted
    merged = tmp_path / "table.json"
    merged.write_text("[]")
    code, _, _ = _report_main(monkeypatch, capsys, "--results", str(merged), "--merge", str(out / "results.json"))
    assert code == 0 and json.loads(merged.read_text()) == rs


def test_gpu_table_skips_the_runs_the_table_already_holds_on_this_kernel_family(tmp_path):
    """``bench/gpu_table.sh`` lists its jobs less the (config, tag, seed) runs that ``SKIP_FROM`` holds at the
    same epochs, precision and kernel family; another family's run (or another budget's) is no reason to skip,
    and ``SKIP_FROM=`` runs them all. The job list is written before the jobs start; a one-second deadline
    (and no data) stops them before anything trains."""
    num = table.planned_numerics("configs/attention/resnet_fast_se.yaml")
    prec, kern = num.split(" on ")
    mine = dict(precision=prec, kernels=kern, epochs=3)
    model = {c: report.planned_options(f"configs/attention/resnet_fast_{c}.yaml", ["model.widths=[8,8,8]"])
             for c in ("se", "none")}
    have = [dict(_r("resnet_fast_none/w", 0, 0.9), model=model["none"], **mine),
            dict(_r("resnet_fast_se/w", 0, 0.9), model=model["se"], **mine),
            dict(_r("resnet_fast_se/w", 1, 0.9), model=model["se"], **dict(mine, kernels="NVIDIA H100 80GB HBM3")),
            dict(_r("resnet_fast_none/w", 1, 0.9), model=model["none"], **dict(mine, epochs=4)),
            # an earlier round's run of the same name and numerics, built with other block options: not this one
            dict(_r("resnet_fast_se/w", 1, 0.9), model=dict(model["se"], attn_kwargs={"init": "default"}), **mine)]
    skip = tmp_path / "table.json"
    skip.write_text(json.dumps(have))

    def jobs(skip_from: str) -> list:
        env = {**os.environ, "OUT": str(tmp_path / "out"), "RUNS": str(tmp_path / "runs"), "PY": sys.executable,
               "CONFIGS": "se none", "SEEDS": "0 1", "EPOCHS": "3", "JOBS": "1", "DEADLINE": "1",
               "DATA": str(tmp_path / "absent.tar.gz"), "ARGS": "--tag w --backbone --set model.widths=[8,8,8]",
               "SKIP_FROM": skip_from}
        done = subprocess.run(["bash", str(ROOT / "bench" / "gpu_table.sh")], env=env, capture_output=True,
                              text=True, timeout=240, cwd=ROOT)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        return (tmp_path / "runs" / "jobs.txt").read_text().split("\n")[:-1], done

    listed, done = jobs(str(skip))
    assert listed == ["se 1", "none 1"]
    assert f"skipping resnet_fast_se/w seed 0: in {skip} (3 epochs, {num})" in done.stderr
    assert "=== 2 runs to go" in done.stdout
    assert jobs("")[0] == ["se 0", "none 0", "se 1", "none 1"]


def test_a_missing_or_bad_config_is_one_line_and_leaves_the_results_file_alone(tmp_path, monkeypatch, capsys):
    out = tmp_path / "results.json"
    out.write_text(json.dumps([_r("resnet_fast_none", 0, 0.9)]))
    before = out.read_text()
    for args in (["--configs", "configs/nope.yaml"],
                 ["--configs", "configs/attention/resnet_fast_se.yaml", "--tag", "x", "--set", "model.nope=1"]):
        code, _, err = _table_main(monkeypatch, capsys, *args, "--seeds", "0", "--results", str(out),
                                   "--runs", str(tmp_path / "runs"))
        assert code not in (0, None) and err.count("\n") == 1 and "nope" in err
        assert err.startswith("attention_table.py: ")
        assert out.read_text() == before and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("mode", ["flops", "overhead"])
def test_a_bench_scripts_missing_config_is_one_line_naming_it(mode, monkeypatch, capsys):
    code, _, err = _script_main("speed.py", monkeypatch, capsys, mode, "--config", "configs/nope.yaml")
    assert code not in (0, None)
    assert err == "speed.py: config file 'configs/nope.yaml' not found\n"


def test_the_report_writes_the_summary_between_the_markers_and_leaves_the_rest(tmp_path, monkeypatch, capsys):
    """``attention_report.py --summary --write`` regenerates the README's and docs' summary blocks in place:
    the text around the markers is kept, a page without markers or already current is not touched."""
    text = f"{report.README_BEGIN}\nnew table\n{report.README_END}"
    page, other, plain = tmp_path / "a.md", tmp_path / "b.md", tmp_path / "c.md"
    page.write_text(f"intro\n{report.README_BEGIN}\nold\n{report.README_END}\noutro\n")
    other.write_text(f"{text}\n")
    plain.write_text("no markers\n")
    assert report.write_summary(text, [page, other, plain]) == [page]
    assert page.read_text() == f"intro\n{text}\noutro\n" and plain.read_text() == "no markers\n"
    assert report.write_summary(text, [page]) == []  # already current
    code, _, err = _report_main(monkeypatch, capsys, "--write")
    assert code == 2 and "--write writes the summary: give --summary too" in err and "Traceback" not in err
    code, out, _ = _report_main(monkeypatch, capsys)  # no flags: every run's table, per budget and kernel family
    assert code == 0 and "| config | params | epochs |" in out and "epochs, bf16 on" in out


def _provenance_rows(data) -> list:
    """The records of a results file that must say what made them: the file itself where it records its command,
    else each of its rows (a list, or the list under ``rows`` / ``runs`` / ``arms``)."""
    if isinstance(data, dict) and "command" in data:
        return [data]
    rows = data if isinstance(data, list) else next((data[k] for k in ("rows", "runs", "arms") if k in data), None)
    assert isinstance(rows, list) and rows, "neither a command of its own nor rows that could hold one"
    return rows


@pytest.mark.parametrize("path", sorted((ROOT / "bench" / "results").rglob("*.json")),
                         ids=lambda p: str(p.relative_to(ROOT / "bench" / "results")))
def test_every_results_file_records_its_command_and_git_and_has_one_producer(path):
    """Each results file says what made it (command and git revision, in the file or in every row), and
    bench/README.md's table names exactly one script that writes it."""
    for record in _provenance_rows(json.loads(path.read_text())):
        assert record.get("command") and record.get("git"), f"{path.name}: a record without its command or git revision"
    name = f"`results/{path.relative_to(ROOT / 'bench' / 'results')}`"
    table = [ln for ln in (ROOT / "bench" / "README.md").read_text().splitlines() if ln.startswith("| `")]
    writers = [ln.split("|")[1].strip() for ln in table if name in ln.split("|")[3]]
    assert len(writers) == 1, f"{name}: written by {writers or 'no script'} in bench/README.md, not exactly one"
