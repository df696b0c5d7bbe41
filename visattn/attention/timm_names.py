"""timm's attention type names (``timm.layers.get_attn``) and the visattn block and options for each.

timm 1.0.31 builds 21 attention types by name. Each is available here either as a block of its own or as an
option of the block of the same paper (:data:`TIMM_ATTN`); :func:`create_timm_attention` builds one by timm's
name. ``parity`` says how far the two are the same function, and the tests hold each claim
(``tests/test_timm_names.py``):

* ``"module"``: equal to ``timm.layers.get_attn(name)(channels)`` with the weights copied in registration
  order (float64, outputs and gradients);
* ``"mapped"``: equal to timm's module with its weights mapped by name (``nl``: timm's ``t``, ``p``, ``g``
  convs are the rows of the non-local block's ``qkv``);
* ``"core"``: timm's module is a convolution replacement or attention alone (no residual); the visattn block
  wraps that same mechanism as a same-width residual block, and its own tests compare the mechanism to
  timm's module (``test`` names the file);
* ``"unbuildable"``: timm 1.0.31 cannot build its default (``ge``: a ``*dd`` where ``**dd`` is meant);
  the block's tests compare against timm's module where it builds.

Widths timm rounds its own way (``make_divisible``) are passed as options derived from the channel count,
so ``create_timm_attention(name, C)`` has timm's widths at any ``C``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from timm.layers import make_divisible
from torch import nn

from ..registry import create_attention

__all__ = ["TIMM_ATTN", "TimmAttn", "create_timm_attention", "timm_attention_options"]

PARITIES = ("module", "mapped", "core", "unbuildable")


@dataclass(frozen=True)
class TimmAttn:
    """One timm attention name: the visattn ``block``, its constant ``options``, the options timm derives
    from the channel count (``derived(channels) -> dict``), how far it equals timm's module (``parity``), the
    test file that holds the comparison, and a note."""

    block: str
    options: Mapping[str, Any] = field(default_factory=dict)
    derived: Optional[Callable[[int], Dict[str, Any]]] = None
    parity: str = "module"
    test: str = "tests/test_timm_names.py"
    note: str = ""

    def resolve(self, channels: int) -> Tuple[str, Dict[str, Any]]:
        """``(block, options)`` that build timm's configuration at ``channels``."""
        opts = dict(self.options)
        if self.derived is not None:
            opts.update(self.derived(channels))
        return self.block, opts


def _coord_mip(channels: int) -> Dict[str, Any]:  # timm's CoordAttn: rd_ratio 1/16 times se_factor 2/3, divisor 8
    return {"mip": make_divisible(channels * (1.0 / 16) * (2.0 / 3), 8, round_limit=0.0)}


def _scoord_mip(channels: int) -> Dict[str, Any]:  # timm's SimpleCoordAttn: rd_ratio 1/4 times se_factor 2/3
    return {"mip": make_divisible(channels * 0.25 * (2.0 / 3), 8, round_limit=0.0)}


def _nl_width(channels: int) -> Dict[str, Any]:  # timm's NonLocalAttn: rd_ratio 1/8, divisor 8
    return {"rd_channels": make_divisible(channels / 8, 8)}


_CONV = "tests/test_catalogue_conv.py"

TIMM_ATTN: Dict[str, TimmAttn] = {
    "se": TimmAttn("se", {"rd_divisor": 8}, note="SEModule: its width rounded to a multiple of 8"),
    "ese": TimmAttn("se", {"effective": True}, note="EffectiveSEModule (CenterMask's eSE): se(effective=True)"),
    "eca": TimmAttn("eca"),
    "ecam": TimmAttn("eca", {"use_mlp": True}, note="EcaModule(use_mlp=True), a timm experiment: eca(use_mlp=True)"),
    "ceca": TimmAttn("eca", {"padding": "circular"}, note="CecaModule: eca(padding='circular')"),
    "ge": TimmAttn("ge", parity="unbuildable", test="tests/test_catalogue_gates.py",
                   note="GatherExcite's default (use_mlp=True) does not build in timm 1.0.31 (*dd for **dd)"),
    "gc": TimmAttn("gc", {"fusion": "scale", "rd_ratio": 1.0 / 8, "norm_eps": 1e-6},
                   note="GlobalContext's default is the scale fusion, ratio 1/8, LayerNorm2d eps 1e-6"),
    "gca": TimmAttn("gc", {"fusion": "add", "rd_ratio": 1.0 / 8, "norm_eps": 1e-6},
                    note="GlobalContext(fuse_add=True, fuse_scale=False): visattn's default fusion"),
    "cbam": TimmAttn("cbam"),
    "lcbam": TimmAttn("cbam", {"light": True}, note="LightCbamModule, a timm experiment: cbam(light=True)"),
    "coord": TimmAttn("coord", {"bias": False}, _coord_mip, note="CoordAttn: no conv biases, timm's width rounding"),
    "scoord": TimmAttn("coord", {"combine": "sum", "norm_layer": None, "act_layer": nn.SiLU}, _scoord_mip,
                       note="SimpleCoordAttn, a timm simplification: coord(combine='sum'), no norm, SiLU"),
    "ela": TimmAttn("ela", test="tests/test_catalogue_gates.py", note="EfficientLocalAttn"),
    "strip": TimmAttn("strip", note="StripAttn: a minimal strip pooling block of its own"),
    "sk": TimmAttn("sk", parity="core", test=_CONV, note="SelectiveKernel replaces a conv: a residual block here"),
    "splat": TimmAttn("splat", parity="core", test=_CONV, note="SplitAttn replaces a conv: a residual block here"),
    "lambda": TimmAttn("lambda", parity="core", test=_CONV, note="LambdaLayer replaces a conv: a residual block here"),
    "bottleneck": TimmAttn("mhsa2d", {"scale_pos": False}, parity="core", test="tests/test_blocks.py",
                           note="BottleneckAttn is the attention alone (fixed feat_size): mhsa2d's y, "
                                "x + BN(proj(y)); scale_pos=False is timm's scale_pos_embed=False"),
    "halo": TimmAttn("halo", parity="core", test=_CONV, note="HaloAttn replaces a conv: a residual block here"),
    "nl": TimmAttn("nonlocal", {"scale_by": "channels"}, _nl_width, parity="mapped",
                   note="NonLocalAttn: t, p, g stacked as qkv; width C/8 (divisor 8), logits scaled by 1/sqrt(C)"),
    "bat": TimmAttn("bat", parity="core", test=_CONV, note="BatNonLocalAttn, with a residual scale here"),
}


def timm_attention_options(name: str, channels: int) -> Tuple[str, Dict[str, Any]]:
    """``(visattn block, options)`` for timm's attention type ``name`` at ``channels``."""
    if name not in TIMM_ATTN:
        raise ValueError(f"unknown timm attention type {name!r}; valid: {', '.join(TIMM_ATTN)}")
    return TIMM_ATTN[name].resolve(channels)


def create_timm_attention(name: str, channels: int, **kwargs: Any) -> nn.Module:
    """The visattn block for timm's attention type ``name`` (``timm.layers.get_attn``'s names) at ``channels``,
    with timm's configuration; ``kwargs`` (``init="identity"``, ...) override it."""
    block, options = timm_attention_options(name, channels)
    return create_attention(block, channels, **{**options, **kwargs})
