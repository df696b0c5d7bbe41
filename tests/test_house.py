"""The house drawn from the imports: every arrow (an import anywhere in a module, function-level ones included)
points down the floors below, and no modules import each other in a circle."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "visattn"

# Floors, lowest first: a module may import its own floor's modules and the floors below, never above.
FLOORS = (
    ("visattn.errors", "visattn.registry", "visattn.options", "visattn.cpu_heap", "visattn.results", "visattn.rng",
     "visattn.signals", "visattn.own_options"),
    ("visattn.config", "visattn.cross_checks"),
    ("visattn.attention", "visattn.data"),
    ("visattn.models",),
    ("visattn.maps",),
    ("visattn.evaluate", "visattn.rundir"),
    # the run's parts around the loop: optimizer, step, distillation, hooks, checks, the HParams file
    ("visattn.optim", "visattn.step", "visattn.distill", "visattn.hooks", "visattn.run_checks", "visattn.hparams"),
    ("visattn.trainer",),
    ("visattn.visualize", "visattn.cli", "visattn"),
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def imports(name: str) -> set:
    """The visattn modules ``name`` imports (``from .x import y`` counts as x.y where x.y is a module)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")
            mod = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else (node.module or "")
            for a in node.names:
                out.add(f"{mod}.{a.name}" if f"{mod}.{a.name}" in MODULES else mod)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m in MODULES and m != name}


def floor(name: str) -> int:
    best = [(len(p), i) for i, f in enumerate(FLOORS) for p in f
            if name == p or (p != "visattn" and name.startswith(p + "."))]
    assert best, f"{name} is on no floor of the house: add it to FLOORS"
    return max(best)[1]


def test_every_module_is_on_a_floor():
    for name in MODULES:
        floor(name)


def test_no_arrow_points_up():
    up = [f"{a} (floor {floor(a)}) -> {b} (floor {floor(b)})" for a in MODULES for b in imports(a)
          if floor(b) > floor(a) and not b.startswith(a + ".")]  # a package may import its own modules
    assert not up, "imports that point up the house:\n" + "\n".join(up)


def test_no_circles():
    graph = {a: {b for b in imports(a) if not b.startswith(a + ".") and not a.startswith(b + ".")} for a in MODULES}
    state, circles = {}, []

    def visit(a: str, stack: list) -> None:
        state[a] = "open"
        for b in sorted(graph[a]):
            if state.get(b) == "open":
                circles.append(" -> ".join(stack[stack.index(b):] + [b]))
            elif b not in state:
                visit(b, stack + [b])
        state[a] = "done"

    for a in sorted(graph):
        if a not in state:
            visit(a, [a])
    assert not circles, "modules that import each other in a circle:\n" + "\n".join(circles)
