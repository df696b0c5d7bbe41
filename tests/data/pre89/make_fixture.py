"""Run folders from the code before issue 89 (tests/old_revisions.py runs this at test time): from a tree of
revision 77dcb8a, `python make_fixture.py OUT 77dcb8a` writes OUT/epoch, OUT/mid and OUT/expected.json."""
import hashlib
import json
import shutil
import sys
from pathlib import Path

import torch

from visattn.config import load_config
from visattn.rundir import metrics_rows
from visattn.trainer import run

OUT = Path(sys.argv[1])
COMMON = ["train.epochs=2", "data.synthetic_size=200", "data.val_size=50", "log.progress=false",
          "model.widths=[8,16,16]", "model.stem_width=8", "precision=fp32", "device=cpu", "deterministic=true",
          "log.maps_every=0", "log.tensorboard=false", "eval.tta=flip", "train.batch_size=50",
          "train.ema_decay=0.9", "train.lookahead_every=2", "data.augment.cutout=8"]
VARIANTS = {"epoch": [], "mid": ["train.max_steps=5"]}  # 3 steps an epoch: "mid" stops 2 steps into epoch 2
KEEP = ("config.yaml", "run_info.json", "metrics.jsonl", "last.pt")

def digest(state):
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode()); h.update(state[k].detach().double().contiguous().numpy().tobytes())
    return h.hexdigest()

record = {"made_by": "code at " + sys.argv[2] + " (before issue 89)", "cpu_capability": torch.backends.cpu.get_cpu_capability(),
          "torch": torch.__version__, "overrides": COMMON, "variants": {}}
for name, extra in VARIANTS.items():
    work = OUT / "_work" / name
    shutil.rmtree(work, ignore_errors=True)
    run(load_config("configs/smoke.yaml", [f"run_dir={work}", *COMMON, *extra]), log=lambda *a, **k: None)
    dest = OUT / name
    dest.mkdir(parents=True, exist_ok=True)
    for f in KEEP:
        shutil.copy2(work / f, dest / f)
    # the old code resumes a copy of the folder to epoch 3: what the new code must reproduce
    again = OUT / "_work" / (name + "_resumed")
    shutil.rmtree(again, ignore_errors=True)
    shutil.copytree(dest, again)
    out = run(load_config("configs/smoke.yaml", [f"run_dir={again}", *COMMON, "resume=auto", "train.epochs=3",
                                                  "train.max_steps=null"]), log=lambda *a, **k: None)
    rows = [r for _, r in metrics_rows(again / "metrics.jsonl")]
    last = torch.load(again / "last.pt", map_location="cpu", weights_only=True)
    record["variants"][name] = {"extra": extra, "rows": rows, "best_val_acc": out["best_val_acc"],
                                "model_sha256": digest(last["model"]), "ema_sha256": digest(last["ema"]),
                                "step": last["step"], "epoch": last["epoch"]}
(OUT / "expected.json").write_text(json.dumps(record, indent=1) + "\n")
print(json.dumps({k: (v["rows"][-1], v["step"]) for k, v in record["variants"].items()}, indent=1))
