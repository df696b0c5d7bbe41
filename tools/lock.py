"""Regenerate constraints.txt: the versions pip resolves today for visattn's [dev,docs] extras, less the
PyTorch stack (installed first by the Makefile as a matched pair, platform by platform).

    .venv/bin/python tools/lock.py        # or: make lock

Resolves with ``pip install --dry-run --ignore-installed --report`` (nothing is installed), then writes the
pins sorted by name. Run the tests on the new set (``make clean test``) before committing it.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UNLOCKED = re.compile(r"^(torch|torchvision|triton|nvidia-.*|cuda-.*|visattn)$", re.I)
HEADER = """# The versions CI tested, for every package visattn's [dev,docs] extras pull in except the PyTorch stack
# (torch, torchvision and their CUDA/triton wheels are installed first, as a matched pair, by the Makefile).
# make installs with -c constraints.txt; regenerate with: make lock
"""


def resolve() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed", "--report",
                        str(report), "-e", f"{ROOT}[dev,docs]"], check=True, cwd=ROOT)
        return {i["metadata"]["name"]: i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}


def main() -> None:
    pins = {n: v for n, v in resolve().items() if not UNLOCKED.match(n)}
    lines = [f"{n}=={pins[n]}" for n in sorted(pins, key=str.lower)]
    (ROOT / "constraints.txt").write_text(HEADER + "\n".join(lines) + "\n")
    print(f"constraints.txt: {len(lines)} pins")


if __name__ == "__main__":
    main()
