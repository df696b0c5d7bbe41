"""Time to a target accuracy, read from a finished (or running) run's ``metrics.jsonl``.

    python -m bench.time_to_accuracy runs/cifar10_gpu [--targets 0.94 0.95]

For each target: the first evaluated epoch whose ``val_acc`` reaches it, the training time up to the end of
that epoch (the sum of ``epoch_seconds``: training steps only, evaluation excluded, as fast-CIFAR-10 records
count it; summed over resumes too) and the run's ``wall_seconds`` there (from the start of the process that
trained that epoch to the end of its training: earlier evaluations and checkpoint writes included; it restarts
at a resume), with the evaluation split and the device the run recorded (``run_info.json``). Only evaluated
epochs count (``eval.every``), so set ``eval.every=1`` to read the time to a target to the epoch.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

from bench.common import parser
from visattn.errors import run_main
from visattn.results import read_json
from visattn.rundir import complete_rows


def rows(run_dir: Path) -> List[dict]:
    """The complete rows of ``metrics.jsonl`` (a torn last line of a running or killed run is skipped)."""
    return complete_rows(run_dir / "metrics.jsonl")


def time_to(rs: List[dict], target: float) -> Optional[dict]:
    """{epoch, train_seconds, wall_seconds, val_acc} at the first evaluated epoch with val_acc >= target."""
    train = 0.0
    for r in rs:
        train += r.get("epoch_seconds") or 0.0
        acc = r.get("val_acc")
        if isinstance(acc, (int, float)) and acc >= target:
            return {"epoch": r["epoch"], "train_seconds": train, "wall_seconds": r.get("wall_seconds"), "val_acc": acc}
    return None


def main(argv: Optional[List[str]] = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--targets", nargs="+", type=float, default=[0.94, 0.95])
    args = ap.parse_args(argv)
    if not (args.run_dir / "metrics.jsonl").is_file():
        print(f"error: {args.run_dir / 'metrics.jsonl'} not found: give a run folder", file=sys.stderr)
        return 2
    bad = [t for t in args.targets if not 0 < t <= 1]
    if bad:
        print(f"error: --targets are accuracies in (0, 1], got {bad[0]}", file=sys.stderr)
        return 2
    rs = rows(args.run_dir)
    info_path = args.run_dir / "run_info.json"
    info = read_json(info_path, dict, missing={})
    evaluated = [r for r in rs if isinstance(r.get("val_acc"), (int, float))]
    print(f"{args.run_dir}: {len(rs)} epochs, {len(evaluated)} evaluated on the {info.get('eval_split', '?')}, "
          f"device {info.get('device', '?')}, precision {info.get('precision', '?')}")
    if evaluated:
        print(f"final val_acc {100 * evaluated[-1]['val_acc']:.2f}% at epoch {evaluated[-1]['epoch']}")
    for t in args.targets:
        hit = time_to(rs, t)
        if hit is None:
            print(f"{100 * t:.1f}%: not reached")
        else:
            wall = f"{hit['wall_seconds']:.1f} s" if isinstance(hit["wall_seconds"], (int, float)) else "?"
            print(f"{100 * t:.1f}%: epoch {hit['epoch']} ({100 * hit['val_acc']:.2f}%), training {hit['train_seconds']:.1f} s, "
                  f"wall {wall}")
    return 0


if __name__ == "__main__":
    run_main(lambda: sys.exit(main()), "time_to_accuracy.py")
