"""Off the happy path, the next round: an integrity check the input itself could switch off (a checkpoint's
digest removed or set to null), numbers valid alone but not with the rest of the config (a distillation
temperature, an ECA ``gamma``, a warmup longer than the run, a hole larger than the image), values of another type
that Python would coerce (a bool as a number, a list as a mapping), the bench scripts' readers and numeric flags,
and ``~`` in paths. Each ends in one ``error`` line and exit 2 with files as they were, or works
(docs/reliability.md). What is a process's (the exit status of ``python -m visattn.evaluate``, a bench script's)
runs as a subprocess; the rest through the entry points in-process (conftest's ``run_cli``), as tests/test_hostile.py.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest
import torch
from conftest import ROOT, SMOKE, run_cli
from test_faults import TINY, _cli, _env, _snapshot
from test_hostile import _script

from visattn import evaluate as evaluate_cli
from visattn import visualize as visualize_cli
from visattn.config import load_config
from visattn.errors import CheckpointError, ConfigError
from visattn.run_checks import check_for_training
from visattn.rundir import CHECKPOINT_FORMAT, DIGEST_KEY, load_checkpoint, save_checkpoint, state_digest

RUN = TINY + ["train.batch_size=50", "log.tensorboard=false"]


def _argv(run_dir: Path, *extra: str) -> List[str]:
    return ["--config", str(SMOKE), f"run_dir={run_dir}", *RUN, *extra]


def _one_line(rc: int, err: str, fragment: str, status: int = 2) -> None:
    assert rc == status, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert fragment in lines[0], err


def _proc(args: List[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=kw.pop("env", _env()), capture_output=True, text=True,
                          timeout=300, **kw)


# ---------------------------------------------------------------------------------- a digest removed or null


def _edited(finished_run: Path, folder: Path) -> dict:
    """Today's checkpoint with its classifier zeroed (it scores 10% instead of the run's accuracy), its digest
    removed, null, a number, or left as it was (then it no longer matches), each written with plain torch.save."""
    state = torch.load(finished_run / "last.pt", weights_only=True)
    assert state["format_version"] == CHECKPOINT_FORMAT and state[DIGEST_KEY].startswith("sha256:")
    state["model"]["fc.weight"].zero_()
    state["ema"] = {k: v.zero_() if k == "module.fc.weight" else v for k, v in state["ema"].items()}
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for name, digest in (("removed", ...), ("null", None), ("number", 5), ("stale", state[DIGEST_KEY])):
        s = {k: v for k, v in state.items() if k != DIGEST_KEY}
        if digest is not ...:
            s[DIGEST_KEY] = digest
        torch.save(s, folder / f"{name}.pt")
        files[name] = folder / f"{name}.pt"
    return files


WHY = {"removed": "its digest entry was removed", "null": "its digest entry is None, not a sha256 digest",
       "number": "its digest entry is 5, not a sha256 digest", "stale": "do not match the digest"}


def test_evaluate_refuses_a_checkpoint_whose_digest_was_removed_or_nulled(tmp_path, finished_run):
    files = _edited(finished_run, tmp_path / "edited")
    for name in ("removed", "null"):
        r = _proc(["-m", "visattn.evaluate", "--checkpoint", str(files[name]), "--data", "synthetic", "--tta", "none",
                   "--device", "cpu"])
        _one_line(r.returncode, r.stderr, WHY[name])
        assert f"{name}.pt" in r.stderr and "is damaged" in r.stderr and "top-1" not in r.stdout


def test_every_loader_refuses_an_edited_checkpoint(tmp_path, finished_run):
    files = _edited(finished_run, tmp_path / "edited")
    bench_run = tmp_path / "bench_run"  # a run folder as the bench scripts find it: last.pt beside metrics.jsonl
    for name, path in files.items():
        why = WHY[name]
        with pytest.raises(CheckpointError, match="is damaged"):
            load_checkpoint(path)
        _one_line(*_cli(["--checkpoint", str(path), "--data", "synthetic", "--device", "cpu"], evaluate_cli.main), why)
        _one_line(*_cli(["--checkpoint", str(path), "--validation", "1", "--data", "synthetic", "--device", "cpu",
                         "--out", str(tmp_path / "maps")], visualize_cli.main), why)
        assert not (tmp_path / "maps").exists()
        resumed = tmp_path / f"resume-{name}"
        resumed.mkdir()
        shutil.copy(path, resumed / "last.pt")
        before = _snapshot(resumed)
        _one_line(*_cli(_argv(resumed, "resume=auto", "train.epochs=2", "train.ema_decay=0.9")), why)
        assert _snapshot(resumed) == before
        for extra in (f"model.init_from={path}", f"train.distill.teacher={path}"):
            _one_line(*_cli(_argv(tmp_path / "new", "train.epochs=1", extra)), why)
            assert not (tmp_path / "new").exists()
        bench_run.mkdir(exist_ok=True)
        shutil.copy(path, bench_run / "last.pt")
        results = tmp_path / "faithfulness.json"
        results.write_text('{"rows": []}\n')
        for script, out in (("faithfulness.py", results), ("localization.py", results)):
            rc, _, err = _script(script, str(bench_run), "--out", str(out), "--images", "4", "--device", "cpu")
            _one_line(rc, err, why)
            assert results.read_text() == '{"rows": []}\n'


def test_a_newer_or_odd_format_and_weights_that_are_not_a_state_dict_are_refused(tmp_path, finished_run,
                                                                                  pre_digest_best):
    state = load_checkpoint(finished_run / "last.pt")
    for version, says in ((CHECKPOINT_FORMAT + 1, "is newer than this visattn reads"), ("2", "is not one visattn writes"),
                          (True, "is not one visattn writes")):
        s = dict(state, format_version=version)
        s[DIGEST_KEY] = state_digest(s)  # a whole file, as written
        torch.save(s, tmp_path / "f.pt")
        with pytest.raises(CheckpointError, match=says):
            load_checkpoint(tmp_path / "f.pt")
    old = torch.load(pre_digest_best, weights_only=True)  # before digests
    torch.save(old, tmp_path / "old.pt")
    assert load_checkpoint(tmp_path / "old.pt")["epoch"] == 1  # a pre-digest file: only the checks below remain
    for key, value, says in (("model", [float("nan")], "a list, not a state dict"), ("ema", "w", "a str, not a state dict"),
                             ("config", [1], "a list, not a mapping"), ("epoch", "1", "a str, not an integer"),
                             ("step", True, "a bool, not an integer")):
        torch.save({**old, key: value}, tmp_path / "old.pt")
        with pytest.raises(CheckpointError, match=f"its {key} entry is {says}"):
            load_checkpoint(tmp_path / "old.pt")


def test_a_checkpoint_path_may_start_with_the_home_folder(tmp_path, finished_run, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copy(finished_run / "best.pt", tmp_path / "b.pt")
    assert load_checkpoint("~/b.pt")["epoch"] == 1
    done = run_cli(["--checkpoint=~/b.pt", "--data", "synthetic", "--device", "cpu", "--tta", "none"], evaluate_cli.main)
    assert done.returncode == 0 and "top-1" in done.stdout, done.stderr


# ------------------------------------------------------------------------------ numbers valid alone, not together


@pytest.mark.parametrize("overrides,fragment", [
    (["train.distill.temperature=1e-30"], "train.distill.temperature=1e-30 is below 0.1"),
    (["train.distill.temperature=0.05", "train.distill.kind=soft"], "switches distillation off"),
    (["model.attention=eca", "model.attn_kwargs.gamma=0"], "eca: gamma must be > 0"),
    (["model.attention=eca", "model.attn_kwargs.gamma=1e-300"],
     "eca: gamma=1e-300 with b=1 gives a kernel size of 4e+300 for 8 channels, wider than 2 * channels + 1 = 17"),
    (["model.attention=eca", "model.attn_kwargs.gamma=.nan"], "attn_kwargs.gamma must be a finite number"),
    (["sched.warmup_epochs=3", "train.epochs=2"], "sched.warmup_epochs=3 is longer than the run (train.epochs=2)"),
    (["data.augment.cutout=20", "data.image_size=16"], "data.augment.cutout=20 is larger than the 16x16 images"),
    (["data.augment.crop_padding=8", "data.image_size=8"], "crop_padding=8 with padding_mode=reflect needs images"),
    (["train.lookahead_every=13", "train.epochs=2"], "train.lookahead_every=13 is longer than the run's 12 steps"),
], ids=["temperature-1e-30", "temperature-0.05", "eca-gamma-0", "eca-gamma-1e-300", "eca-gamma-nan",
        "warmup-longer-than-run", "cutout-larger-than-image", "reflect-padding-wider-than-image",
        "lookahead-longer-than-run"])
def test_a_number_that_does_not_fit_the_rest_is_one_line_before_anything_is_written(tmp_path, overrides, fragment):
    rd = tmp_path / "run"
    _one_line(*_cli(_argv(rd, *overrides)), fragment)
    assert not rd.exists()


def test_the_eca_gamma_refusals_are_the_processs_one_line(tmp_path):
    for gamma, says in (("0", "gamma must be > 0"), ("1e-300", "gives a kernel size of")):
        r = _proc(["train.py", *_argv(tmp_path / "run", "model.attention=eca", f"model.attn_kwargs.gamma={gamma}")])
        _one_line(r.returncode, r.stderr, says)
        assert not (tmp_path / "run").exists()


def test_a_warmup_within_the_run_and_a_constant_schedule_are_accepted():
    for overrides in (["sched.warmup_epochs=2", "train.epochs=2"], ["sched.name=constant", "sched.warmup_epochs=5",
                      "train.epochs=1"], ["train.distill.temperature=0.1"], ["data.augment.cutout=16", "data.image_size=16"]):
        check_for_training(load_config(SMOKE, overrides))


def test_a_checkpoint_whose_stored_config_a_run_would_refuse_still_evaluates(tmp_path, finished_run):
    """The training-time refusals are not the schema's: a checkpoint trained before them (a 2.3-epoch warmup in a
    one-epoch dry run, a temperature of 0.05) still loads for evaluate and visualize."""
    state = load_checkpoint(finished_run / "best.pt")
    stored = state["config"]
    state["config"] = {**stored, "sched": {**stored["sched"], "warmup_epochs": 5.0},
                       "train": {**stored["train"], "distill": {**stored["train"]["distill"], "temperature": 0.05}}}
    save_checkpoint(state, tmp_path / "old_settings.pt")
    rc, err = _cli(["--checkpoint", str(tmp_path / "old_settings.pt"), "--data", "synthetic", "--device", "cpu"],
                   evaluate_cli.main)
    assert rc == 0, err


# ----------------------------------------------------------------------------------------- coerced types


@pytest.mark.parametrize("override,fragment", [
    ("model.attn_kwargs=[[init, identity]]", "option 'attn_kwargs' of model 'resnet_fast' must be a mapping"),
    ("model.attn_kwargs.rd_ratio=true", "option attn_kwargs.rd_ratio must be a number, not True"),
    ("model.attn_kwargs.bias=1", "option attn_kwargs.bias must be true or false, not 1"),
    ("model.stem_width=true", "option 'stem_width' of model 'resnet_fast' must be a number"),
    ("model.stem_width=8.5", "option 'stem_width' of model 'resnet_fast' must be an integer, not 8.5"),
    ("model.widths=abc", "option 'widths' of model 'resnet_fast' must be a list, not a str"),
    ("optim.lr=true", "optim.lr: must be a number, not true or false"),
    ("train.epochs=true", "train.epochs: must be a number, not true or false"),
    ("optim.lr='0.1'", "optim.lr: must be a number, not a string"),
    ("log.tensorboard=1", "log.tensorboard: must be true or false"),
    ("log.faithfulness=1", "log.faithfulness: must be true or false"),
    ("data.mean=[true, 0, 0]", "data.mean: value 0 must be a number, not true or false"),
    ("seed=true", "seed: must be a number, not true or false"),
])
def test_a_value_of_another_type_is_refused_not_coerced(tmp_path, override, fragment):
    rd = tmp_path / "run"
    _one_line(*_cli(_argv(rd, override)), fragment)
    assert not rd.exists()


def test_a_config_file_with_a_list_for_a_mapping_is_refused(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(f"base: {SMOKE}\nmodel:\n  attention: se\n  attn_kwargs: [[init, identity]]\n")
    with pytest.raises(ConfigError, match="'attn_kwargs' of model 'resnet_fast' must be a mapping"):
        load_config(f)
    f.write_text(f"base: {SMOKE}\nmodel:\n  attention: se\n  attn_kwargs: {{rd_ratio: true}}\n")
    with pytest.raises(ConfigError, match="attn_kwargs.rd_ratio must be a number"):
        load_config(f)


def test_values_of_their_own_type_still_load():
    cfg = load_config(SMOKE, ["optim.lr=1", "train.epochs=2.0", "log.faithfulness=auto", "model.stem_width=8.0",
                              "model.attn_kwargs={init: identity, rd_ratio: 0.25}", "model.attention=se"])
    assert cfg.optim.lr == 1.0 and cfg.train.epochs == 2 and cfg.model.options()["stem_width"] == 8
    assert isinstance(cfg.model.options()["stem_width"], int)


# ------------------------------------------------------------------------------------------------ ~ in paths


def test_init_from_and_a_configs_base_take_the_home_folder(tmp_path, finished_run, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    shutil.copy(finished_run / "last.pt", home / "b.pt")
    (home / "base.yaml").write_text(SMOKE.read_text())
    child = tmp_path / "child.yaml"
    child.write_text("base: ~/base.yaml\ntrain:\n  epochs: 1\n")
    cfg = load_config(child, [f"run_dir={tmp_path / 'r'}", "model.init_from=~/b.pt", "resume=~/x.pt",
                              "train.distill.teacher=~/t.pt"])
    assert cfg.train.epochs == 1 and cfg.model.init_from == str(home / "b.pt")
    assert cfg.resume == str(home / "x.pt") and cfg.train.distill.teacher == str(home / "t.pt")
    rd = tmp_path / "from_home"
    rc, err = _cli(_argv(rd, "train.epochs=1", "model.init_from=~/b.pt"))
    assert rc == 0, err
    assert json.loads((rd / "run_info.json").read_text())["init_from"]["path"] == str(home / "b.pt")


# ----------------------------------------------------------------------------------- bench readers and flags


def _bench(*args: str) -> subprocess.CompletedProcess:
    return _proc(["-m", f"bench.{Path(args[0]).stem}", *args[1:]])  # python -m bench.NAME ARGS


def test_the_bench_reports_refuse_a_file_with_no_usable_row(tmp_path):
    rows = tmp_path / "rows.json"
    rows.write_text('{"rows": [{}]}')
    r = _bench("faithfulness.py", "--report", "--out", str(rows))
    _one_line(r.returncode, r.stderr, f"{rows}: row 1 has no 'model'")
    runs = tmp_path / "runs.json"
    runs.write_text("[{}]")
    r = _bench("attention_report.py", "--summary", "--results", str(runs))
    _one_line(r.returncode, r.stderr, f"{runs}: row 1 has no 'name'")
    assert not r.stdout.strip() and rows.read_text() == '{"rows": [{}]}' and runs.read_text() == "[{}]"


def _attention_row(**change) -> dict:
    row = {"config": "configs/attention/resnet_fast_none.yaml", "name": "resnet_fast_none", "seed": 0, "epochs": 4,
           "val_acc": 0.9, "train_seconds": 100.0, "images_per_s": 1000.0, "parameters": 1000}
    return {**row, **change}


def _faith_row(**change) -> dict:
    row = {"model": "m", "checkpoint": {"path": "p", "config": "c", "seed": 0}, "val_acc": 0.5, "images": 4,
           "map": "centre", "kind": "centre", "deletion_score": [0.1, 0.0, 0.2], "insertion_score": [0.1, 0.0, 0.2],
           "sanity_rho": None}
    return {**row, **change}


@pytest.mark.parametrize("script,doc,fragment", [
    ("attention_report.py", [_attention_row(val_acc=True)], "row 1 has true as its 'val_acc'"),
    ("attention_report.py", [_attention_row(), _attention_row(seed="1")], "row 2 has \"1\" as its 'seed'"),
    ("attention_report.py", [_attention_row(val_acc=float("nan"))], "has NaN as its 'val_acc'"),
    ("attention_report.py", [1], "row 1 is a JSON int, not an object"),
    ("faithfulness.py", {"rows": [_faith_row(deletion_score=[0.1, 0.2])]}, "'deletion_score', which must be [mean"),
    ("faithfulness.py", {"rows": [_faith_row(checkpoint={"path": "p", "config": "c", "seed": False})]},
     "false as its 'checkpoint.seed'"),
    ("faithfulness.py", {"rows": {"a": 1}}, "holds no list of rows"),
    ("localization.py", {"rows": [_faith_row(object=True, canvas=80, object_size=32, tolerance=4)]}, "has no 'pointing'"),
    ("localization.py", {"rows": []}, "--report: RESULTS holds no results"),
], ids=["bool-acc", "str-seed", "nan-acc", "not-object", "short-interval", "bool-seed", "rows-not-list",
        "map-row-without-scores", "no-rows"])
def test_a_damaged_row_is_named_and_nothing_is_written(tmp_path, script, doc, fragment):
    path = tmp_path / "results.json"
    path.write_text(json.dumps(doc))
    before = path.read_bytes()
    docs_before = (ROOT / "docs" / "maps.md").read_bytes()
    flag = ["--summary", "--results"] if script == "attention_report.py" else ["--report", "--out"]
    rc, out, err = _script(script, *flag, str(path))
    _one_line(rc, err, fragment.replace("RESULTS", str(path)))
    assert str(path) in err and not out.strip()
    assert path.read_bytes() == before and (ROOT / "docs" / "maps.md").read_bytes() == docs_before


def test_attention_report_merge_and_plot_refuse_in_one_line(tmp_path):
    results = tmp_path / "results.json"
    results.write_text(json.dumps([_attention_row()]))
    before = results.read_bytes()
    other = tmp_path / "other.json"
    for text, fragment in (("{not json", "not a readable JSON file"), ('[{"name": 5}]', "row 1 has 5 as its 'name'")):
        other.write_text(text)
        rc, _, err = _script("attention_report.py", "--results", str(results), "--merge", str(other))
        _one_line(rc, err, fragment)
    for epochs, fragment in (("0", "holds no runs of --plot-epochs 0"), ("x", "invalid int value: 'x'")):
        rc, _, err = _script("attention_report.py", "--results", str(results), "--plot", str(tmp_path / "p.png"),
                             "--plot-epochs", epochs)
        _one_line(rc, err, fragment)
    assert results.read_bytes() == before and not (tmp_path / "p.png").exists()
    rc, _, err = _script("attention_report.py", "--summary", "--results", str(results))  # no run of its families
    _one_line(rc, err, "holds no runs of the summary's kernel families")


@pytest.mark.parametrize("argv,fragment", [
    (["faithfulness.py", "RUNS", "--images", "0"], "--images must be at least 1, got 0"),
    (["faithfulness.py", "RUNS", "--draws", "-2"], "--draws must be at least 1, got -2"),
    (["faithfulness.py", "RUNS", "--steps", "nan"], "argument --steps: invalid int value: 'nan'"),
    (["faithfulness.py", "RUNS", "--vit-images", "0"], "--vit-images must be at least 1"),
    (["localization.py", "RUNS", "--images", "0"], "--images must be at least 1, got 0"),
    (["localization.py", "RUNS", "--faith-images", "-1"], "--faith-images must be at least 0, got -1"),
    (["localization.py", "RUNS", "--regions", "0"], "--regions must be at least 1"),
    (["finetune.py", "--lr", "nan"], "--lr: give the fine-tune's peak learning rate"),
    (["finetune.py", "--lr", "0.1", "--seeds", "-1"], "--seeds must be at least 0, got -1"),
    (["finetune.py", "--lr", "0.1", "--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["faithfulness.py", "NOWHERE"], "no last.pt in"),
])
def test_bench_flags_out_of_range_are_one_line_and_write_nothing(tmp_path, finished_run, argv, fragment):
    results = tmp_path / "results.json"
    text = '{"runs": [], "paired": []}\n' if argv[0] == "finetune.py" else '{"rows": []}\n'
    results.write_text(text)
    argv = [a.replace("RUNS", str(finished_run)).replace("NOWHERE", str(tmp_path / "nowhere")) for a in argv]
    out_flag = ["--results", str(results)] if argv[0] == "finetune.py" else ["--out", str(results)]
    rc, out, err = _script(*argv, *out_flag)
    _one_line(rc, err, fragment)
    assert results.read_text() == text


def test_the_ablation_and_worked_example_readers_name_a_damaged_row(tmp_path, monkeypatch, capsys):
    from test_bench import _load

    from visattn.errors import DataError, run_main

    ablation = _load("recipe_ablation")
    results = tmp_path / "ablation.json"
    results.write_text('[{"variant": "recipe", "seed": 0}]')
    config, variants, _ = ablation.RECIPES["cpu"]
    monkeypatch.setitem(ablation.RECIPES, "cpu", (config, variants, results))
    monkeypatch.setattr(sys, "argv", ["recipe_ablation.py", "--table"])
    with pytest.raises(SystemExit) as e:
        run_main(ablation.main, "recipe_ablation.py")
    out, err = capsys.readouterr()
    assert e.value.code == 2 and not out
    _one_line(2, err, "row 1 has no 'val_acc', which must be a finite number")
    from test_bench_finetune import _example

    example = _example()
    monkeypatch.setattr(example, "RESULTS", tmp_path / "example.json")
    example.RESULTS.write_text('{"base": {"epochs": 4, "val_acc": 0.6}, "arms": [{"block": "cbam", "val_acc": "68%"}]}')
    with pytest.raises(DataError, match="row 1 has no 'inserted'"):
        example.read()
