"""Checkpoints: written atomically, read with ``torch.load(weights_only=True)``.

A checkpoint is a dict of tensors, numbers, strings, lists and dicts only (model, optimizer, scheduler,
scaler and EMA state dicts, RNG states, the data-order position, the resolved config, versions), so it
loads with PyTorch's restricted unpickler: a file that carries arbitrary pickled objects is refused, and
the code it would run never runs.
"""
from __future__ import annotations

import os
import pickle
import re
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Dict, Union

import torch

from .errors import CheckpointError

REQUIRED_KEYS = ("model", "config", "epoch", "step")


def save_checkpoint(state: Dict[str, Any], path: Union[str, os.PathLike]) -> Path:
    """Write ``state`` to ``path`` atomically: a temporary file in the same folder, fsync, rename.

    A kill at any moment leaves either the old file or the new one, never a torn one.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
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
    if path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} is a folder, not a checkpoint file (e.g. {str(path / 'best.pt')!r})")
    if not path.exists():
        raise CheckpointError(f"checkpoint {str(path)!r} not found")
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} is not a regular file")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
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
    return state
