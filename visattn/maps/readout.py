"""From records to drawable maps: the one readout shared by the TensorBoard logger, ``visualize``,
``faithfulness`` and the benches.

    for m in read_maps(rec.records, model, images.shape):
        m.name, m.kind, m.heat, m.scale, m.keys, m.geometry, m.description

Each :class:`LayerMap` is one map per image, ``(B, h, w)`` on the record's grid, with what drawing it honestly
needs: its value scale (``"gate"``, ``"gain"`` or ``"relative"``, :mod:`.render`), the keys its weights are
spread over (uniform = 1 / keys) and where its cells lie on the input (:mod:`.geometry`). Names are the
TensorBoard tags without ``maps/``: the block's module path (``@1``, ``@2`` for later calls in one pass),
``<layer>/cls_head<i>`` for single heads, ``rollout`` through the last run of token layers on one grid.
A gradient recording also gives ``<layer>/grad`` (:func:`gradient_heatmap`), ``rollout_grad`` and, for a CNN
whose blocks lie on several grids, ``layers_grad`` (:func:`fuse_layers`): shares of the positive evidence
(sum 1), on the ``"relative"`` scale.

:func:`attention_rollout` (Abnar & Zuidema 2020, arXiv 2005.00928): each layer fused over heads, optionally
thinned (as in Gildenblat's vit-explain), plus the identity for the residual path, rows renormalised, and
multiplied in order, ``R = A_L @ ... @ A_1``. :func:`gradient_rollout` (Chefer, Gur, Wolf 2021, arXiv
2103.15679): ``R = I; R = R + A_bar R`` with ``A_bar = E_h[(grad * A)^+]``. Both are read out as the model
pools: the class token's row, the mean over tokens, or its own pooling weights.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ..attention.tap import AttentionRecord
from . import families
from .geometry import GeometryTrace, GridGeometry, place, trace_geometry
from .kinds import MATRIX, infer_grid, kind_of, kinds_where, record_kind
from .record import unwrap_model
from .render import Stats, describe, map_stats, to_unit

HEAD_MAPS = ("all", "last", "none")
GRADIENT_KINDS = kinds_where("from_gradients")  # LayerMap kinds made from gradients
GRADIENT_LAYER_KINDS = ("attention_gradient",)  # one layer's gradient map: what fuse_layers joins
_POOL_CLS = {"cls", "token"}
_POOL_MEAN = {"mean", "avg", "gap"}
_POOL_SEQ = {"seq", "sequence", "attn", "attention"}
HEAD_FUSIONS = ("mean", "max", "min")


@dataclass
class LayerMap:
    name: str  # tag without "maps/": "layers.0.units.0.attn.spatial", "blocks.1.attn/cls_head0", "rollout"
    kind: str  # "spatial" | "token" | "pool" | "head" | "rollout" | "attention_gradient" | "gradient_rollout" | ...
    heat: torch.Tensor  # (B, h, w) fp32, raw values (gates, or weights / shares summing to <= 1 over the keys)
    scale: str  # "gate" | "gain" | "relative"
    keys: int  # tokens / positions the weights are spread over (uniform weight = 1 / keys); 0 for gates
    geometry: GridGeometry
    note: str = ""  # the description of a map made outside read_maps (a baseline, a caller's own map)
    record: Optional[AttentionRecord] = None
    info: Dict[str, Any] = field(default_factory=dict)  # facts for the description: owner, layers, readout

    @property
    def tag(self) -> str:
        return f"maps/{self.name}"

    @property
    def placed(self) -> bool:
        """Its cells lie on the image (False for a matrix kind such as ``"covariance"``)."""
        return kind_of(self.kind).placed

    @property
    def description(self) -> str:
        """One line: what the map is, its scale and where its cells lie (:func:`~visattn.maps.render.describe`)."""
        return describe(self)

    def unit(self, norm: str = "fixed") -> torch.Tensor:
        """Colour-map positions in [0, 1], ``(B, h, w)``."""
        return to_unit(self.heat, self.scale, self.keys, norm)

    def stats(self) -> List[Stats]:
        return map_stats(self.heat, self.scale, self.keys)

    def finite(self) -> bool:
        return bool(torch.isfinite(self.heat).all())


# ----------------------------------------------------------------------------- a record as a 2-D map


def spatial_heatmap(
    record: AttentionRecord, image_hw: Optional[Sequence[int]] = None, query: str = "auto"
) -> torch.Tensor:
    """A per-image 2-D map ``(B, h, w)`` on the record's grid (fp32, the weights' device), read back as its
    kind's table entry says (:mod:`.kinds`):

    * ``spatial``: the gate itself.
    * ``token``: ``query="cls"``: the class token's row (mean over heads) over the grid tokens;
      ``query="mean"``: the attention each grid token receives, averaged over heads and over the grid
      queries (prefix rows and columns dropped); ``"auto"`` picks ``"cls"`` when the record has a prefix
      token, else ``"mean"``.
    * ``pool``: the pooling weights of the grid tokens (prefix tokens dropped).
    * ``covariance``: the ``(B, d, d)`` channel x channel matrix, mean of the heads (not an image map).
    * ``channel``: raises ValueError (channel weights have no spatial layout).

    ``image_hw`` only matters for a token/pool record that carries no grid: the grid is then the
    factorisation of its token count closest to the image's aspect ratio (square when not given).
    """
    if query not in ("auto", "cls", "mean"):
        raise ValueError(f"unknown query {query!r}; valid: auto, cls, mean")
    return record_kind(record).read(record, record.weights.float(), image_hw, query)


def gradient_heatmap(record: AttentionRecord, image_hw: Optional[Sequence[int]] = None,
                     query: str = "auto") -> torch.Tensor:
    """The map ``(B, h, w)`` of a :class:`GradientRecord`'s relevance: each image's positive evidence for the
    target class, normalised to sum to 1 over the positions (all zeros where there is none).

    * ``spatial`` (a gate, GC's context softmax): Grad-CAM's rule on the gate: ``gate * d logit / d gate``
      summed over the gate's channels, positive part.
    * ``token``: Chefer, Gur, Wolf 2021 (arXiv 2103.15679): ``E_h[(grad * A)^+]``, the positive part per head
      averaged over heads, read out like :func:`spatial_heatmap` (the class token's row, or what each grid
      position receives averaged over the grid queries).
    * ``pool``: ``(w * d logit / d w)^+`` over the grid tokens.

    The values are shares, not gates: a product with a gradient has no fixed range, so the map is drawn on
    the ``"relative"`` scale (x the uniform share, 1 / positions), like the rollout.
    """
    rel = getattr(record, "relevance", None)
    if rel is None:
        raise ValueError(f"record {record.name!r} carries no relevance (record with gradients=True)")
    rel = rel.float()
    if kind_of(record.kind).sums_channels and rel.dim() == 4:
        rel = rel.sum(1, keepdim=True)
    heat = spatial_heatmap(replace(record, weights=rel.clamp_min(0)), image_hw, query)
    total = heat.flatten(1).sum(1).clamp_min(torch.finfo(torch.float32).tiny)
    return heat / total[:, None, None]


# ----------------------------------------------------------------------------- rollout


def _as_weights(layer: Union[torch.Tensor, AttentionRecord], i: int, attr: str = "weights") -> torch.Tensor:
    if isinstance(layer, AttentionRecord):
        if not kind_of(layer.kind).rolls_out:
            raise ValueError(f"layer {i} ({layer.name!r}) is a {layer.kind!r} record; rollout needs token records")
        if getattr(layer, attr, None) is None:
            raise ValueError(f"layer {i} ({layer.name!r}) carries no {attr} (record with gradients=True)")
        layer = getattr(layer, attr)
    if not isinstance(layer, torch.Tensor):
        raise TypeError(f"layer {i}: expected a tensor or an AttentionRecord, got {type(layer).__name__}")
    if layer.dim() != 4 or layer.shape[-1] != layer.shape[-2]:
        raise ValueError(f"layer {i}: attention must be (B, heads, N, N), got {tuple(layer.shape)}")
    return layer.float()


def _from_records(attentions, attr: str):
    values = {getattr(a, attr) for a in attentions if isinstance(a, AttentionRecord)} - {None}
    if len(values) > 1:
        raise ValueError(f"the records disagree on {attr}: {sorted(values, key=str)}")
    return values.pop() if values else None


def _layout(attentions, layers: List[torch.Tensor], num_prefix_tokens: Optional[int], grid) -> Tuple[int, int, int]:
    """``(p, gh, gw)``: prefix-token count and grid, from the arguments or the records, checked."""
    n = layers[0].shape[-1]
    rec_prefix = _from_records(attentions, "num_prefix_tokens")
    if num_prefix_tokens is None:
        num_prefix_tokens = 1 if rec_prefix is None else rec_prefix
    elif rec_prefix is not None and rec_prefix != num_prefix_tokens:
        raise ValueError(f"num_prefix_tokens={num_prefix_tokens} but the records say {rec_prefix}")
    p = int(num_prefix_tokens)
    if not 0 <= p < n:
        raise ValueError(f"num_prefix_tokens must be in [0, {n}) for {n} tokens, got {p}")
    if grid is None:
        grid = _from_records(attentions, "grid")
    gh, gw = infer_grid(n - p) if grid is None else (int(grid[0]), int(grid[1]))
    if gh * gw != n - p:
        raise ValueError(f"grid {gh}x{gw} does not hold the {n - p} tokens after {p} prefix token(s)")
    return p, gh, gw


def _fused(a: torch.Tensor, head_fusion: str, num_discard: int, protected: torch.Tensor) -> torch.Tensor:
    """One layer ``(B, heads, N, N)`` -> fused over heads, thinned, plus the identity, rows renormalised."""
    b, _, n, _ = a.shape
    fused = {"mean": lambda: a.mean(1), "max": lambda: a.amax(1), "min": lambda: a.amin(1)}[head_fusion]()
    if num_discard > 0:
        flat = fused.reshape(b, n * n)
        candidates = flat.masked_fill(protected, float("inf"))
        drop = candidates.topk(num_discard, dim=1, largest=False).indices  # (B, k)
        fused = flat.scatter(1, drop, 0.0).reshape(b, n, n)
    fused = fused + torch.eye(n, device=a.device)  # the residual connection carries each token to itself
    return fused / fused.sum(-1, keepdim=True)


def _read_out(result: torch.Tensor, readout, p: int) -> torch.Tensor:
    """``(B, N)`` flow into what the classifier reads, from the rolled-out ``(B, N, N)`` matrix."""
    b, n, _ = result.shape
    if isinstance(readout, AttentionRecord):
        if not kind_of(readout.kind).pools:
            raise ValueError(f"readout record {readout.name!r} is {readout.kind!r}; expected a pool record")
        readout = readout.weights
    if isinstance(readout, torch.Tensor):
        if tuple(readout.shape) != (b, n):
            raise ValueError(f"pooling weights must be (B, N) = {(b, n)}, got {tuple(readout.shape)}")
        return torch.einsum("bi,bij->bj", readout.float().to(result.device), result)
    if readout == "cls":
        if p == 0:
            raise ValueError("readout='cls' needs a class token (num_prefix_tokens >= 1); use readout='mean'")
        return result[:, 0]  # what the class token's output draws from each input token
    if readout == "mean":
        return result[:, p:].mean(1)  # averaged over the grid tokens' outputs, as global pooling does
    raise ValueError(f"unknown readout {readout!r}; valid: cls, mean, or a (B, N) tensor of pooling weights")


def _checked(attentions, attr: str, num_prefix_tokens, grid) -> Tuple[List[torch.Tensor], Tuple[int, int, int]]:
    """The layers as ``(B, heads, N, N)`` fp32 tensors (``attr`` of records), checked, and ``(p, gh, gw)``."""
    if isinstance(attentions, (torch.Tensor, AttentionRecord)) or len(attentions) == 0:
        raise ValueError("attentions must be a non-empty list of (B, heads, N, N) tensors or token records")
    layers = [_as_weights(a, i, attr) for i, a in enumerate(attentions)]
    b, _, n, _ = layers[0].shape
    for i, a in enumerate(layers[1:], start=1):
        if a.shape[0] != b or a.shape[-1] != n:
            raise ValueError(
                f"layer {i}: attention shape {tuple(a.shape)} does not match layer 0's {tuple(layers[0].shape)} "
                "(batch and token count must agree)"
            )
    return layers, _layout(attentions, layers, num_prefix_tokens, grid)


def attention_rollout(
    attentions: Sequence[Union[torch.Tensor, AttentionRecord]],
    head_fusion: str = "mean",
    discard_ratio: float = 0.0,
    num_prefix_tokens: Optional[int] = None,
    readout: Union[str, torch.Tensor, AttentionRecord] = "cls",
    grid: Optional[Tuple[int, int]] = None,
) -> torch.Tensor:
    """Roll attention out through the layers and return a map ``(B, H, W)`` over the grid tokens (fp32).

    ``attentions``: per layer, first to last, ``(B, heads, N, N)`` tensors or token ``AttentionRecord``s
    (the whole batch at once; heads may differ between layers, ``B`` and ``N`` may not).
    ``head_fusion``: ``"mean"``, ``"max"`` or ``"min"`` over heads.
    ``discard_ratio``: per image and layer, the fraction of the fused ``N*N`` weights set to zero, lowest
    first. Kept always: each prefix (class) token's attention to itself, the diagonal entries
    ``(p, p)`` for ``p < num_prefix_tokens``, so the class token's path to itself survives thinning; the
    count discarded is ``floor(discard_ratio * (N*N - num_prefix_tokens))``. Rows stay positive because
    the identity is added afterwards.
    ``num_prefix_tokens``: tokens before the grid tokens; default: the records' value, else 1.
    ``readout``: ``"cls"`` (row of token 0, the class token), ``"mean"`` (uniform mean over the grid
    tokens' rows, for models that average-pool without a class token), or pooling weights ``(B, N)`` over
    all tokens (a tensor or a pool ``AttentionRecord``; CCT's sequence pooling). Prefix columns are dropped.
    ``grid``: ``(H, W)`` of the grid tokens; default: the records' grid, else a square.
    """
    if head_fusion not in HEAD_FUSIONS:
        raise ValueError(f"unknown head_fusion {head_fusion!r}; valid: {', '.join(HEAD_FUSIONS)}")
    if not 0.0 <= float(discard_ratio) < 1.0:
        raise ValueError(f"discard_ratio must be in [0, 1), got {discard_ratio}")
    layers, (p, gh, gw) = _checked(attentions, "weights", num_prefix_tokens, grid)
    b, _, n, _ = layers[0].shape
    device = layers[0].device
    # Discarding never touches the prefix tokens' self-attention entries (p, p).
    protected = torch.zeros(n * n, dtype=torch.bool, device=device)
    protected[torch.arange(p, device=device) * (n + 1)] = True
    num_discard = int(float(discard_ratio) * (n * n - p))
    result = torch.eye(n, device=device).expand(b, n, n)
    for a in layers:
        result = _fused(a.to(device), head_fusion, num_discard, protected) @ result
    return _read_out(result, readout, p)[:, p:].reshape(b, gh, gw)


def gradient_rollout(
    relevances: Sequence[Union[torch.Tensor, AttentionRecord]],
    num_prefix_tokens: Optional[int] = None,
    readout: Union[str, torch.Tensor, AttentionRecord] = "cls",
    grid: Optional[Tuple[int, int]] = None,
) -> torch.Tensor:
    """Chefer et al.'s gradient-weighted rollout: a map ``(B, H, W)`` over the grid tokens (fp32, >= 0).

    ``relevances``: per layer, first to last, ``A * d logit / d A`` ``(B, heads, N, N)`` as tensors or the
    ``relevance`` of token :class:`~visattn.maps.record.GradientRecord`s (``record_attention(...,
    gradients=True)``). Each layer gives ``A_bar = E_h[(grad * A)^+]`` and ``R = I; R = R + A_bar @ R``.
    ``readout``, ``num_prefix_tokens`` and ``grid`` as for :func:`attention_rollout`. Under ``"mean"`` the
    identity's share (the same for every position) is left out, so the map shows what attention
    carried; under ``"cls"`` it never reaches the grid columns anyway.
    """
    layers, (p, gh, gw) = _checked(relevances, "relevance", num_prefix_tokens, grid)
    b, _, n, _ = layers[0].shape
    device = layers[0].device
    eye = torch.eye(n, device=device)
    result = eye.expand(b, n, n)
    for a in layers:
        result = result + a.to(device).clamp_min(0).mean(1) @ result
    if isinstance(readout, str) and readout == "mean":
        result = result - eye
    return _read_out(result, readout, p)[:, p:].reshape(b, gh, gw)


# ----------------------------------------------------------------------------- records -> maps


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


class _Reader:
    """Turns records into :class:`LayerMap`s; holds the model, input size and geometry trace."""

    def __init__(self, model: Optional[nn.Module], image_hw, trace: Optional[GeometryTrace], gradients: bool = True,
                 matrices: bool = False):
        self.model = model
        self.matrices = matrices
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
        kind = record_kind(r)
        if not (kind.placed or (self.matrices and kind.draw == MATRIX)):
            return []  # channel gates (histograms); matrices unless asked for
        heat = spatial_heatmap(r, image_hw=self.image_hw)  # (B, h, w); (B, d, d) for a matrix kind
        name = record_tag(r.name, k)
        geo = self.geometry(heat.shape[-2:], r.name, k) if kind.placed else GridGeometry(heat.shape[-2:], exact=False)
        info = {"owner": _owner(self.model, r.name)}
        if self.model is not None and families.where(unwrap_model(self.model), r.name):
            info["where"] = families.where(unwrap_model(self.model), r.name)
        scale = r.value_scale
        keys = kind.keys(r, heat)
        out = [LayerMap(name, r.kind, heat, scale, keys if scale == "relative" else 0, geo, record=r, info=info)]
        if heads and kind.head_maps and r.num_prefix_tokens > 0:
            p = r.num_prefix_tokens
            for h in range(r.weights.shape[1]):
                hm = r.weights[:, h, 0, p:].reshape(heat.shape)
                out.append(LayerMap(f"{name}/cls_head{h}", "head", hm, "relative", keys, geo, record=r, info=info))
        if self.gradients and kind.placed and getattr(r, "relevance", None) is not None:
            try:
                grad = gradient_heatmap(r, image_hw=self.image_hw)
            except ValueError:
                return out  # a relevance with no map: the record's own maps stand
            cells = int(grad.shape[-1] * grad.shape[-2])
            out.append(LayerMap(f"{name}/grad", "attention_gradient", grad, "relative", cells, geo, record=r,
                                info=info))
        return out

    def readout(self, records: Sequence[AttentionRecord], layers: Sequence[AttentionRecord]) -> Tuple[Any, str]:
        """How the rollout through ``layers`` is read out, as the model pools: ``(readout, mode)``."""
        p, n = layers[0].num_prefix_tokens, layers[0].weights.shape[-1]
        pools = [r for r in records if kind_of(r.kind).pools and r.weights.shape[-1] == n]
        mode = pool_mode(unwrap_model(self.model) if self.model is not None else None)
        if mode is None:
            mode = "cls" if p > 0 else ("seq" if pools else "mean")
        if mode == "cls" and p == 0:
            mode = "mean"
        if mode == "seq":
            return (pools[-1], "seq") if pools else ("mean", "mean")
        return mode, mode

    def rollout(self, records: Sequence[AttentionRecord], gradient: bool = False) -> Optional[LayerMap]:
        layers = rollout_layers([r for r in records if kind_of(r.kind).rolls_out])
        if not layers or (gradient and any(getattr(r, "relevance", None) is None for r in layers)):
            return None
        p = layers[0].num_prefix_tokens
        readout, mode = self.readout(records, layers)
        try:
            grid = layers[0].grid or tuple(spatial_heatmap(layers[0], image_hw=self.image_hw).shape[-2:])
            roll = gradient_rollout if gradient else attention_rollout
            heat = roll(layers, num_prefix_tokens=p, readout=readout, grid=grid)
        except ValueError:
            return None
        geo = self.geometry(heat.shape[-2:], layers[0].name, 0)
        # the share of the flow that comes from the grid tokens (prefix tokens' own share left out), so a
        # model that attends uniformly gives exactly x1 everywhere
        heat = heat / heat.flatten(1).sum(1).clamp_min(torch.finfo(torch.float32).tiny)[:, None, None]
        cells = int(heat.shape[-1] * heat.shape[-2])
        name, kind = ("rollout_grad", "gradient_rollout") if gradient else ("rollout", "rollout")
        return LayerMap(name, kind, heat, "relative", cells, geo, info={"layers": len(layers), "readout": mode})


def fuse_layers(maps: Sequence[LayerMap], image_hw: Sequence[int]) -> Optional[LayerMap]:
    """``layers_grad``: the per-layer gradient maps (kind ``"attention_gradient"``) of ``maps`` joined into one
    map on the input's pixels, or None when they lie on fewer than two grids (one grid: a transformer trunk,
    which :func:`gradient_rollout` joins instead).

    Each layer's map is placed on an ``image_hw`` picture where its cells lie
    (:func:`~visattn.maps.geometry.place`; 0 where no cell reaches), re-normalised to sum 1 over the pixels,
    and the layers are averaged with equal weight, so every stage has the same say whatever its resolution:
    a share of the positive evidence per pixel (sum 1), on the ``"relative"`` scale (x the uniform share).
    The multi-layer fusion of class activation maps in the spirit of LayerCAM (Jiang et al. 2021), applied
    to the blocks' own gates and attention rather than to the convolutions' activations.
    """
    grads = [m for m in maps if m.kind in GRADIENT_LAYER_KINDS]
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
    names = [m.name.removesuffix("/grad") for m in grads]
    return LayerMap("layers_grad", "layers_gradient", heat, "relative", hw[0] * hw[1], geo, info={"layers": names})


def read_maps(records: Sequence[AttentionRecord], model: Optional[nn.Module] = None,
              input_shape: Optional[Sequence[int]] = None, head_maps: str = "none", rollout: bool = True,
              geometry: Optional[GeometryTrace] = None, gradients: bool = True,
              matrices: bool = False) -> List[LayerMap]:
    """Every drawable map of one recorded pass, in call order (each record's map, its heads, its ``/grad``
    map), then the rollout, the gradient rollout and the layers' joined gradient map (:func:`fuse_layers`).

    ``records``: one pass's records (``rec.records``, or ``rec.by_pass(i)``). ``model``: the recorded model;
    it names the blocks in the descriptions, says how the model pools (for the rollout) and gives the grid
    geometry (traced once per input shape, :func:`~visattn.maps.geometry.trace_geometry`; without a model
    each grid is stretched over the image). ``input_shape``: the model input's ``(B, C, H, W)`` or
    ``(C, H, W)`` (needed when ``geometry`` is not given). ``head_maps``: token layers with a class token
    that also get one map per head: ``"all"``, ``"last"`` or ``"none"``. ``gradients``: also the gradient
    maps of records that carry a relevance (a gradient recording). ``matrices``: also the maps of the kinds
    drawn as a matrix and never placed on the image (``"covariance"``: a ``(B, d, d)`` map, mean of the heads;
    ``LayerMap.placed`` is False). Channel records have no map (TensorBoard draws them as histograms); records
    whose map cannot be formed are left out.
    """
    if head_maps not in HEAD_MAPS:
        raise ValueError(f"unknown head_maps {head_maps!r}; valid: {', '.join(HEAD_MAPS)}")
    if geometry is None and input_shape is None:
        raise ValueError("read_maps needs input_shape (or a geometry trace)")
    if geometry is None and model is not None:
        geometry = trace_geometry(model, input_shape)
    image_hw = geometry.image_hw if geometry is not None else tuple(input_shape[-2:])
    reader = _Reader(model, image_hw, geometry, gradients, matrices)
    cls_layers = [r for r in records if kind_of(r.kind).head_maps and r.num_prefix_tokens > 0]
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


def named_records(records: Sequence[AttentionRecord], kinds: Union[str, Sequence[str]],
                  dims: Optional[int] = None) -> List[tuple]:
    """``(tag, record)`` for the records of ``kinds`` (a kind or several; and ``dims`` dimensions), tagged like
    the maps."""
    wanted = (kinds,) if isinstance(kinds, str) else tuple(kinds)
    seen: Dict[str, int] = {}
    out = []
    for r in records:
        k = seen.get(r.name, 0)
        seen[r.name] = k + 1
        if r.kind in wanted and (dims is None or r.weights.dim() == dims):
            out.append((record_tag(r.name, k), r))
    return out
