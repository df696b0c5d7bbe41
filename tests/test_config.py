"""Config loading: overrides, types, and one-line errors (exit status 2) for bad input."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from visattn.cli import main
from visattn.config import Config, load_config
from visattn.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def test_defaults_and_overrides_are_typed():
    cfg = load_config(None, ["optim.lr=0.05", "data.val_size=5000", "model.widths=[8, 16, 32]", "train.ema_decay=0.99",
                             "data.augment.hflip=false", "model.attention=none"])
    assert isinstance(cfg, Config)
    assert cfg.optim.lr == 0.05 and isinstance(cfg.optim.lr, float)
    assert cfg.data.val_size == 5000
    assert cfg.model.options()["widths"] == [8, 16, 32]
    assert cfg.data.augment.hflip is False
    assert cfg.train.ema_decay == 0.99


def test_override_beats_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("optim:\n  lr: 0.3\ntrain:\n  epochs: 4\n")
    cfg = load_config(f, ["train.epochs=7"])
    assert cfg.optim.lr == 0.3 and cfg.train.epochs == 7


def test_resolved_config_round_trips():
    cfg = load_config(None, ["model.attention=none", "optim.name=adamw"])
    again = Config.model_validate(cfg.to_dict())
    assert again.to_dict() == cfg.to_dict()


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_validates(path):
    load_config(path)


BAD = [
    # (overrides or file content, expected fragment of the one-line message)
    (["optim.lrr=0.1"], "unknown key 'optim.lrr'"),
    (["optim.lr=-0.1"], "optim.lr"),
    (["optim.lr=fast"], "optim.lr"),
    (["precision=fp8"], "precision: must be one of"),
    (["train.epochs=0"], "train.epochs"),
    (["data.source=imagenet"], "data.source"),
    (["model.name=resnet99"], "unknown model 'resnet99'"),
    (["model.widthz=[1,2,3]"], "unknown option 'widthz'"),
    (["device=tpu"], "device"),
    (["data.augment.extra=[{name: NotATransform}]", "data.loader=albumentations"], "NotATransform"),
    (["data.augment.extra=[{name: HorizontalFlip}]"], "needs loader=albumentations"),
    (["data.augment.extra=[{name: HorizontalFlip, q: 2}]", "data.loader=albumentations"], "HorizontalFlip: bad arguments"),
    (["optim"], "not of the form key=value"),
    (["optim.lr=0.1", "optim.lr.x=1"], "is a value, not a section"),
    (["sched.name=step"], "sched.name"),
    (["data.std=[0.2, 0.0, 0.2]"], "std"),
    (["model.head_scale=abc"], "must be a number"),
]


def test_model_numbers_keep_their_type():
    """YAML reads 1e38 (no dot) as a string; a numeric model option is converted, not passed on as text."""
    assert load_config(None, ["model.head_scale=1e-2"]).model.options()["head_scale"] == 0.01


def test_exponents_without_a_dot_are_numbers(tmp_path):
    """YAML 1.2 reads 1e-4 as a float, PyYAML's YAML 1.1 as a string: configs and overrides read it as a number,
    also where the builder's default gives no type to convert to (``layer_scale`` defaults to None)."""
    f = tmp_path / "c.yaml"
    f.write_text("model:\n  name: cct_2\n  layer_scale: 1e-4\noptim:\n  lr: 2E-3\n")
    cfg = load_config(f, ["train.label_smoothing=1e-1"])
    assert cfg.model.options()["layer_scale"] == 1e-4 and cfg.optim.lr == 2e-3
    assert cfg.train.label_smoothing == 0.1
    assert load_config(f, ["model.layer_scale=-3e+2"]).model.options()["layer_scale"] == -300.0
    assert load_config(None, ["name=1e5x"]).name == "1e5x" and load_config(None, ["train.epochs=10"]).train.epochs == 10


