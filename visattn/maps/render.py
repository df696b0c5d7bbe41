"""Honest colour scales: every map kind is drawn on a declared range that is the same for every image,
layer and training step.

* ``"gate"``: sigmoid gates on their absolute range [0, 1], linear. A gate that varies from 0.48 to 0.53
  covers 5% of the colour map; a flat gate looks flat.
* ``"gain"``: the gates of blocks built with ``init="identity"``, read as multipliers on their range [0, 2],
  linear, with 1 (the input passed through unchanged) in the middle of the colour map.
* ``"relative"``: attention rows, pooling weights, GC's context softmax and rollout, as weight x number of
  keys (uniform attention = 1), on a log2 scale from 1/8x to 8x uniform that saturates at both ends;
  uniform attention sits exactly in the middle of the colour map (the "uniform colour").

``norm="per_image"`` stretches each map to its own minimum and maximum instead: an explicit option, for
looking at the shape of a map whose range is tiny; the colour bar and captions then say so.

:func:`map_stats` gives the numbers a caption states: the range on the declared scale and how peaked the
map is (max / uniform and the entropy relative to uniform for relative maps, max / mean for gates).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Tuple

import torch

NORMS = ("fixed", "per_image")
RELATIVE_RANGE = 8.0  # relative maps span 1/8x .. 8x uniform
GAIN_RANGE = 2.0  # gain maps span 0 .. 2x (identity-initialised gates: 2 * sigmoid)


@dataclass(frozen=True)
class Stats:
    lo: float
    hi: float
    peak: float  # relative: max x uniform; gate: max / mean
    entropy: float  # relative: entropy / log(cells) of the renormalised map (1 = flat); gate: nan
    finite: bool


def check_norm(norm: str) -> str:
    if norm not in NORMS:
        raise ValueError(f"unknown map norm {norm!r}; valid: {', '.join(NORMS)}")
    return norm


def display_values(heat: torch.Tensor, scale: str, keys: int = 0) -> torch.Tensor:
    """Values in the scale's units: gates as they are, relative weights times ``keys``."""
    if scale == "relative":
        if keys < 1:
            raise ValueError("a relative map needs its number of keys")
        return heat.float() * float(keys)
    if scale in ("gate", "gain"):
        return heat.float()
    raise ValueError(f"unknown value scale {scale!r}; valid: gate, gain, relative")


def to_unit(heat: torch.Tensor, scale: str, keys: int = 0, norm: str = "fixed") -> torch.Tensor:
    """``(B, ...)`` map values -> positions in [0, 1] on the colour map (fp32; non-finite values -> 0)."""
    check_norm(norm)
    v = torch.nan_to_num(display_values(heat, scale, keys), nan=0.0, posinf=0.0, neginf=0.0)
    if norm == "per_image":
        flat = v.reshape(v.shape[0], -1)
        lo = flat.amin(1, keepdim=True)
        span = flat.amax(1, keepdim=True) - lo
        # A constant map has no hot spot: it stays at the colormap's cold end rather than dividing by zero.
        flat = torch.where(span > 0, (flat - lo) / span.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
        return flat.reshape(v.shape)
    if scale == "gate":
        return v.clamp(0, 1)
    if scale == "gain":
        return (v / GAIN_RANGE).clamp(0, 1)
    top = math.log2(RELATIVE_RANGE)
    return ((torch.log2(v.clamp_min(1e-30)) + top) / (2 * top)).clamp(0, 1)


def uniform_position() -> float:
    """Where uniform attention (x1) sits on a relative map's colour map."""
    return 0.5


def ticks(scale: str, norm: str = "fixed") -> List[Tuple[float, str]]:
    """``(position in [0, 1], label)`` of the colour bar's ticks."""
    if check_norm(norm) == "per_image":
        return [(0.0, "min"), (0.5, "mid"), (1.0, "max")]
    if scale == "gate":
        return [(t, f"{t:g}") for t in (0.0, 0.25, 0.5, 0.75, 1.0)]
    if scale == "gain":
        return [(t / GAIN_RANGE, f"{t:g}" + ("x" if t == GAIN_RANGE else "")) for t in (0.0, 0.5, 1.0, 1.5, 2.0)]
    top = int(math.log2(RELATIVE_RANGE))
    labels = {-3: "1/8", -2: "1/4", -1: "1/2", 0: "1", 1: "2", 2: "4", 3: "8"}
    return [((e + top) / (2 * top), labels.get(e, f"2^{e}") + ("x" if e == top else "")) for e in range(-top, top + 1)]


def scale_title(scale: str, norm: str = "fixed") -> str:
    if check_norm(norm) == "per_image":
        return "stretched per image (see captions)"
    if scale == "gate":
        return "gate value, fixed 0-1"
    if scale == "gain":
        return "gain, fixed 0-2 (1 = unchanged)"
    return "x uniform attention, log 1/8-8"


def map_stats(heat: torch.Tensor, scale: str, keys: int = 0) -> List[Stats]:
    """Per image of ``(B, h, w)``: range (in the scale's units) and peakedness."""
    out = []
    v = display_values(heat, scale, keys).reshape(heat.shape[0], -1)
    for row in v:
        finite = bool(torch.isfinite(row).all())
        r = torch.nan_to_num(row, nan=0.0, posinf=0.0, neginf=0.0)
        lo, hi, mean = float(r.min()), float(r.max()), float(r.mean())
        if scale == "relative":
            total = float(r.clamp_min(0).sum())
            p = r.clamp_min(0) / total if total > 0 else torch.full_like(r, 1.0 / r.numel())
            ent = float(-(p * torch.log(p.clamp_min(1e-30))).sum()) / math.log(r.numel()) if r.numel() > 1 else 1.0
            out.append(Stats(lo, hi, hi, min(max(ent, 0.0), 1.0) + 0.0, finite))  # + 0.0: no "-0.00"
        else:
            out.append(Stats(lo, hi, hi / mean if mean > 0 else float("inf"), float("nan"), finite))
    return out


def _num(v: float) -> str:
    if not math.isfinite(v):
        return str(v)
    a = abs(v)
    if a >= 100:
        return f"{v:.0f}"
    if a >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}" if a >= 0.01 or v == 0 else f"{v:.1e}"


def caption(stats: Stats, scale: str, norm: str = "fixed") -> str:
    """One short line: the range and the peakedness, e.g. ``"0.48-0.53 max/mean 1.04"`` or
    ``"x0.61-3.2 H 0.93"`` (relative: x uniform, H = entropy / uniform's)."""
    if scale == "relative":
        text = f"x{_num(stats.lo)}-{_num(stats.hi)}  H {stats.entropy:.2f}"
    else:
        text = f"{_num(stats.lo)}-{_num(stats.hi)}  max/mean {_num(stats.peak)}"
    return text + (" (str.)" if norm == "per_image" else "")


__all__ = ["GAIN_RANGE", "NORMS", "RELATIVE_RANGE", "Stats", "caption", "display_values", "map_stats", "scale_title", "ticks",
           "to_unit", "uniform_position"]
