"""Where a CPU run's tensors get their memory: config ``cpu_heap``.

A training step on a CPU allocates and frees the same large tensors every step (activations, their gradients,
attention scores). glibc's ``malloc`` serves each request of 128 KiB or more (the threshold grows with use, to 32
MiB at most) with a fresh ``mmap`` and gives it back to the system when freed, so every step pays the kernel to
fault in and zero those pages again.

``cpu_heap: keep`` (the default) tells glibc to serve every request from its heap and to keep freed memory there
for the next step (``mallopt``: no ``mmap`` chunks, no trimming). The process holds on to its peak footprint instead
of returning it between steps. ``cpu_heap: system`` leaves glibc's settings as they are. Where the C library is not
glibc (macOS, Windows, musl) there is nothing to set and ``keep`` does nothing. ``python -m bench.cpu_heap``
measures what it gives.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import platform
from typing import Optional

__all__ = ["keep_freed_memory", "system_defaults", "HEAP_MODES"]

HEAP_MODES = ("keep", "system")

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4
_INT_MAX = 2**31 - 1
# glibc's starting values (malloc/malloc.c: DEFAULT_TRIM_THRESHOLD, DEFAULT_MMAP_THRESHOLD, DEFAULT_MMAP_MAX)
SYSTEM = {M_TRIM_THRESHOLD: 128 * 1024, M_MMAP_THRESHOLD: 128 * 1024, M_MMAP_MAX: 65536}
KEEP = {M_MMAP_MAX: 0, M_TRIM_THRESHOLD: _INT_MAX}


def _glibc() -> Optional[ctypes.CDLL]:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") else None


def _set(values: dict) -> bool:
    libc = _glibc()
    if libc is None:
        return False
    return all(libc.mallopt(ctypes.c_int(k), ctypes.c_int(v)) == 1 for k, v in values.items())


def keep_freed_memory() -> bool:
    """Serve every allocation from glibc's heap and keep what is freed for reuse (``cpu_heap: keep``). True where it
    was set (glibc on Linux); False where there is no glibc to set it on. Process-wide, and inherited by the data
    loader's forked workers."""
    return _set(KEEP)


def system_defaults() -> bool:
    """glibc's starting settings again (``mmap`` for 128 KiB and more, trimming at 128 KiB), and the heap's free top
    given back. Once any setting is made glibc no longer raises its ``mmap`` threshold with use, so this is the
    starting point, not the drift a long process would show. For benchmarks that compare both in one process."""
    libc = _glibc()
    if libc is None or not _set(SYSTEM):
        return False
    libc.malloc_trim(ctypes.c_size_t(0))
    return True


def apply(mode: str) -> bool:
    """The config's ``cpu_heap``: ``keep`` sets :func:`keep_freed_memory`; ``system`` changes nothing."""
    if mode not in HEAP_MODES:
        raise ValueError(f"cpu_heap: unknown mode {mode!r}; valid: {', '.join(HEAP_MODES)}")
    return keep_freed_memory() if mode == "keep" else False
