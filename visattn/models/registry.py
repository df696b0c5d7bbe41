"""Model registry: ``register_model``, ``create_model``, ``list_models``."""
from __future__ import annotations

from typing import Any, List

from torch import nn

from ..registry import Registry

_MODELS = Registry("model")


def register_model(name: str, family: str = "cnn"):
    return _MODELS.register(name, family=family)


def list_models(family: str | None = None) -> List[str]:
    return _MODELS.names(family=family)


def model_options(name: str) -> List[str]:
    return _MODELS.options(name)


def model_defaults(name: str) -> dict:
    """Default values of the builder's keyword options (for type checks of config values)."""
    import inspect

    fn = _MODELS.get(name)
    target = fn.__init__ if inspect.isclass(fn) else fn
    return {p.name: p.default for p in inspect.signature(target).parameters.values()
            if p.default is not inspect.Parameter.empty}


def create_model(name: str, num_classes: int = 10, **kwargs: Any) -> nn.Module:
    """Build model ``name``; keyword options are the builder's (``model_options(name)`` lists them)."""
    return _MODELS.create(name, num_classes=num_classes, **kwargs)
