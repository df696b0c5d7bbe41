"""Attention rollout: Abnar & Zuidema, "Quantifying Attention Flow in Transformers", 2020, arXiv 2005.00928.

Each layer's attention ``(B, heads, N, N)`` is fused over heads, optionally thinned (the lowest weights
discarded, as in Gildenblat's vit-explain), mixed with the identity to account for the residual path,
re-normalised to rows summing to one, and the layers are multiplied in order:
``R = A_L @ ... @ A_1``. Row ``i`` of ``R`` says how much each input token flows into output token ``i``.
The map is then read out for what the classifier looks at: the class token's row, the uniform mean over
tokens (global average pooling), or the model's own pooling weights (CCT's sequence pooling).

:func:`gradient_rollout` is the class-specific rule of Chefer, Gur, Wolf 2021 ("Generic Attention-model
Explainability for Interpreting Bi-Modal and Encoder-Decoder Transformers", arXiv 2103.15679): each layer's
attention weighted by its gradient for the target class, ``A_bar = E_h[(grad * A)^+]``, accumulated as
``R = I; R = R + A_bar R`` layer by layer, then read out the same way.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch

from ..attention.tap import AttentionRecord
from .record import infer_grid

HEAD_FUSIONS = ("mean", "max", "min")
READOUTS = ("cls", "mean")


def _as_weights(layer: Union[torch.Tensor, AttentionRecord], i: int, attr: str = "weights") -> torch.Tensor:
    if isinstance(layer, AttentionRecord):
        if layer.kind != "token":
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
        if readout.kind != "pool":
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
