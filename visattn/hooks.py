"""The training loop's hooks: what a run does around its steps and epochs, each piece a class that owns its state.

A hook is any object with some of these methods; the loop calls each hook's in the order of ``run.hooks``:

* ``on_fit_start(run)``: once, before the first step (the run folder's outputs open, the model wrapped for
  training); a forward hook put on ``run.model`` here sees every training and evaluation batch;
* ``on_epoch_start(run, epoch)``: before an epoch's first step (``epoch`` counts from 0);
* ``on_optimizer_step(model, step)``: right after each optimizer step that was taken (``step``: the global step
  it makes, from 1), before lookahead's averaging; also in :func:`visattn.trainer.train_one_epoch` without a run;
* ``on_step_end(run, step)``: after each step (the gradients still on the parameters), before the loop decides
  whether to stop and save there;
* ``on_epoch_end(run, epoch, row)``: after each epoch's metrics row, on every rank (rank 0 alone writes;
  ``run.last_eval`` holds the epoch's evaluation where it had one);
* ``on_fit_end(run)``: once, after the last epoch of a run that trained to its end, before its outputs close;
* ``on_close(run)``: the run's outputs close (at its end, on a failure or a signal).

A run's built-in hooks come first (:func:`builtin_hooks`): :class:`ProgressBar`, :class:`EmaUpdate` (the
weight average of Polyak & Juditsky 1992, "Acceleration of Stochastic Approximation by Averaging", as timm's
``ModelEmaV3``), :class:`CheckpointWriter` and :class:`TensorBoardLog`; then those given to
``visattn.trainer.run(cfg, hooks=...)``, then functions registered with :func:`register_hook`. A hook that
raises stops the run. Lightning's callbacks (``Callback``) are the model: a progress bar, an EMA and checkpoints
are each one.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

from .hparams import finish_hparams, log_hparam_metrics, run_hparams, start_hparams
from .results import git_revision, versions
from .rng import rng_state
from .rundir import check_finite, metrics_line, save_checkpoint
from .step import host_check_every, nothing_learned

EVENTS = ("fit_start", "epoch_start", "optimizer_step", "step_end", "epoch_end", "fit_end", "close")
EPOCH_SCALARS = ("train_loss", "train_acc", "val_loss", "val_acc", "images_per_s", "lr", "nonfinite_steps",
                 "skipped_steps")
# functions every run built from now on calls (:func:`register_hook`), after its own hooks
HOOKS: Dict[str, List[Callable[..., None]]] = {"fit_start": [], "step_end": [], "epoch_end": [], "fit_end": []}


def call(hooks: Sequence[Any], event: str, *args: Any) -> None:
    """Call ``on_<event>(*args)`` of every hook that has it, in order."""
    for hook in hooks:
        method = getattr(hook, f"on_{event}", None)
        if method is not None:
            method(*args)


class FunctionHook:
    """One function as a hook of one event (``"fit_start"``, ``"step_end"``, ``"epoch_end"``, ``"fit_end"``),
    called with that event's arguments."""

    def __init__(self, event: str, fn: Callable[..., None]) -> None:
        if event not in HOOKS:
            raise ValueError(f"unknown hook event {event!r}; valid: {', '.join(HOOKS)}")
        setattr(self, f"on_{event}", fn)
        self.event, self.fn = event, fn


def register_hook(event: str, hook: Callable[..., None]) -> Callable[[], None]:
    """Call function ``hook`` in every run built after this, e.g. from a script that then calls
    ``visattn.cli.main``: ``"fit_start"`` (``hook(run)``), ``"step_end"`` (``hook(run, step)``), ``"epoch_end"``
    (``hook(run, epoch, row)``) or ``"fit_end"`` (``hook(run)``), as the module's docstring says. Returns a
    function that removes it."""
    if event not in HOOKS:
        raise ValueError(f"unknown hook event {event!r}; valid: {', '.join(HOOKS)}")
    HOOKS[event].append(hook)
    return lambda: HOOKS[event].remove(hook) if hook in HOOKS[event] else None


def registered() -> List[FunctionHook]:
    """The registered functions as hooks, in the order of the events, then of registration."""
    return [FunctionHook(event, fn) for event, fns in HOOKS.items() for fn in fns]


