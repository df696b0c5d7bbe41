"""The two name -> builder registries, attention blocks and models, with one :class:`Registry` class.

Decorator based (``@register_attention("se")``); duplicate names are rejected, and an unknown name or option
is answered with an error that lists what is valid. A model *variant* puts a dict of arguments onto one class
(``@register_model("vit_tiny", cls=VisionTransformer)``); its options are read from ``cls``'s signature (and
through ``**kwargs`` from its base classes'), so the builders need not copy signatures. This module imports
nothing else from visattn: blocks and models register themselves when their packages are imported.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Dict, List, Optional, Tuple

from torch import nn


def _own_params(target: Callable[..., Any]) -> List[inspect.Parameter]:
    params = inspect.signature(target).parameters.values()
    return [p for p in params if p.name != "self"]


def _signature_params(fn: Callable[..., Any], cls: Optional[type]) -> Dict[str, inspect.Parameter]:
    """Keyword parameters ``fn`` accepts, looking through ``**kwargs`` into ``cls`` and its base classes.

    A base class's parameters without a default are left out: the subclass fills those in itself (e.g. a
    transformer's tokenizer).
    """
    target = fn.__init__ if inspect.isclass(fn) else fn
    params = _own_params(target)
    out = {p.name: p for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        return out
    if inspect.isclass(fn):
        chain = fn.__mro__[1:]
    elif cls is not None:
        chain = cls.__mro__
    else:
        return out
    for klass in chain:
        if not (isinstance(klass, type) and issubclass(klass, nn.Module)) or klass is nn.Module:
            break
        own = _own_params(klass.__init__)
        for p in own:
            keyword = p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
            if keyword and p.name not in out and (klass is cls or p.default is not inspect.Parameter.empty):
                out[p.name] = p
        if not any(p.kind is p.VAR_KEYWORD for p in own):
            break
    return out


class Registry:
    """Names -> builders (classes or functions), with metadata and option checks."""

    def __init__(self, what: str):
        self.what = what  # "attention block" or "model", used in messages
        self._builders: Dict[str, Callable[..., Any]] = {}
        self._meta: Dict[str, Dict[str, Any]] = {}
        # "prefix/<name>" names another package builds: prefix -> (builder, resolve, check)
        self._namespaces: Dict[str, Tuple[Callable[..., Any], Callable[[str], str], Callable[[str, Dict[str, Any]], None]]] = {}

    def register(self, name: str, **meta: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
            if name in self._builders:
                raise ValueError(f"{self.what} {name!r} is already registered (by {self._builders[name]!r})")
            self._builders[name] = fn
            self._meta[name] = dict(meta)
            return fn

        return deco

    def register_namespace(self, prefix: str, builder: Callable[..., Any], resolve: Callable[[str], str],
                           check: Callable[[str, Dict[str, Any]], None]) -> None:
        """Names ``prefix/<name>``: ``builder(name, *args, **kwargs)`` builds one, ``resolve(name)`` raises a
        ValueError for a name the package does not have, ``check(name, options)`` checks options without building."""
        if prefix in self._namespaces:
            raise ValueError(f"{self.what} namespace {prefix!r} is already registered")
        self._namespaces[prefix] = (builder, resolve, check)

    def namespace(self, name: str) -> Optional[Tuple[str, str]]:
        """``(prefix, rest)`` for a name of a registered namespace (``timm/resnet18``), else None."""
        prefix, sep, rest = name.partition("/") if isinstance(name, str) else ("", "", "")
        return (prefix, rest) if sep and prefix in self._namespaces else None

    def names(self, **filters: Any) -> List[str]:
        out = []
        for name in sorted(self._builders):
            meta = self._meta[name]
            if all(v is None or meta.get(k) == v for k, v in filters.items()):
                out.append(name)
        return out

    def meta(self, name: str) -> Dict[str, Any]:
        space = self.namespace(self.check(name))
        if space is not None:
            return {"family": space[0]}
        return {k: v for k, v in self._meta[name].items() if k != "cls"}

    def get(self, name: str) -> Callable[..., Any]:
        space = self.namespace(self.check(name))
        if space is not None:
            return functools.partial(self._namespaces[space[0]][0], space[1])
        return self._builders[name]

    def check(self, name: str) -> str:
        """``name`` if registered (or a name its namespace's package has), else a ValueError listing the valid names."""
        space = self.namespace(name)
        if space is not None:
            self._namespaces[space[0]][1](space[1])
            return name
        if name not in self._builders:
            more = "".join(f", {p}/<name>" for p in self._namespaces)
            raise ValueError(f"unknown {self.what} {name!r}; valid: {', '.join(self.names())}{more}")
        return name

    def _params(self, name: str) -> Dict[str, inspect.Parameter]:
        if self.namespace(name) is not None:
            return _signature_params(self.get(name), None)
        return _signature_params(self.get(name), self._meta[name].get("cls"))

    def options(self, name: str) -> List[str]:
        """Keyword options the builder accepts (for error messages, config checks and docs)."""
        return list(self._params(name))

    def defaults(self, name: str) -> Dict[str, Any]:
        """Default values of the builder's keyword options (for type checks of config values)."""
        return {k: p.default for k, p in self._params(name).items() if p.default is not inspect.Parameter.empty}

    def annotations(self, name: str) -> Dict[str, str]:
        """The builder's keyword options' annotations as text (``"Optional[Dict[str, Any]]"``), for type checks
        of config values: a list is not a mapping, a bool not a number."""
        out = {}
        for k, p in self._params(name).items():
            a = p.annotation
            if a is not inspect.Parameter.empty:
                out[k] = a if isinstance(a, str) else a.__name__ if isinstance(a, type) else str(a)
        return out

    def check_options(self, name: str, kwargs: Dict[str, Any]) -> None:
        """A ValueError listing the valid options if ``kwargs`` holds others (any go for an open-ended builder)."""
        space = self.namespace(self.check(name))
        if space is not None:
            self._namespaces[space[0]][2](space[1], {k: v for k, v in kwargs.items() if k != "num_classes"})
            return
        fn = self.get(name)
        open_ended = any(p.kind is p.VAR_KEYWORD for p in _own_params(fn.__init__ if inspect.isclass(fn) else fn))
        if open_ended and self._meta[name].get("cls") is None:
            return
        valid = set(self.options(name))
        bad = sorted(k for k in kwargs if k not in valid)
        if bad:
            raise ValueError(f"{self.what} {name!r} got unknown option(s) {', '.join(bad)}; valid: {', '.join(sorted(valid))}")

    def create(self, name: str, *args: Any, **kwargs: Any) -> Any:
        self.check_options(name, kwargs)
        return self.get(name)(*args, **kwargs)


# ------------------------------------------------------------------------------------- attention blocks

ATTENTION = Registry("attention block")
LAYOUTS = ("feature", "token")  # (B, C, H, W) -> same, or (B, N, D) -> same


def register_attention(name: str, layout: str = "feature", kind: str = "channel"):
    """Register a block class/builder. ``layout``: 'feature' or 'token'; ``kind``: what its tap carries."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; valid: {', '.join(LAYOUTS)}")
    return ATTENTION.register(name, layout=layout, kind=kind)


def list_attention(layout: Optional[str] = None) -> List[str]:
    """Names of the registered blocks ("none" included), optionally only one layout."""
    if layout is not None and layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; valid: {', '.join(LAYOUTS)}")
    return ATTENTION.names(layout=layout)


def attention_info(name: str) -> dict:
    """``{"layout": ..., "kind": ...}`` of block ``name`` (ValueError listing the blocks if unknown)."""
    return ATTENTION.meta(name)


def attention_options(name: str) -> List[str]:
    return ATTENTION.options(name)


def create_attention(name: str, channels: int, **kwargs: Any) -> nn.Module:
    """Build block ``name`` for ``channels`` input channels (or token dim); ``"none"`` gives an identity.

    The block is marked as an attention block (see :func:`backbone_modules`): a model's own initialisation
    and norm options leave its parameters as the block made them."""
    block = ATTENTION.create(name, channels, **kwargs)
    block._visattn_attention = name
    return block


def is_attention_block(module: nn.Module) -> bool:
    """Whether ``module`` was built by :func:`create_attention`."""
    return isinstance(getattr(module, "_visattn_attention", None), str)


def backbone_modules(model: nn.Module) -> List[nn.Module]:
    """``model.modules()`` less the attention blocks inside it and everything they hold.

    What a model's weight initialisation, norm options (frozen scales, momentum, eps) and optimizer-wide
    norm-layer rules walk: a block keeps its own initialisation and trainability wherever it is inserted."""
    out: List[nn.Module] = []

    def walk(m: nn.Module) -> None:
        if m is not model and is_attention_block(m):
            return
        out.append(m)
        for child in m.children():
            walk(child)

    walk(model)
    return out


# ----------------------------------------------------------------------------------------------- models

MODELS = Registry("model")


def register_model(name: str, family: str = "cnn", cls: Optional[type] = None):
    """Register a model builder; ``cls``: the class a ``**kwargs`` variant builder puts its arguments onto."""
    return MODELS.register(name, family=family, cls=cls)


def list_models(family: Optional[str] = None) -> List[str]:
    return MODELS.names(family=family)


def model_options(name: str) -> List[str]:
    return MODELS.options(name)


def model_defaults(name: str) -> Dict[str, Any]:
    return MODELS.defaults(name)


def create_model(name: str, num_classes: int = 10, **kwargs: Any) -> nn.Module:
    """Build model ``name``; keyword options are the builder's (``model_options(name)`` lists them). ``name`` may
    also be ``timm/<name>`` or ``torchvision/<name>``: any classifier of the installed package
    (:mod:`visattn.models.foreign`: ``attention``, ``attn_kwargs``, ``attn_at``, ``cifar_stem``, ``kwargs``,
    ``pretrained_file``)."""
    return MODELS.create(name, num_classes=num_classes, **kwargs)
