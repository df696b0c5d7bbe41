"""A run's state on disk, and each guarantee that keeps it whole, in one place.

- **One run per folder**: :class:`RunLock` is an ``fcntl.flock`` on ``RUN/.visattn-run.lock`` (the owner's pid,
  host and start time inside). The kernel drops it when its process dies however it dies, so a second process is
  refused while the first lives and a dead one's lock is taken over and named. The ``check_*`` functions keep two
  runs' files apart: a new run refuses a folder that holds run files or a source tree; ``resume=PATH`` continues
  the folder's own checkpoint without rewinding finished epochs (:func:`check_rewind`) or branches another run's
  into a new folder (:func:`check_branch`).
- **Atomic checkpoints**: :func:`save_checkpoint` writes a temporary file, fsyncs and renames, so a kill leaves the
  old file or the new one. Checkpoints hold tensors and plain data only and load with
  ``torch.load(weights_only=True)``; torch does not check the zip's CRC-32, so each carries a SHA-256
  ``digest`` (:func:`state_digest`) and a ``format_version`` that :func:`load_checkpoint` checks, refusing a
  mismatch, a digest that is ``None``, not a string or removed, or non-finite ``model``/``ema`` weights (only a
  file from before digests, which holds no entry that came with them, loads without one, after the finite check).
- **Exact resume**: ``metrics.jsonl`` rows past the checkpoint and a torn last line are dropped
  (:func:`trim_metrics`), a damaged row is refused (:func:`metrics_rows`); the random state a checkpoint holds
  is :mod:`visattn.rng`'s.
- **Non-finite values**: :func:`check_finite` names every NaN or inf in a number, tensor, module or nested row.

Beside it: signals and the stop they cause in :mod:`visattn.signals`, the HParams file in :mod:`visattn.hparams`,
results files and where they were made (``read_json``, ``write_atomic``, ``git_revision``...) in
:mod:`visattn.results`.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any, Callable, Collection, Dict, Iterator, List, Optional, Tuple, Union

import torch
from torch import nn

from .errors import CheckpointError, ConfigError
from .registry import MODELS
from .results import write_atomic

try:
    import fcntl
except ImportError:  # pragma: no cover - not a POSIX system: runs are not locked
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = ".visattn-run.lock"
# what a run writes into its folder; a new run refuses a folder that holds any of them
RUN_FILES = ("last.pt", "best.pt", "metrics.jsonl", "config.yaml", "run_info.json", "tb")
PROJECT_MARKERS = (".git", "pyproject.toml", "setup.py", "setup.cfg")  # a source tree, not a run folder
# folders no run may write into (as root it could): the file-system root and its system folders
SYSTEM_DIRS = frozenset({"/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/media", "/mnt",
                         "/opt", "/proc", "/root", "/run", "/sbin", "/srv", "/sys", "/tmp", "/usr", "/usr/bin",
                         "/usr/lib", "/usr/local", "/usr/share", "/var", "/var/lib", "/var/log", "/var/tmp"})

_HELD: Dict[Path, "RunLock"] = {}  # folders this process holds the lock of (resolved path -> lock)


def _warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr, flush=True)


class RunLock:
    """An exclusive lock on a run folder; use as a context manager. ``enabled=False`` is a no-op (ranks > 0).

    Raises :class:`ConfigError` (exit 2, one line) when another live process holds the folder.
    """

    def __init__(self, run_dir: Path, enabled: bool = True, warn: Callable[[str], None] = _warn):
        self.run_dir = Path(run_dir)
        self.enabled = enabled and fcntl is not None
        self.warn = warn
        self.fd: Optional[int] = None
        self.created: List[Path] = []  # folders this lock made (removed again when the run left them empty)
        self.previous_owner = ""  # "pid N on host H" of a dead process whose lock file was taken over

    @property
    def path(self) -> Path:
        return self.run_dir / LOCK_NAME

    def __enter__(self) -> "RunLock":
        if self.enabled:
            self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def acquire(self) -> None:
        self._make_folder()
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = _read_owner(fd)
                os.close(fd)
                self._remove_created()
                raise ConfigError(f"run_dir {str(self.run_dir)!r} is in use by another run ({owner or 'owner unknown'}); "
                                  "wait for it to end or choose another run_dir") from None
            except OSError as e:  # a file system without locks (some network mounts): run, unguarded, and say so
                os.close(fd)
                self.path.unlink(missing_ok=True)
                self.warn(f"run_dir {str(self.run_dir)!r} cannot be locked ({e.strerror or e}); another run on the "
                          "same folder would not be refused")
                return
            if _same_file(fd, self.path):
                break
            os.close(fd)  # the holder before us removed the file after we opened it: lock the new one
        self.fd = fd
        owner = _read_owner(fd)
        if owner:  # the kernel dropped that process's lock: it is no longer running
            self.previous_owner = owner
            self.warn(f"run_dir {str(self.run_dir)!r}: taking over the lock left by {owner}, which is no longer running")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
                  .encode(), 0)
        _HELD[_key(self.run_dir)] = self

    def release(self) -> None:
        if self.fd is None:
            return
        _HELD.pop(_key(self.run_dir), None)
        try:
            self.path.unlink(missing_ok=True)  # while still locked: a waiting opener sees the file is gone
        finally:
            os.close(self.fd)
            self.fd = None
        self._remove_created()

    def _make_folder(self) -> None:
        existing = next((p for p in (self.run_dir, *self.run_dir.parents) if p.exists()), None)
        if existing is not None and not existing.is_dir():
            raise ConfigError(f"run_dir {str(self.run_dir)!r}: {str(existing)!r} is a file, not a folder")
        missing = [p for p in (self.run_dir, *self.run_dir.parents) if not p.exists()]
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.created = missing  # deepest first

    def _remove_created(self) -> None:
        for p in self.created:  # a run that failed before writing anything leaves no empty folders behind
            try:
                p.rmdir()
            except OSError:
                break
        self.created = []


def _key(run_dir: Path) -> Path:
    return Path(os.path.realpath(run_dir))


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _read_owner(fd: int) -> str:
    try:
        text = os.pread(fd, 512, 0).decode("utf-8", "replace").strip()
    except OSError:
        return ""
    return text.splitlines()[0][:200] if text else ""


def holds(run_dir: Path) -> bool:
    """Whether this process holds ``run_dir``'s lock."""
    return _key(run_dir) in _HELD


