"""What a training run needs around the model: seeds and RNG state, versions and git revision, signals,
data-parallel process info, and the run folder's metrics file.
"""
from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from .errors import ConfigError, DataError


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
    """Training stopped on a signal, after saving unless ``saved`` is False (the weights were not finite, so the
    folder keeps what it had: ``kept`` says what); ``exit_code`` is 128 + the signal number."""

    def __init__(self, signum: int, path: Path, saved: bool = True, kept: str = ""):
        name = signal.Signals(signum).name
        what = f"state saved to {path}" if saved else f"the weights were not finite, so nothing was saved ({kept})"
        super().__init__(f"stopped by {name}; {what} (resume with resume=auto)")
        self.exit_code = 128 + signum


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


def all_finite(module: nn.Module) -> bool:
    """Whether every parameter and floating-point buffer (BN running statistics) of ``module`` is finite."""
    tensors = [*module.parameters(), *(b for b in module.buffers() if b.is_floating_point())]
    return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())


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


_REQUIRED = object()


def read_json(path: Path, kind: type = dict, missing: Any = _REQUIRED) -> Any:
    """The ``kind`` (dict or list) a JSON file holds (a results file, a run's ``run_info.json``); ``missing`` where
    there is no file and it is given. A missing, unreadable, empty or malformed file is one :class:`DataError`
    line naming it: a script that merges results never reads a damaged file as no results."""
    path = Path(path)
    if missing is not _REQUIRED and not path.exists():
        return missing
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0][:120] if str(e) else ""
        raise DataError(f"{path}: not a readable JSON file ({why or e.__class__.__name__})") from None
    if not isinstance(data, kind):
        raise DataError(f"{path}: holds a JSON {type(data).__name__}, not a {kind.__name__}")
    return data


def complete_rows(path: Path) -> List[Dict[str, Any]]:
    """The complete rows of a ``metrics.jsonl`` (:func:`metrics_rows`)."""
    return [row for _, row in metrics_rows(path)]


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path``'s text in one step (a temporary file beside it, then a rename): a kill mid-write leaves
    the old file, never a torn one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _finite(v: Any, bad: List[str], key: str) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        bad.append(f"{key}={v}")
        return None
    if isinstance(v, dict):
        return {k: _finite(x, bad, f"{key}.{k}" if key else str(k)) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x, bad, f"{key}[{i}]") for i, x in enumerate(v)]
    return v


def metrics_line(row: Dict[str, Any], say: Any = print) -> str:
    """``row`` as one line of strict JSON: a NaN or infinite value is written as ``null``, with a warning."""
    bad: List[str] = []
    clean = _finite(row, bad, "")
    if bad:
        say(f"warning: epoch {row.get('epoch')}: {', '.join(bad)} is not finite; written as null in metrics.jsonl")
    return json.dumps(clean, allow_nan=False)


def yaml_dump(d: Dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(d, sort_keys=False)
