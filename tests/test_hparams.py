"""Runs compared in TensorBoard's HParams dashboard: each run folder is one row, its settings and final metrics.

The end-to-end test trains two tiny runs through ``train.py``'s entry point (one of them resumed with a longer
schedule, ``--resume RUN/last.pt train.epochs=2``), then asks a real TensorBoard server's HParams API
(``POST /data/plugin/hparams/experiment`` and ``/session_groups``) what its dashboard lists.
"""
from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("tensorboard")

from test_tensorboard_server import OPENER, poll, serving  # noqa: E402

from visattn.cli import main  # noqa: E402
from visattn.config import load_config  # noqa: E402
from visattn.hparams import HPARAMS_FILE, METRIC_TAGS, logged_hparams, run_hparams, start_hparams  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / "configs" / "smoke.yaml")
TINY = ["data.synthetic_size=240", "data.val_size=40", "train.batch_size=40", "train.epochs=1", "eval.batch_size=100",
        "eval.tta=none", "model.widths=[8,16,16]", "model.stem_width=8", "log.progress=false", "log.maps_every=0",
        "log.faithfulness=false"]
STATUSES = ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE", "STATUS_RUNNING"]


def test_every_run_logs_the_same_keys_as_scalars():
    """Whichever run's experiment summary the dashboard picks lists every run's columns: the same keys, one type
    each, for every model; lists and None are text."""
    hps = [run_hparams(load_config(SMOKE, ["model.attn_kwargs={init: identity, reduction: 8}", "optim.grad_clip=1.0",
                                           "model.attn_position=unit_out"]), "fp32", 5),
           *(run_hparams(load_config(ROOT / "configs" / name), "bf16", 1000)
             for name in ("smoke.yaml", "vit_tiny.yaml", "cct_2.yaml", "vit_tiny_lsa_spt.yaml"))]
    assert all(set(hp) == set(hps[0]) for hp in hps)
    for key in hps[0]:
        assert len({type(hp[key]) is str for hp in hps}) == 1, key
    assert all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for hp in hps for v in hp.values())
    first, smoke, vit = hps[:3]
    assert (first["attention"], first["attn_init"], first["attn_position"]) == ("cbam", "identity", "unit_out")
    assert first["model.options"] == "attn_kwargs.reduction=8, stem_width=16, widths=[16, 32, 64]"
    assert (smoke["attn_init"], smoke["attn_position"], smoke["optim.grad_clip"]) == ("default", "unit_bn", "none")
    assert first["optim.grad_clip"] == "1.0" and first["data.mean"] == "[0.4914, 0.4822, 0.4465]"
    assert (vit["model"], vit["attention"], vit["attn_position"], vit["optimizer"]) == ("vit_tiny", "mhsa", "n/a", "adamw")
    assert (smoke["lr"], smoke["batch_size"], smoke["epochs"], smoke["seed"]) == (0.2, 100, 2, 0)
    assert smoke["precision"] == "bf16" and smoke["data.augment.hflip"] == "true"
    assert not any(k.startswith("resume") or k == "run_dir" for k in smoke)


def test_resume_keeps_or_replaces_the_settings(tmp_path):
    said = []
    hp = {"epochs": 1, "model": "m"}
    assert start_hparams(tmp_path, hp, said.append) == []
    first = (tmp_path / HPARAMS_FILE).stat()
    assert start_hparams(tmp_path, dict(hp), said.append) == []  # the same settings: the file is kept
    assert (tmp_path / HPARAMS_FILE).stat().st_mtime_ns == first.st_mtime_ns
    assert start_hparams(tmp_path, {"epochs": 2, "model": "m"}, said.append) == ["epochs"]
    assert logged_hparams(tmp_path) == ({"epochs": 2.0, "model": "m"}, False)
    assert len(said) == 1 and "epochs 1 -> 2" in said[0]
    (tmp_path / HPARAMS_FILE).write_bytes(b"not an event file")
    assert start_hparams(tmp_path, hp, said.append) == [] and logged_hparams(tmp_path)[0] == {"epochs": 1.0, "model": "m"}