def remove_stale_temps(run_dir: Path) -> List[Path]:
    """Delete the torn checkpoint writes (``.*.pt.*.tmp``) a dead run left; only while holding the lock."""
    if not holds(run_dir):
        return []
    removed = []
    for p in run_dir.glob(".*.pt.*.tmp"):
        p.unlink(missing_ok=True)
        removed.append(p)
    return removed


def remove_new_run_files(run_dir: Path, before: Collection[str]) -> List[str]:
    """Delete the run files (:data:`RUN_FILES`) that were not among ``before`` (the folder's entries when the run
    began): a run that fails before its first checkpoint leaves its folder as it found it."""
    removed = []
    for name in RUN_FILES:
        p = run_dir / name
        if name in before or not (p.exists() or p.is_symlink()):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(name)
    return removed


def run_files(run_dir: Path) -> List[str]:
    """The run files ``run_dir`` holds (``tb`` as ``tb/``)."""
    return [n + ("/" if n == "tb" else "") for n in RUN_FILES if (run_dir / n).exists()]


def check_run_dir(run_dir: Path) -> None:
    """Before anything is created: refuse a system folder, the home folder, a source tree, and an existing folder
    that holds other files but no run (a run would mix its files into someone's folder)."""
    real = Path(os.path.realpath(run_dir))
    home = Path(os.path.realpath(Path.home()))
    if str(real) in SYSTEM_DIRS or real == home or real.parts[1:2] in (("proc",), ("sys",), ("dev",)):
        what = "the home folder" if real == home else "a system folder"
        raise ConfigError(f"run_dir {str(run_dir)!r} is {what} ({real}), not a run folder; give the run a folder of "
                          "its own, e.g. run_dir=runs/NAME")
    if not real.is_dir():
        return
    check_not_project(run_dir)
    other = sorted(n for n in os.listdir(real)
                   if n not in RUN_FILES and n != LOCK_NAME and not (n.startswith(".") and n.endswith(".tmp")))
    if other and not run_files(real):
        more = f" and {len(other) - 3} more" if len(other) > 3 else ""
        raise ConfigError(f"run_dir {str(run_dir)!r} holds other files ({', '.join(other[:3])}{more}) and no run; "
                          "give the run a new or empty folder, e.g. run_dir=runs/NAME")


