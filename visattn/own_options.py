"""visattn's own builder options, each with its documented values: one table (:data:`OWN_OPTIONS`) and one check
(:func:`check_own`), used wherever such an option arrives: a package model's options (``model.cifar_stem``,
``model.bn_momentum``, ``model.head_init``, ``model.attn_at``, ...; :mod:`visattn.models.foreign`), the options
of :func:`~visattn.attention.insert_attention` given in ``model.attn_kwargs`` (``replace_se``, ``rule``), and
``insert_attention`` called directly. A value outside its option's values is one ValueError line naming the option
and the values it takes: a string is never a bool (``replace_se: 'no'`` is not false, and Python would read it as
true), a bool never a number, a number never a name.

A package's own options (``model.kwargs``) are typed from its signatures instead
(:mod:`visattn.models.builder_options`); a block's options (``init``, ``rd_ratio``, ...) by the block.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, Tuple

__all__ = ["HEAD_INITS", "INSERT_OPTIONS", "NULLABLE", "OWN_OPTIONS", "RULES", "check_own", "shown"]

# insert_attention's rules: "auto" (the sites found in the model's forward, a family's rule inside the blocks it
# knows), "structure" (the found sites alone), "family" (the family rules alone)
RULES = ("auto", "structure", "family")
HEAD_INITS = ("zero",)  # model.head_init: "zero" starts the classifier at zero; unset: the package's own init


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def _is_momentum(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and 0 < v <= 1


def _is_names(v: Any) -> bool:
    if isinstance(v, str):
        return bool(v)
    return isinstance(v, (list, tuple)) and bool(v) and all(isinstance(p, str) and p for p in v)


def _one_of(values: Tuple[str, ...]) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, str) and v in values


# option -> (the values it takes, in words; whether a value is one of them)
OWN_OPTIONS: Dict[str, Tuple[str, Callable[[Any], bool]]] = {
    "replace_se": ("true or false", _is_bool),
    "rule": (f"one of {', '.join(RULES)}", _one_of(RULES)),
    "cifar_stem": ("true or false", _is_bool),
    "bn_momentum": ("a number in (0, 1] (torch's BatchNorm momentum; unset: the package's own)", _is_momentum),
    "head_init": (f"one of {', '.join(HEAD_INITS)} (unset: the package's own init)", _one_of(HEAD_INITS)),
    "attention": ("a block name (a string)", lambda v: isinstance(v, str)),
    "attn_at": ("a module name or a list of them (non-empty strings)", _is_names),
    "attn_kwargs": ("a mapping", lambda v: isinstance(v, dict)),
    "kwargs": ("a mapping", lambda v: isinstance(v, dict)),
    "pretrained_file": ("a path (a non-empty string)", lambda v: isinstance(v, str) and bool(v)),
}
# insert_attention's own options, which model.attn_kwargs may carry beside the block's
INSERT_OPTIONS = ("replace_se", "rule")
# options that null (unset) leaves to the package or to visattn's default
NULLABLE = frozenset({"bn_momentum", "head_init", "attn_at", "attn_kwargs", "kwargs", "pretrained_file"})


def shown(v: Any) -> str:
    """A value as a config file writes it (``true``, ``'no'``, ``1``), shortened."""
    text = "true" if v is True else "false" if v is False else "null" if v is None else repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def check_own(where: str, key: str, value: Any, form: str = "{where} must be {said}, not {value}") -> None:
    """``value`` of visattn's own option ``key`` (a key of :data:`OWN_OPTIONS`; others pass) is one of its values,
    else a ValueError ``<where> must be <its values>, not <value>`` (or as ``form`` puts them); ``where`` names the
    option as the user gave it (``option 'attn_kwargs.replace_se' of model timm/resnet18``)."""
    if key in OWN_OPTIONS and not (value is None and key in NULLABLE):
        said, fits = OWN_OPTIONS[key]
        if not fits(value):
            raise ValueError(form.format(where=where, said=said, value=shown(value)))
