"""``python -m visattn.evaluate --checkpoint RUN/best.pt --data PATH``: accuracy of a trained checkpoint.

Rebuilds the model from the config stored in the checkpoint, reads any supported dataset form at ``--data``
(an image folder or its ``.tar.gz``, the CIFAR-10 python batches, ``synthetic``), and reports top-1
accuracy, per-class accuracy and loss on its ``test/`` split — or, where there is none, on the validation
split held out with the checkpoint's ``data.split_seed`` and ``val_size`` (the report says which). A folder
that holds only ``test/<class>/`` images (no ``train/``) is scored as it is; linked folders are followed.
Every option is checked first (``--batch-size``, ``--device``), and a checkpoint whose stored config no
longer builds a model is one error line, like every other problem.

Here too is what every user of a trained model shares with the trainer (which imports this module, never the
reverse): the device, the precision and its autocast, :func:`evaluate` and its test-time views.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .attention.functional import cpu_has_native_bf16  # noqa: F401  (re-exported: optim, bench and tests read it here)
from .attention.insert import check_sites
from .config import build_config
from .errors import CheckpointError, ConfigError, DataError, VisattnError
from .models import from_config
from .models.layout import to_channels_last
from .options import check_device, check_range, describe
from .rundir import load_checkpoint

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


def resolve_precision(precision: str, device: torch.device) -> str:
    """'auto' -> bf16 where the device runs it natively (Ampere+ GPUs; CPUs with AMX or AVX512-BF16), fp16 on
    older GPUs, fp32 on other CPUs (where bf16 is emulated and slower than fp32)."""
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "bf16" if device.type == "cpu" and cpu_has_native_bf16() else "fp32"


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    dtype = AMP_DTYPES[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def main_logits(out: Any) -> torch.Tensor:
    """A classifier's logits from what its forward returned: the tensor itself, or the main logits of a tuple
    or named tuple (torchvision's GoogLeNet and Inception v3 return ``(logits, aux_logits...)`` in training
    mode: the ``logits`` field, else the first element). Anything else is a :class:`ConfigError` line."""
    if isinstance(out, torch.Tensor):
        return out
    field = getattr(out, "logits", None)
    if isinstance(field, torch.Tensor):
        return field
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise ConfigError(f"the model returned a {type(out).__name__}, not logits (a tensor, or a tuple whose first "
                      "element is the logits)")


def tta_views(x: torch.Tensor, tta: str) -> List[torch.Tensor]:
    """Test-time views: the image, its mirror, and (flip_translate) 1-pixel shifts of both."""
    views = [x]
    if tta in ("flip", "flip_translate"):
        views.append(x.flip(3))
    if tta == "flip_translate":
        pad = F.pad(x, (1, 1, 1, 1), mode="reflect")
        H, W = x.shape[-2:]
        for dy, dx in ((0, 0), (2, 2)):
            shifted = pad[..., dy : dy + H, dx : dx + W]
            views += [shifted, shifted.flip(3)]
    return views


@torch.no_grad()
def evaluate(model: nn.Module, loader: Iterable, *, device: torch.device, precision: str, tta: str = "none",
             num_classes: int = 10, reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> Dict[str, Any]:
    """Top-1 accuracy, mean loss and per-class accuracy; logits averaged over the TTA views."""
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    per_class = torch.zeros(2, num_classes, dtype=torch.float64, device=device)  # correct, count
    t0 = time.perf_counter()
    for xb, yb in loader:
        logits = None
        for v in tta_views(xb, tta):
            with autocast(device, precision):
                out = main_logits(model(v)).float()
            logits = out if logits is None else logits + out
        logits = logits / len(tta_views(xb[:1], tta))
        loss_sum += F.cross_entropy(logits, yb, reduction="sum").double()
        hit = (logits.argmax(1) == yb).double()
        per_class[0].index_add_(0, yb, hit)
        per_class[1].index_add_(0, yb, torch.ones_like(hit))
    packed = torch.cat([loss_sum.view(1), per_class.flatten()])
    if reduce is not None:
        packed = reduce(packed)
    loss_sum, per_class = packed[0], packed[1:].view(2, num_classes)
    n = per_class[1].sum().clamp_min(1)
    model.train(was_training)
    return {
        "acc": float(per_class[0].sum() / n),
        "loss": float(loss_sum / n),
        "per_class_acc": (per_class[0] / per_class[1].clamp_min(1)).tolist(),
        "images": int(n),
        "seconds": time.perf_counter() - t0,
    }


def load_model_from_checkpoint(path: str, device: torch.device) -> tuple[torch.nn.Module, Any, Dict[str, Any]]:
    """(model in eval mode with the checkpoint's weights — EMA weights when the run kept them, config, state)."""
    state = load_checkpoint(path)
    try:
        cfg = build_config(state["config"])
        num_classes = len(state.get("classes") or []) or 10
        # the checkpoint holds the weights: a model.pretrained_file is not needed (nor read) to rebuild it
        model = from_config(cfg, num_classes, weights=False)
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
        check_sites(model, list(weights) if isinstance(weights, dict) else [], f"checkpoint {str(path)!r}")
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    try:
        model.load_state_dict(weights)
    except (RuntimeError, TypeError) as e:  # TypeError: a "model" entry that is not a state dict
        why = weights_misfit(model, weights) if isinstance(weights, dict) else ""
        raise CheckpointError(f"checkpoint {path!r}: weights do not fit model {cfg.model.name!r} "
                              f"({why or str(e).splitlines()[0]})") from None
    return model.to(device).eval(), cfg, state


def weights_misfit(model: nn.Module, weights: Dict[str, Any]) -> str:
    """The first keys of ``weights`` that do not fit ``model``: missing, unexpected, of another shape ("" if all
    fit)."""
    own = model.state_dict()

    def first(keys: List[str]) -> str:
        return ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
    missing = [k for k in own if k not in weights]
    unexpected = [k for k in weights if k not in own]
    shapes = [f"{k} {list(weights[k].shape)} here {list(own[k].shape)}" for k in own
              if isinstance(weights.get(k), torch.Tensor) and tuple(weights[k].shape) != tuple(own[k].shape)]
    return "; ".join(f"{what}: {first(keys)}" for what, keys in (("missing", missing), ("unexpected", unexpected),
                                                                  ("shapes differ", shapes)) if keys)


def evaluate_checkpoint(checkpoint: str, data: Optional[str] = None, tta: Optional[str] = None,
                        batch_size: int = 1000, device: str = "auto", precision: Optional[str] = None) -> Dict[str, Any]:
    from .data import Placement, build_loader, load_splits

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
    prec = resolve_precision(precision or cfg.precision, dev)
    loader = build_loader(splits.eval, dcfg, batch_size, False, cfg.seed, Placement(dev, channels_last=cfg.channels_last))
    if cfg.channels_last:
        to_channels_last(model, dev)
    res = evaluate(model, loader, device=dev, precision=prec, tta=tta or cfg.eval.tta, num_classes=len(classes))
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
