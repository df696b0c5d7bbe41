"""Random state and determinism: seeding every generator a run draws from, torch's deterministic-algorithm
settings kept as a caller had them, and the generators' state as plain data a ``weights_only`` checkpoint holds
(so a resumed run draws what an unstopped one would). Python's ``random``, NumPy's legacy global generator
(the Mersenne Twister, Matsumoto & Nishimura 1998), torch's CPU and CUDA generators.
"""
from __future__ import annotations

import os
import random
from contextlib import contextmanager
from typing import Any, Dict, Iterator

import numpy as np
import torch


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


@contextmanager
def kept_determinism() -> Iterator[None]:
    """Torch's deterministic-algorithm and cuDNN settings as they were on entry, put back on exit: a run with
    ``deterministic=true`` called from a user's program leaves that program's settings as it found them."""
    flags = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(flags[0], warn_only=flags[1])
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = flags[2], flags[3]


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