def check_new_run_dir(run_dir: Path) -> None:
    """A new run's folder must hold no run files and must not be a source tree; raises :class:`ConfigError`."""
    if not run_dir.is_dir():
        return
    check_not_project(run_dir)
    found = run_files(run_dir)
    if found:
        raise ConfigError(f"run_dir {str(run_dir)!r} already holds {', '.join(found)}; continue it with resume=auto "
                          "or choose another run_dir")


def check_auto_start(run_dir: Path) -> None:
    """``resume=auto`` without ``last.pt`` starts a new run: refused where that would overwrite finished epochs."""
    if not run_dir.is_dir():
        return
    check_not_project(run_dir)
    kept = [n for n in ("best.pt",) if (run_dir / n).exists()] + (["metrics.jsonl"] if _has_rows(run_dir) else [])
    if kept:
        raise ConfigError(f"resume=auto: run_dir {str(run_dir)!r} holds {', '.join(kept)} but no last.pt to continue "
                          "from; a new run there would overwrite them: move them away or choose another run_dir")


def check_not_project(run_dir: Path) -> None:
    """Refuse a folder that holds a project's source tree (``run_dir=.`` in a checkout)."""
    marker = next((m for m in PROJECT_MARKERS if (run_dir / m).exists()), None)
    if marker is not None:
        raise ConfigError(f"run_dir {str(run_dir)!r} is a project folder (it holds {marker}), not a run folder; "
                          "give the run a folder of its own, e.g. run_dir=runs/NAME")


def check_branch(run_dir: Path, checkpoint: Path) -> None:
    """``resume=PATH`` with a checkpoint from another folder starts a branch: ``run_dir`` must be a new run's."""
    if checkpoint.resolve().parent == run_dir.resolve():
        return
    found = run_files(run_dir) if run_dir.is_dir() else []
    if found:
        raise ConfigError(f"resume: {str(checkpoint)!r} belongs to another run folder, and run_dir {str(run_dir)!r} "
                          f"already holds {', '.join(found)}; continuing there would mix two runs: give a new run_dir "
                          "to branch into, or resume=auto to continue that folder's own run")


def check_rewind(run_dir: Path, checkpoint: Path, epoch: int, step: Optional[int] = None) -> None:
    """A checkpoint of ``run_dir`` other than its ``last.pt`` may not rewind the run over epochs it has finished:
    neither those ``metrics.jsonl`` records nor those ``last.pt`` holds itself (its own epoch and step, which no
    edit of the metrics file can hide; a ``last.pt`` that does not load is no later state to keep)."""
    last = run_dir / "last.pt"
    if checkpoint.resolve() == last.resolve() or checkpoint.resolve().parent != run_dir.resolve():
        return
    rewind = "resuming there would overwrite them: branch into a new run_dir instead (resume=PATH run_dir=NEW)"
    later = [e for e in _finished_epochs(run_dir) if e > epoch]
    if later:
        raise ConfigError(f"resume: {str(checkpoint)!r} is from epoch {epoch}, but run_dir {str(run_dir)!r} has "
                          f"finished epochs up to {max(later)}; {rewind}")
    if step is None or not last.is_file():
        return
    try:
        held = load_checkpoint(last)
    except CheckpointError:
        return
    if held["step"] > step or held["epoch"] > epoch:
        raise ConfigError(f"resume: {str(checkpoint)!r} is from epoch {epoch} (step {step}), but {str(last)!r} holds "
                          f"epoch {held['epoch']} (step {held['step']}); {rewind.replace('them', 'it')}")


