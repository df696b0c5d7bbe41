"""What a distillation teacher's soft targets carry beyond the label: per checkpoint, on training images and on
held-out validation images, its accuracy, the mean probability of its top class and the mean entropy of its
softmax (nats; ln 10 = 2.30 for ten classes) at each temperature.

    python bench/teacher_targets.py runs/teachers/resnet_fast_none-e4-s3.pt runs/teachers/resnet_fast_none-e16-s3.pt
    python bench/teacher_targets.py RUN/last.pt --images 2000 --temperatures 1 4 --out targets.json

How far a teacher's softmax is from one-hot, and how often it disagrees with the labels of the images a student
trains on, is what soft distillation can add to those labels. The images are the checkpoint's own data settings
(its ``data.root``, split seed and validation size), ``--images`` of each split taken class by class (the first
image of each class, then the second, ...), through the evaluation loader (no augmentation), in the checkpoint's
precision; the training images are those the teacher (and a student with the same data settings) trained on.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Dict, List, Sequence

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from visattn import evaluate  # noqa: E402
from visattn.data import ImageSet, Placement, build_loader, load_splits, spread_indices  # noqa: E402
from visattn.errors import VisattnError  # noqa: E402
from visattn.evaluate import load_model_from_checkpoint  # noqa: E402


def target_stats(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> Dict[str, float]:
    """Accuracy, mean top-class probability and mean entropy (nats) of ``softmax(logits / temperature)``."""
    logp = torch.log_softmax(logits.float() / temperature, dim=1)
    p = logp.exp()
    return {"acc": (logits.argmax(1) == labels).float().mean().item(), "top_prob": p.max(1).values.mean().item(),
            "entropy": -(p * logp).sum(1).mean().item()}


@torch.no_grad()
def logits_of(model: torch.nn.Module, images: ImageSet, cfg, precision: str, batch: int = 500) -> torch.Tensor:
    """The model's logits on ``images``, batched and normalised by the evaluation loader of ``cfg``'s data."""
    loader = build_loader(images, cfg.data, batch, False, cfg.seed, Placement(torch.device("cpu"), cfg.channels_last))
    out: List[torch.Tensor] = []
    for x, _ in loader:
        with evaluate.autocast(x.device, precision):
            out.append(model(x).float())
    return torch.cat(out)


def measure(checkpoint: str, n: int, temperatures: Sequence[float]) -> List[dict]:
    model, cfg, state = load_model_from_checkpoint(checkpoint, torch.device("cpu"))
    if cfg.channels_last:
        model.to(memory_format=torch.channels_last)
    precision = evaluate.resolve_precision(cfg.precision, torch.device("cpu"))
    splits = load_splits(cfg.data, cfg.seed)
    rows = []
    for split, images in (("train", splits.train), ("validation", splits.eval)):
        idx = spread_indices(images.y, n)
        logits = logits_of(model, ImageSet(images.x[idx], images.y[idx], images.classes), cfg, precision)
        labels = torch.from_numpy(images.y[idx]).long()
        for t in temperatures:
            rows.append({"checkpoint": checkpoint, "epochs": state.get("epoch"), "split": split, "images": len(idx),
                         "temperature": t, "precision": precision, **target_stats(logits, labels, t)})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoints", nargs="+")
    ap.add_argument("--images", type=int, default=2000, help="images of each split (default 2000)")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 4.0])
    ap.add_argument("--out", help="also write the rows as JSON")
    a = ap.parse_args(argv)
    if a.images < 1 or any(not (t > 0 and math.isfinite(t)) for t in a.temperatures):
        print("teacher_targets: --images must be >= 1 and every --temperatures value positive and finite",
              file=sys.stderr)
        return 2
    try:
        rows = [r for c in a.checkpoints for r in measure(c, a.images, a.temperatures)]
    except (VisattnError, FileNotFoundError) as e:
        print(f"teacher_targets: {e}", file=sys.stderr)
        return 2
    print(f"ln 10 = {math.log(10):.2f} nats is the entropy of a uniform softmax over ten classes")
    print("| checkpoint | epochs | split | images | temperature | accuracy % | top-class probability | entropy (nats) |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| `{r['checkpoint']}` | {r['epochs']} | {r['split']} | {r['images']} | {r['temperature']:g} | "
              f"{100 * r['acc']:.1f} | {r['top_prob']:.3f} | {r['entropy']:.3f} |")
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
