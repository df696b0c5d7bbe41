"""Map kinds, one table: what each kind of record or map is, its value scale, how it is drawn and how it reads
back into per-layer maps. :mod:`.record`, :mod:`.readout`, :mod:`.render` and :mod:`.tensorboard` look a kind
up here (:func:`kind_of`) instead of switching on its name, so a new kind is one :class:`MapKind` entry.

Record kinds (what a tap emits, :data:`visattn.attention.tap.KINDS`):

* ``"channel"``: ``(B, C)`` gates (SE: Hu et al., 2018, "Squeeze-and-Excitation Networks", arXiv:1709.01507):
  no spatial layout, drawn as a histogram;
* ``"spatial"``: ``(B, 1, H, W)`` gates or a softmax over positions (CBAM: Woo et al., 2018, "CBAM:
  Convolutional Block Attention Module", arXiv:1807.06521), read back as the map itself;
* ``"token"``: ``(B, heads, N, N)`` attention (Vaswani et al., 2017, "Attention Is All You Need",
  arXiv:1706.03762), read back as the class token's row or the attention each grid token receives;
* ``"pool"``: ``(B, N)`` attention-pooling weights (CCT: Hassani et al., 2021, "Escaping the Big Data Paradigm
  with Compact Transformers", arXiv:2104.05704), read back as the grid tokens' weights;
* ``"covariance"``: ``(B, heads, d, d)`` channel x channel attention (XCA: El-Nouby et al., 2021, "XCiT:
  Cross-Covariance Image Transformers", arXiv:2106.09681): no image position, read back as a ``d x d``
  matrix (mean of the heads) and drawn as one, never placed on the image.

Derived kinds (made by the readout): ``"head"`` (one head's class-token row), ``"rollout"`` (Abnar & Zuidema,
2020, "Quantifying Attention Flow in Transformers", arXiv:2005.00928), ``"attention_gradient"`` and
``"gradient_rollout"`` (Chefer, Gur & Wolf, 2021, "Generic Attention-model Explainability for Interpreting
Bi-Modal and Encoder-Decoder Transformers", arXiv:2103.15679) and ``"layers_gradient"`` (the layers' gradient
maps joined in the spirit of LayerCAM: Jiang et al., 2021, "LayerCAM", IEEE TIP 30).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch

from ..attention.tap import KINDS, AttentionRecord

OVERLAY, MATRIX, HISTOGRAM = "overlay", "matrix", "histogram"  # how a kind is drawn


def infer_grid(num_tokens: int, image_hw: Optional[Sequence[int]] = None) -> Tuple[int, int]:
    """A grid ``(h, w)`` with ``h * w == num_tokens``: square, or with ``image_hw``'s aspect ratio if given."""
    if image_hw is None:
        side = math.isqrt(num_tokens)
        if side * side != num_tokens:
            raise ValueError(
                f"cannot infer a grid for {num_tokens} tokens: not a square; pass grid=(H, W) or image_hw"
            )
        return side, side
    target = float(image_hw[0]) / float(image_hw[1])
    best = None
    for h in range(1, num_tokens + 1):
        if num_tokens % h == 0:
            err = abs(math.log((h / (num_tokens // h)) / target))
            if best is None or err < best[0]:
                best = (err, h)
    h = best[1]
    return h, num_tokens // h


def token_grid(rec: AttentionRecord, num_grid_tokens: int, image_hw) -> Tuple[int, int]:
    """The record's grid, checked against its grid-token count, or one inferred from the count."""
    if rec.grid is None:
        return infer_grid(num_grid_tokens, image_hw)
    h, w = rec.grid
    if h * w != num_grid_tokens:
        raise ValueError(
            f"record {rec.name!r}: grid {h}x{w} does not hold the {num_grid_tokens} tokens after "
            f"{rec.num_prefix_tokens} prefix token(s)"
        )
    return h, w


# ----------------------------------------------------------------------------- reading a record back


def _read_channel(record: AttentionRecord, w: torch.Tensor, image_hw, query: str) -> torch.Tensor:
    raise ValueError(f"record {record.name!r} holds channel weights: there is no spatial map")


def _read_spatial(record: AttentionRecord, w: torch.Tensor, image_hw, query: str) -> torch.Tensor:
    if w.dim() == 4 and w.shape[1] == 1:
        return w[:, 0]
    if w.dim() == 3:
        return w
    raise ValueError(f"record {record.name!r}: spatial weights must be (B, 1, H, W), got {tuple(w.shape)}")


def _read_pool(record: AttentionRecord, w: torch.Tensor, image_hw, query: str) -> torch.Tensor:
    if w.dim() != 2:
        raise ValueError(f"record {record.name!r}: pool weights must be (B, N), got {tuple(w.shape)}")
    p = int(record.num_prefix_tokens)
    h, gw = token_grid(record, w.shape[1] - p, image_hw)
    return w[:, p:].reshape(w.shape[0], h, gw)


def _read_token(record: AttentionRecord, w: torch.Tensor, image_hw, query: str) -> torch.Tensor:
    if w.dim() != 4:
        raise ValueError(f"record {record.name!r}: token weights must be (B, heads, N, N), got {tuple(w.shape)}")
    p = int(record.num_prefix_tokens)
    b, _, nq, nk = w.shape
    h, gw = token_grid(record, nk - p, image_hw)
    mode = ("cls" if p > 0 else "mean") if query == "auto" else query
    if mode == "cls":
        if p == 0:
            raise ValueError(f"record {record.name!r} has no class token; use query='mean'")
        row = w[:, :, 0, p:].mean(1)  # (B, h*w): what the class token reads from each grid token
    else:
        # Queries: the grid rows when queries and keys are the same tokens, else every query row.
        rows = w[:, :, p:, p:] if nq == nk else w[:, :, :, p:]
        row = rows.mean(dim=(1, 2))  # (B, h*w): attention received, averaged over heads and queries
    return row.reshape(b, h, gw)


def _read_covariance(record: AttentionRecord, w: torch.Tensor, image_hw, query: str) -> torch.Tensor:
    if w.dim() != 4 or w.shape[-1] != w.shape[-2]:
        raise ValueError(f"record {record.name!r}: covariance weights must be (B, heads, d, d), got {tuple(w.shape)}")
    return w.mean(1)  # (B, d, d): channel x channel, mean of the heads


def _matrix_of_heads(record: AttentionRecord) -> torch.Tensor:
    return record.weights.float().mean(1)  # (B, rows, columns), mean over heads


def _spread_keys(record: AttentionRecord, heat: torch.Tensor) -> int:
    return int(record.weights.shape[-1])


def _cells(record: AttentionRecord, heat: torch.Tensor) -> int:
    return int(heat.shape[-1] * heat.shape[-2])


# ----------------------------------------------------------------------------- describing a map


def _spatial_words(lm: Any, owner: str) -> str:
    return f"spatial map of {owner}" + {"relative": " (softmax over positions)",
                                        "gain": " (gain per position, 2 x sigmoid: 1 = unchanged)"}.get(
        lm.scale, " (sigmoid gate per position)")


def _token_words(lm: Any, owner: str) -> str:
    r = lm.record
    heads = r.weights.shape[1]
    return f"attention of {owner}: " + (f"the class token's row, mean of {heads} heads" if r.num_prefix_tokens > 0
                                        else f"attention each position receives, mean of {heads} heads and all "
                                             "queries")


def _rollout_words(lm: Any) -> str:
    how = {"cls": "the class token", "mean": "the mean over tokens"}.get(lm.info["readout"],
                                                                          "the sequence-pooling weights")
    return f"{lm.info['layers']} layer(s), read out by {how}"


SHARE = "share of the positive evidence per position (sum 1)"


def _gradient_words(lm: Any, owner: str) -> str:
    return f"{kind_of(lm.record.kind).gradient_words(lm.record)} of {owner} for the target class's logit; {SHARE}"


def _layers_words(lm: Any, owner: str) -> str:
    names = lm.info["layers"]
    return (f"mean of the layers' gate or attention x gradient shares ({len(names)} layers, equal weight, on the "
            f"input's pixels: {', '.join(names)}); {SHARE}")


def _spatial_gradient(r: AttentionRecord) -> str:
    through = " through the block's output" if getattr(r, "via", "") == "output" else ""
    return ("gate x gradient (Grad-CAM's rule: positive part of gate * d logit / d gate, summed over the "
            f"gate's channels){through}")


def _token_gradient(r: AttentionRecord) -> str:
    return ("attention x gradient (Chefer et al. 2021: E_h[(grad * A)^+], "
            + ("the class token's row)" if r.num_prefix_tokens > 0 else "received per position, mean of the queries)"))


# ----------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class MapKind:
    """One kind of record or map.

    ``scale``: its default value scale. ``derived``: made by the readout, never emitted by a tap. ``draw``:
    ``"overlay"`` (a map placed on the image), ``"matrix"`` (a rows x columns picture, ``axes`` naming them) or
    ``"histogram"``. ``read``: ``(record, fp32 weights, image_hw, query) -> (B, h, w)`` map (a ``(B, d, d)``
    matrix for a matrix kind), None for a derived kind. ``keys``: the number of keys a relative map's weights
    are spread over. ``words``: ``(LayerMap, owner) -> str``, the first part of its description.
    ``gradient_words``: ``record -> str``, what its gradient map is (None: it has none). ``matrix``: its
    records also get a ``matrix/<layer>`` picture (``record -> (B, rows, columns)``). Flags: ``rolls_out``
    (token layers a rollout chains), ``head_maps`` (one map per head of the class-token row), ``pools``
    (pooling weights a rollout may be read out by), ``gate_curve`` (``gates/<layer>/mean`` scalars),
    ``output_route`` (a gradient may come through the block's output), ``sums_channels`` (a 4-D relevance is
    summed over channels), ``from_gradients`` (a map made from gradients), ``scored`` (faithfulness and the
    pointing game score it).
    """

    name: str
    what: str
    scale: str
    derived: bool = False
    draw: str = OVERLAY
    read: Optional[Callable[..., torch.Tensor]] = None
    keys: Callable[[AttentionRecord, torch.Tensor], int] = _cells
    words: Optional[Callable[[Any, str], str]] = None
    gradient_words: Optional[Callable[[AttentionRecord], str]] = None
    matrix: Optional[Callable[[AttentionRecord], torch.Tensor]] = None
    axes: Tuple[str, str] = ("query token", "key token")
    rolls_out: bool = False
    head_maps: bool = False
    pools: bool = False
    gate_curve: bool = False
    output_route: bool = False
    sums_channels: bool = False
    from_gradients: bool = False
    scored: bool = True

    @property
    def placed(self) -> bool:
        """Drawn on the image (its cells have image positions)."""
        return self.draw == OVERLAY

    @property
    def draws_histogram(self) -> bool:
        return self.draw == HISTOGRAM


TABLE: Dict[str, MapKind] = {k.name: k for k in (
    MapKind("channel", "(B, C) channel gates", "gate", draw=HISTOGRAM, read=_read_channel, gate_curve=True,
            scored=False),
    MapKind("spatial", "(B, 1, H, W) spatial gates or a softmax over positions", "gate", read=_read_spatial,
            words=_spatial_words, gradient_words=_spatial_gradient, gate_curve=True, output_route=True,
            sums_channels=True),
    MapKind("token", "(B, heads, N, N) token attention", "relative", read=_read_token, keys=_spread_keys,
            words=_token_words, gradient_words=_token_gradient, matrix=_matrix_of_heads, rolls_out=True,
            head_maps=True),
    MapKind("pool", "(B, N) attention-pooling weights", "relative", read=_read_pool, keys=_spread_keys,
            words=lambda lm, owner: f"attention-pooling weights of {owner} over the tokens",
            gradient_words=lambda r: "pooling weights x gradient (positive part of w * d logit / d w)", pools=True),
    MapKind("covariance", "(B, heads, d, d) channel x channel cross-covariance attention", "relative",
            draw=MATRIX, read=_read_covariance, keys=_spread_keys, matrix=_matrix_of_heads,
            axes=("query channel", "key channel"), scored=False,
            words=lambda lm, owner: (f"cross-covariance attention of {owner}: channel x channel (El-Nouby et al. "
                                     "2021), mean of the heads; not placed on the image")),
    MapKind("head", "one head's class-token row", "relative", derived=True, scored=False,
            words=lambda lm, owner: f"class-token attention of one head of {owner}"),
    MapKind("rollout", "attention rollout through a trunk of token layers", "relative", derived=True,
            words=lambda lm, owner: (f"attention rollout (Abnar & Zuidema 2020) through {_rollout_words(lm)}; "
                                     "the grid's share of the flow")),
    MapKind("attention_gradient", "a layer's weights x gradient", "relative", derived=True, from_gradients=True,
            words=_gradient_words),
    MapKind("gradient_rollout", "gradient-weighted attention rollout", "relative", derived=True, from_gradients=True,
            words=lambda lm, owner: ("gradient-weighted attention rollout (Chefer, Gur, Wolf 2021): R = I + A_bar R "
                                     f"with A_bar = E_h[(grad * A)^+] through {_rollout_words(lm)}; {SHARE}")),
    MapKind("layers_gradient", "the layers' gradient maps joined on the input's pixels", "relative", derived=True,
            from_gradients=True, words=_layers_words),
)}

NO_KIND = MapKind("", "a map made outside the readout (a baseline, a caller's own)", "gate", derived=True)


def kind_of(name: str) -> MapKind:
    """The table entry of kind ``name``; an unknown name gets :data:`NO_KIND` (no map, described by its note)."""
    return TABLE.get(name, NO_KIND)


def record_kind(record: AttentionRecord) -> MapKind:
    """A record's entry; ValueError naming the valid kinds for a kind no tap emits."""
    k = TABLE.get(record.kind)
    if k is None or k.derived:
        raise ValueError(f"record {record.name!r} has unknown kind {record.kind!r}; valid: {', '.join(KINDS)}")
    return k


def kinds_where(flag: str) -> Tuple[str, ...]:
    """The names of the kinds whose ``flag`` (a :class:`MapKind` attribute) is true."""
    return tuple(name for name, k in TABLE.items() if getattr(k, flag))
