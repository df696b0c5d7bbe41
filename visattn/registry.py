"""A small name -> builder registry shared by attention blocks and models.

Decorator based (``@register_attention("se")``), duplicate names are rejected, and an unknown name or a
bad keyword option is answered with an error that lists what is valid (never an ``assert``).
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, List, Optional


class Registry:
    def __init__(self, what: str):
        self.what = what  # "attention block" or "model", used in messages
        self._builders: Dict[str, Callable[..., Any]] = {}
        self._meta: Dict[str, Dict[str, Any]] = {}

    def register(self, name: str, **meta: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
            if name in self._builders:
                raise ValueError(f"{self.what} {name!r} is already registered (by {self._builders[name]!r})")
            self._builders[name] = fn
            self._meta[name] = dict(meta)
            return fn

        return deco

    def names(self, **filters: Any) -> List[str]:
        out = []
        for name in sorted(self._builders):
            meta = self._meta[name]
            if all(v is None or meta.get(k) == v for k, v in filters.items()):
                out.append(name)
        return out

    def meta(self, name: str) -> Dict[str, Any]:
        return dict(self._meta[self._check(name)])

    def get(self, name: str) -> Callable[..., Any]:
        return self._builders[self._check(name)]

    def _check(self, name: str) -> str:
        if name not in self._builders:
            raise ValueError(f"unknown {self.what} {name!r}; valid: {', '.join(self.names())}")
        return name

    def options(self, name: str) -> List[str]:
        """Keyword options the builder accepts (for error messages and docs)."""
        fn = self.get(name)
        target = fn.__init__ if inspect.isclass(fn) else fn
        params = list(inspect.signature(target).parameters.values())
        return [p.name for p in params if p.name != "self" and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]

    def create(self, name: str, *args: Any, **kwargs: Any) -> Any:
        fn = self.get(name)
        target = fn.__init__ if inspect.isclass(fn) else fn
        sig = inspect.signature(target)
        accepts_var_kw = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
        if not accepts_var_kw:
            valid = set(self.options(name))
            bad = sorted(k for k in kwargs if k not in valid)
            if bad:
                raise ValueError(
                    f"{self.what} {name!r} got unknown option(s) {', '.join(bad)}; valid: {', '.join(sorted(valid))}"
                )
        return fn(*args, **kwargs)


def describe(obj: Optional[Callable[..., Any]]) -> str:
    doc = inspect.getdoc(obj) if obj is not None else None
    return (doc or "").strip().splitlines()[0] if doc else ""