def check_hooks(hooks: Any) -> List[Any]:
    """``run(cfg, hooks=...)``'s hooks as a list: objects with at least one ``on_<event>`` method."""
    if hooks is None:
        return []
    if not isinstance(hooks, (list, tuple)):
        raise ValueError(f"hooks must be a list of hook objects, got a {type(hooks).__name__}")
    for h in hooks:
        if not any(callable(getattr(h, f"on_{e}", None)) for e in EVENTS):
            raise ValueError(f"hook {h!r} has none of the methods {', '.join('on_' + e for e in EVENTS)}")
    return list(hooks)


class ProgressBar:
    """Each epoch's tqdm bar on stderr (rank 0, ``log.progress``), closed after the epoch's last step."""

    def __init__(self) -> None:
        self.bar: Any = None

    def on_epoch_start(self, run: Any, epoch: int) -> None:
        if run.dist.is_main and run.cfg.log.progress:
            from tqdm import tqdm

            loader = run.train_loader
            self.bar = tqdm(total=len(loader), initial=loader.position, desc=f"epoch {epoch + 1}/{run.cfg.train.epochs}",
                            leave=False, dynamic_ncols=True, file=sys.stderr)

    def on_step_end(self, run: Any, step: int) -> None:
        if self.bar is not None:
            self.bar.update(1)
            if run.train_loader.position >= len(run.train_loader):
                self.on_close(run)

    def on_close(self, run: Any) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class EmaUpdate:
    """The exponential moving average of the weights (timm's ``ModelEmaV3``, kept in checkpoints as ``ema``),
    updated after every optimizer step taken; a warming-up EMA's decay follows the step count (from 1)."""

    def __init__(self, ema: nn.Module) -> None:
        self.ema = ema

    def on_optimizer_step(self, model: nn.Module, step: int) -> None:
        self.ema.update(model, step=step if getattr(self.ema, "use_warmup", False) else None)


class CheckpointWriter:
    """The run's saves: at an epoch's end (rank 0) the metrics row, ``best.pt`` where the epoch is the best and
    ``last.pt``, which goes last: it commits the epoch. A crash before it redoes the epoch on resume, which first
    drops the metrics rows past the checkpoint, so no row is lost or written twice. Mid-epoch, the loop asks
    :meth:`save_step` after each step's hooks (a signal, ``train.max_steps``, ``train.ckpt_every_steps``)."""

    def on_epoch_end(self, run: Any, epoch: int, row: Dict[str, Any]) -> None:
        if not run.dist.is_main:
            return
        with open(run.run_dir / "metrics.jsonl", "a") as f:
            f.write(metrics_line(row, run.say) + "\n")
        run.train_loader.set_epoch(epoch)
        state = checkpoint_state(run, epoch, None)
        if run.is_best:  # this epoch's score is the best so far
            save_checkpoint(state, run.run_dir / "best.pt")
        save_checkpoint(state, run.run_dir / "last.pt")

    def save_step(self, run: Any, step: int, halt: bool) -> None:
        """After step ``step``: save ``last.pt`` when the run stops here (``halt``) or every
        ``train.ckpt_every_steps``. No save replaces the last good checkpoint with non-finite weights (on a GPU the
        loss is checked only every ``train.check_every`` steps, after the weights took the step), and only a
        signal's stop saves an epoch whose every step so far had a non-finite loss."""
        every = run.cfg.train.ckpt_every_steps
        if not (halt or (every and step % every == 0)):  # the same decision on every rank
            return
        live = run.meter.totals if run.meter is not None else None
        if run.dist.enabled and live is not None:  # the partial epoch's totals over all ranks; rank 0 resumes them
            live = run.dist.reduce(live.clone())
        nothing = live is not None and nothing_learned(live)
        finite = not check_finite(run.model)
        if run.dist.is_main and finite and (bool(run.stop) or not nothing):
            save_checkpoint(checkpoint_state(run, run.train_loader.epoch, live), run.run_dir / "last.pt")
        run.stop_saved = finite  # what a signal's stop reports