def _finished_epochs(run_dir: Path) -> List[int]:
    """The epochs of ``metrics.jsonl``'s complete rows (a torn last line of a killed run does not count)."""
    p = run_dir / "metrics.jsonl"
    rows = complete_rows(p) if p.is_file() else []
    return [r["epoch"] if isinstance(r.get("epoch"), int) else 0 for r in rows]


def _has_rows(run_dir: Path) -> bool:
    """Whether ``metrics.jsonl`` holds a finished epoch's row."""
    try:
        return bool(_finished_epochs(run_dir))
    except OSError:
        return True  # unreadable: assume it holds rows, and refuse


# ------------------------------------------------------------------------------------- checkpoints


REQUIRED_KEYS = ("model", "config", "epoch", "step")
DIGEST_KEY = "digest"
WEIGHT_KEYS = ("model", "ema")  # entries whose floating-point tensors must be finite
# what save_checkpoint writes: format 2 carries a digest; format 1 (no format_version entry) is a file from before
# digests. A newer format is refused rather than read as an older one.
FORMAT_KEY = "format_version"
CHECKPOINT_FORMAT = 2
# entries that only a writer of digests puts into a checkpoint (they came with digests): a file that holds one
# and no digest lost its digest after it was written
DIGEST_ERA_ENTRIES = (FORMAT_KEY, "teacher_digest")
DIGEST_ERA_CONFIG = (("model", "init_from"), ("data", "placed"))  # config keys that came with digests
# timm / torchvision models by name (model.name=timm/<name>) and their options came after digests: a stored
# config that names one, or holds one of its options, shows a writer of digests (and the name cannot go: the
# model is rebuilt from it)
FOREIGN_PREFIXES = ("timm/", "torchvision/")
FOREIGN_OPTIONS = ("pretrained_file", "cifar_stem", "attn_at", "kwargs")
# what every visattn before digests (issue 60, commit DIGEST_COMMIT) wrote, read from the git history: the union
# of its checkpoints' entries, and of its config's keys section by section (the model section: every option of
# its models). A file without a digest loads only where it holds nothing else, and its git entry does not name a
# revision at or after DIGEST_COMMIT: anything else is what a writer of digests wrote, so the digest was lost
DIGEST_COMMIT = "0c428f2"
PRE_DIGEST_ENTRIES = frozenset("best_acc classes config ema epoch epoch_stats eval_split git loader lookahead model "
                               "optimizer rng scaler scheduler seed step versions".split())
PRE_DIGEST_CONFIG = {
    "": frozenset("channels_last compile data deterministic device eval log model name optim precision resume resume_allow_changes run_dir sched seed sync_bn train".split()),
    "data": frozenset("augment cache_dir download image_size loader max_image_pixels mean on_bad_image root source split_seed std subset synthetic_size use_test_split val_size workers".split()),
    "data.augment": frozenset("crop_padding cutout extra hflip hflip_mode padding_mode".split()),
    "eval": frozenset("batch_size every tta".split()),
    "log": frozenset("faithfulness gradient_maps head_maps map_norm map_scale maps_every probe_size progress tensorboard".split()),
    "model": frozenset("act attention attn attn_drop_rate attn_kwargs attn_position block bn_eps bn_momentum bn_scale cin conv_channels conv_init cout depth dim drop drop_path drop_path_rate drop_rate eps grid_size group_skip head_scale img_size in_channels in_chans init kernel_size layer_scale layers mlp_ratio n_conv_layers n_frozen name norm num_classes num_heads out_channels padding patch patch_size pool pool_kernel pools position post_act skip spt stem stem_width stride tokenizer tokenizer_act tokenizer_init tokenizer_norm units whiten_bias_epochs width widths".split()),
    "optim": frozenset("betas grad_clip lr momentum name nesterov no_decay_norm_bias norm_bias_lr_scale weight_decay".split()),
    "sched": frozenset("anneal min_lr_ratio name start_lr_ratio warmup_epochs".split()),
    "train": frozenset("batch_size check_every ckpt_every_steps distill ema_decay ema_warmup epochs label_smoothing lookahead_decay lookahead_every lookahead_power max_nonfinite_steps max_steps".split()),
    "train.distill": frozenset("kind teacher temperature weight".split()),
}


