"""Starting weights: ``model.init_from`` (a visattn checkpoint's weights, blocks new to the model starting fresh),
a model's ``model.pretrained_file`` (loaded by its builder, :func:`visattn.models.foreign.load_pretrained`), and
a checkpoint's weights into a model where ``model.attn_at`` has since wrapped a module with a block.

Checkpoint files are read by the caller (the trainer, with :func:`visattn.rundir.load_checkpoint`): these
functions take the loaded state. The identity start the new blocks rely on is the blocks' own (Hu et al. 2018,
"Squeeze-and-Excitation Networks", arXiv 1709.01507, and each block's paper: see :mod:`visattn.attention`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from torch import nn

from ..attention.insert import check_sites
from ..config import Config, with_defaults
from ..data import Splits
from ..errors import CheckpointError, ConfigError
from ..registry import is_attention_block

# data settings a checkpoint the run starts from must share with it: the held-out split (or the run is scored on
# images its weights saw)
SPLIT_MUST_MATCH = ("source", "split_seed", "val_size", "use_test_split")  # the same held-out images


def check_init_folder(cfg: Config, run_dir: Path) -> None:
    src = cfg.model.init_from
    if src and Path(src).resolve().parent == run_dir.resolve():
        raise ConfigError(f"model.init_from: {src} is in run_dir {str(run_dir)!r}; a run started from a checkpoint "
                          "gets a folder of its own (run_dir=NEW; resume=auto continues the run itself)")


def init_from_state(state: Dict[str, Any], cfg: Config, model: nn.Module, splits: Splits,
                    say: Callable[..., None]) -> Dict[str, Any]:
    """``model.init_from``: load a checkpoint's weights into ``model`` before the optimizer, schedule and EMA are
    built from it: the EMA weights where the checkpoint kept them (the weights it was evaluated with), else its
    model weights. Every weight of the checkpoint must land, and only attention blocks the checkpoint does not
    hold start fresh; anything else is one :class:`CheckpointError` line naming the keys. The loaded weights
    replace the ones the model was built with, a whitening stem's data-computed ones included. Returns the
    origin that ``run_info.json`` records. ``state``: the checkpoint, as
    :func:`~visattn.rundir.load_checkpoint` read it from ``cfg.model.init_from``."""
    path = cfg.model.init_from
    if not isinstance(state["config"], dict):
        raise CheckpointError(f"model.init_from: {path}: its config entry is a {type(state['config']).__name__}")
    check_same_data(f"model.init_from: {path}", cfg, state, splits, SPLIT_MUST_MATCH,
                     "the run must hold out the same validation images, or it is scored on images its weights saw")
    weights, kind = state["model"], "model"
    ema = state.get("ema")
    if isinstance(ema, dict) and any(k.startswith("module.") for k in ema):
        weights, kind = {k[len("module."):]: v for k, v in ema.items() if k.startswith("module.")}, "EMA"
    if not isinstance(weights, dict):
        raise CheckpointError(f"model.init_from: {path}: its {kind} entry is a {type(weights).__name__}, not weights")
    try:
        check_sites(model, list(weights), f"model.init_from: {path}")
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    own = model.state_dict()
    weights, moved = into_wrapped(model, weights, own)
    new = [p for p, m in model.named_modules() if p and is_attention_block(m)  # blocks with state, none of it held
           and any(k.startswith(p + ".") for k in own) and not any(k.startswith(p + ".") for k in weights)]
    unused = [k for k in weights if k not in own]
    missing = [k for k in own if k not in weights and not any(k.startswith(b + ".") for b in new)]
    shapes = [f"{k} {list(weights[k].shape)} vs {list(own[k].shape)}" for k in weights
              if k in own and getattr(weights[k], "shape", None) != own[k].shape]

    def keys(ks: List[str]) -> str:
        return ", ".join(ks[:3]) + (f" and {len(ks) - 3} more" if len(ks) > 3 else "")

    problems = ([f"its {keys(unused)} have no place in this model"] if unused else []) + \
        ([f"this model's {keys(missing)} are not in it (only new attention blocks may start fresh)"] if missing else []) + \
        ([f"shapes differ: {keys(shapes)}"] if shapes else [])
    if problems:
        raise CheckpointError(f"model.init_from: {path} does not fit model {cfg.model.name!r}: {'; '.join(problems)}")
    model.load_state_dict(weights, strict=False)
    origin = {"path": str(Path(path).resolve()), "epoch": int(state["epoch"]), "best_acc": state.get("best_acc"),
              "weights": kind, "new_blocks": new, "wrapped": moved}
    say(f"model.init_from: {path} (epoch {origin['epoch']}, best val acc {origin['best_acc']}): its {kind} weights; "
        + (f"new, starting fresh: {keys(new)}" if new else "no new blocks")
        + (f"; the weights of {keys(moved)}, which a block now follows, load as their .inner ones" if moved else ""))
    return origin


def into_wrapped(model: nn.Module, weights: Dict[str, Any], own: Dict[str, Any]) -> Tuple[Dict[str, Any], List[str]]:
    """A checkpoint's weights under the names they take in ``model``, where a block was put after a module since
    the checkpoint was trained: ``model.attn_at`` wraps module ``X`` as ``AttnAfter(inner=X, attn=block)``
    (``X.weight`` becomes ``X.inner.weight``), a torchvision ResNet's last BN becomes ``bnX.norm``. Only a
    checkpoint key this model lacks, whose wrapped name it has, is renamed. Returns (weights, the modules renamed)."""
    moves = []  # ("X.", "X.inner."): a module holding a block named "attn" and the module it follows
    for path, m in model.named_modules():
        kids = dict(m.named_children())
        if path and len(kids) == 2 and "attn" in kids and is_attention_block(kids["attn"]):
            other = next(n for n in kids if n != "attn")
            moves.append((f"{path}.", f"{path}.{other}."))
    if not moves:
        return weights, []
    out, moved = {}, []
    for k, v in weights.items():
        if k not in own:
            for pre, inner in moves:
                if k.startswith(pre) and not k.startswith((inner, f"{pre}attn.")) and inner + k[len(pre):] in own:
                    k = inner + k[len(pre):]
                    if pre[:-1] not in moved:
                        moved.append(pre[:-1])
                    break
        out[k] = v
    return out, moved


def pretrained_origin(model: nn.Module, say: Callable[..., None]) -> Optional[Dict[str, Any]]:
    """A ``model.pretrained_file`` the builder loaded (a timm / torchvision model): said, and returned as the
    run's origin, whose step-0 score the trainer's ``fit`` adds; None for a model built without one."""
    loaded = getattr(model, "pretrained_origin", None)
    if not loaded:
        return None
    replaced, entry, others = loaded["replaced"], loaded.get("entry"), loaded.get("other_entries") or []
    where = ""
    if entry is not None:  # a timm checkpoint: which of its weight entries was taken
        where = f" (its {entry} entry" + (", the EMA weights" if entry == "state_dict_ema" else "") \
            + (f"; it also holds {', '.join(others)}, not used" if others else "") + ")"
    say(f"model.pretrained_file: {loaded['path']}{where}: {loaded['tensors']} tensors loaded"
        + (f"; its classifier ({', '.join(replaced)}) has another class count ({loaded.get('file_classes')} classes, "
           f"this run's {loaded.get('num_classes')}): replaced by a fresh one" if replaced else ""))
    return {"path": loaded["path"], "epoch": None, "best_acc": None, "weights": "pretrained_file",
            "new_blocks": [], "replaced": replaced, "entry": entry, "other_entries": others}


def _data_key(k: str) -> str:
    return k if k == "seed" else f"data.{k}"


def check_same_data(what: str, cfg: Config, state: Dict[str, Any], splits: Splits, keys: Tuple[str, ...],
                     why: str) -> None:
    """Refuse a checkpoint (``what``: the key and its path) trained with other ``data`` ``keys`` than this run
    (read from its stored config, with today's defaults for keys it predates), or on other classes."""
    other = with_defaults(state["config"])
    ours, theirs = cfg.data.model_dump(mode="json"), other["data"]
    differ = [k for k in keys if ours[k] != theirs[k]]
    if ours["source"] == "synthetic":  # synthetic images are drawn from the run's seed and size: other ones
        differ += [k for k in ("synthetic_size",) if ours[k] != theirs[k]]
        if other["seed"] != cfg.seed:
            ours, theirs = {**ours, "seed": cfg.seed}, {**theirs, "seed": other["seed"]}
            differ.append("seed")
    elif Path(ours["root"]).name != Path(theirs["root"]).name:
        differ.append("root")
    if differ:
        raise ConfigError(f"{what} was trained with other data settings "
                          f"({', '.join(f'{_data_key(k)}: {theirs[k]!r}, here {ours[k]!r}' for k in differ)}); {why}")
    classes = list(state.get("classes") or [])
    if classes and classes != list(splits.train.classes):
        raise ConfigError(f"{what} predicts other classes ({classes[:3]}...) than this run's "
                          f"({list(splits.train.classes)[:3]}...)")