def post(port: int, path: str, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with OPENER.open(req, timeout=10) as r:
        return json.loads(r.read())


def train(argv, capsys) -> dict:
    assert main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    return {"summary": json.loads(out.strip().splitlines()[-1]), "log": out}


def test_hparams_dashboard_lists_each_run_once(tmp_path, capsys):
    logdir = tmp_path / "runs"
    cbam = train(["--config", SMOKE, f"run_dir={logdir / 'cbam'}", *TINY], capsys)["summary"]
    train(["--config", SMOKE, f"run_dir={logdir / 'se'}", *TINY, "model.attention=se", "optim.lr=0.1"], capsys)
    # resumed with a longer schedule, the override after --resume: the same row, now 2 epochs
    se = train(["--config", SMOKE, f"run_dir={logdir / 'se'}", *TINY, "model.attention=se", "--resume",
                str(logdir / "se" / "last.pt"), "optim.lr=0.1", "train.epochs=2"], capsys)
    assert (cbam["epochs"], se["summary"]["epochs"]) == (1, 1)  # the resumed process trained epoch 2 only
    assert "hparams: settings changed since this run folder was last started (epochs 1 -> 2)" in se["log"]
    se = se["summary"]
    assert len(list((logdir / "se" / "tb").glob("events.out.tfevents.*"))) == 3  # hparams + two writers

    with serving(logdir, tmp_path) as (proc, port, log_path):
        def probe():
            exp = post(port, "/data/plugin/hparams/experiment", {"experimentName": ""})
            groups = post(port, "/data/plugin/hparams/session_groups", {
                "experimentName": "", "allowedStatuses": STATUSES, "startIndex": 0, "sliceSize": 100,
                "colParams": [{"hparam": h["name"]} for h in exp.get("hparamInfos", [])]
                + [{"metric": m["name"]} for m in exp.get("metricInfos", [])]})
            rows = groups.get("sessionGroups", [])
            done = len(rows) == 2 and all(len(g["metricValues"]) == len(METRIC_TAGS) for g in rows)
            return ((exp, rows) if done else None), f"{len(rows)} session groups"

        exp, rows = poll(proc, log_path, "HParams session groups for both runs", probe)

    assert sorted(m["name"]["tag"] for m in exp["metricInfos"]) == sorted(METRIC_TAGS)
    names = {h["name"] for h in exp["hparamInfos"]}
    assert {"model", "attention", "attn_init", "attn_position", "optimizer", "lr", "batch_size", "epochs",
            "precision", "seed", "optim.weight_decay", "data.synthetic_size"} <= names
    by_run = {g["name"]: g for g in rows}
    assert sorted(by_run) == ["cbam/tb", "se/tb"]  # one row per run folder, the resumed one included
    for run, attention, epochs, lr, summary in [("cbam/tb", "cbam", 1, 0.2, cbam), ("se/tb", "se", 2, 0.1, se)]:
        g = by_run[run]
        hp = g["hparams"]
        assert (hp["model"], hp["attention"], hp["attn_init"], hp["attn_position"]) == ("resnet_fast", attention,
                                                                                        "default", "unit_bn")
        assert (hp["optimizer"], hp["lr"], hp["batch_size"], hp["epochs"], hp["seed"]) == ("sgd", lr, 40, epochs, 0)
        assert hp["precision"] in ("bf16", "fp32") and hp["data.synthetic_size"] == 240
        metrics = {m["name"]["tag"]: m for m in g["metricValues"]}
        assert metrics["hparams/best_val_acc"]["value"] == pytest.approx(summary["best_val_acc"], abs=1e-6)
        assert all(m["trainingStep"] == epochs for m in metrics.values())  # the latest epoch's values
        assert metrics["hparams/images_per_s"]["value"] > 0
        assert [s["status"] for s in g["sessions"]] == ["STATUS_SUCCESS"]
