"""Taps for attention modules visattn did not build: timm's ``Attention`` and ``torch.nn.MultiheadAttention``.

:func:`add_taps` gives each such module an :class:`~visattn.attention.tap.AttentionTap` (held here, not
registered in the model, so ``state_dict``, ``named_modules`` and ``print(model)`` do not change) fed by
forward hooks that compute the module's attention weights explicitly, in fp32, on recording passes only:

* timm ``Attention`` (``timm.layers.Attention``, which ``timm.models.vision_transformer.Attention`` is):
  hooks on its ``q_norm`` and ``k_norm`` capture the very ``q`` and ``k`` its forward uses, and the weights
  are ``softmax(q k^T * scale + mask)``. The module's own forward (fused ``scaled_dot_product_attention``
  included) is untouched, so recording works with fused attention on, in training too (the recorded weights
  are those before attention dropout).
* ``nn.MultiheadAttention``: a forward hook recomputes the query and key projections from the call's
  inputs (``in_proj_weight`` / ``q_proj_weight``, biases, ``bias_k``, ``add_zero_attn``, ``attn_mask``,
  ``key_padding_mask``); the module's forward still runs with ``need_weights`` as its caller asked.

The token grid and the class-token count come from the model around the module: timm's
``patch_embed.grid_size`` and ``num_prefix_tokens``, torchvision's ``image_size // patch_size`` and its
class token; otherwise a square grid after 0 or 1 prefix tokens, whichever fits.

The hooks stay on the module (one attribute check each when not recording), so a compiled model is not
recompiled by each new recording; :func:`remove_taps` takes them off.

For gradients (``record_attention(..., gradients=True)``) the recorded weights must be the ones the module's
output is computed from; :func:`own_attention` makes them so for the length of one recording: timm's
``Attention`` runs its unfused path (``fused_attn=False``) and its tap is handed the softmax at the input of
``attn_drop``, the tensor that multiplies the values; ``nn.MultiheadAttention`` is called with
``need_weights=True, average_attn_weights=False`` and its tap is handed those per-head weights (its caller
still gets what it asked for). Training and plain recordings keep the fused kernels.
"""
from __future__ import annotations

import math
import weakref
from contextlib import contextmanager
from typing import Any, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..attention.tap import AttentionTap

SEARCHED = (
    "visattn AttentionTap modules",
    "timm Attention (timm.layers.Attention = timm.models.vision_transformer.Attention)",
    "torch.nn.MultiheadAttention",
)


def _timm_attention() -> Tuple[type, ...]:
    try:
        from timm.layers import Attention
    except ImportError:  # pragma: no cover - timm is a dependency
        return ()
    return (Attention,)


class _Adapter:
    """One foreign module's tap, its hooks and the state a recording pass passes between them."""

    def __init__(self, tap: AttentionTap, prefix: Optional[int], grid: Optional[Tuple[int, int]]):
        self.tap = tap
        self.prefix = prefix  # class tokens before the grid tokens (None: infer from N)
        self.grid = grid  # (h, w) when the model says
        self.handles: List[Any] = []
        self.q: Optional[torch.Tensor] = None
        self.mask: Optional[torch.Tensor] = None
        self.causal = False
        self.own = False  # own_attention(): the module hands its tap the weights it uses itself
        self.asked: Optional[Tuple[bool, bool]] = None  # MultiheadAttention: what its caller asked for
        self.pending: Optional[torch.Tensor] = None  # timm, own_attention(): recomputed weights not yet emitted

    def layout(self, n: int) -> Tuple[Optional[Tuple[int, int]], int]:
        """``(grid, num_prefix_tokens)`` for ``n`` tokens."""
        if self.grid is not None and self.prefix is not None and self.grid[0] * self.grid[1] + self.prefix == n:
            return self.grid, self.prefix
        for p in ([self.prefix] if self.prefix is not None else []) + [0, 1]:
            side = math.isqrt(max(n - p, 0))
            if side * side == n - p and side > 0:
                return (side, side), p
        return None, self.prefix or 0

    def emit(self, weights: torch.Tensor) -> None:
        grid, p = self.layout(weights.shape[-1])
        self.tap(weights, grid=grid, num_prefix_tokens=p)


_ADAPTERS: "weakref.WeakKeyDictionary[nn.Module, _Adapter]" = weakref.WeakKeyDictionary()


def _context(model: nn.Module, path: str) -> Tuple[Optional[int], Optional[Tuple[int, int]]]:
    """Prefix-token count and grid from the nearest enclosing module that declares them."""
    parts = path.split(".") if path else []
    for cut in range(len(parts), -1, -1):
        m = model.get_submodule(".".join(parts[:cut])) if cut else model
        pe = getattr(m, "patch_embed", None)
        if pe is not None and getattr(pe, "grid_size", None) is not None:  # timm
            return int(getattr(m, "num_prefix_tokens", 1)), tuple(int(g) for g in pe.grid_size)
        if isinstance(getattr(m, "conv_proj", None), nn.Module) and hasattr(m, "patch_size"):  # torchvision
            size = int(getattr(m, "image_size"))
            g = size // int(m.patch_size)
            return (1 if getattr(m, "class_token", None) is not None else 0), (g, g)
        if isinstance(getattr(m, "num_prefix_tokens", None), int) and cut < len(parts):
            return int(m.num_prefix_tokens), None
    return None, None


