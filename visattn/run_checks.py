"""The checks a training run makes before it writes anything, each a one-line error: values valid alone but not
together (:func:`check_for_training`, the ``run`` stage of :data:`visattn.cross_checks.CROSS_CHECKS`, the one
table of every check across config fields), the model's options (built
once on the meta device), one image through the built model, the checkpoint a resume continues (its path, the
settings it may not change, the epochs left), and a note where BatchNorm statistics cannot keep up with a short
run (Ioffe & Szegedy 2015, "Batch Normalization", arXiv 1502.03167: evaluation uses the running statistics).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional

import torch
from torch import nn

from .attention.functional import BATCH_NORMS
from .config import Config, with_defaults
from .cross_checks import check_for_training  # noqa: F401 - re-exported: the run stage of the one table
from .data import normalize
from .errors import CheckpointError, ConfigError
from .models import from_config
from .registry import backbone_modules
from .rundir import check_auto_start, check_new_run_dir, check_not_project, config_diff

RESUME_MUST_MATCH = ("model", "data")  # config sections a resume may not silently change
# settings the saved optimizer, schedule, EMA and lookahead state is shaped by (the optimizer's param groups keep
# lr, momentum, betas and weight decay; the schedule its shape): never changed on resume, even with
# resume_allow_changes. optim.grad_clip and precision (a fresh fp16 loss scale) are taken as given.
RESUME_FIXED = tuple(f"optim.{k}" for k in ("name", "lr", "momentum", "nesterov", "betas", "weight_decay",
                                              "no_decay_norm_bias", "norm_bias_lr_scale",
                                              "attn_lr_scale")) + \
    tuple(f"sched.{k}" for k in ("name", "warmup_epochs", "min_lr_ratio", "anneal", "start_lr_ratio")) + \
    tuple(f"train.{k}" for k in ("ema_decay", "ema_warmup", "lookahead_every", "lookahead_decay", "lookahead_power"))
MAX_PARAMETERS = 2_000_000_000  # a model larger than this is a typo in model.widths, not a CIFAR model


def resume_path(cfg: Config, run_dir: Path) -> Optional[Path]:
    existing = next((p for p in (run_dir, *run_dir.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise ConfigError(f"run_dir {str(run_dir)!r}: {str(existing)!r} is a file, not a folder")
    if cfg.resume is None:
        check_new_run_dir(run_dir)
        return None
    if run_dir.is_dir():
        check_not_project(run_dir)
    if cfg.resume == "auto":
        p = run_dir / "last.pt"
        if p.is_dir():
            raise CheckpointError(f"resume=auto: {str(p)!r} is a folder, not a checkpoint file")
        if p.exists():
            return p
        check_auto_start(run_dir)
        return None
    p = Path(cfg.resume)
    if p.is_dir():
        raise CheckpointError(f"resume: {cfg.resume!r} is a folder; give a checkpoint file (e.g. its last.pt) or resume=auto")
    if not p.is_file():
        raise CheckpointError(f"resume: checkpoint {cfg.resume!r} not found")
    return p


def check_model_options(cfg: Config, fresh: bool = True) -> None:
    """Build the model once on the meta device (no memory, no data): bad options fail before any data is read.
    A resumed run (``fresh=False``) holds its weights in the checkpoint: its ``model.pretrained_file`` is not
    read (it may be gone or replaced since), as the trainer's model build does not read it."""
    try:
        with torch.device("meta"):
            model = from_config(cfg, weights=fresh)
    except NotImplementedError:  # a constructor that reads tensor values cannot run on the meta device
        return
    except (ValueError, TypeError, RuntimeError) as e:
        raise ConfigError(f"model: {str(e).strip().splitlines()[0] if str(e).strip() else e.__class__.__name__}") from None
    n = sum(p.numel() for p in model.parameters())
    if n > MAX_PARAMETERS:
        raise ConfigError(f"model: these options build {n:,} parameters; the limit is {MAX_PARAMETERS:,}")


