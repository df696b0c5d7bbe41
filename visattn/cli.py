"""``python train.py --config CONFIG [key=value ...]``: train with a config; errors are one line.

Overrides (``key=value``) go anywhere on the line, before or after the flags:
``train.py --config X --resume RUN/last.pt train.epochs=8``."""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import List, Optional

from .errors import VisattnError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="train.py",
        description="Train a visattn model on CIFAR-10 (or any image folder) from a YAML config.",
        epilog="Overrides use dotted keys and go anywhere on the line, e.g.: optim.lr=0.05 data.val_size=5000 "
               "model.attention=cbam; --resume RUN/last.pt train.epochs=8",
    )
    p.add_argument("--config", "-c", help="YAML config file (configs/*.yaml)")
    p.add_argument("--resume", nargs="?", const="auto", default=None,
                   help="continue a run: a checkpoint path, or nothing for the run_dir's last.pt")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides (anywhere on the line)")
    return p


OVERRIDE = re.compile(r"[A-Za-z_]\w*(\.\w+)*=")  # a dotted config key, then "="


def bare_resume(argv: List[str]) -> List[str]:
    """``--resume`` followed by an override (``--resume train.epochs=8``) means ``--resume`` with no path: argparse
    would take the override for the checkpoint path (unless a file of that name exists)."""
    out = list(argv)
    for i, token in enumerate(out[:-1]):
        if token == "--resume" and OVERRIDE.match(out[i + 1]) and not _is_file(out[i + 1]):
            out[i] = "--resume=auto"
    return out


def _is_file(name: str) -> bool:
    try:
        return Path(name).exists()
    except (OSError, ValueError):  # a name too long, or with a NUL: no such file
        return False


def heap_for_cpu(cfg) -> bool:
    """``cpu_heap`` for a run on a CPU (:mod:`visattn.cpu_heap`): this process is the run's own, so glibc's settings
    are made here, not in :func:`visattn.trainer.run`, which leaves its caller's process as it found it."""
    from . import cpu_heap
    from .options import resolve_device

    try:
        on_cpu = resolve_device(cfg.device).type == "cpu"
    except VisattnError:  # the trainer refuses such a device with its own message
        return False
    return on_cpu and cpu_heap.apply(cfg.cpu_heap)


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    # intermixed: overrides may follow the flags (plain parse_args takes positionals only before them)
    args = parser.parse_intermixed_args(bare_resume(sys.argv[1:] if argv is None else argv))
    try:
        from .config import load_config

        overrides = list(args.overrides)
        if args.resume is not None:
            overrides.append(f"resume={args.resume}")
        cfg = load_config(args.config, overrides)
        if args.print_config:
            import yaml

            print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
            return 0
        from .signals import Interrupted
        from .trainer import run

        heap_for_cpu(cfg)

        try:
            summary = run(cfg)
        except Interrupted as e:
            print(str(e), file=sys.stderr)
            return e.exit_code
        if os.environ.get("RANK", "0") == "0":  # under torchrun: one summary, from rank 0
            print(json.dumps({"best_val_acc": summary["best_val_acc"], "epochs": summary["epochs"],
                              "wall_seconds": round(summary["wall_seconds"], 1), "eval_split": summary["eval_split"],
                              "run_dir": summary["run_dir"]}))
        return 0
    except VisattnError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except OSError as e:  # the system's refusal (disk full, permissions), not a bug: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
