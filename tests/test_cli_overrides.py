"""``key=value`` overrides go anywhere on the ``train.py`` command line, ``--resume PATH`` or not."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from visattn.cli import bare_resume, main

ROOT = Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / "configs" / "smoke.yaml")


def resolved(argv, capsys) -> dict:
    assert main([*argv, "--print-config"]) == 0
    return yaml.safe_load(capsys.readouterr().out)


@pytest.mark.parametrize("argv", [
    ["--config", SMOKE, "--resume", "RUN/last.pt", "train.epochs=8", "optim.lr=0.3"],
    ["train.epochs=8", "--config", SMOKE, "--resume", "RUN/last.pt", "optim.lr=0.3"],
    ["--resume", "RUN/last.pt", "train.epochs=8", "--config", SMOKE, "optim.lr=0.3"],
    ["--config", SMOKE, "train.epochs=8", "--resume", "RUN/last.pt", "optim.lr=0.3"],
], ids=["after-resume", "around", "before-config", "before-resume"])
def test_overrides_anywhere(argv, capsys):
    cfg = resolved(argv, capsys)
    assert cfg["resume"] == "RUN/last.pt"
    assert cfg["train"]["epochs"] == 8 and cfg["optim"]["lr"] == 0.3


def test_override_right_after_bare_resume_is_an_override(capsys):
    """``--resume train.epochs=8``: resume the run_dir's last.pt (resume=auto), with the override applied."""
    cfg = resolved(["--config", SMOKE, "--resume", "train.epochs=8"], capsys)
    assert cfg["resume"] == "auto" and cfg["train"]["epochs"] == 8
    cfg = resolved(["--config", SMOKE, "--resume", "--print-config", "train.epochs=7"], capsys)
    assert cfg["resume"] == "auto" and cfg["train"]["epochs"] == 7


def test_a_checkpoint_named_like_an_override_is_still_a_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a=1").write_bytes(b"")
    assert bare_resume(["--resume", "a=1"]) == ["--resume", "a=1"]
    assert bare_resume(["--resume", "b=1"]) == ["--resume=auto", "b=1"]
    assert bare_resume(["--resume", "runs/x/last.pt", "b=1"]) == ["--resume", "runs/x/last.pt", "b=1"]
    assert bare_resume(["--resume", "x" * 5000 + "=1"])[0] == "--resume=auto"  # too long for a file name


def test_unknown_flag_is_still_refused_after_overrides(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--config", SMOKE, "--resume", "RUN/last.pt", "train.epochs=8", "--frobnicate"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "train.py: error: unrecognized arguments: --frobnicate"


def test_not_an_override_is_one_line(capsys, tmp_path):
    rc = main(["--config", SMOKE, f"run_dir={tmp_path}", "--resume", "RUN/last.pt", "epochs"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1
    assert "not of the form key=value" in err
