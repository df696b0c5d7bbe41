"""Stopping on a signal: SIGTERM/SIGINT set a :class:`StopFlag` (:func:`graceful_signals`); the loop finishes the
current step, saves, and raises :class:`Interrupted`, whose ``exit_code`` is 128 + the signal number (the
shell's convention: 143 for SIGTERM)."""
from __future__ import annotations

import signal
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional


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
