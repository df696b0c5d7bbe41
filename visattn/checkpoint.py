"""Checkpoints: written atomically, read with ``torch.load(weights_only=True)``.

A checkpoint is a dict of tensors, numbers, strings, lists and dicts only (model, optimizer, scheduler,
scaler and EMA state dicts, RNG states, the data-order position, the resolved config, versions), so it
loads with PyTorch's restricted unpickler: a file that carries arbitrary pickled objects is refused, and
the code it would run never runs.

torch does not check the zip's CRC-32 on load, so a damaged file would load as garbage weights: every
checkpoint carries a ``digest`` entry (SHA-256 over every tensor's bytes, dtype and shape and every other
value, in the dict's order) that :func:`load_checkpoint` recomputes, and it refuses a file that does not
match, or whose ``model``/``ema`` weights are not finite. A checkpoint written before digests existed (no
``digest`` entry) is accepted after the finite check.
"""
from __future__ import annotations

import hashlib
import os
import pickle
import re
import stat
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Dict, Union

import torch

from .errors import CheckpointError

REQUIRED_KEYS = ("model", "config", "epoch", "step")
DIGEST_KEY = "digest"
WEIGHT_KEYS = ("model", "ema")  # entries whose floating-point tensors must be finite


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


def _nonfinite(state: Dict[str, Any]) -> str:
    """The first ``entry/key`` of a ``model`` or ``ema`` tensor holding NaN or inf, or ``""``."""
    for entry in WEIGHT_KEYS:
        weights = state.get(entry)
        for k, v in (weights.items() if isinstance(weights, dict) else ()):
            if isinstance(v, torch.Tensor) and v.is_floating_point() and not bool(torch.isfinite(v).all()):
                return f"{entry}/{k}"
    return ""


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
    state = {**state, DIGEST_KEY: state_digest(state)}
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
    """Load a visattn checkpoint safely; every failure is one :class:`CheckpointError` line naming the file."""
    path = Path(path)
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
    stored = state.pop(DIGEST_KEY, None)  # absent: written before digests; the finite check below still runs
    if stored is not None and stored != state_digest(state):
        raise CheckpointError(f"checkpoint {str(path)!r} is damaged: its contents do not match the digest written with "
                              "it (a changed byte on disk or in a copy); use another copy or an earlier checkpoint")
    bad = _nonfinite(state)
    if bad:
        raise CheckpointError(f"checkpoint {str(path)!r} holds non-finite weights (NaN or inf in {bad}); it was not "
                              "used: take an earlier checkpoint")
    return state