def _masked(logits: torch.Tensor, mask: Optional[torch.Tensor], allow_true: bool) -> torch.Tensor:
    """Add an attention mask: boolean (``allow_true``: True = may attend, SDPA/timm; else True = blocked,
    ``nn.MultiheadAttention``) or additive float."""
    if mask is None:
        return logits
    if mask.dtype == torch.bool:
        blocked = ~mask if allow_true else mask
        return logits.masked_fill(blocked, float("-inf"))
    return logits + mask.float()


def _timm_hooks(module: nn.Module, ad: _Adapter) -> None:
    def pre(m, args, kwargs):
        if ad.tap.recording:
            ad.mask = args[1] if len(args) > 1 else kwargs.get("attn_mask")
            ad.causal = bool(args[2] if len(args) > 2 else kwargs.get("is_causal", False))

    def on_q(m, args, out):
        if ad.tap.recording:
            ad.q = out

    def on_k(m, args, out):
        if not ad.tap.recording or ad.q is None:
            ad.q = None
            return
        q, k = ad.q, out  # (B, heads, N, d), after q_norm / k_norm: what the forward attends with
        ad.q = None
        with torch.autocast(q.device.type, enabled=False):
            logits = (q.float() * float(module.scale)) @ k.float().transpose(-2, -1)
            if ad.causal:
                n = logits.shape[-1]
                logits = logits.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
            else:
                logits = _masked(logits, ad.mask, allow_true=True)
            weights = logits.softmax(-1)
        if ad.own:  # own_attention(): the module's own softmax is emitted instead, when its forward reaches it
            ad.pending = weights
        else:
            ad.emit(weights)
        ad.mask = None

    ad.handles += [module.register_forward_pre_hook(pre, with_kwargs=True),
                   module.q_norm.register_forward_hook(on_q), module.k_norm.register_forward_hook(on_k)]


def _mha_inputs(m: nn.MultiheadAttention, args: tuple, kwargs: dict):
    names = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask")
    got = {n: (args[i] if len(args) > i else kwargs.get(n)) for i, n in enumerate(names)}
    q, k = got["query"], got["key"]
    if m.batch_first:
        q, k = q.transpose(0, 1), k.transpose(0, 1)  # (L, B, E)
    return q, k, got["key_padding_mask"], got["attn_mask"]


