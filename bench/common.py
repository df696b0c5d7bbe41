"""What every bench script shares: the parser with the common flags, the provenance stamp of a results file, the
interleaved timing harness and the splice that writes a table into a docs page.

Every script runs from the repository root as a module, ``python -m bench.NAME ARGS``, and imports what it shares
as ``from bench.common import ...`` (no script edits ``sys.path``).

* :func:`parser`: the project's one-line-error parser (:class:`visattn.options.ArgumentParser`) with the flags a
  script asks for (``--threads``, ``--precision``, ``--batch``/``--batch-size``, ``--repeats``, ``--warmup``,
  ``--device``, ``--out``), each count checked after parsing (a count below 1, a ``--warmup`` below 0: one line,
  exit 2) and ``--threads`` applied; :func:`mode` adds a mode (``python -m bench.speed flops``) with its own
  common flags. The script adds its own flags to the parser returned.
* :func:`provenance`: ``{"command", "git", "date", "torch", "cpu", "kernels", "precision"}``, the keys every
  ``bench/results`` file records beside its rows, so each file says what made it and on what; :func:`command` is
  the command alone (``python -m bench.NAME ARGS``).
* :func:`interleaved`: time callables in turn, ``repeats`` rounds of each (CUDA synchronised; the order reversed
  every other round), after timed warm-up calls, so a load that comes and goes falls on every variant alike; the
  ratio of two medians (:func:`ratio`) is the figure to quote.
* :func:`splice`: replace the text between a docs page's two marker comments, atomically, or one line naming the
  page if a marker is missing.
* :func:`read_results`: a results file as a script reads it, its top-level keys and its rows checked against the
  kinds the script reads (:func:`visattn.results.check_rows`), and :func:`revision`: the commit a revision flag
  names. A file that is not what the script expects (a list for a mapping, a folder, a row without its keys) or a
  flag that names no commit is one line, exit 2, never a traceback or git's own message.
"""
from __future__ import annotations

import argparse
import datetime
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Hashable, List, Mapping, NamedTuple, Optional, Sequence, Union

from visattn.errors import ConfigError, DataError
from visattn.options import ArgumentParser, check_at_least, describe
from visattn.results import cpu_name

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
PRECISIONS = ("bf16", "fp16", "fp32")

__all__ = ["ROOT", "Timed", "command", "cpu_name", "interleaved", "kernels", "mode", "parser", "provenance", "ratio",
           "splice"]