def state_digest(state: Dict[str, Any]) -> str:
    """``sha256:HEX`` over ``state`` less its digest: each tensor's key path, dtype, shape and bytes, and the
    ``repr`` of every other value, walked in the dict's order (which the pickle keeps)."""
    h = hashlib.sha256()

    def walk(x: Any, key: str) -> None:
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            h.update(f"{key}:{t.dtype}:{tuple(t.shape)};".encode())
            h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{key}/{k!r}")
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, f"{key}[{i}]")
        else:
            h.update(f"{key}={x!r};".encode())

    walk({k: v for k, v in state.items() if k != DIGEST_KEY}, "")
    return f"sha256:{h.hexdigest()}"


def file_digest(path: Union[str, os.PathLike]) -> str:
    """``sha256:HEX`` of a file's bytes (a distillation teacher's, recorded in the student's checkpoints)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return f"sha256:{h.hexdigest()}"


def _umask() -> int:
    mask = os.umask(0o22)
    os.umask(mask)
    return mask


def save_checkpoint(state: Dict[str, Any], path: Union[str, os.PathLike]) -> Path:
    """Write ``state`` to ``path`` atomically: a temporary file in the same folder, fsync, rename.

    A kill at any moment leaves either the old file or the new one, never a torn one. The file carries
    :func:`state_digest` and follows the umask, like the run's other files (``mkstemp`` would make it 0600).
    A failed write (disk full, a file-size limit) is the ``OSError`` behind it, whatever torch's writer wraps.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v for k, v in state.items() if k != DIGEST_KEY}
    state[FORMAT_KEY] = CHECKPOINT_FORMAT
    state[DIGEST_KEY] = state_digest(state)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            try:
                torch.save(state, f)
            except RuntimeError as e:  # torch's zip writer reports a failed write as "unexpected pos ..."
                cause = e.__context__ or e.__cause__
                raise (cause if isinstance(cause, OSError) else OSError(f"writing {path} failed ({e})")) from None
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        try:  # make the rename itself durable
            dfd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError:
            pass
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def load_checkpoint(path: Union[str, os.PathLike], map_location: Union[str, torch.device] = "cpu") -> Dict[str, Any]:
    """Load a visattn checkpoint safely; every failure is one :class:`CheckpointError` line naming the file. A
    leading ``~`` is the home folder (``--checkpoint=~/run/best.pt``, which the shell leaves as it is)."""
    path = Path(path).expanduser()
    try:
        mode = path.stat().st_mode
        if stat.S_ISDIR(mode):
            raise CheckpointError(f"checkpoint {str(path)!r} is a folder, not a checkpoint file (e.g. "
                                  f"{str(path / 'best.pt')!r})")
        if not stat.S_ISREG(mode):
            raise CheckpointError(f"checkpoint {str(path)!r} is not a regular file")
        f = open(path, "rb")
    except (FileNotFoundError, NotADirectoryError):
        raise CheckpointError(f"checkpoint {str(path)!r} not found") from None
    except OSError as e:  # permissions (of the file or a folder above it), not damage
        raise CheckpointError(f"checkpoint {str(path)!r} cannot be read ({e.strerror or e.__class__.__name__})") from None
    try:
        with f:
            state = torch.load(f, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        text = str(e)
        if "Weights only load failed" in text or "Unsupported global" in text or "weights_only" in text:
            m = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text) or re.search(r"Unsupported operand \d+", text)
            what = f" ({m.group(1) if m.groups() else m.group(0)})" if m else ""
            raise CheckpointError(
                f"checkpoint {str(path)!r} refused: it holds pickled objects other than tensors and plain data{what}; "
                "loading it could run code, so it was not loaded"
            ) from None
        raise CheckpointError(f"checkpoint {str(path)!r} is corrupt ({first[:120]})") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError, AttributeError, IndexError, KeyError,
            TypeError) as e:  # what garbage bytes make the unpickler raise (a text file: IndexError)
        first = str(e).strip().splitlines()[0] if str(e).strip() else e.__class__.__name__
        raise CheckpointError(f"checkpoint {str(path)!r} is corrupt or truncated ({first[:120]})") from None
    if not isinstance(state, dict) or any(k not in state for k in REQUIRED_KEYS):
        missing = [k for k in REQUIRED_KEYS if not isinstance(state, dict) or k not in state]
        raise CheckpointError(f"checkpoint {str(path)!r} is not a visattn checkpoint (missing {', '.join(missing)})")
    _check_state(state, str(path))
    return state


