"""``python -m visattn.evaluate --checkpoint RUN/best.pt --data PATH``: accuracy of a trained checkpoint.

Rebuilds the model from the config stored in the checkpoint, reads any supported dataset form at ``--data``
(an image folder or its ``.tar.gz``, the CIFAR-10 python batches, ``synthetic``), and reports top-1
accuracy, per-class accuracy and loss on its ``test/`` split — or, where there is none, on the validation
split held out with the checkpoint's ``data.split_seed`` and ``val_size`` (the report says which). A folder
that holds only ``test/<class>/`` images (no ``train/``) is scored as it is; linked folders are followed.
Every option is checked first (``--batch-size``, ``--device``), and a checkpoint whose stored config no
longer builds a model is one error line, like every other problem.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, List, Optional

import torch

from .errors import VisattnError
from .options import describe


def load_model_from_checkpoint(path: str, device: torch.device) -> tuple[torch.nn.Module, Any, Dict[str, Any]]:
    """(model in eval mode with the checkpoint's weights — EMA weights when the run kept them, config, state)."""
    from .checkpoint import load_checkpoint
    from .config import build_config
    from .errors import CheckpointError, ConfigError
    from .models import create_model

    state = load_checkpoint(path)
    try:
        cfg = build_config(state["config"])
        num_classes = len(state.get("classes") or []) or 10
        model = create_model(cfg.model.name, num_classes=num_classes, **cfg.model.options())
    except (ConfigError, ValueError, TypeError, RuntimeError, AttributeError) as e:
        # a stored config this version refuses, or that no longer builds a model
        why = str(e).strip().splitlines()[0] if str(e).strip() else e.__class__.__name__
        raise CheckpointError(f"checkpoint {str(path)!r}: its stored config does not build a model ({why[:200]})") from None
    weights = state["model"]
    if state.get("ema"):  # the run evaluated its EMA weights: report those
        ema = state["ema"]
        if not isinstance(ema, dict):
            raise CheckpointError(f"checkpoint {str(path)!r}: its ema entry is a {type(ema).__name__}, not a state dict")
        weights = {k[len("module."):]: v for k, v in ema.items() if k.startswith("module.")} or weights
    try:
        model.load_state_dict(weights)
    except (RuntimeError, TypeError) as e:  # TypeError: a "model" entry that is not a state dict
        raise CheckpointError(f"checkpoint {path!r}: weights do not fit model {cfg.model.name!r} ({str(e).splitlines()[0]})") from None
    return model.to(device).eval(), cfg, state


def evaluate_checkpoint(checkpoint: str, data: Optional[str] = None, tta: Optional[str] = None,
                        batch_size: int = 1000, device: str = "auto", precision: Optional[str] = None) -> Dict[str, Any]:
    from . import engine
    from .data import Placement, build_loader, load_splits
    from .errors import DataError
    from .options import check_device, check_range

    check_range("--batch-size", batch_size, 1, 65536)
    dev = check_device("--device", device)
    model, cfg, state = load_model_from_checkpoint(checkpoint, dev)
    dcfg = cfg.data.model_copy()
    if data is not None:
        if data == "synthetic":
            dcfg.source = "synthetic"
        else:
            dcfg.source, dcfg.root = "auto", data
    dcfg.subset = None
    splits = load_splits(dcfg, cfg.seed, eval_only=True)
    classes = list(state.get("classes") or splits.eval.classes)
    if list(splits.eval.classes) != classes:
        raise DataError(
            f"--data {data}: classes {list(splits.eval.classes)[:4]}... differ from the checkpoint's {classes[:4]}..."
        )
    prec = engine.resolve_precision(precision or cfg.precision, dev)
    loader = build_loader(splits.eval, dcfg, batch_size, False, cfg.seed, Placement(dev, channels_last=cfg.channels_last))
    if cfg.channels_last:
        model.to(memory_format=torch.channels_last)
    res = engine.evaluate(model, loader, device=dev, precision=prec, tta=tta or cfg.eval.tta, num_classes=len(classes))
    return {"checkpoint": checkpoint, "split": splits.eval_split, "acc": res["acc"], "loss": res["loss"],
            "images": res["images"], "tta": tta or cfg.eval.tta,
            "per_class_acc": dict(zip(classes, res["per_class_acc"]))}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m visattn.evaluate", description=describe(__doc__))
    p.add_argument("--checkpoint", required=True, help="a visattn checkpoint (RUN/best.pt or RUN/last.pt)")
    p.add_argument("--data", default=None, help="dataset path (folder, .tar.gz, cifar-10-batches-py) or 'synthetic'; "
                                                "default: the run's own data.root")
    p.add_argument("--tta", choices=["none", "flip", "flip_translate"], default=None, help="default: the run's eval.tta")
    p.add_argument("--batch-size", type=int, default=1000)
    p.add_argument("--device", default="auto")
    p.add_argument("--precision", choices=["auto", "bf16", "fp16", "fp32"], default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    try:
        r = evaluate_checkpoint(args.checkpoint, args.data, args.tta, args.batch_size, args.device, args.precision)
    except VisattnError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except OSError as e:  # the system's refusal (permissions, disk): one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(r))
        return 0
    print(f"{r['checkpoint']}: top-1 {r['acc'] * 100:.2f}%  loss {r['loss']:.4f}  on the {r['split']} (tta {r['tta']})")
    for c, a in r["per_class_acc"].items():
        print(f"  {c:>12s}  {a * 100:6.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