@pytest.mark.parametrize("overrides,fragment", BAD, ids=[b[1][:30] for b in BAD])
def test_bad_override_is_one_line_exit_2(overrides, fragment, capsys, tmp_path):
    rc = main(["--config", str(ROOT / "configs" / "smoke.yaml"), f"run_dir={tmp_path}", *overrides])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert fragment in err
    assert len(err.splitlines()) == 1 and err.startswith("error: ")
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "content,fragment",
    [
        (None, "not found"),
        ("optim: [1, 2\n", "not valid YAML at line"),
        ("- just\n- a list\n", "must hold a mapping"),
        ("optim:\n  lr: 0.1\nbogus: 1\n", "unknown key 'bogus'"),
    ],
    ids=["missing", "bad-yaml", "not-mapping", "unknown-top-key"],
)
def test_bad_config_file(tmp_path, content, fragment, capsys):
    f = tmp_path / "c.yaml"
    if content is not None:
        f.write_text(content)
    rc = main(["--config", str(f)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and fragment in err and len(err.splitlines()) == 1


def test_error_names_valid_choices():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["optim.name=lamb"])
    assert "'sgd'" in str(e.value) and "'adamw'" in str(e.value)


def test_cli_process_prints_no_traceback(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs" / "smoke.yaml"),
                        "train.batch_size=-5"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip().startswith("error: train.batch_size")
    assert "Traceback" not in r.stderr


# ------------------------------------------------------------------------------------------ inheritance (base:)


def _files(tmp_path: Path, **texts: str) -> Path:
    """Write ``name=text`` files (``_`` in a name stands for ``/``); returns ``tmp_path``."""
    for name, text in texts.items():
        f = tmp_path / f"{name.replace('_', '/')}.yaml"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    return tmp_path


def test_a_config_inherits_its_base_through_a_chain_and_overrides_keys(tmp_path):
    """``base:`` is relative to the file that names it; mappings merge key by key, lists are replaced, and the
    nearest file wins, then the command line."""
    _files(tmp_path, root="optim:\n  lr: 0.3\n  momentum: 0.8\nmodel:\n  widths: [8, 16, 32]\n  attention: se\n"
                          "train:\n  epochs: 4\n",
           sub_mid="base: ../root.yaml\noptim:\n  lr: 0.2\nmodel:\n  widths: [4, 4]\n",
           sub_leaf="base: mid.yaml\nname: leaf\noptim:\n  lr: 0.1\n")
    cfg = load_config(tmp_path / "sub" / "leaf.yaml", ["train.epochs=7"])
    assert cfg.name == "leaf" and cfg.optim.lr == 0.1 and cfg.optim.momentum == 0.8  # leaf over mid over root
    assert cfg.model.options() == {"widths": [4, 4], "attention": "se"}  # the list replaced, the mapping merged
    assert cfg.train.epochs == 7  # the command line over every file
    assert load_config(tmp_path / "sub" / "mid.yaml").optim.lr == 0.2


def test_the_printed_and_saved_config_is_whole_and_has_no_base_key(tmp_path, capsys):
    import yaml

    from visattn.config import read_yaml

    _files(tmp_path, root="optim:\n  lr: 0.3\n", leaf="base: root.yaml\nname: leaf\n")
    assert read_yaml(tmp_path / "leaf.yaml") == {"optim": {"lr": 0.3}, "name": "leaf"}
    assert main(["--config", str(tmp_path / "leaf.yaml"), "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert "base" not in printed and printed["optim"]["lr"] == 0.3 and printed["name"] == "leaf"
    assert printed == load_config(None, ["optim.lr=0.3", "name=leaf"]).to_dict()


@pytest.mark.parametrize("texts, fragment", [
    ({"a": "base: b.yaml\n", "b": "base: a.yaml\n"}, "base 'a.yaml' makes a cycle (a.yaml -> b.yaml -> a.yaml)"),
    ({"a": "base: a.yaml\n"}, "base 'a.yaml' makes a cycle (a.yaml -> a.yaml)"),
    ({"a": "base: nowhere.yaml\n"}, "base 'nowhere.yaml' not found"),
    ({"a": "base: b.yaml\n", "b": "base: gone.yaml\n"}, "b.yaml': base 'gone.yaml' not found"),
    ({"a": "base: [b.yaml]\n"}, "base must be the path of a config file"),
    ({"a": "base: b.yaml\n", "b": "optim: [1, 2\n"}, "b.yaml' is not valid YAML"),
    ({"a": "base: b.yaml\n", "b": "optim:\n  lrr: 1\n"}, "unknown key 'optim.lrr'"),
], ids=["cycle", "self", "missing", "missing-in-chain", "not-a-path", "bad-yaml-in-base", "bad-key-in-base"])
def test_a_bad_base_is_one_line_exit_2(tmp_path, texts, fragment):
    _files(tmp_path, **texts)
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), "--config", str(tmp_path / "a.yaml"), "--print-config"],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2 and r.stdout == "", r.stdout
    assert r.stderr.startswith("error: ") and fragment in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_a_chain_longer_than_the_limit_is_refused(tmp_path):
    from visattn.config import MAX_BASE_CHAIN

    n = MAX_BASE_CHAIN + 1
    _files(tmp_path, **{f"c{i}": f"base: c{i + 1}.yaml\n" for i in range(n)}, **{f"c{n}": "name: end\n"})
    with pytest.raises(ConfigError, match=f"more than {MAX_BASE_CHAIN} bases in a chain"):
        load_config(tmp_path / "c0.yaml")
    assert load_config(tmp_path / f"c{n - MAX_BASE_CHAIN}.yaml").name == "end"  # exactly at the limit: read