def check_forward(run: Any) -> None:
    """One training image through the model (eval mode, no gradient) before anything is written: a model that
    cannot take this data's images (a ViT built for 32x32 with data.image_size=48) is one line, not a traceback
    at the first step after the run folder was filled."""
    x = torch.from_numpy(run.splits.train.x[:1]).permute(0, 3, 1, 2)
    x = normalize(x, run.cfg.data.mean, run.cfg.data.std).to(run.device)
    training = run.model.training
    run.model.eval()
    try:
        with torch.no_grad():
            run.model(x)
    except (ValueError, RuntimeError, TypeError, AssertionError) as e:
        why = str(e).strip().splitlines()[0][:200] if str(e).strip() else e.__class__.__name__
        raise ConfigError(f"model {run.cfg.model.name!r} cannot take this data's {x.shape[2]}x{x.shape[3]} images "
                          f"(data.image_size={run.cfg.data.image_size}): {why}") from None
    finally:
        run.model.train(training)


def bn_lag_note(model: nn.Module, total_steps: int, weight: float = 0.05) -> Optional[str]:
    """A note when the model's BatchNorms update their running statistics so slowly (``momentum``) that at the
    end of ``total_steps`` those statistics, which evaluation uses, still give the first half of training more
    than ``weight`` of their sum: a short run of a model built for long ones (torchvision's MobileNetV3 at 0.01
    over 4 CIFAR epochs scores at chance in eval mode). ``None`` where they keep up."""
    slowest = min((m.momentum for m in backbone_modules(model)
                   if isinstance(m, BATCH_NORMS) and m.track_running_stats
                   and m.momentum is not None), default=None)
    if slowest is None or not 0 < slowest < 1:
        return None
    held = (1 - slowest) ** (total_steps / 2)
    if held <= weight:
        return None
    return (f"note: the model's BatchNorm momentum is {slowest:g}: after this run's {total_steps} steps the running "
            f"statistics evaluation uses would still weigh the first half of training at {held:.0%}, so eval-mode "
            "accuracy can trail training far; set model.bn_momentum=0.1 (package models) or train longer")


def check_epochs_left(run: Any, path: Path) -> None:
    """A resume asking for fewer epochs than the checkpoint has trained (or trained into), or for no more steps
    than it has taken (``train.max_steps``), would train nothing and rewrite ``config.yaml`` to that setting: one
    line, before anything is written."""
    epochs, done, into = run.cfg.train.epochs, run.epoch, run.train_loader.position
    if done > epochs or (done == epochs and into > 0):
        what = f"{done} epochs" + (f" and {into} batches of epoch {done + 1}" if into else "")
        raise ConfigError(f"resume: {path} has trained {what}, more than train.epochs={epochs}: nothing would train; "
                          f"give train.epochs={done + (1 if into else 0)} or more (or start a new run from these "
                          f"weights: model.init_from={path} run_dir=NEW)")
    limit = run.cfg.train.max_steps
    if limit is not None and run.step >= limit and done < epochs:
        raise ConfigError(f"resume: {path} has taken {run.step} steps, train.max_steps={limit}: nothing would train; "
                          f"give a larger train.max_steps, or train.max_steps=null to train to train.epochs={epochs}")


def check_resume_config(state: Dict[str, Any], cfg: Config, path: Path) -> None:
    now = cfg.to_dict()
    stored = with_defaults(state["config"])  # keys newer than the checkpoint: their defaults
    diff = [k for sec in RESUME_MUST_MATCH for k in config_diff({sec: stored.get(sec, {})}, {sec: now[sec]})]
    diff += config_diff({"train": {"distill": stored.get("train", {}).get("distill", {})}},
                        {"train": {"distill": now["train"]["distill"]}})  # a teacher shapes every step's loss
    if diff and not cfg.resume_allow_changes:
        raise CheckpointError(
            f"resume: {path} was trained with different settings for {', '.join(diff)} "
            "(set resume_allow_changes=true to resume anyway)"
        )
    fixed = [k for sec in ("optim", "sched", "train")
             for k in config_diff({sec: stored.get(sec, {})}, {sec: now[sec]}) if k in RESUME_FIXED]
    if fixed:
        raise CheckpointError(f"resume: {path} holds optimizer/schedule/EMA/lookahead state made with other settings "
                              f"for {', '.join(fixed)}, which cannot change on resume (start a new run to "
                              "train with them)")