class BenchParser(ArgumentParser):
    """:class:`ArgumentParser` that checks the common count flags and applies ``--threads`` after parsing."""

    counts = {"threads": 1, "batch": 1, "repeats": 1, "warmup": 0}  # flag -> its least value

    def parse_args(self, args: Optional[Sequence[str]] = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        ns = super().parse_args(args, namespace)
        for name, low in self.counts.items():
            check_at_least(f"--{name}", getattr(ns, name, None), low)
        if getattr(ns, "threads", None):
            import torch

            torch.set_num_threads(ns.threads)
        return ns


Flag = Union[None, bool, int, str, Path]  # None / False: no such flag; True: the flag, its default None; else its default


def parser(doc: str, *, prog: Optional[str] = None, **flags: Any) -> BenchParser:
    """The parser of a bench script whose module docstring is ``doc``, with the common flags asked for
    (:func:`add_flags`); the script adds its own to it."""
    ap = BenchParser(prog=prog, description=describe(doc), formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(ap, **flags)
    return ap


def mode(modes: Any, name: str, doc: str, **flags: Any) -> argparse.ArgumentParser:
    """A mode of a script with modes (``modes``: the script parser's ``add_subparsers()``), described by ``doc``
    (its first paragraph), with the common flags asked for (:func:`add_flags`)."""
    sub = modes.add_parser(name, help=describe(doc), description=describe(doc),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(sub, **flags)
    return sub


def add_flags(ap: argparse.ArgumentParser, *, threads: bool = False, precision: Flag = None,
              precisions: Sequence[str] = PRECISIONS, batch: Flag = None, repeats: Optional[int] = None,
              warmup: Optional[int] = None, device: Optional[str] = None, out: Flag = None,
              help: Optional[Mapping[str, str]] = None, aliases: Optional[Mapping[str, Sequence[str]]] = None) -> None:
    """Add the common flags asked for, each spelled and checked the same in every script:

    ``--threads`` (torch's own unless set); ``--precision`` (``True``: the config's unless set, else the default
    named, one of ``precisions``); ``--batch``, also spelled ``--batch-size`` (``True``: the config's unless set,
    else the default); ``--repeats`` and ``--warmup`` (the timing harness's rounds and untimed calls, defaults
    given); ``--device`` (default given); ``--out`` (the results file written; ``True``: none unless set).
    ``help`` replaces a flag's help text (by name), ``aliases`` adds other spellings of a flag (by name)."""
    def given(value: Flag) -> Any:
        return None if value is True else value

    specs: List[tuple] = []
    if threads:
        specs.append(("threads", ["--threads"], dict(type=int, default=None), "torch threads (default: torch's own)"))
    if precision not in (None, False):
        specs.append(("precision", ["--precision"], dict(default=given(precision), choices=list(precisions)),
                      "instead of the config's precision" if precision is True else "autocast precision (default: %(default)s)"))
    if batch not in (None, False):
        specs.append(("batch", ["--batch", "--batch-size"], dict(type=int, default=given(batch)),
                      "images a step (default: the config's)" if batch is True else "images a step (default: %(default)s)"))
    if repeats is not None:
        specs.append(("repeats", ["--repeats"], dict(type=int, default=repeats),
                      "timed rounds of each variant, interleaved (medians; default: %(default)s)"))
    if warmup is not None:
        specs.append(("warmup", ["--warmup"], dict(type=int, default=warmup),
                      "untimed calls of each variant first (compilation, caches; default: %(default)s)"))
    if device is not None:
        specs.append(("device", ["--device"], dict(default=device), "cpu, cuda (cuda:N) or auto (default: %(default)s)"))
    if out not in (None, False):
        specs.append(("out", ["--out"], dict(type=Path, default=given(out)),
                      "also write the results here" if out is True else "the results file written (default: %(default)s)"))
    for name, spellings, kwargs, text in specs:
        ap.add_argument(*spellings, *(aliases or {}).get(name, ()), dest=name, help=(help or {}).get(name, text), **kwargs)


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


def command(argv: Optional[Sequence[str]] = None, script: Optional[str] = None) -> str:
    """The command that runs this process again from the repository root: ``python -m bench.NAME ARGS`` for a bench
    script (run as a module, its ``sys.argv[0]`` is its file's path), ``python PATH ARGS`` for another ``.py`` file,
    else the command line as it was (a test runner's). ``argv``: the arguments (default ``sys.argv[1:]``);
    ``script``: the script's file (default ``sys.argv[0]``), for a ``main(argv)`` called in-process."""
    script = (sys.argv[0] if sys.argv else "python") if script is None else str(script)
    args = list(sys.argv[1:] if argv is None else argv)
    if not script.endswith(".py"):
        return shlex.join([script, *args])
    path = Path(script).resolve()
    if path.parent == BENCH:
        return shlex.join(["python", "-m", f"bench.{path.stem}", *args])
    return shlex.join(["python", os.path.relpath(path, ROOT), *args])


def provenance(precision: Optional[str] = None, device: str = "auto") -> Dict[str, Any]:
    """The stamp a results file carries: the command that made it (:func:`command`), the git revision
    (``-dirty`` with uncommitted changes), the UTC date, torch's version, the CPU, the kernel family and the
    precision (``None``: each row says its own)."""
    import torch

    from visattn.results import git_revision

    return {"command": command(), "git": git_revision(), "date": datetime.datetime.now(datetime.timezone.utc)
            .strftime("%Y-%m-%dT%H:%M:%SZ"), "torch": torch.__version__, "cpu": cpu_name(), "kernels": kernels(device),
            "precision": precision}


class Timed(NamedTuple):
    """What :func:`interleaved` measured: each timed call's seconds, and each variant's warm-up seconds."""

    seconds: Dict[Hashable, List[float]]
    warmup: Dict[Hashable, float]


def interleaved(variants: Mapping[Hashable, Callable[[], Any]], repeats: int, warmup: int = 1,
                sync: Optional[Callable[[], None]] = None, *, alternate: bool = True,
                warm: Optional[Mapping[Hashable, Callable[[], Any]]] = None) -> Timed:
    """Seconds of each call of each variant: ``warmup`` untimed calls each (their seconds, compilation included,
    kept apart), then ``repeats`` rounds that call every variant once in turn, the order reversed every other
    round unless not ``alternate``. ``warm``: what a variant's warm-up calls instead of the variant itself (a
    variant it lacks has none). ``sync`` (default: CUDA's synchronize where CUDA is up) runs before each clock
    read, so queued GPU work is counted."""
    import torch

    if sync is None and torch.cuda.is_available() and torch.cuda.is_initialized():
        sync = torch.cuda.synchronize
    sync = sync or (lambda: None)
    warmed: Dict[Hashable, float] = {}
    for key, fn in variants.items():
        first = fn if warm is None else warm.get(key)
        t0 = time.perf_counter()
        for _ in range(warmup if first is not None else 0):
            first()
        sync()
        warmed[key] = time.perf_counter() - t0
    order = list(variants.items())
    times: Dict[Hashable, List[float]] = {k: [] for k in variants}
    for r in range(repeats):
        for key, fn in order if r % 2 == 0 or not alternate else order[::-1]:
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[key].append(time.perf_counter() - t0)
    return Timed(times, warmed)


def ratio(times: Mapping[Hashable, List[float]], name: Hashable, baseline: Hashable) -> float:
    """Speed of ``name`` against ``baseline`` (above 1: faster), from the medians of their calls."""
    return statistics.median(times[baseline]) / statistics.median(times[name])


def splice(doc: Path, begin: str, end: str, text: str) -> bool:
    """Write ``text`` between the markers ``begin`` and ``end`` of ``doc`` (atomically; a page whose block is
    already ``text`` is left as it is); returns whether the page changed. A page without both markers (or no
    page) is one ConfigError line naming it, the page untouched."""
    from visattn.results import write_atomic

    page = Path(doc).read_text() if Path(doc).is_file() else ""
    if begin not in page or end not in page.split(begin, 1)[1]:
        raise ConfigError(f"{doc}: the table's markers are missing ({begin} ... {end})")
    head, rest = page.split(begin, 1)
    new = f"{head}{begin}\n{text}\n{end}{rest.split(end, 1)[1]}"
    if new == page:
        return False
    write_atomic(Path(doc), new)
    return True


def read_results(path: Path, head: Mapping[str, str], rows: Optional[str] = "rows",
                 row_fields: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """The JSON object of results file ``path`` when it holds ``head`` (key -> a
    :func:`visattn.results.check_rows` kind: ``str``, ``bool``, ``number``, ...; a trailing ``?``: may be absent or
    null) and, under ``rows``, a list of objects that each hold ``row_fields``; else one
    :class:`~visattn.errors.DataError` line naming the file and the key (a missing file, a folder, a list where a
    mapping belongs, a row without its keys)."""
    from visattn.results import check_rows, read_json

    data = read_json(Path(path), dict)
    try:
        check_rows(Path(path), [data], dict(head))
    except DataError as e:  # the whole file is the one "row": say so
        raise DataError(str(e).replace(f"{path}: row 1 ", f"{path}: ", 1)) from None
    if rows is not None:
        if not isinstance(data.get(rows), list):
            raise DataError(f"{path}: has no list {rows!r} (not a results file of this script?)")
        check_rows(Path(path), data[rows], dict(row_fields or {}))
    return data


def revision(flag: str, rev: str) -> str:
    """The full commit id ``rev`` names in this repository, or one :class:`~visattn.errors.ConfigError` line naming
    ``flag``: a string that starts with ``-`` (git would read it as an option), or one that names no commit (a
    path, a tree or file id, a typo) is refused before git runs on it as a revision."""
    if not isinstance(rev, str) or not rev or rev.startswith("-") or any(c.isspace() or c == "\0" for c in rev):
        raise ConfigError(f"{flag} {rev!r}: not a revision of this repository")
    got = subprocess.run(["git", "rev-parse", "--verify", "--quiet", "--end-of-options", f"{rev}^{{commit}}"],
                         cwd=ROOT, capture_output=True, text=True)
    if got.returncode or not got.stdout.strip():
        raise ConfigError(f"{flag} {rev!r}: not a revision of this repository")
    return got.stdout.strip()
