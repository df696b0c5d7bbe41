"""What every bench script shares: the parser with the common flags, the provenance stamp of a results file, the
interleaved timing harness and the splice that writes a table into a docs page.

* :func:`parser`: the project's one-line-error parser (:class:`visattn.options.ArgumentParser`) with the flags a
  script asks for (``--threads``, ``--precision``, ``--batch``, ``--repeats``, ``--out``), each checked after
  parsing (a count below 1 is one line, exit 2) and ``--threads`` applied.
* :func:`provenance`: ``{"command", "git", "date", "torch", "cpu", "kernels", "precision"}``, the keys every
  ``bench/results`` file records beside its rows, so each file says what made it and on what.
* :func:`interleaved`: time callables in turn, ``repeats`` rounds of each (CUDA synchronised), so a load that
  comes and goes falls on every variant alike; the ratio of two medians is the figure to quote.
* :func:`splice`: replace the text between a docs page's two marker comments, atomically, or one line naming the
  page if a marker is missing.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from visattn.errors import ConfigError  # noqa: E402
from visattn.options import ArgumentParser, describe  # noqa: E402

__all__ = ["ROOT", "cpu_name", "interleaved", "kernels", "parser", "provenance", "splice"]


class BenchParser(ArgumentParser):
    """:class:`ArgumentParser` that checks the common count flags and applies ``--threads`` after parsing."""

    counts = ("threads", "batch", "repeats")

    def parse_args(self, args: Optional[Sequence[str]] = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        ns = super().parse_args(args, namespace)
        for name in self.counts:
            value = getattr(ns, name, None)
            if value is not None and value < 1:
                raise ConfigError(f"--{name} must be at least 1, got {value}")
        if getattr(ns, "threads", None):
            import torch

            torch.set_num_threads(ns.threads)
        return ns


def parser(doc: str, *, threads: bool = False, precision: bool = False, batch: Optional[int] = None,
           repeats: Optional[int] = None, out: Optional[str] = None) -> BenchParser:
    """The parser of a bench script whose module docstring is ``doc``, with the common flags asked for (their
    defaults given here; ``threads``: torch's own unless set; ``precision``: the config's unless set)."""
    ap = BenchParser(description=describe(doc), formatter_class=argparse.RawDescriptionHelpFormatter)
    if threads:
        ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    if precision:
        ap.add_argument("--precision", default=None, choices=["bf16", "fp16", "fp32"],
                        help="instead of the config's precision")
    if batch is not None:
        ap.add_argument("--batch", type=int, default=batch, help=f"images a step (default {batch})")
    if repeats is not None:
        ap.add_argument("--repeats", type=int, default=repeats, help=f"timed rounds of each variant (default {repeats})")
    if out is not None:
        ap.add_argument("--out", default=out, help="the results file written")
    return ap


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def kernels(device: str = "auto") -> str:
    """The family of kernels a run here computes with: the CUDA device's name, else the CPU's best of ``amx``,
    ``avx512_bf16``, ``avx512``, ``avx2``, else ``cpu``. Runs pair only within one family."""
    import torch

    from visattn import options

    dev = options.resolve_device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    for probe, name in (("amx_tile", "amx"), ("avx512_bf16", "avx512_bf16"), ("avx512", "avx512"), ("avx2", "avx2")):
        check = getattr(torch.cpu, f"_is_{probe}_supported", None)
        if check is not None and check():
            return name
    return "cpu"


def provenance(precision: Optional[str] = None, device: str = "auto") -> Dict[str, Any]:
    """The stamp a results file carries: the command that made it (from the repository root), the git revision
    (``-dirty`` with uncommitted changes), the UTC date, torch's version, the CPU, the kernel family and the
    precision (``None``: each row says its own)."""
    import torch

    from visattn.rundir import git_revision

    argv = [os.path.relpath(sys.argv[0], ROOT) if sys.argv and sys.argv[0].endswith(".py") else "python"] + sys.argv[1:]
    command = "python " + shlex.join(argv) if argv[0].endswith(".py") else shlex.join(sys.argv)
    return {"command": command, "git": git_revision(), "date": datetime.datetime.now(datetime.timezone.utc)
            .strftime("%Y-%m-%dT%H:%M:%SZ"), "torch": torch.__version__, "cpu": cpu_name(), "kernels": kernels(device),
            "precision": precision}


def interleaved(variants: Mapping[str, Callable[[], Any]], repeats: int, warmup: int = 1,
                sync: Optional[Callable[[], None]] = None) -> Dict[str, List[float]]:
    """Seconds of each call of each variant: ``warmup`` untimed calls each, then ``repeats`` rounds that call
    every variant once in turn. ``sync`` (default: CUDA's synchronize where CUDA is up) runs before each clock
    read, so queued GPU work is counted."""
    import torch

    if sync is None and torch.cuda.is_available() and torch.cuda.is_initialized():
        sync = torch.cuda.synchronize
    sync = sync or (lambda: None)
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    times: Dict[str, List[float]] = {k: [] for k in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t0)
    return times


def ratio(times: Mapping[str, List[float]], name: str, baseline: str) -> float:
    """Speed of ``name`` against ``baseline`` (above 1: faster), from the medians of their calls."""
    return statistics.median(times[baseline]) / statistics.median(times[name])


def splice(doc: Path, begin: str, end: str, text: str) -> None:
    """Write ``text`` between the markers ``begin`` and ``end`` of ``doc`` (atomically); a page without both is
    one ConfigError line naming it, the page untouched."""
    from visattn.rundir import write_atomic

    page = doc.read_text()
    if begin not in page or end not in page:
        raise ConfigError(f"{doc}: the table's markers are missing ({begin})")
    head, rest = page.split(begin, 1)
    write_atomic(doc, f"{head}{begin}\n{text}\n{end}{rest.split(end, 1)[1]}")
