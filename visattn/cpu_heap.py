"""Where a CPU run's tensors get their memory: config ``cpu_heap``.

A training step on a CPU allocates and frees the same large tensors every step (activations, their gradients,
attention scores). glibc's ``malloc`` serves a request above its ``mmap`` threshold (128 KiB at the start, raised
with use up to 32 MiB) with fresh pages from the kernel and returns them when the tensor is freed, so each step pays
to fault in and zero them again; the recipe's largest activations at its batch of 512 are above any threshold.

``cpu_heap: keep`` (the default) has ``train.py`` tell glibc, for a run on a CPU, to take no ``mmap`` chunks
(``M_MMAP_MAX`` 0) and to keep up to 2 GiB of free memory at the heap's top (``M_TRIM_THRESHOLD``), so the main
thread's tensors come from the heap and what a step frees serves the next one. The process holds its peak footprint
between steps instead of returning it. glibc's arenas for other threads keep their own rules (a request above 64 MiB
there is still mapped). Data-loader workers started by `fork` inherit the setting. ``cpu_heap: system`` leaves glibc alone;
where the C library is not glibc (macOS, Windows, musl) there is nothing to set. ``python -m bench.cpu_heap``
measures what it gives.
"""
from __future__ import annotations

import ctypes
import functools
import platform
from typing import Optional

__all__ = ["HEAP_MODES", "apply", "in_effect", "keep_freed_memory"]

HEAP_MODES = ("keep", "system")

# glibc's mallopt parameters (malloc.h); mallopt takes an int, so the trim threshold's most is INT_MAX (2 GiB)
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
KEEP = {M_MMAP_MAX: 0, M_TRIM_THRESHOLD: 2**31 - 1}
_state = {"keep": False}


@functools.lru_cache(maxsize=1)
def _glibc() -> Optional[ctypes.CDLL]:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") else None


def keep_freed_memory() -> bool:
    """Serve the main thread's allocations from glibc's heap and keep what is freed for reuse (``cpu_heap: keep``).
    True where it was set (glibc on Linux); False where there is no glibc to set it on. Process-wide, for the rest
    of the process's life."""
    libc = _glibc()
    if libc is None:
        return False
    done = all(libc.mallopt(ctypes.c_int(k), ctypes.c_int(v)) == 1 for k, v in KEEP.items())
    _state["keep"] = _state["keep"] or done
    return done


def in_effect() -> str:
    """``"keep"`` once this process has made the setting, else ``"system"`` (a run's ``run_info.json`` records it:
    ``trainer.run`` called from a caller's own process leaves the allocator as it found it)."""
    return "keep" if _state["keep"] else "system"


def apply(mode: str) -> bool:
    """The config's ``cpu_heap``: ``keep`` sets :func:`keep_freed_memory`; ``system`` changes nothing."""
    if mode not in HEAP_MODES:
        raise ValueError(f"cpu_heap: unknown mode {mode!r}; valid: {', '.join(HEAP_MODES)}")
    return keep_freed_memory() if mode == "keep" else False
