"""The training run: reads the config once and drives the engine.

``run(cfg)`` sets up the device, precision, data, model, optimizer, schedule, EMA, TensorBoard and the run
directory, resumes when asked, trains with a checkpoint every epoch (and every ``train.ckpt_every_steps``),
evaluates, logs attention maps, and stops cleanly on SIGTERM/SIGINT after the current step with a
checkpoint saved. Under ``torchrun`` it runs data-parallel (gloo on CPU, NCCL on GPU); rank 0 alone writes.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from . import engine
from .checkpoint import load_checkpoint, save_checkpoint
from .config import Config, build_config
from .data import build_loader, load_splits
from .errors import CheckpointError, ConfigError, TrainingError
from .models import create_model

RESUME_MUST_MATCH = ("model", "data")  # config sections a resume may not silently change
# settings the saved optimizer/schedule state is shaped by: never changed on resume, even with resume_allow_changes
RESUME_FIXED = ("optim.name", "optim.no_decay_norm_bias", "sched.name")


# --------------------------------------------------------------------------------------------- helpers


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        if torch.cuda.is_available():
            torch.backends.cudnn.benchmark = False
            torch.backends.cudnn.deterministic = True
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    elif torch.cuda.is_available():
        torch.backends.cudnn.benchmark = True


def git_revision() -> str:
    try:
        here = Path(__file__).resolve().parent
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        if rev.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return rev.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def versions() -> Dict[str, str]:
    import platform

    import timm
    import torchvision

    from . import __version__

    return {"visattn": __version__, "torch": str(torch.__version__), "torchvision": str(torchvision.__version__),
            "timm": str(timm.__version__), "python": platform.python_version(), "numpy": str(np.__version__)}


def rng_state() -> Dict[str, Any]:
    st = {"torch": torch.get_rng_state(), "python": _to_lists(random.getstate()),
          "numpy": _numpy_state_to_plain(np.random.get_state())}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: Dict[str, Any]) -> None:
    torch.set_rng_state(st["torch"])
    random.setstate(_to_tuples(st["python"]))
    np.random.set_state(_numpy_state_from_plain(st["numpy"]))
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def _to_lists(x: Any) -> Any:
    return [_to_lists(v) for v in x] if isinstance(x, (tuple, list)) else x


def _to_tuples(x: Any) -> Any:
    return tuple(_to_tuples(v) for v in x) if isinstance(x, list) else x


def _numpy_state_to_plain(st: tuple) -> Dict[str, Any]:
    return {"name": st[0], "keys": torch.from_numpy(st[1].astype(np.int64)), "pos": int(st[2]),
            "has_gauss": int(st[3]), "gauss": float(st[4])}


def _numpy_state_from_plain(d: Dict[str, Any]) -> tuple:
    return (d["name"], d["keys"].numpy().astype(np.uint32), d["pos"], d["has_gauss"], d["gauss"])


def config_diff(a: Dict[str, Any], b: Dict[str, Any], prefix: str = "") -> List[str]:
    """Dotted keys whose values differ between two nested dicts."""
    out = []
    for k in sorted(set(a) | set(b)):
        key = f"{prefix}{k}"
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += config_diff(va, vb, key + ".")
        elif va != vb:
            out.append(key)
    return out


class StopFlag:
    """Set by SIGTERM/SIGINT; the loop finishes the current step, saves and exits."""

    def __init__(self) -> None:
        self.signum: Optional[int] = None

    def __bool__(self) -> bool:
        return self.signum is not None


@contextmanager
def graceful_signals(flag: StopFlag) -> Iterator[None]:
    def handler(signum: int, frame: Any) -> None:
        if flag.signum is not None and signum == signal.SIGINT:  # a second Ctrl-C stops at once
            raise KeyboardInterrupt
        flag.signum = signum
        print(f"\nreceived {signal.Signals(signum).name}: finishing the current step, then saving", file=sys.stderr, flush=True)

    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for s in old:
            signal.signal(s, handler)
    except ValueError:  # not the main thread (e.g. called from a notebook worker): no handlers
        old = {}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


class Interrupted(Exception):
    """Training stopped on a signal after saving; ``exit_code`` is 128 + the signal number."""

    def __init__(self, signum: int, path: Path):
        super().__init__(f"stopped by {signal.Signals(signum).name}; state saved to {path} (resume with resume=auto)")
        self.exit_code = 128 + signum


# ---------------------------------------------------------------------------------------------- the run


class DistInfo:
    def __init__(self) -> None:
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.enabled = self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            dist.all_reduce(t)
        return t


def _resume_path(cfg: Config, run_dir: Path) -> Optional[Path]:
    existing = next((p for p in (run_dir, *run_dir.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise ConfigError(f"run_dir {str(run_dir)!r}: {str(existing)!r} is a file, not a folder")
    if cfg.resume is None:
        if (run_dir / "last.pt").exists():
            raise ConfigError(
                f"run_dir {str(run_dir)!r} already holds last.pt; continue it with resume=auto or choose another run_dir"
            )
        return None
    if cfg.resume == "auto":
        p = run_dir / "last.pt"
        return p if p.exists() else None
    p = Path(cfg.resume)
    if p.is_dir():
        raise CheckpointError(f"resume: {cfg.resume!r} is a folder; give a checkpoint file (e.g. its last.pt) or resume=auto")
    if not p.is_file():
        raise CheckpointError(f"resume: checkpoint {cfg.resume!r} not found")
    return p


def run(cfg: Config, log: Any = print) -> Dict[str, Any]:
    """Train as ``cfg`` says; returns a summary dict (best/final accuracy, paths, wall time)."""
    di = DistInfo()
    if di.enabled and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() and cfg.device != "cpu" else "gloo"
        dist.init_process_group(backend)
    device = engine.resolve_device(cfg.device)
    if di.enabled and device.type == "cuda":
        device = torch.device("cuda", di.local_rank)
        torch.cuda.set_device(device)
    precision = engine.resolve_precision(cfg.precision, device)
    run_dir = Path(cfg.run_dir)
    resume_from = _resume_path(cfg, run_dir)
    say = log if di.is_main else (lambda *a, **k: None)

    seed_everything(cfg.seed + di.rank, cfg.deterministic)
    splits = load_splits(cfg.data, cfg.seed)
    num_classes = len(splits.train.classes)
    say(f"data: {len(splits.train)} train images ({splits.source}); evaluating on the {splits.eval_split}"
        + (f"; {splits.skipped} unreadable images skipped" if splits.skipped else ""))

    try:
        model = create_model(cfg.model.name, num_classes=num_classes, **cfg.model.options())
    except (ValueError, TypeError) as e:
        raise ConfigError(f"model: {e}") from None
    if getattr(model, "needs_data_init", False):  # e.g. a whitening stem computed from training patches
        model.data_init(torch.from_numpy(splits.train.x[:5000]).permute(0, 3, 1, 2), cfg.data.mean, cfg.data.std)
    if di.enabled and cfg.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model.to(device)
    if di.enabled:  # ranks seed differently: start every rank, and so its EMA copy, from rank 0's initial weights
        with torch.no_grad():
            for t in model.state_dict().values():
                dist.broadcast(t, src=0)
    if cfg.channels_last:
        model.to(memory_format=torch.channels_last)
    raw_model = model  # the module whose state is saved (not the compiled / DDP wrapper)
    n_params = sum(p.numel() for p in raw_model.parameters())
    say(f"model: {cfg.model.name} ({n_params / 1e6:.2f}M parameters) on {device}, precision {precision}"
        + (f", {di.world_size} ranks" if di.enabled else ""))

    o = cfg.optim
    optimizer = engine.build_optimizer(raw_model, o.name, o.lr, o.weight_decay, o.momentum, o.nesterov, o.betas,
                                       o.no_decay_norm_bias)
    if cfg.train.batch_size % di.world_size:
        raise ConfigError(f"train.batch_size={cfg.train.batch_size} must divide evenly over {di.world_size} ranks")
    local_bs = cfg.train.batch_size // di.world_size
    train_loader = build_loader(splits.train, cfg.data, local_bs, True, device, cfg.seed, di.rank, di.world_size,
                                cfg.channels_last)
    eval_loader = build_loader(splits.eval, cfg.data, cfg.eval.batch_size, False, device, cfg.seed, di.rank,
                               di.world_size, cfg.channels_last)
    steps_per_epoch = len(train_loader)
    if steps_per_epoch == 0:
        raise ConfigError(f"train.batch_size={cfg.train.batch_size} exceeds the {len(splits.train)} training images")
    total_steps = steps_per_epoch * cfg.train.epochs
    scheduler = engine.StepScheduler(optimizer, cfg.sched.name, o.lr, total_steps,
                                     int(round(cfg.sched.warmup_epochs * steps_per_epoch)), cfg.sched.min_lr_ratio,
                                     cfg.sched.anneal)
    scaler = engine.make_scaler(device, precision)
    ema = None
    if cfg.train.ema_decay:
        from timm.utils import ModelEmaV3

        ema = ModelEmaV3(raw_model, decay=cfg.train.ema_decay)

    start_epoch, global_step, best_acc, carry = 0, 0, -1.0, None
    if resume_from is not None:
        state = load_checkpoint(resume_from, map_location="cpu")
        diff = [k for sec in RESUME_MUST_MATCH
                for k in config_diff({sec: state["config"].get(sec, {})}, {sec: cfg.to_dict()[sec]})]
        if diff and not cfg.resume_allow_changes:
            raise CheckpointError(
                f"resume: {resume_from} was trained with different settings for {', '.join(diff)} "
                "(set resume_allow_changes=true to resume anyway)"
            )
        fixed = [k for sec in ("optim", "sched")
                 for k in config_diff({sec: state["config"].get(sec, {})}, {sec: cfg.to_dict()[sec]}) if k in RESUME_FIXED]
        if fixed:
            raise CheckpointError(f"resume: {resume_from} holds optimizer/schedule state made with other settings for "
                                  f"{', '.join(fixed)}, which cannot change on resume")
        try:
            raw_model.load_state_dict(state["model"])
        except RuntimeError as e:  # the first line only says "Error(s) in loading state_dict": name the first mismatch
            lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
            why = (lines[1] if len(lines) > 1 else lines[0] if lines else "")[:200]
            raise CheckpointError(f"resume: {resume_from} does not fit model {cfg.model.name!r} ({why})") from None
        try:
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            if scaler is not None and state.get("scaler"):
                scaler.load_state_dict(state["scaler"])
            if ema is not None and state.get("ema") is not None:
                ema.load_state_dict(state["ema"])
            train_loader.load_state_dict(state["loader"])
            set_rng_state(state["rng"])
            start_epoch, global_step = int(state["epoch"]), int(state["step"])
        except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:
            why = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise CheckpointError(f"resume: {resume_from} does not fit this run ({e.__class__.__name__}: {why[:120]})") from None
        best_acc = float(state.get("best_acc", -1.0))
        carry = state.get("epoch_stats") if di.is_main else None  # all-rank totals: counted once, on rank 0
        say(f"resumed from {resume_from}: epoch {start_epoch}, step {global_step}"
            + (f" ({train_loader.position} batches into the epoch)" if train_loader.position else ""))

    train_model: nn.Module = raw_model
    if cfg.compile:
        train_model = torch.compile(raw_model)
    if di.enabled:
        train_model = nn.parallel.DistributedDataParallel(
            train_model, device_ids=[device.index] if device.type == "cuda" else None)
    eval_model = ema.module if ema is not None else raw_model

    writer = None
    if di.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(_yaml_dump(cfg.to_dict()))
        info = {"seed": cfg.seed, "versions": versions(), "git": git_revision(), "argv": sys.argv,
                "eval_split": splits.eval_split, "device": str(device), "precision": precision,
                "world_size": di.world_size, "parameters": n_params, "classes": list(splits.train.classes)}
        (run_dir / "run_info.json").write_text(json.dumps(info, indent=2))
        if resume_from is not None:
            _trim_metrics(run_dir / "metrics.jsonl", start_epoch)
        for p in run_dir.glob(".*.pt.*.tmp"):  # torn checkpoint writes of a killed run
            p.unlink(missing_ok=True)
        if cfg.log.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(str(run_dir / "tb"), purge_step=global_step if resume_from else None)

    probe = None
    if di.is_main and cfg.log.maps_every and _has_taps(raw_model):
        from .data import normalize, spread_indices

        pick = spread_indices(splits.eval.y, cfg.log.probe_size)  # fixed: one image per class in turn
        px = torch.from_numpy(splits.eval.x[pick]).permute(0, 3, 1, 2)
        probe = (normalize(px, cfg.data.mean, cfg.data.std).to(device), torch.from_numpy(splits.eval.y[pick]).to(device))

    def checkpoint_state(epoch: int, position_stats: Optional[torch.Tensor]) -> Dict[str, Any]:
        return {
            "model": raw_model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict() if scaler is not None else None,
            "ema": ema.state_dict() if ema is not None else None,
            "rng": rng_state(), "loader": train_loader.state_dict(), "epoch": epoch, "step": global_step,
            "epoch_stats": position_stats.cpu() if position_stats is not None else None,
            "best_acc": best_acc, "config": cfg.to_dict(), "classes": list(splits.train.classes),
            "eval_split": splits.eval_split, "versions": versions(), "git": git_revision(), "seed": cfg.seed,
        }

    stop = StopFlag()
    metrics_path = run_dir / "metrics.jsonl"
    t_start = time.perf_counter()
    history: List[Dict[str, Any]] = []
    last: Dict[str, Any] = {}
    stats_box: Dict[str, torch.Tensor] = {}

    def after_step(step: int) -> bool:
        nonlocal global_step
        global_step = step
        halt = bool(stop)
        if di.enabled:  # every rank stops at the same step
            t = torch.tensor([1.0 if halt else 0.0], device=device)
            halt = bool(di.reduce(t).item() > 0)
            if halt and stop.signum is None:
                stop.signum = signal.SIGTERM
        if cfg.train.max_steps is not None and step >= cfg.train.max_steps:
            halt = True
        every = cfg.train.ckpt_every_steps
        if halt or (every and step % every == 0):  # the same decision on every rank
            live = stats_box.get("live")
            if di.enabled and live is not None:  # carry the partial epoch's totals over all ranks; rank 0 resumes them
                live = di.reduce(live.clone())
            # a periodic save never replaces the last good checkpoint with non-finite weights (on a GPU the loss is
            # checked only every train.check_every steps, after the weights have taken the step)
            if di.is_main and (halt or _all_finite(raw_model)):
                save_checkpoint(checkpoint_state(train_loader.epoch, live), run_dir / "last.pt")
        return halt

    def on_check(step: int, loss: float, lr: float) -> None:
        if writer is not None:
            writer.add_scalar("train/loss_step", loss, step)
            writer.add_scalar("train/lr", lr, step)

    with graceful_signals(stop):
        for epoch in range(start_epoch, cfg.train.epochs):
            if cfg.train.max_steps is not None and global_step >= cfg.train.max_steps:
                break
            train_loader.set_epoch(epoch)
            bar = None
            if di.is_main and cfg.log.progress:
                from tqdm import tqdm

                bar = tqdm(total=len(train_loader), initial=train_loader.position, desc=f"epoch {epoch + 1}/{cfg.train.epochs}",
                           leave=False, dynamic_ncols=True, file=sys.stderr)
            live = torch.zeros(5, dtype=torch.float64, device=device) if carry is None else carry.to(device).double()
            stats_box["live"] = live
            carry = None
            ep, global_step, live = engine.train_one_epoch(
                train_model, train_loader, optimizer, scheduler, device=device, precision=precision, scaler=scaler,
                label_smoothing=cfg.train.label_smoothing, grad_clip=o.grad_clip, ema=ema,
                max_nonfinite_steps=cfg.train.max_nonfinite_steps, check_every=cfg.train.check_every,
                global_step=global_step, hooks=engine.StepHooks(after_step=after_step, on_check=on_check),
                progress=bar, carry=live, reduce=di.reduce if di.enabled else None,
            )
            if bar is not None:
                bar.close()
            if stop or 0 < train_loader.position < len(train_loader):  # stopped mid-epoch: state already saved
                if stop:
                    if writer is not None:
                        writer.close()
                    raise Interrupted(stop.signum, run_dir / "last.pt")
                break
            done = epoch + 1
            row: Dict[str, Any] = {"epoch": done, "step": global_step, "train_loss": ep.loss, "train_acc": ep.acc,
                                   "images_per_s": ep.images_per_s,  # ep.images is already summed over ranks
                                   "epoch_seconds": ep.seconds, "nonfinite_steps": ep.nonfinite_steps,
                                   "skipped_steps": ep.skipped_steps,
                                   "lr": optimizer.param_groups[0]["lr"],
                                   "wall_seconds": time.perf_counter() - t_start}
            if done % cfg.eval.every == 0 or done == cfg.train.epochs:
                if di.enabled:  # BN running stats drift apart per rank: evaluate rank 0's, the ones it saves
                    with torch.no_grad():
                        for b in eval_model.buffers():
                            dist.broadcast(b, src=0)
                ev = engine.evaluate(eval_model, eval_loader, device=device, precision=precision, tta=cfg.eval.tta,
                                     num_classes=num_classes, reduce=di.reduce if di.enabled else None)
                row.update({"val_loss": ev["loss"], "val_acc": ev["acc"], "eval_seconds": ev["seconds"]})
                last = ev
            is_best = "val_acc" in row and row["val_acc"] > best_acc
            if is_best:
                best_acc = row["val_acc"]
            row["best_val_acc"] = best_acc
            history.append(row)
            if di.is_main:
                # last.pt goes last: it commits the epoch. A crash before it redoes the epoch on resume, which first
                # drops the metrics rows past the checkpoint, so no row is lost or written twice.
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(row) + "\n")
                train_loader.set_epoch(done)
                state = checkpoint_state(done, None)
                if is_best:
                    save_checkpoint(state, run_dir / "best.pt")
                save_checkpoint(state, run_dir / "last.pt")
                if writer is not None:
                    for k in ("train_loss", "train_acc", "val_loss", "val_acc", "images_per_s", "lr", "nonfinite_steps", "skipped_steps"):
                        if k in row:
                            tag = k.replace("_", "/", 1) if k.startswith(("train_", "val_")) else f"train/{k}"
                            writer.add_scalar("train/lr_epoch" if k == "lr" else tag, row[k], done)
                    if probe is not None and cfg.log.maps_every and done % cfg.log.maps_every == 0:
                        _log_maps(writer, eval_model, probe, done, cfg, splits.train.classes)
                    writer.flush()
                msg = f"epoch {done}/{cfg.train.epochs}: train loss {ep.loss:.4f} acc {ep.acc:.4f}"
                if "val_acc" in row:
                    msg += f" | val loss {row['val_loss']:.4f} acc {row['val_acc']:.4f}"
                msg += f" | {row['images_per_s']:.0f} img/s | {row['wall_seconds']:.0f}s"
                say(msg)
            if stop:
                if writer is not None:
                    writer.close()
                raise Interrupted(stop.signum, run_dir / "last.pt")
    if writer is not None:
        writer.close()
    if di.enabled:
        dist.barrier()
    summary = {"best_val_acc": best_acc, "final": history[-1] if history else None, "epochs": len(history),
               "wall_seconds": time.perf_counter() - t_start, "run_dir": str(run_dir), "eval_split": splits.eval_split,
               "per_class_acc": last.get("per_class_acc"), "classes": list(splits.train.classes)}
    return summary


def _all_finite(module: nn.Module) -> bool:
    return bool(torch.stack([torch.isfinite(p).all() for p in module.parameters()]).all())


def _trim_metrics(path: Path, epochs_done: int) -> None:
    """Keep the complete rows of epochs the checkpoint has finished; drop later ones and a torn last line."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)
    keep = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if line.endswith("\n") and isinstance(row, dict) and int(row.get("epoch", 0)) <= epochs_done:
            keep.append(line)
    if keep != lines:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(keep))
        os.replace(tmp, path)


def _has_taps(model: nn.Module) -> bool:
    from .attention.tap import AttentionTap

    return any(isinstance(m, AttentionTap) for m in model.modules())


def _log_maps(writer: Any, model: nn.Module, probe: Any, step: int, cfg: Config, classes: Any) -> None:
    from .maps.tensorboard import log_attention_maps

    log_attention_maps(writer, model, probe[0], probe[1], step, cfg.data.mean, cfg.data.std, list(classes),
                       scale=cfg.log.map_scale, head_maps=cfg.log.head_maps, norm=cfg.log.map_norm,
                       faithfulness=cfg.log.faithfulness)


def _yaml_dump(d: Dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(d, sort_keys=False)


def load_run_config(tree: Dict[str, Any]) -> Config:
    """Rebuild a :class:`Config` from the dict stored in a checkpoint or a run's config.yaml."""
    return build_config(tree)
