"""The HParams dashboard: each run folder is one row of TensorBoard's HParams tab (:func:`start_hparams`).

The dashboard reads a run's settings from the *first* session-start summary it meets, so they live in an event
file of their own, :data:`HPARAMS_FILE`, whose name sorts before the ``SummaryWriter``'s: it is replaced when a
resumed run's settings differ, so the row shows the settings the run last started with. Values are numbers or
one-line text, one type per key (TensorBoard's hparams plugin, ``torch.utils.tensorboard.summary.hparams``).
"""
from __future__ import annotations

import functools
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from .config import Config
from .models import model_defaults
from .registry import MODELS

Scalar = Union[str, int, float]
HPARAMS_FILE = "events.out.tfevents.0000000000.visattn-hparams"  # sorts before SummaryWriter's timestamped files
METRIC_TAGS = ("hparams/best_val_acc", "hparams/final_val_acc", "hparams/images_per_s")
# config keys the headline names stand for, and keys that say how a run was started, not what it is
COVERED = ("model", "optim.name", "optim.lr", "train.batch_size", "train.epochs", "precision", "seed",
           "resume", "resume_allow_changes", "run_dir")
ATTENTION_KEYS = ("attention", "attn")  # the option that picks the attention: CNNs, transformers
def text(value: Any) -> str:
    """A config value as one line: ``[16, 32, 64]``, ``{init: identity}``, ``true``, ``none``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {text(v)}" for k, v in value.items()) + "}"
    return str(value)


def flatten(tree: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """Nested sections to dotted keys: ``{"optim": {"lr": 0.1}}`` -> ``{"optim.lr": 0.1}``."""
    out: Dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


@functools.lru_cache(maxsize=1)
def _text_keys() -> frozenset:
    """Keys whose default is None (``optim.grad_clip``, ``data.subset``...): always text, so one type per key."""
    return frozenset(k for k, v in flatten(Config().to_dict()).items() if v is None or isinstance(v, (list, dict)))


def scalar(key: str, value: Any) -> Scalar:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in _text_keys():
        return value
    return value if isinstance(value, str) else text(value)


def model_hparams(cfg: Config) -> Dict[str, Scalar]:
    """The model's name, attention (``model.attention``, or ``model.attn`` for the transformers), attention init
    (``model.attn_kwargs.init``, else ``default``), placement (``model.attn_position``; ``n/a`` for a model
    without it), its other options as one line (``model.options``: the same key for every model), and the
    checkpoint it started from (``init_from``, ``none`` for a run from scratch)."""
    opts = cfg.model.options()
    defaults = model_defaults(cfg.model.name)
    foreign = MODELS.namespace(cfg.model.name) is not None  # timm/<name>: blocks go in through insert_attention
    attn_key = next((k for k in ATTENTION_KEYS if k in defaults or k in opts), None)
    kwargs = dict(opts.get("attn_kwargs") or {})
    init = kwargs.pop("init", "identity" if foreign else "default")  # insert_attention's default: identity
    place = "attn_at" if foreign else "attn_position"
    rest = {k: v for k, v in opts.items() if k not in (attn_key, "attn_kwargs", place)}
    rest.update({f"attn_kwargs.{k}": v for k, v in kwargs.items()})
    return {
        "model": cfg.model.name,
        "family": text(MODELS.meta(cfg.model.name).get("family")),  # cnn, transformer, or the package: timm, torchvision
        "attention": text(opts.get(attn_key, defaults.get(attn_key))) if attn_key else "n/a",
        "attn_init": text(init),
        "attn_position": text(opts.get(place, defaults.get(place, "n/a")) or ("per family" if foreign else "n/a")),
        "model.options": ", ".join(f"{k}={text(v)}" for k, v in sorted(rest.items())),
        "init_from": text(cfg.model.init_from),  # the checkpoint the weights started from (model.init_from)
    }


def run_hparams(cfg: Config, precision: Optional[str] = None, parameters: Optional[int] = None,
                world_size: int = 1) -> Dict[str, Scalar]:
    """Every value the HParams table shows for a run: the headline settings, then the flat config.

    ``precision`` is the one the run resolved (``auto`` -> ``bf16``...); ``parameters`` the model's size."""
    hp: Dict[str, Scalar] = model_hparams(cfg)
    hp.update({"optimizer": cfg.optim.name, "lr": cfg.optim.lr, "batch_size": cfg.train.batch_size,
               "epochs": cfg.train.epochs, "precision": precision or cfg.precision, "seed": cfg.seed,
               "parameters": parameters if parameters is not None else -1, "world_size": world_size})
    for key, value in flatten(cfg.to_dict()).items():
        if not any(key == c or key.startswith(c + ".") for c in COVERED):
            hp[key] = scalar(key, value)
    return hp