def checkpoint_state(run: Any, epoch: int, position_stats: Optional[torch.Tensor]) -> Dict[str, Any]:
    """What a checkpoint holds: weights, optimizer, schedule, scaler, EMA, lookahead, RNG, data order, counters
    (``epoch_stats``: a partly done epoch's totals), config and provenance."""
    opt, cfg = run.opt, run.cfg
    return {
        "model": run.model.state_dict(), "optimizer": opt.optimizer.state_dict(), "scheduler": opt.scheduler.state_dict(),
        "scaler": opt.scaler.state_dict() if opt.scaler is not None else None,
        "ema": opt.ema.state_dict() if opt.ema is not None else None,
        "lookahead": opt.lookahead.state_dict() if opt.lookahead is not None else None,
        "rng": rng_state(), "loader": run.train_loader.state_dict(), "epoch": epoch, "step": run.step,
        "epoch_stats": position_stats.cpu() if position_stats is not None else None,
        "best_acc": run.best_acc, "config": cfg.to_dict(), "classes": list(run.splits.train.classes),
        "eval_split": run.splits.eval_split, "versions": versions(), "git": git_revision(), "seed": cfg.seed,
        "teacher_digest": run.teacher_digest,
    }


class TensorBoardLog:
    """Rank 0's TensorBoard writer (``run_dir/tb``, ``log.tensorboard``): the HParams row, the step-0 score of a
    run started from weights, the loss and lr every ``max(train.check_every, 20)`` steps where the host reads, and
    each epoch's scalars and attention maps (``log.maps_every``); the HParams session marked ended at the end."""

    def __init__(self) -> None:
        self.writer: Any = None

    def on_fit_start(self, run: Any) -> None:
        cfg = run.cfg
        if not (run.dist.is_main and cfg.log.tensorboard):
            return
        from torch.utils.tensorboard import SummaryWriter

        parameters = sum(p.numel() for p in run.model.parameters())
        hparams = run_hparams(cfg, run.policy.precision, parameters, run.dist.world_size)
        start_hparams(run.run_dir / "tb", hparams, run.say)  # the HParams dashboard's row of this run
        self.writer = SummaryWriter(str(run.run_dir / "tb"), purge_step=run.step if run.resume_from else None)
        if "val_acc" in (run.init_from or {}):
            self.writer.add_scalar("val/acc", run.init_from["val_acc"], 0)
            self.writer.add_scalar("val/loss", run.init_from["val_loss"], 0)

    def on_step_end(self, run: Any, step: int) -> None:
        every = host_check_every(run.policy)
        if self.writer is not None and run.meter is not None and step % every == 0 and step % max(every, 20) == 0:
            self.writer.add_scalar("train/loss_step", run.meter.mean_loss(), step)
            self.writer.add_scalar("train/lr", run.opt.optimizer.param_groups[0]["lr"], step)

    def on_epoch_end(self, run: Any, epoch: int, row: Dict[str, Any]) -> None:
        writer, cfg = self.writer, run.cfg
        if writer is None:
            return
        for k in EPOCH_SCALARS:
            if k in row:
                tag = k.replace("_", "/", 1) if k.startswith(("train_", "val_")) else f"train/{k}"
                writer.add_scalar("train/lr_epoch" if k == "lr" else tag, row[k], epoch)
        log_hparam_metrics(writer, row, epoch)
        if run.probe is not None and cfg.log.maps_every and epoch % cfg.log.maps_every == 0:
            skipped = run.maps.log(writer, run.eval_model, run.probe, epoch, row.get("epoch_seconds"))
            if skipped:
                run.say(f"warning: epoch {epoch}: the attention maps of {', '.join(skipped)} on the probe batch are "
                        "not finite; those pictures were skipped")
        writer.flush()

    def on_fit_end(self, run: Any) -> None:
        if self.writer is not None:  # trained as asked: the HParams row's status is "success"
            finish_hparams(run.run_dir / "tb")

    def on_close(self, run: Any) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def builtin_hooks(opt: Any) -> List[Any]:
    """A run's own hooks, in their order: the progress bar, the EMA (where ``opt.ema``), the checkpoints, then
    TensorBoard (after the epoch's save, which it must not delay)."""
    return [ProgressBar(), *([EmaUpdate(opt.ema)] if opt.ema is not None else []), CheckpointWriter(),
            TensorBoardLog()]


def step_hooks(opt: Any) -> List[Any]:
    """The hooks :func:`visattn.trainer.train_one_epoch` calls without a run: the EMA's update."""
    return [EmaUpdate(opt.ema)] if opt.ema is not None else []
