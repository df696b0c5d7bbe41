"""The one readout from records to drawable maps, shared by the TensorBoard logger, ``visualize``,
``faithfulness`` and the benches.

    with record_attention(model) as rec:
        model(images)
    for m in read_maps(rec.records, model, images.shape):
        m.name, m.kind, m.heat, m.scale, m.keys, m.geometry, m.description

Each :class:`LayerMap` is one map per image, ``(B, h, w)``, on the record's grid, with what is needed to draw
it honestly: its value scale (``"gate"``, ``"gain"`` or ``"relative"``, :mod:`visattn.maps.scale`), the number of keys its
weights are spread over (uniform = 1 / keys), where its cells lie on the input (:mod:`visattn.maps.geometry`)
and a one-line description. Names are the TensorBoard tags without ``maps/``: the block's module path, ``@1``,
``@2`` for its later calls in one pass, ``<layer>/cls_head<i>`` for single heads, ``rollout`` for the attention
rollout through the last run of token layers on one grid, read out the way the model pools (class token,
mean, or its sequence-pooling weights).

Records of a gradient recording (:class:`~visattn.maps.record.GradientRecord`, ``record_attention(...,
gradients=True)``) also give ``<layer>/grad`` (kind ``"attention_gradient"``: the gate or attention weighted by
its gradient for the target class, :func:`~visattn.maps.record.gradient_heatmap`) and ``rollout_grad`` (kind
``"gradient_rollout"``: Chefer et al.'s gradient-weighted rollout, :func:`~visattn.maps.rollout.gradient_rollout`).
They are shares of the positive evidence (sum 1 over positions), on the ``"relative"`` scale: x the uniform
share. A model whose gradient maps lie on more than one grid (a CNN with a block in each stage, where no
rollout can join them) also gets ``layers_grad`` (kind ``"layers_gradient"``, :func:`fuse_layers`): the mean
of those maps' shares, each placed on the input's pixels where its cells lie.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..attention.tap import AttentionRecord
from .geometry import GeometryTrace, GridGeometry, place, trace_geometry
from .record import gradient_heatmap, spatial_heatmap, unwrap_model
from .rollout import attention_rollout, gradient_rollout
from .scale import Stats, map_stats, scale_title, to_unit

HEAD_MAPS = ("all", "last", "none")
GRADIENT_KINDS = ("attention_gradient", "gradient_rollout", "layers_gradient")  # LayerMap kinds made from gradients
_POOL_CLS = {"cls", "token"}
_POOL_MEAN = {"mean", "avg", "gap"}
_POOL_SEQ = {"seq", "sequence", "attn", "attention"}


@dataclass
class LayerMap:
    name: str  # tag without "maps/": "layers.0.units.0.attn.spatial", "blocks.1.attn/cls_head0", "rollout"
    kind: str  # "spatial" | "token" | "pool" | "head" | "rollout" | "attention_gradient" | "gradient_rollout" | ...
    heat: torch.Tensor  # (B, h, w) fp32, raw values (gates, or weights / shares summing to <= 1 over the keys)
    scale: str  # "gate" | "gain" | "relative"
    keys: int  # tokens / positions the weights are spread over (uniform weight = 1 / keys); 0 for gates
    geometry: GridGeometry
    description: str
    record: Optional[AttentionRecord] = None

    @property
    def tag(self) -> str:
        return f"maps/{self.name}"

    def unit(self, norm: str = "fixed") -> torch.Tensor:
        """Colour-map positions in [0, 1], ``(B, h, w)``."""
        return to_unit(self.heat, self.scale, self.keys, norm)

    def stats(self) -> List[Stats]:
        return map_stats(self.heat, self.scale, self.keys)

    def finite(self) -> bool:
        return bool(torch.isfinite(self.heat).all())


def pool_mode(model: Optional[nn.Module]) -> Optional[str]:
    """How ``model`` pools its tokens, from its ``pool`` / ``global_pool`` attribute: ``"cls"``, ``"mean"``,
    ``"seq"``, or None when it does not say."""
    if model is None:
        return None
    for attr in ("pool", "global_pool"):
        value = getattr(model, attr, None)
        if isinstance(value, str):
            v = value.lower()
            for mode, names in (("cls", _POOL_CLS), ("mean", _POOL_MEAN), ("seq", _POOL_SEQ)):
                if v in names:
                    return mode
    return None


def rollout_layers(token_records: Sequence[AttentionRecord]) -> List[AttentionRecord]:
    """The last run of consecutive token records sharing token count, grid and prefix (a transformer trunk)."""
    run: List[AttentionRecord] = []
    for r in token_records:
        key = (r.weights.shape[-1], r.grid, r.num_prefix_tokens)
        if run and key != (run[-1].weights.shape[-1], run[-1].grid, run[-1].num_prefix_tokens):
            run = []
        run.append(r)
    return run


def _owner(model: Optional[nn.Module], name: str) -> str:
    if model is None:
        return "block"
    try:
        return type(model.get_submodule(name.split("@")[0])).__name__
    except AttributeError:
        return "block"


def _describe(kind: str, owner: str, scale: str, geometry: GridGeometry, extra: str = "") -> str:
    share = "share of the positive evidence per position (sum 1)"
    what = {
        "attention_gradient": f"{extra} of {owner} for the target class's logit; {share}",
        "gradient_rollout": f"gradient-weighted attention rollout (Chefer, Gur, Wolf 2021){extra}; {share}",
        "layers_gradient": f"mean of the layers' gate or attention x gradient shares{extra}; {share}",
        "spatial": f"spatial map of {owner}"
        + {"relative": " (softmax over positions)", "gain": " (gain per position, 2 x sigmoid: 1 = unchanged)"}.get(
            scale, " (sigmoid gate per position)"),
        "token": f"attention of {owner}{extra}",
        "pool": f"attention-pooling weights of {owner} over the tokens",
        "head": f"class-token attention of one head of {owner}",
        "rollout": f"attention rollout (Abnar & Zuidema 2020){extra}",
    }.get(kind, f"{kind} map{extra}")
    return f"{what}; scale: {scale_title(scale)}; {geometry.describe()}"


class _Reader:
    """Turns records into :class:`LayerMap`s; holds the model, input size and geometry trace."""

    def __init__(self, model: Optional[nn.Module], image_hw, trace: Optional[GeometryTrace], gradients: bool = True):
        self.model = model
        self.image_hw = tuple(image_hw)
        self.trace = trace
        self.gradients = gradients
        self.calls: Dict[str, int] = {}

    def geometry(self, grid, name: Optional[str], call: int) -> GridGeometry:
        if self.trace is None:
            return GridGeometry.stretched(grid, self.image_hw)
        return self.trace.lookup(grid, name, call)

    def record_maps(self, r: AttentionRecord, heads: bool) -> List[LayerMap]:
        k = self.calls.get(r.name, 0)
        self.calls[r.name] = k + 1
        if r.kind == "channel":
            return []
        heat = spatial_heatmap(r, image_hw=self.image_hw)  # (B, h, w)
        name = record_tag(r.name, k)
        geo = self.geometry(heat.shape[-2:], r.name, k)
        owner = _owner(self.model, r.name)
        scale = r.value_scale
        keys = int(r.weights.shape[-1]) if r.kind in ("token", "pool") else int(heat.shape[-1] * heat.shape[-2])
        extra = ""
        if r.kind == "token":
            n_heads = r.weights.shape[1]
            extra = (f": the class token's row, mean of {n_heads} heads" if r.num_prefix_tokens > 0
                     else f": attention each position receives, mean of {n_heads} heads and all queries")
        out = [LayerMap(name, r.kind, heat, scale, keys if scale == "relative" else 0, geo,
                        _describe(r.kind, owner, scale, geo, extra), r)]
        if heads and r.kind == "token" and r.num_prefix_tokens > 0:
            p = r.num_prefix_tokens
            for h in range(r.weights.shape[1]):
                hm = r.weights[:, h, 0, p:].reshape(heat.shape)
                out.append(LayerMap(f"{name}/cls_head{h}", "head", hm, "relative", keys, geo,
                                    _describe("head", owner, "relative", geo), r))
        if self.gradients and getattr(r, "relevance", None) is not None:
            try:
                out.append(self.gradient_map(r, name, geo, owner))
            except ValueError:
                pass  # a relevance with no map: the record's own maps stand
        return out

    def gradient_map(self, r: AttentionRecord, name: str, geo: GridGeometry, owner: str) -> LayerMap:
        heat = gradient_heatmap(r, image_hw=self.image_hw)
        what = {"spatial": "gate x gradient (Grad-CAM's rule: positive part of gate * d logit / d gate, summed over "
                           "the gate's channels)" + (" through the block's output" if getattr(r, "via", "") == "output" else ""),
                "pool": "pooling weights x gradient (positive part of w * d logit / d w)"}.get(
            r.kind, "attention x gradient (Chefer et al. 2021: E_h[(grad * A)^+], "
            + ("the class token's row)" if r.num_prefix_tokens > 0 else "received per position, mean of the queries)"))
        cells = int(heat.shape[-1] * heat.shape[-2])
        return LayerMap(f"{name}/grad", "attention_gradient", heat, "relative", cells, geo,
                        _describe("attention_gradient", owner, "relative", geo, what), r)

    def readout(self, records: Sequence[AttentionRecord], layers: Sequence[AttentionRecord]) -> Tuple[Any, str]:
        """How the rollout through ``layers`` is read out, as the model pools: ``(readout, words)``."""
        p, n = layers[0].num_prefix_tokens, layers[0].weights.shape[-1]
        pools = [r for r in records if r.kind == "pool" and r.weights.shape[-1] == n]
        mode = pool_mode(unwrap_model(self.model) if self.model is not None else None)
        if mode is None:
            mode = "cls" if p > 0 else ("seq" if pools else "mean")
        if mode == "cls" and p == 0:
            mode = "mean"
        readout: Any = pools[-1] if mode == "seq" and pools else ("mean" if mode == "seq" else mode)
        how = {"cls": "the class token", "mean": "the mean over tokens"}.get(
            readout if isinstance(readout, str) else "", "the sequence-pooling weights")
        return readout, how

    def rollout(self, records: Sequence[AttentionRecord], gradient: bool = False) -> Optional[LayerMap]:
        layers = rollout_layers([r for r in records if r.kind == "token"])
        if not layers or (gradient and any(getattr(r, "relevance", None) is None for r in layers)):
            return None
        p = layers[0].num_prefix_tokens
        readout, how = self.readout(records, layers)
        try:
            grid = layers[0].grid or tuple(spatial_heatmap(layers[0], image_hw=self.image_hw).shape[-2:])
            if gradient:
                heat = gradient_rollout(layers, num_prefix_tokens=p, readout=readout, grid=grid)
            else:
                heat = attention_rollout(layers, num_prefix_tokens=p, readout=readout, grid=grid)
        except ValueError:
            return None
        geo = self.geometry(heat.shape[-2:], layers[0].name, 0)
        # the share of the flow that comes from the grid tokens (prefix tokens' own share left out), so a
        # model that attends uniformly gives exactly x1 everywhere
        heat = heat / heat.flatten(1).sum(1).clamp_min(torch.finfo(torch.float32).tiny)[:, None, None]
        cells = int(heat.shape[-1] * heat.shape[-2])
        if gradient:
            return LayerMap("rollout_grad", "gradient_rollout", heat, "relative", cells, geo,
                            _describe("gradient_rollout", "", "relative", geo,
                                      f": R = I + A_bar R with A_bar = E_h[(grad * A)^+] through {len(layers)} "
                                      f"layer(s), read out by {how}"))
        return LayerMap("rollout", "rollout", heat, "relative", cells, geo,
                        _describe("rollout", "", "relative", geo,
                                  f" through {len(layers)} layer(s), read out by {how}; the grid's share of the flow"))


def fuse_layers(maps: Sequence[LayerMap], image_hw: Sequence[int]) -> Optional[LayerMap]:
    """``layers_grad``: the per-layer gradient maps (kind ``"attention_gradient"``) of ``maps`` joined into one
    map on the input's pixels, or None when they lie on fewer than two grids (one grid: a transformer trunk,
    which :func:`~visattn.maps.rollout.gradient_rollout` joins instead).

    Each layer's map is placed on an ``image_hw`` picture where its cells lie
    (:func:`~visattn.maps.geometry.place`; 0 where no cell reaches), re-normalised to sum 1 over the pixels,
    and the layers are averaged with equal weight, so every stage has the same say whatever its resolution:
    a share of the positive evidence per pixel (sum 1), on the ``"relative"`` scale (x the uniform share).
    The multi-layer fusion of class activation maps in the spirit of LayerCAM (Jiang et al. 2021), applied
    to the blocks' own gates and attention rather than to the convolutions' activations.
    """
    grads = [m for m in maps if m.kind == "attention_gradient"]
    if len({tuple(m.heat.shape[-2:]) for m in grads}) < 2:
        return None
    hw = (int(image_hw[0]), int(image_hw[1]))
    tiny = torch.finfo(torch.float32).tiny
    shares = []
    for m in grads:
        values, covered = place(m.heat.float().clamp_min(0), m.geometry, hw, hw)  # NaN stays NaN: the logger skips it
        values = values * covered
        shares.append(values / values.flatten(1).sum(1).clamp_min(tiny)[:, None, None])
    heat = torch.stack(shares).mean(0)
    geo = GridGeometry.image(hw)
    names = ", ".join(m.name.removesuffix("/grad") for m in grads)
    return LayerMap("layers_grad", "layers_gradient", heat, "relative", hw[0] * hw[1], geo,
                    _describe("layers_gradient", "", "relative", geo,
                              f" ({len(grads)} layers, equal weight, on the input's pixels: {names})"))


def read_maps(records: Sequence[AttentionRecord], model: Optional[nn.Module] = None,
              input_shape: Optional[Sequence[int]] = None, head_maps: str = "none", rollout: bool = True,
              geometry: Optional[GeometryTrace] = None, gradients: bool = True) -> List[LayerMap]:
    """Every drawable map of one recorded pass, in call order (each record's map, its heads, its ``/grad``
    map), then the rollout, the gradient rollout and the layers' joined gradient map (:func:`fuse_layers`).

    ``records``: one pass's records (``rec.records``, or ``rec.by_pass(i)``). ``model``: the recorded model;
    it names the blocks in the descriptions, says how the model pools (for the rollout) and gives the grid
    geometry (traced once per input shape, :func:`~visattn.maps.geometry.trace_geometry`; without a model
    each grid is stretched over the image). ``input_shape``: the model input's ``(B, C, H, W)`` or
    ``(C, H, W)`` (needed when ``geometry`` is not given). ``head_maps``: token layers with a class token
    that also get one map per head: ``"all"``, ``"last"`` or ``"none"``. ``gradients``: also the gradient
    maps of records that carry a relevance (a gradient recording). Channel records have no map
    (see :func:`channel_records`); records whose map cannot be formed are left out.
    """
    if head_maps not in HEAD_MAPS:
        raise ValueError(f"unknown head_maps {head_maps!r}; valid: {', '.join(HEAD_MAPS)}")
    if geometry is None and input_shape is None:
        raise ValueError("read_maps needs input_shape (or a geometry trace)")
    if geometry is None and model is not None:
        geometry = trace_geometry(model, input_shape)
    image_hw = geometry.image_hw if geometry is not None else tuple(input_shape[-2:])
    reader = _Reader(model, image_hw, geometry, gradients)
    cls_layers = [r for r in records if r.kind == "token" and r.num_prefix_tokens > 0]
    with_heads = {"all": cls_layers, "last": cls_layers[-1:], "none": []}[head_maps]
    out: List[LayerMap] = []
    for r in records:
        try:
            out += reader.record_maps(r, any(r is h for h in with_heads))
        except ValueError:
            continue
    if rollout:
        for ro in (reader.rollout(records), reader.rollout(records, gradient=True) if gradients else None):
            if ro is not None:
                out.append(ro)
    if gradients:
        fused = fuse_layers(out, image_hw)
        if fused is not None:
            out.append(fused)
    return out


def record_tag(name: str, call: int) -> str:
    """A record's tag: its module path, with ``@k`` for the k-th call of a block called more than once."""
    return (name or "model") + (f"@{call}" if call else "")


def named_records(records: Sequence[AttentionRecord], kind: str, dims: Optional[int] = None) -> List[tuple]:
    """``(tag, record)`` for the records of ``kind`` (and ``dims`` dimensions), tagged like the maps."""
    seen: Dict[str, int] = {}
    out = []
    for r in records:
        k = seen.get(r.name, 0)
        seen[r.name] = k + 1
        if r.kind == kind and (dims is None or r.weights.dim() == dims):
            out.append((record_tag(r.name, k), r))
    return out


def channel_records(records: Sequence[AttentionRecord]) -> List[tuple]:
    """``(tag, record)`` for the channel gates (no spatial layout: drawn as histograms)."""
    return named_records(records, "channel")


__all__ = ["GRADIENT_KINDS", "HEAD_MAPS", "LayerMap", "channel_records", "fuse_layers", "named_records", "pool_mode",
           "read_maps", "record_tag", "rollout_layers"]