def _summaries(hp: Dict[str, Scalar]) -> Tuple[Any, Any, Any]:
    from torch.utils.tensorboard.summary import hparams

    return hparams(hp, {tag: 0.0 for tag in METRIC_TAGS})  # (experiment, session start, session end)


def _write(path: Path, summaries: List[Any], append: bool) -> None:
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.summary.writer.record_writer import RecordWriter

    target = path if append else path.with_name(".visattn-hparams.tmp")
    with open(target, "ab" if append else "wb") as f:
        records = RecordWriter(f)
        if not append:
            records.write(Event(wall_time=time.time(), file_version="brain.Event:2").SerializeToString())
        for summary in summaries:
            records.write(Event(wall_time=time.time(), step=0, summary=summary).SerializeToString())
        f.flush()
        os.fsync(f.fileno())
    if not append:
        os.replace(target, path)


def logged_hparams(log_dir: Union[str, os.PathLike]) -> Tuple[Optional[Dict[str, Any]], bool]:
    """What :data:`HPARAMS_FILE` in ``log_dir`` holds: (its session-start hparams or None, whether it has ended)."""
    from google.protobuf import json_format
    from google.protobuf.message import DecodeError
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    path = Path(log_dir) / HPARAMS_FILE
    if not path.is_file():
        return None, False
    found: Optional[Dict[str, Any]] = None
    ended = False
    try:
        for event in LegacyEventFileLoader(str(path)).Load():
            for value in event.summary.value:
                data = HParamsPluginData.FromString(value.metadata.plugin_data.content)
                if data.HasField("session_start_info"):
                    found = {k: json_format.MessageToDict(v) for k, v in data.session_start_info.hparams.items()}
                ended = ended or data.HasField("session_end_info")
    except (OSError, ValueError, DecodeError):  # a torn or foreign file: written anew
        return None, False
    return found, ended


def start_hparams(log_dir: Union[str, os.PathLike], hp: Dict[str, Scalar],
                  say: Callable[..., None] = print) -> List[str]:
    """Write the run's settings for the HParams dashboard (experiment + session start) into ``log_dir``.

    A resumed run whose settings are those already logged, and not ended, keeps the file as it is (a running
    TensorBoard keeps reading it); otherwise the file is replaced. Returns the settings that changed."""
    path = Path(log_dir) / HPARAMS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    exp, ssi, _ = _summaries(hp)
    before, ended = logged_hparams(log_dir)
    now = {k: float(v) if isinstance(v, (int, float)) else v for k, v in hp.items()}
    if before == now and not ended:
        return []
    changed = [] if before is None else sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))
    _write(path, [exp, ssi], append=False)
    if changed:
        shown = ", ".join(f"{k} {_shown(before.get(k))} -> {_shown(now.get(k))}" for k in changed[:6])
        say(f"hparams: settings changed since this run folder was last started ({shown}"
            + (f", and {len(changed) - 6} more" if len(changed) > 6 else "")
            + "); a TensorBoard already running shows them after a restart")
    return changed


def _shown(value: Any) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else text(value)


def finish_hparams(log_dir: Union[str, os.PathLike]) -> None:
    """Mark the run's HParams session ended with success (the run trained all its epochs)."""
    path = Path(log_dir) / HPARAMS_FILE
    if path.is_file():
        _write(path, [_summaries({})[2]], append=True)


def log_hparam_metrics(writer: Any, row: Dict[str, Any], step: int) -> None:
    """The HParams metrics from an epoch's metrics row, as scalars under :data:`METRIC_TAGS`."""
    values = {"hparams/best_val_acc": row.get("best_val_acc"), "hparams/final_val_acc": row.get("val_acc"),
              "hparams/images_per_s": row.get("images_per_s")}
    for tag, value in values.items():
        if isinstance(value, (int, float)) and math.isfinite(float(value)) and not (tag.endswith("acc") and value < 0):
            writer.add_scalar(tag, value, step)
