"""One run per folder: a lock held for the run's life, and the checks that keep two runs' files apart.

:class:`RunLock` is an ``fcntl.flock`` on ``RUN/.visattn-run.lock``, a file that holds the owner's pid, host
and start time. The kernel drops the lock when its process dies however it dies (``kill -9`` included), so
a second process on the same folder is refused while the first lives, and a lock file left by a dead
process is taken over and named. Only the lock's holder may delete what a dead run left behind (torn
checkpoint writes, ``.*.pt.*.tmp``): :func:`remove_stale_temps` does nothing in a folder this process has
not locked.

:func:`check_new_run_dir` is the guard of a new run (no ``resume``): the folder must hold no run files and
must not be a project's source tree (``run_dir=.`` in a checkout). ``resume=PATH`` either continues a
checkpoint of the run folder itself, never rewinding past epochs it has finished (:func:`check_rewind`), or
branches a checkpoint of another run into a new folder (:func:`check_branch`): two runs' files never meet.
"""
from __future__ import annotations

import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Callable, Collection, Dict, List, Optional

from .errors import ConfigError
from .runtime import complete_rows

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


def check_rewind(run_dir: Path, checkpoint: Path, epoch: int) -> None:
    """A checkpoint of ``run_dir`` other than its ``last.pt`` may not rewind the run over epochs it has finished."""
    if checkpoint.resolve() == (run_dir / "last.pt").resolve() or checkpoint.resolve().parent != run_dir.resolve():
        return
    later = [e for e in _finished_epochs(run_dir) if e > epoch]
    if later:
        raise ConfigError(f"resume: {str(checkpoint)!r} is from epoch {epoch}, but run_dir {str(run_dir)!r} has "
                          f"finished epochs up to {max(later)}; resuming there would overwrite them: branch into a new "
                          "run_dir instead (resume=PATH run_dir=NEW)")


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
