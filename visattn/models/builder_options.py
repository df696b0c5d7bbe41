"""The options of a timm or torchvision builder (``model.kwargs``), typed and ranged before anything is built.

A package's model is made in two steps: the builder function registered under its name (timm's
``mobilenetv3_small_050``, torchvision's ``mobilenet_v3_small``), and the helpers it hands ``**kwargs`` to
(timm's ``_gen_mobilenet_v3`` takes ``depth_multiplier``, torchvision's ``_mobilenet_v3_conf`` takes
``width_mult`` and ``reduced_tail``), consume some options; the class built takes the rest. An option is checked
against the first of these signatures that names it (:func:`option_params`: the functions reached from the
builder through a ``**kwargs`` call, then the class): its annotation, else its default's type (a bool is never a
number, a string never a bool or a number, a list item by item). Whatever its signature, an option is ranged by
its name (:data:`RANGES`): a probability (dropout, drop path, stochastic depth: Srivastava et al. 2014,
"Dropout", JMLR 15; Huang et al. 2016, "Deep Networks with Stochastic Depth", arXiv 1603.09382) lies in [0, 1),
a width or depth multiplier (Howard et al. 2019, "Searching for MobileNetV3", arXiv 1905.02244; Tan & Le 2019,
"EfficientNet", arXiv 1905.11946) is above 0, a BatchNorm momentum (Ioffe & Szegedy 2015, arXiv 1502.03167) in
(0, 1], a ratio at least 0, and a count (depth, heads, widths, channels, patch and image sizes) at least 1.
Every refusal is a one-line ValueError naming ``model.kwargs.<key>``.
"""
from __future__ import annotations

import ast
import collections.abc
import functools
import inspect
import math
import re
import textwrap
import typing
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from torch import nn

from ..own_options import shown

PACKAGE_MODULES = {"timm": "timm.", "torchvision": "torchvision."}


def package_model(package: str, arch: str, num_classes: int, kwargs: Dict[str, Any]) -> nn.Module:
    """``package``'s model ``arch`` with ``num_classes`` and ``kwargs``, no weights (nothing is downloaded)."""
    if package == "timm":
        import timm

        return timm.create_model(arch, pretrained=False, num_classes=num_classes, **kwargs)
    import torchvision.models as tvm

    return tvm.get_model(arch, weights=None, num_classes=num_classes, **kwargs)


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)




# ---- where the options are consumed ----------------------------------------------------------------------


def _entry(package: str, arch: str) -> Optional[Callable[..., Any]]:
    try:
        if package == "timm":
            import timm.models as tm

            return tm.model_entrypoint(arch.partition(".")[0])
        import torchvision.models as tvm

        return tvm.get_model_builder(arch)
    except Exception:  # noqa: BLE001 - an unknown name is resolve()'s to report
        return None


def _splat_callees(fn: Callable[..., Any], package: str) -> List[Callable[..., Any]]:
    """The package's functions that ``fn`` calls with a ``**`` argument (where its ``**kwargs`` go on to)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and any(k.arg is None for k in node.keywords):
            callee = getattr(fn, "__globals__", {}).get(node.func.id)
            if inspect.isfunction(callee) and callee.__module__.startswith(PACKAGE_MODULES[package]):
                out.append(inspect.unwrap(callee))
    return out


def builder_functions(package: str, arch: str, depth: int = 3) -> List[Callable[..., Any]]:
    """The builder function registered for ``arch`` and the package functions its ``**kwargs`` reach, outermost
    first (``depth`` calls deep)."""
    entry = _entry(package, arch)
    if entry is None:
        return []
    found, level = [inspect.unwrap(entry)], [inspect.unwrap(entry)]
    for _ in range(depth):
        level = [c for f in level for c in _splat_callees(f, package) if c not in found]
        found += level
    return found


def _params_of(fn: Callable[..., Any]) -> List[Tuple[str, Any, Any]]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - an annotation that does not resolve: its default's type is used
        hints = {}
    out = []
    for p in sig.parameters.values():
        if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name not in ("self", "cls"):
            annotation = hints.get(p.name, p.annotation)
            out.append((p.name, inspect.Parameter.empty if isinstance(annotation, str) else annotation, p.default))
    return out


@functools.lru_cache(maxsize=64)
def option_params(package: str, arch: str) -> Tuple[Tuple[str, Any, Any], ...]:
    """(name, annotation, default) of every keyword option of the builder functions (:func:`builder_functions`)
    and then of the class built (found by building it once with no options on the meta device), the first
    signature naming an option giving its type; () where nothing can be read."""
    sources = builder_functions(package, arch)
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sources.append(type(package_model(package, arch, 10, {})).__init__)
    except Exception:  # noqa: BLE001 - a builder that cannot run on the meta device: the functions' types only
        pass
    seen: Dict[str, Tuple[str, Any, Any]] = {}
    for fn in sources:
        for name, annotation, default in _params_of(fn):
            if name not in seen or (seen[name][1] is inspect.Parameter.empty and seen[name][2] is inspect.Parameter.empty):
                seen[name] = (name, annotation, default)
    return tuple(seen.values())


# ---- types -----------------------------------------------------------------------------------------------


Misfit = Optional[Tuple[str, str, Any]]  # (where under the key: "" or "[i]", what it must be, the value there)


def _misfit(annotation: Any, value: Any) -> Misfit:
    """Why ``value`` is not of ``annotation``'s type (None where it is, or where the annotation says nothing a
    config value could be checked against: a callable, a module class): a bool is never a number, a string
    never a bool or a number, a list's items are checked one by one."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is inspect.Parameter.empty or annotation is Any:
        return None
    if origin is Union or type(annotation).__name__ == "UnionType":
        if value is None and type(None) in args:
            return None
        whys = [_misfit(a, value) for a in args if a is not type(None)]
        return None if not whys or not all(whys) else whys[0]
    if origin is typing.Literal:
        ok = any(value == a and type(value) is type(a) for a in args)
        return None if ok else ("", "must be one of " + ", ".join(map(repr, args)), value)
    simple = {bool: (lambda v: isinstance(v, bool), "must be true or false"),
              int: (lambda v: isinstance(v, int) and not isinstance(v, bool), "must be an integer"),
              float: (is_number, "must be a number"), str: (lambda v: isinstance(v, str), "must be a string")}
    if annotation in simple:
        fits, must = simple[annotation]
        return None if fits(value) else ("", must, value)
    if origin in (list, tuple, collections.abc.Sequence):
        if not isinstance(value, (list, tuple)):
            return ("", "must be a list", value)
        each = args[:1] if (origin is not tuple or (len(args) == 2 and args[1] is Ellipsis)) else args
        if origin is tuple and args and args[-1] is not Ellipsis and len(args) != len(value):
            return ("", f"must be a list of {len(args)} values", value)
        for i, v in enumerate(value):
            why = _misfit(each[min(i, len(each) - 1)], v) if each else None
            if why:
                return (f"[{i}]{why[0]}", why[1], why[2])
        return None
    if origin in (dict, collections.abc.Mapping) or annotation is dict:
        return None if isinstance(value, dict) else ("", "must be a mapping", value)
    return None