def _check_state(state: Dict[str, Any], name: str) -> None:
    """The integrity checks of a loaded checkpoint ``state`` (popping its digest), in :class:`CheckpointError`
    lines naming ``name``. The digest must match; a ``None`` or non-string one is damage, and a missing one is
    refused too where the file shows a writer of digests (:func:`_digest_era`): only a file from before digests
    loads without one. Then the format, the weight entries' types and the finite check, none of which an
    entry's absence or type can skip."""
    damaged = f"checkpoint {name!r} is damaged"
    fix = "use another copy or an earlier checkpoint"
    has_digest = DIGEST_KEY in state
    stored = state.pop(DIGEST_KEY, None)
    if has_digest and not (isinstance(stored, str) and stored.startswith("sha256:")):
        raise CheckpointError(f"{damaged}: its digest entry is {_short(stored)}, not a sha256 digest; {fix}")
    if not has_digest and _digest_era(state):
        raise CheckpointError(f"{damaged}: its digest entry was removed (its {_digest_era(state)} shows that a "
                              f"visattn that writes digests wrote it); {fix}")
    if has_digest and stored != state_digest(state):
        raise CheckpointError(f"{damaged}: its contents do not match the digest written with it (a changed byte on "
                              f"disk or in a copy); {fix}")
    version = state.get(FORMAT_KEY, 1)
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= CHECKPOINT_FORMAT:
        newer = isinstance(version, int) and not isinstance(version, bool) and version > CHECKPOINT_FORMAT
        raise CheckpointError(f"checkpoint {name!r}: format_version {_short(version)} "
                              + (f"is newer than this visattn reads (up to {CHECKPOINT_FORMAT}); update visattn"
                                 if newer else f"is not one visattn writes (1 to {CHECKPOINT_FORMAT})"))
    for key, kind in (("config", dict), ("epoch", int), ("step", int)):  # what every loader reads first
        if not isinstance(state[key], kind) or isinstance(state[key], bool):
            raise CheckpointError(f"checkpoint {name!r}: its {key} entry is a {type(state[key]).__name__}, not "
                                  f"{'a mapping' if kind is dict else 'an integer'}")
    for key in WEIGHT_KEYS:  # a weight entry of another type would skip the finite check
        if not isinstance(state.get(key), dict) and not (key == "ema" and state.get(key) is None):
            raise CheckpointError(f"checkpoint {name!r}: its {key} entry is a {type(state.get(key)).__name__}, not a "
                                  "state dict")
    bad = check_finite({k: state[k] for k in WEIGHT_KEYS if state.get(k) is not None})
    if bad:
        raise CheckpointError(f"checkpoint {name!r} holds non-finite weights (NaN or inf in {bad[0]}); it was not "
                              "used: take an earlier checkpoint")


