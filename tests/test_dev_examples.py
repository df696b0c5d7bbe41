"""docs/development.md's worked examples run as written (issue 89, item 4): each section's Python code block
is taken from the Markdown and executed in a fresh interpreter (a block it registers stays out of this one)."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "development.md"


def code_of(section: str) -> str:
    """The Python code blocks of the ``## <section>`` of docs/development.md, joined."""
    text = DOC.read_text()
    head = f"## {section}\n"
    assert head in text, f"docs/development.md has no section {section!r}"
    body = text.split(head, 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", body, flags=re.S)
    assert blocks, f"section {section!r} has no python code block"
    return "\n".join(blocks)


@pytest.mark.parametrize("section", ["Worked example: a new block (one file)",
                                     "Worked example: a new map card (one class)"])
def test_worked_example_runs(section):
    code = code_of(section) + "\nprint('EXAMPLE OK')\n"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0 and "EXAMPLE OK" in done.stdout, done.stderr[-3000:]