def _by_default(default: Any) -> Any:
    """The type an unannotated option takes, from its default (bool, int, float, or a list of ints)."""
    if isinstance(default, bool):
        return bool
    if isinstance(default, (int, float)):
        return float if isinstance(default, float) else int
    if isinstance(default, (list, tuple)) and default and all(is_number(v) for v in default):
        return Tuple[float if any(isinstance(v, float) for v in default) else int, ...]
    return inspect.Parameter.empty


def _type_text(annotation: Any) -> str:
    text = annotation.__name__ if isinstance(annotation, type) else str(annotation)
    return text.replace("typing.", "")


# ---- ranges ----------------------------------------------------------------------------------------------


# by the option's name: (pattern, low, high, low allowed, high allowed, what it is, integers only)
RANGES = (
    (re.compile(r"drop|_prob$|^prob$|^stochastic_depth"), 0.0, 1.0, True, False, "a probability: 1 drops everything", False),
    (re.compile(r"mult$|multiplier|_mult_|^mult_"), 0.0, math.inf, False, False, "a multiplier of widths or depths", False),
    (re.compile(r"momentum"), 0.0, 1.0, False, True, "a BatchNorm momentum: at 0 the statistics never move", False),
    (re.compile(r"ratio$"), 0.0, math.inf, True, False, "a ratio", False),
    (re.compile(r"^(depths?|num_heads|heads|embed_dims?|dims|patch_size|img_size|in_chans|channels|layers|widths?|"
                r"stem_width|num_features|hidden_dim|mlp_dim|head_dim|\w+_chs|\w+_channels)$"),
     1, math.inf, True, False, "a count or size", True),
)
RATE_LIKE = RANGES[0][0]


def check_range(where: str, key: str, value: Any) -> None:
    """``value`` (or each number of a list of them) within the range :data:`RANGES` gives ``key``'s name; a
    probability is never a bool or a string."""
    for pattern, lo, hi, lo_in, hi_in, what, ints in RANGES:
        if not pattern.search(key) or value is None:
            continue
        items = list(enumerate(value)) if isinstance(value, (list, tuple)) else [(None, value)]
        for i, v in items:
            at = where if i is None else f"{where}[{i}]"
            if pattern is RATE_LIKE and isinstance(v, (bool, str)):
                raise ValueError(f"{at} is a probability: it must be a number in [0, 1), not {shown(v)}"
                                 + (" (true would be taken as 1.0)" if v is True else ""))
            if not is_number(v) or (ints and not isinstance(v, int)) or not math.isfinite(v):
                continue  # the type check names these
            if not ((lo <= v if lo_in else lo < v) and (v <= hi if hi_in else v < hi)):
                span = f"at least {lo:g}" if hi == math.inf and lo_in else f"above {lo:g}" if hi == math.inf else \
                    f"in {'[' if lo_in else '('}{lo:g}, {hi:g}{']' if hi_in else ')'}"
                raise ValueError(f"option {at.removeprefix('model.')} must be {span}, got {v} ({what})")
        return


def check_kwargs(package: str, arch: str, kwargs: Dict[str, Any]) -> None:
    """Every key of ``model.kwargs`` against the type the first signature naming it gives it
    (:func:`option_params`: its annotation, else its default's: a bool where a number belongs is refused, and a
    string where a bool belongs) and within the range its name gives it (:func:`check_range`); a ValueError
    naming the key."""
    params = {name: (a, d) for name, a, d in option_params(package, arch)} if kwargs else {}
    for key, value in kwargs.items():
        where = f"model.kwargs.{key}"
        if key in params:
            annotation, default = params[key]
            if annotation is inspect.Parameter.empty:
                annotation = _by_default(default)
            if value is None and default is not None and annotation in (bool, int, float):
                raise ValueError(f"{where} must be {'true or false' if annotation is bool else 'a number'}, not null")
            why = _misfit(annotation, value)
            if why:
                at, must, got = why
                kind = "a bool" if isinstance(got, bool) else f"a {type(got).__name__}"
                raise ValueError(f"{where}{at} {must}, not {shown(got)} ({kind}; {package}'s {arch} takes "
                                 f"{key}: {_type_text(annotation)})")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"option {where.removeprefix('model.')} must be a finite number, got {value}")
        check_range(where, str(key), value)