def _digest_era(state: Dict[str, Any]) -> str:
    """What in ``state`` shows a writer that writes digests ("" where nothing does: a file from before them)."""
    held = next((k for k in DIGEST_ERA_ENTRIES if k in state), None)
    if held is not None:
        return f"{held} entry"
    config = state.get("config")
    for section, key in DIGEST_ERA_CONFIG:
        if isinstance(config, dict) and isinstance(config.get(section), dict) and key in config[section]:
            return f"config (it holds {section}.{key})"
    model = config.get("model") if isinstance(config, dict) else None
    if isinstance(model, dict):
        name = model.get("name")
        if isinstance(name, str) and (name.startswith(FOREIGN_PREFIXES) or MODELS.namespace(name) is not None):
            return f"config (its model.name is {_short(name)}, a package model: those came with digests)"
        held_opt = next((k for k in FOREIGN_OPTIONS if k in model), None)
        if held_opt is not None:
            return f"config (it holds model.{held_opt}, an option of the package models, which came with digests)"
    newer = sorted(str(k) for k in state if k not in PRE_DIGEST_ENTRIES)
    if newer:
        return f"{newer[0]} entry (one that no visattn before digests wrote)"
    key = _newer_config_key(config) if isinstance(config, dict) else None
    if key is not None:
        return f"config (it holds {key}, which no visattn before digests wrote)"
    return _git_after_digests(state.get("git"))


def _newer_config_key(config: Dict[str, Any], path: str = "") -> Optional[str]:
    """The first key of a stored ``config`` that no visattn before digests had (:data:`PRE_DIGEST_CONFIG`)."""
    for k, v in config.items():
        where = f"{path}.{k}" if path else str(k)
        if k not in PRE_DIGEST_CONFIG[path]:
            return where
        if isinstance(v, dict) and where in PRE_DIGEST_CONFIG:
            found = _newer_config_key(v, where)
            if found is not None:
                return found
    return None


def _git_after_digests(rev: Any) -> str:
    """A note where ``rev`` (a checkpoint's git entry) names a revision this checkout knows at or after
    :data:`DIGEST_COMMIT` ("" where it does not, or where no git can tell)."""
    rev = rev.removesuffix("-dirty") if isinstance(rev, str) else ""
    if not re.fullmatch(r"[0-9a-f]{7,40}", rev):
        return ""
    try:
        here = Path(__file__).resolve().parent
        done = subprocess.run(["git", "merge-base", "--is-ancestor", DIGEST_COMMIT, rev], cwd=here, capture_output=True,
                              timeout=5)
    except (OSError, subprocess.SubprocessError):
        return ""
    return f"git entry (revision {rev[:12]}, which came after digests)" if done.returncode == 0 else ""


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


# ------------------------------------------------------------------------------- non-finite values


def check_finite(x: Any, key: str = "") -> List[str]:
    """The keys where ``x`` holds NaN or inf (``model/conv.weight``, ``val_loss``, ``acc[3]``); ``[]`` when all is
    finite. ``x``: a number, a tensor, a module (its parameters and floating-point buffers, BN running statistics
    included), or a dict, list or tuple of them. The one test behind every non-finite rule: checkpoints saved and
    loaded, an epoch's weights and results, a metrics row."""
    leaves = list(_leaves(x, key))
    tensors = [(k, v) for k, v in leaves if isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())]
    flags = [torch.isfinite(v).all() for _, v in tensors]
    if len({f.device for f in flags}) == 1:  # one host read for them all
        flags = torch.stack(flags).tolist()
    bad = {k for (k, _), ok in zip(tensors, flags) if not ok}
    return [k for k, v in leaves if k in bad or isinstance(v, float) and not math.isfinite(v)]


def _leaves(x: Any, key: str) -> Iterator[Tuple[str, Any]]:
    if isinstance(x, nn.Module):
        x = dict(x.named_parameters()) | dict(x.named_buffers())
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _leaves(v, f"{key}/{k}" if key else str(k))
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from _leaves(v, f"{key}[{i}]")
    else:
        yield key, x


# ------------------------------------------------------------------------------- metrics, run info


def trim_metrics(path: Path, epochs_done: int) -> None:
    """Keep the complete rows of epochs the checkpoint has finished; drop later ones and a torn last line."""
    if not path.is_file():
        return
    rows = metrics_rows(path)
    keep = [line for line, row in rows if row["epoch"] <= epochs_done]
    if len(keep) != len(rows) or not path.read_bytes().endswith(b"\n") and path.stat().st_size:
        write_atomic(path, "".join(keep))


