"""Results files and where they were made: the helpers bench scripts, examples and the run folder share.

:func:`read_json` and :func:`check_rows` read a results file or refuse it in one line (a damaged row is never
read as something else), :func:`write_atomic` replaces one in a single step, and :func:`cpu_name`,
:func:`git_revision` and :func:`versions` say on what machine, at what revision and with what packages it was
made.
"""
from __future__ import annotations

import json
import math
import os
import platform
import subprocess
from pathlib import Path
from typing import Any, Callable, Dict, List

import numpy as np
import torch

from .errors import DataError

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


def _row_value_fits(kind: str, v: Any) -> bool:
    number = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)  # a bool is not a number
    return {"str": isinstance(v, str), "bool": isinstance(v, bool), "number": number,
            "int": number and isinstance(v, int), "dict": isinstance(v, dict), "list": isinstance(v, list),
            "interval": isinstance(v, list) and len(v) == 3 and all(_row_value_fits("number", x) for x in v)}[kind]


_KIND_SAID = {"str": "a string", "bool": "true or false", "number": "a finite number", "int": "an integer",
              "dict": "an object", "list": "a list", "interval": "[mean, lo, hi] of finite numbers"}
def check_rows(path: Path, rows: Any, fields: Dict[str, str], only: Callable[[Dict[str, Any]], bool] = lambda r: True
               ) -> List[Dict[str, Any]]:
    """``rows`` (a results file's list of rows) when every row is a JSON object that holds ``fields`` (dotted key
    -> ``str``, ``bool``, ``number``, ``int``, ``dict``, ``list`` or ``interval``; a trailing ``?``: may be absent or
    null), for the rows ``only`` picks; else one :class:`DataError` line naming the file, the row and the key. A
    bool is never a number and NaN never a result: a report never reads a damaged row as something else."""
    if not isinstance(rows, list):
        raise DataError(f"{path}: holds no list of rows")
    for i, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise DataError(f"{path}: row {i} is a JSON {type(row).__name__}, not an object")
        if not only(row):
            continue
        for key, kind in fields.items():
            v: Any = row
            for part in key.split("."):
                v = v.get(part) if isinstance(v, dict) else None
            if v is None and kind.endswith("?"):
                continue
            if v is None or not _row_value_fits(kind.rstrip("?"), v):
                got = "has no" if v is None else f"has {_said(v)} as its"
                raise DataError(f"{path}: row {i} {got} {key!r}, which must be {_KIND_SAID[kind.rstrip('?')]} (a damaged "
                                "or foreign results file?)")
    return rows


def _said(v: Any) -> str:
    text = json.dumps(v) if isinstance(v, (bool, int, float, str)) else type(v).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path``'s text in one step (a temporary file beside it, then a rename): a kill mid-write leaves
    the old file, never a torn one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` says: what results files record."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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
    from importlib import metadata

    import timm
    import torchvision

    try:
        own = metadata.version("visattn")
    except metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
        own = "unknown"
    return {"visattn": own, "torch": str(torch.__version__), "torchvision": str(torchvision.__version__),
            "timm": str(timm.__version__), "python": platform.python_version(), "numpy": str(np.__version__)}