def _mha_weights(m: nn.MultiheadAttention, args: tuple, kwargs: dict) -> torch.Tensor:
    q_in, k_in, key_padding, mask = _mha_inputs(m, args, kwargs)
    e, h = m.embed_dim, m.num_heads
    if m._qkv_same_embed_dim:
        w_q, w_k = m.in_proj_weight[:e], m.in_proj_weight[e : 2 * e]
    else:
        w_q, w_k = m.q_proj_weight, m.k_proj_weight
    b_q, b_k = (m.in_proj_bias[:e], m.in_proj_bias[e : 2 * e]) if m.in_proj_bias is not None else (None, None)
    with torch.autocast(q_in.device.type, enabled=False):
        q = F.linear(q_in.float(), w_q.float(), None if b_q is None else b_q.float())  # (L, B, E)
        k = F.linear(k_in.float(), w_k.float(), None if b_k is None else b_k.float())  # (S, B, E)
        b = q.shape[1]
        if m.bias_k is not None:
            k = torch.cat([k, m.bias_k.float().expand(1, b, e)])
        if m.add_zero_attn:
            k = torch.cat([k, k.new_zeros(1, b, e)])
        q = q.reshape(q.shape[0], b, h, e // h).permute(1, 2, 0, 3)  # (B, h, L, d)
        k = k.reshape(k.shape[0], b, h, e // h).permute(1, 2, 0, 3)
        logits = (q / math.sqrt(e // h)) @ k.transpose(-2, -1)  # (B, h, L, S)
        extra = logits.shape[-1] - k_in.shape[0]
        if mask is not None:
            mask = F.pad(mask, (0, extra)) if extra else mask
            logits = _masked(logits, mask.view(-1, h, *mask.shape[-2:]) if mask.dim() == 3 else mask, allow_true=False)
        if key_padding is not None:
            pad = F.pad(key_padding, (0, extra)) if extra else key_padding
            logits = _masked(logits, pad[:, None, None, :].bool() if pad.dtype == torch.bool else pad[:, None, None, :],
                             allow_true=False)
        return logits.softmax(-1)


def _mha_hooks(module: nn.MultiheadAttention, ad: _Adapter) -> None:
    def post(m, args, kwargs, out):
        if ad.tap.recording and not ad.own:
            ad.emit(_mha_weights(m, args, kwargs))

    ad.handles.append(module.register_forward_hook(post, with_kwargs=True))


_NEED_WEIGHTS, _AVERAGE = 4, 6  # positions of need_weights and average_attn_weights in MultiheadAttention.forward


def _set_arg(args: list, kwargs: dict, pos: int, name: str, value: Any, default: Any) -> Any:
    """Set one argument of a call given by position or keyword; returns what the caller had given."""
    if len(args) > pos:
        old, args[pos] = args[pos], value
    else:
        old, kwargs[name] = kwargs.get(name, default), value
    return old


def _mha_own(module: nn.MultiheadAttention, ad: _Adapter) -> List[Any]:
    def pre(m, args, kwargs):
        if not ad.tap.recording:
            return None
        args, kwargs = list(args), dict(kwargs)
        asked = _set_arg(args, kwargs, _NEED_WEIGHTS, "need_weights", True, True)
        average = _set_arg(args, kwargs, _AVERAGE, "average_attn_weights", False, True)
        ad.asked = (bool(asked), bool(average))
        return tuple(args), kwargs

    def post(m, args, kwargs, out):
        if ad.asked is None:
            return None
        (asked, average), ad.asked = ad.asked, None
        attn_out, weights = out  # (B, heads, L, S): a view of the softmax that multiplied the values
        ad.emit(weights if weights is not None else _mha_weights(m, args, kwargs))
        if weights is None:
            return None
        return attn_out, ((weights.mean(1) if average else weights) if asked else None)

    return [module.register_forward_pre_hook(pre, with_kwargs=True),
            module.register_forward_hook(post, with_kwargs=True)]


def _timm_own(module: nn.Module, ad: _Adapter) -> List[Any]:
    def pre(m, args):
        if ad.tap.recording:
            ad.pending = None
            ad.emit(args[0])  # (B, heads, N, N): the softmax the unfused path multiplies the values by

    def post(m, args, out):
        if ad.tap.recording and ad.pending is not None:  # a forward that never reached attn_drop: the weights
            ad.emit(ad.pending)  # recomputed from q and k (recorded, but with no gradient to give)
        ad.pending = None

    return [module.attn_drop.register_forward_pre_hook(pre), module.register_forward_hook(post)]


@contextmanager
def own_attention(model: nn.Module) -> Iterator[None]:
    """For the ``with`` block, the tapped foreign modules of ``model`` hand their taps the attention weights
    their output is computed from (module docstring): timm ``Attention`` unfused, ``nn.MultiheadAttention``
    with per-head weights. Everything is restored on exit."""
    handles: List[Any] = []
    saved: List[Tuple[nn.Module, Any]] = []
    owned: List[_Adapter] = []
    try:
        for _, m in foreign_modules(model):
            ad = _ADAPTERS.get(m)
            if ad is None:
                continue
            if isinstance(m, nn.MultiheadAttention):
                handles += _mha_own(m, ad)
            elif hasattr(m, "fused_attn") and isinstance(getattr(m, "attn_drop", None), nn.Module):
                saved.append((m, m.fused_attn))
                m.fused_attn = False
                handles += _timm_own(m, ad)
            else:
                continue
            ad.own = True
            owned.append(ad)
        yield
    finally:
        for h in handles:
            h.remove()
        for m, fused in saved:
            m.fused_attn = fused
        for ad in owned:
            ad.own, ad.asked, ad.pending = False, None, None


def foreign_modules(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """``(path, module)`` of every timm ``Attention`` and ``nn.MultiheadAttention`` in ``model``."""
    kinds = _timm_attention() + (nn.MultiheadAttention,)
    return [(p, m) for p, m in model.named_modules() if isinstance(m, kinds)]


def add_taps(model: nn.Module) -> List[Tuple[str, AttentionTap]]:
    """Give every timm ``Attention`` and ``nn.MultiheadAttention`` in ``model`` a tap (once; idempotent).

    Returns ``(record name, tap)`` for each, in module order. ``model``: the plain model (unwrap
    ``torch.compile`` and DDP first; :func:`visattn.maps.record_attention` does).
    """
    out = []
    for path, m in foreign_modules(model):
        ad = _ADAPTERS.get(m)
        if ad is None:
            prefix, grid = _context(model, path)
            ad = _Adapter(AttentionTap("token"), prefix, grid)
            if isinstance(m, nn.MultiheadAttention):
                _mha_hooks(m, ad)
            elif all(isinstance(getattr(m, n, None), nn.Module) for n in ("q_norm", "k_norm")):
                _timm_hooks(m, ad)
            else:
                continue
            _ADAPTERS[m] = ad
        out.append((path, ad.tap))
    return out


def adapter_taps(model: nn.Module) -> List[Tuple[str, AttentionTap]]:
    """The taps :func:`add_taps` already gave ``model``'s modules (none are added)."""
    return [(p, _ADAPTERS[m].tap) for p, m in foreign_modules(model) if m in _ADAPTERS]


def remove_taps(model: nn.Module) -> int:
    """Take the hooks :func:`add_taps` put on ``model``'s modules off again; returns how many modules."""
    n = 0
    for _, m in foreign_modules(model):
        ad = _ADAPTERS.pop(m, None)
        if ad is not None:
            for h in ad.handles:
                h.remove()
            n += 1
    return n


__all__ = ["SEARCHED", "add_taps", "adapter_taps", "foreign_modules", "own_attention", "remove_taps"]
