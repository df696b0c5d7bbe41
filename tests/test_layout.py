"""The house rules a newcomer relies on, checked: short functions, no reaching into other modules' privates,
a leaf config, an evaluate that does not need the trainer."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "visattn"
SOURCES = sorted(PKG.rglob("*.py"))
MAX_LINES = 80


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = _module_name(path).split(".")
    if path.name != "__init__.py":
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _visattn_imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ImportFrom):
            mod = _resolve(path, node)
            if mod.startswith("visattn"):
                out.add(mod)
                out.update(f"{mod}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("visattn"))
    return out


@pytest.mark.parametrize("path", SOURCES, ids=[str(p.relative_to(PKG)) for p in SOURCES])
def test_functions_fit_on_a_screen(path):
    long = [f"{n.name} ({n.end_lineno - n.lineno + 1} lines, line {n.lineno})"
            for n in ast.walk(_tree(path)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.end_lineno - n.lineno + 1 > MAX_LINES]
    assert not long, f"functions longer than {MAX_LINES} lines: {long}"


@pytest.mark.parametrize("path", SOURCES, ids=[str(p.relative_to(PKG)) for p in SOURCES])
def test_no_private_names_from_other_modules(path):
    bad = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ImportFrom):
            mod = _resolve(path, node)
            if mod.startswith("visattn") and mod != _module_name(path):
                bad += [f"{mod}.{a.name}" for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    assert not bad, f"imports another module's private names: {bad}"


def test_config_is_a_leaf():
    """config.py validates through the registries' public lookups (a model's options, the attention blocks' option
    types) and imports no other part of visattn."""
    assert _visattn_imports(PKG / "config.py") <= {"visattn.errors", "visattn.errors.ConfigError", "visattn.registry",
                                                    "visattn.registry.MODELS", "visattn.registry.ATTENTION"}


def test_registry_and_errors_import_nothing_of_visattn():
    assert not _visattn_imports(PKG / "registry.py")
    assert not _visattn_imports(PKG / "errors.py")


def test_evaluate_does_not_import_the_trainer():
    assert not any(m.startswith("visattn.trainer") for m in _visattn_imports(PKG / "evaluate.py"))


def test_package_exports_are_explicit():
    for path in SOURCES:
        stars = [n for n in ast.walk(_tree(path)) if isinstance(n, ast.ImportFrom) and any(a.name == "*" for a in n.names)]
        assert not stars, f"{path.relative_to(PKG)} uses a star import"


def test_the_public_api_is_the_users_verbs_in_at_most_15_names():
    """``visattn`` exports what a user calls (blocks, models, maps, config, training, a trained model) and
    nothing else; the rest is reached through its submodule (``visattn.maps.trace_geometry``)."""
    import visattn

    assert len(visattn.__all__) <= 15 and len(set(visattn.__all__)) == len(visattn.__all__)
    assert all(callable(getattr(visattn, name)) for name in visattn.__all__)
    imported = {a.asname or a.name for n in _tree(PKG / "__init__.py").body if isinstance(n, ast.ImportFrom)
                for a in n.names}
    lazy = {"train", "load_model_from_checkpoint"}  # loaded on first use (PEP 562): both modules run as commands
    assert imported | lazy == set(visattn.__all__)  # every name imported at the top is exported, and only those
    assert visattn.load_model_from_checkpoint is __import__("visattn.evaluate").evaluate.load_model_from_checkpoint
    from visattn.maps import trace_geometry
    from visattn.trainer import run

    assert visattn.train is run and callable(trace_geometry) and not hasattr(visattn, "trace_geometry")


MAX_MODULE_LINES = 700


@pytest.mark.parametrize("path", SOURCES, ids=[str(p.relative_to(PKG)) for p in SOURCES])
def test_modules_fit_in_one_sitting(path):
    """A module is at most 700 lines, as a function is at most 80: past that it holds two concerns."""
    n = len(path.read_text().splitlines())
    assert n <= MAX_MODULE_LINES, f"{path.relative_to(PKG)} is {n} lines; the cap is {MAX_MODULE_LINES}: split it"


# torch's names a module binds (``import torch``, ``from torch import nn``, ``import torch.nn.functional as F``...)
TORCH_ROOTS = {"torch", "nn", "F", "dist"}
# what a GradScaler keeps privately: its scale, growth tracker and per-optimizer found-inf state (read through
# ``get_scale()``, ``state_dict()`` and a step's outcome instead)
SCALER_PRIVATE = {"_scale", "_growth_tracker", "_get_growth_tracker", "_init_scale", "_per_optimizer_states",
                  "_found_inf_per_device", "_unscale_grads_", "_check_scale_growth_tracker", "_lazy_init_scale_growth_tracker",
                  "_maybe_opt_step", "_enabled", "_growth_factor", "_backoff_factor", "_growth_interval"}
# private reads allowed by name (none: the norm checks read visattn.attention.functional.BATCH_NORMS and
# NORMS_WITH_STATS, torch's public classes, where they read nn.modules.batchnorm's private base classes before)
# torch's private names visattn reads, each with its reason and its fallback where a release drops it:
# the fused softmax gradient written in place (visattn.attention.self_attn2d.SOFTMAX_GRAD_INTO: no public in-place
# form; 6x faster than the public formula; without it the explicit attention runs on autograd's softmax)
KNOWN_PRIVATE: set = {"torch.ops.aten._softmax_backward_data"}


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else ""


def _private_torch_reads(path: Path) -> set:
    found = set()
    for node in ast.walk(_tree(path)):
        if not isinstance(node, ast.Attribute):
            continue
        name = _dotted(node)
        parts = name.split(".")
        if parts[0] in TORCH_ROOTS and any(p.startswith("_") and not p.startswith("__") for p in parts[1:]):
            found.add(name)
        elif node.attr in SCALER_PRIVATE and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            found.add(name or f"<expr>.{node.attr}")
    return found


@pytest.mark.parametrize("path", SOURCES, ids=[str(p.relative_to(PKG)) for p in SOURCES])
def test_no_private_attribute_of_torch_is_read(path):
    """No module reads torch's private API (``torch._foreach_lerp_``, ``nn.modules.batchnorm._BatchNorm``) or a
    GradScaler's private state (``scaler._scale``): a torch release may change either without notice."""
    bad = _private_torch_reads(path) - KNOWN_PRIVATE
    assert not bad, f"{path.relative_to(PKG)} reads torch's private API: {sorted(bad)}"


def test_the_private_attribute_check_finds_them(tmp_path):
    """The check above sees the reads it is for (so its passing means something)."""
    src = tmp_path / "m.py"
    src.write_text("import torch\nfrom torch import nn\n\ndef f(opt, x):\n    a = opt.scaler._scale.clone()\n"
                   "    torch._foreach_lerp_(x, x, 0.5)\n    return isinstance(x, nn.modules.batchnorm._BatchNorm), self._scale\n")
    assert _private_torch_reads(src) == {"opt.scaler._scale", "torch._foreach_lerp_", "nn.modules.batchnorm._BatchNorm"}
