"""``train.py`` trains a timm vision transformer by name for one epoch on the smoke data (issue 91, item 3), and the
TensorBoard cards hold the model's own attention: a map (and its gradient map) for every module of the model that
visattn.maps.families records, and no block of visattn's (``model.attention=none``). Tiny Swin and CaiT configs
through ``model.kwargs``, 32-px synthetic images; a run takes 10-20 s on two CPU cores (train.py in a child
process, as a user runs it)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import timm

from visattn.maps import families

ROOT = Path(__file__).resolve().parents[1]

MODELS = {  # name: builder options (model.kwargs), small enough for seconds on a CPU at 32 px
    "swin_tiny_patch4_window7_224": {"img_size": 32, "window_size": 4, "embed_dim": 16, "depths": [2, 2],
                                     "num_heads": [1, 2]},
    "cait_xxs24_224": {"img_size": 32, "patch_size": 4, "embed_dim": 32, "depth": 2, "num_heads": 2,
                       "depth_token_only": 1},
}


def _override(key: str, value) -> str:
    shown = f"[{','.join(map(str, value))}]" if isinstance(value, list) else str(value)
    return f"model.kwargs.{key}={shown}"


def _images(run_dir: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps = {}
    for events in (run_dir / "tb").rglob("events.*"):
        acc = EventAccumulator(str(events), size_guidance={"images": 0})
        acc.Reload()
        for tag in acc.Tags().get("images", []):
            steps[tag] = [e.step for e in acc.Images(tag)]
    return steps


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_train_py_trains_a_transformer_by_name_with_its_own_attention_on_the_cards(name, tmp_path):
    kwargs = MODELS[name]
    out = tmp_path / "run"
    cmd = [sys.executable, "train.py", "--config", "configs/smoke.yaml", "train.epochs=1", "data.synthetic_size=200",
           "data.val_size=50", "log.progress=false", f"model.name=timm/{name}", "model.attention=none",
           *(_override(k, v) for k, v in kwargs.items()), f"run_dir={out}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1] and rows[0]["epoch_steps"] >= 1 and rows[0]["val_acc"] is not None
    # the modules of this model whose attention the families record, found in a model built alike
    model = timm.create_model(name, num_classes=10, **kwargs)
    own = [s.path for s in families.sites(model)]
    assert own, "the model has no recorded family module"
    steps = _images(out)
    for path in own:
        for tag in (f"maps/{path}", f"maps/{path}/grad"):
            assert steps.get(tag) == [1], f"{tag}: logged at {steps.get(tag)}; images: {sorted(steps)[:12]}"
    assert not any(".attn.spatial" in t or "units." in t for t in steps)  # no inserted block of visattn's
