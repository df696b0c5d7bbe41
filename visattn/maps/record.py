"""Record the attention weights of every block in a model, and turn a record into a 2-D map.

``record_attention(model)`` attaches one shared list to every :class:`~visattn.attention.tap.AttentionTap`
in the model for the duration of a ``with`` block; each tap then appends an :class:`AttentionRecord` per
call. Outside the block the taps hold ``sink=None`` again, so recording costs nothing when it is off.

    with record_attention(model) as rec:
        model(images)
    for r in rec.records:          # call order
        heat = spatial_heatmap(r)  # (B, h, w), or ValueError for a channel record
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..attention.tap import KINDS, AttentionRecord, AttentionTap


class AttentionRecorder:
    """What ``record_attention`` yields: the records of one recording, in call order."""

    def __init__(self, taps: Dict[str, str]):
        self.records: List[AttentionRecord] = []
        self.taps = taps  # record name -> kind, for every tap found (called or not)

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[AttentionRecord]:
        return iter(self.records)

    def by_name(self) -> Dict[str, List[AttentionRecord]]:
        """Records grouped by block name (a list each: a block called twice records twice), in call order."""
        out: Dict[str, List[AttentionRecord]] = {}
        for r in self.records:
            out.setdefault(r.name, []).append(r)
        return out

    def by_kind(self, kind: str) -> List[AttentionRecord]:
        if kind not in KINDS:
            raise ValueError(f"unknown attention kind {kind!r}; valid: {', '.join(KINDS)}")
        return [r for r in self.records if r.kind == kind]

    def clear(self) -> None:
        # In place: the taps hold this very list as their sink while recording.
        self.records.clear()

    def __repr__(self) -> str:
        return f"AttentionRecorder({len(self.records)} records from {len(self.taps)} taps)"


def _unwrap(model: nn.Module) -> nn.Module:
    """Look through torch.compile and (Distributed)DataParallel wrappers so names match the plain model."""
    while True:
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile's OptimizedModule
            model = model._orig_mod
        else:
            return model


def _record_name(path: str) -> str:
    # "layer2.1.attn.tap" -> "layer2.1.attn"; a tap on the recorded module itself keeps its path "tap".
    return path[: -len(".tap")] if path.endswith(".tap") else path


def find_taps(model: nn.Module) -> List[Tuple[str, AttentionTap]]:
    """``(record name, tap)`` for every tap in ``model``, in module-definition order."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"record_attention expects an nn.Module, got {type(model).__name__}")
    return [(_record_name(p), m) for p, m in _unwrap(model).named_modules() if isinstance(m, AttentionTap)]


@contextmanager
def record_attention(model: nn.Module) -> Iterator[AttentionRecorder]:
    """Record every tap of ``model`` while the ``with`` block runs; yields an :class:`AttentionRecorder`.

    The model's outputs, train/eval mode, parameters and buffers are not touched: taps are identities.
    On exit (also on an exception) each tap gets back the sink and name it had before, so recorders nest:
    an inner recorder of the same model takes the records made inside it and the outer one resumes after.
    Two models recorded at once fill two separate recorders.
    """
    taps = find_taps(model)
    recorder = AttentionRecorder({name: tap.kind for name, tap in taps})
    saved = [(tap, tap.sink, tap.record_name) for _, tap in taps]
    try:
        for name, tap in taps:
            tap.record_name = name
            tap.sink = recorder.records
        yield recorder
    finally:
        for tap, sink, name in saved:
            tap.sink = sink
            tap.record_name = name


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


def _token_grid(rec: AttentionRecord, num_grid_tokens: int, image_hw) -> Tuple[int, int]:
    if rec.grid is None:
        return infer_grid(num_grid_tokens, image_hw)
    h, w = rec.grid
    if h * w != num_grid_tokens:
        raise ValueError(
            f"record {rec.name!r}: grid {h}x{w} does not hold the {num_grid_tokens} tokens after "
            f"{rec.num_prefix_tokens} prefix token(s)"
        )
    return h, w


def spatial_heatmap(
    record: AttentionRecord, image_hw: Optional[Sequence[int]] = None, query: str = "auto"
) -> torch.Tensor:
    """A per-image 2-D map ``(B, h, w)`` on the record's grid (fp32, the weights' device).

    * ``spatial``: the gate itself.
    * ``token``: ``query="cls"``: the class token's row (mean over heads) over the grid tokens;
      ``query="mean"``: the attention each grid token receives, averaged over heads and over the grid
      queries (prefix rows and columns dropped); ``"auto"`` picks ``"cls"`` when the record has a prefix
      token, else ``"mean"``.
    * ``pool``: the pooling weights of the grid tokens (prefix tokens dropped).
    * ``channel``: raises ValueError (channel weights have no spatial layout).

    ``image_hw`` only matters for a token/pool record that carries no grid: the grid is then the
    factorisation of its token count closest to the image's aspect ratio (square when not given).
    """
    if query not in ("auto", "cls", "mean"):
        raise ValueError(f"unknown query {query!r}; valid: auto, cls, mean")
    w = record.weights.float()
    p = int(record.num_prefix_tokens)
    if record.kind == "channel":
        raise ValueError(f"record {record.name!r} holds channel weights: there is no spatial map")
    if record.kind == "spatial":
        if w.dim() == 4 and w.shape[1] == 1:
            return w[:, 0]
        if w.dim() == 3:
            return w
        raise ValueError(f"record {record.name!r}: spatial weights must be (B, 1, H, W), got {tuple(w.shape)}")
    if record.kind == "pool":
        if w.dim() != 2:
            raise ValueError(f"record {record.name!r}: pool weights must be (B, N), got {tuple(w.shape)}")
        h, gw = _token_grid(record, w.shape[1] - p, image_hw)
        return w[:, p:].reshape(w.shape[0], h, gw)
    if record.kind == "token":
        if w.dim() != 4:
            raise ValueError(
                f"record {record.name!r}: token weights must be (B, heads, N, N), got {tuple(w.shape)}"
            )
        b, _, nq, nk = w.shape
        h, gw = _token_grid(record, nk - p, image_hw)
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
    raise ValueError(f"record {record.name!r} has unknown kind {record.kind!r}; valid: {', '.join(KINDS)}")