def metrics_rows(path: Path) -> List[Tuple[str, Dict[str, Any]]]:
    """(line, row) of each complete line of a ``metrics.jsonl``. A torn last line (no newline: a run killed while
    writing it) is left out; a damaged complete line (not UTF-8, not a JSON object, an ``epoch`` that is not an
    integer) is a :class:`ConfigError` naming the file and line: the rows are the run's record, never guessed."""
    out = []
    for i, raw in enumerate(Path(path).read_bytes().splitlines(keepends=True), 1):
        if not raw.endswith(b"\n") or not raw.strip():
            continue
        try:
            line = raw.decode("utf-8")
            row = json.loads(line)
        except (UnicodeDecodeError, ValueError) as e:
            why = "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else "not valid JSON"
        else:
            epoch = row.get("epoch") if isinstance(row, dict) else None
            if isinstance(epoch, int) and not isinstance(epoch, bool) and epoch >= 0:
                out.append((line, row))
                continue
            why = f"its epoch is {epoch!r}, not an integer" if isinstance(row, dict) else "not a JSON object"
        raise ConfigError(f"{path} line {i} is damaged ({why}); repair or delete that line and run again")
    return out


def check_run_records(run_dir: Path, epochs_done: int, checkpoint: Path) -> None:
    """What the run folder records of its checkpoint, checked against it before a resume writes anything (the
    checkpoint is the source of truth): ``metrics.jsonl`` must hold one row for each epoch ``checkpoint`` has
    finished (a row cannot be rebuilt: the checkpoint keeps only the last epoch's counters), and ``run_info.json``
    (the run's origins: ``init_from``, ``branched_from``) must be a JSON object, never read as empty. A
    :class:`CheckpointError` line each."""
    fix = f"restore it from a copy, or branch the run into a new folder (resume={checkpoint} run_dir=NEW)"
    info, origin = run_dir / "run_info.json", None
    if info.is_file():
        try:
            recorded = json.loads(info.read_text())
        except (OSError, ValueError):
            recorded = None
        if not isinstance(recorded, dict):
            raise CheckpointError(f"resume: {info} is damaged (not a JSON object); it records the run's origins "
                                  f"(init_from, branched_from), which would be lost: {fix}")
        origin = recorded.get("branched_from")
    path = run_dir / "metrics.jsonl"
    if path.is_file():
        got = [row["epoch"] for _, row in metrics_rows(path) if 1 <= row["epoch"] <= epochs_done]
        first = (min(got) if got else epochs_done + 1) if origin else 1  # a branch's rows start at its own first epoch
        want = list(range(first, epochs_done + 1))
        if got != want:
            missing = sorted(set(want) - set(got))
            twice = sorted({e for e in got if got.count(e) > 1})
            why = (f"no row for epoch {', '.join(map(str, missing[:5]))}" if missing else
                   f"more than one row for epoch {', '.join(map(str, twice[:5]))}" if twice else "its rows out of order")
            raise CheckpointError(f"resume: {path} does not match {checkpoint}, which has finished epochs up to "
                                  f"{epochs_done}: {why}; {fix}")


def complete_rows(path: Path) -> List[Dict[str, Any]]:
    """The complete rows of a ``metrics.jsonl`` (:func:`metrics_rows`)."""
    return [row for _, row in metrics_rows(path)]


def metrics_line(row: Dict[str, Any], say: Any = print) -> str:
    """``row`` as one line of strict JSON: a NaN or infinite value is written as ``null``, with a warning."""
    bad = check_finite(row)
    if bad:
        shown = ", ".join(f"{k}={row[k]}" if k in row else k for k in bad)
        say(f"warning: epoch {row.get('epoch')}: {shown} is not finite; written as null in metrics.jsonl")
    clean = json.loads(json.dumps(row), parse_constant=lambda _: None)  # NaN, Infinity, -Infinity -> null
    return json.dumps(clean, allow_nan=False)


def yaml_dump(d: Dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(d, sort_keys=False)


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


