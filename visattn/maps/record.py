"""Record the attention weights of every block in a model, and turn a record into a 2-D map.

``record_attention(model)`` attaches a recorder to every :class:`~visattn.attention.tap.AttentionTap` in the
model (and, through :func:`~visattn.maps.adapters.add_taps`, to every timm ``Attention`` and
``nn.MultiheadAttention``) for the duration of a ``with`` block; each tap then appends an
:class:`AttentionRecord` per call. Outside the block the taps hold ``sink=None`` again, so recording costs
nothing when it is off.

    with record_attention(model) as rec:
        model(images)
    for r in rec.records:          # call order
        heat = spatial_heatmap(r)  # (B, h, w), or ValueError for a channel record

**Memory bound.** Records are copied off the accelerator (``device="cpu"`` by default) as they are made,
and the recorder keeps the last ``max_passes`` forward passes of the model (default 64; a pass is one
call of the model given to ``record_attention``), dropping older ones with one warning. Its memory is at
most ``max_passes`` times one pass's weights (fp32): ``bytes_per_pass`` and ``nbytes`` report both.

**Gradients.** ``record_attention(model, gradients=True)`` also keeps, for every spatial, token and pool record,
the very tensor the block used (the tap's input, still in the autograd graph) until
:meth:`AttentionRecorder.backward` differentiates the target class's logit once for the whole batch; each record
is then a :class:`GradientRecord` carrying its ``relevance``, ``weights * d logit / d weights``:

    with record_attention(model, gradients=True) as rec:
        logits = model(images.clone().requires_grad_())  # grad enabled, eval mode
        rec.backward(logits, labels)              # one backward pass; None: the predicted classes

The taps are not changed for this: forward hooks on them see the tensor they pass on. Blocks whose weights
feed their output (every token block, the spatial gate and CBAM's, sequence pooling) get the gradient of that
tensor; a tap handed a reshaped view of the weights (GC's softmax) gets the gradient of the tensor it views;
a spatial tap handed a summary that is not used (coordinate attention's channel mean of ``a_h * a_w``) gets
its block's ``output * d logit / d output`` summed over channels, which for a gate that multiplies its input
equals ``gate * d logit / d gate`` summed over channels. timm ``Attention`` runs unfused and
``nn.MultiheadAttention`` returns per-head weights for the pass (:func:`~visattn.maps.adapters.own_attention`),
so their taps too see the weights on the path to the output. Fused attention is switched off for that pass
only: the taps already compute explicit weights on every recording pass. Parameters' ``.grad`` are never
touched (``torch.autograd.grad`` with the recorded tensors as the only inputs). :func:`probe_pass` does the
whole eval pass (mode, RNG and flags restored after).
"""
from __future__ import annotations

import math
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, fields, replace
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..attention.tap import KINDS, AttentionRecord, AttentionTap
from .adapters import SEARCHED, adapter_taps, add_taps, own_attention

DEFAULT_MAX_PASSES = 64
VIA = ("weights", "view", "output")  # how a GradientRecord's relevance was found (GradientRecord.via)


@dataclass
class GradientRecord(AttentionRecord):
    """An :class:`AttentionRecord` of a gradient recording, with the relevance of every weight for the target
    class: ``relevance = weights * d logit[target] / d weights`` (fp32, the weights' shape, on the recorder's
    device). ``via`` says whose gradient it is: ``"weights"`` (the recorded tensor's own), ``"view"`` (the
    tensor the tap was handed a reshaped view of) or ``"output"`` (the block's output times its gradient,
    summed over channels: equal to the gate's for a gate that multiplies its input)."""

    relevance: Optional[torch.Tensor] = None
    via: str = "weights"


@dataclass
class _Live:
    """One recorded tensor still in the autograd graph, waiting for the backward pass."""

    record: AttentionRecord
    tensor: torch.Tensor
    output: Optional[torch.Tensor] = None  # the block's output (spatial taps), for the "output" route


class AttentionRecorder:
    """What ``record_attention`` yields: the records of one recording, in call order.

    It is also the taps' sink: ``append`` stamps each record with the current pass and drops the oldest
    passes beyond ``max_passes``.
    """

    def __init__(self, taps: Dict[str, str], max_passes: Optional[int] = DEFAULT_MAX_PASSES,
                 device: Optional[torch.device] = torch.device("cpu")):
        if max_passes is not None and max_passes < 1:
            raise ValueError(f"max_passes must be >= 1 or None, got {max_passes}")
        self.records: List[AttentionRecord] = []
        self.taps = taps  # record name -> kind, for every tap found (called or not)
        self.max_passes = max_passes
        self.device = None if device is None else torch.device(device)
        self.pass_index = 0  # the pass records are stamped with now
        self.calls = 0  # calls of the recorded model seen
        self.dropped_passes = 0
        self.bytes_per_pass = 0  # the largest pass recorded so far, in bytes
        self._bytes_pass, self._bytes = -1, 0
        self.target: Optional[torch.Tensor] = None  # (B,) classes the last backward explained
        self._live: List[_Live] = []  # gradient recordings: tensors waiting for backward()

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[AttentionRecord]:
        return iter(self.records)

    # -- sink protocol (called by the taps) ---------------------------------------------------------------
    def append(self, record: AttentionRecord) -> None:
        self.records.append(record)
        if record.pass_index != self._bytes_pass:
            self._bytes_pass, self._bytes = record.pass_index, 0
        self._bytes += record.weights.untyped_storage().nbytes()
        self.bytes_per_pass = max(self.bytes_per_pass, self._bytes)

    def start_pass(self) -> None:
        """Called before each call of the recorded model: later records belong to a new pass."""
        self.calls += 1
        self.pass_index = self.calls - 1
        if self.max_passes is None:
            return
        cutoff = self.pass_index - self.max_passes  # passes <= cutoff are dropped
        first = next((i for i, r in enumerate(self.records) if r.pass_index > cutoff), len(self.records))
        if first:
            dropped = {r.pass_index for r in self.records[:first]}
            del self.records[:first]
            if not self.dropped_passes:
                warnings.warn(
                    f"record_attention keeps the last {self.max_passes} passes (max_passes); older passes are "
                    "dropped (raise max_passes, or read and clear() the recorder between passes)",
                    RuntimeWarning, stacklevel=3)
            self.dropped_passes += len(dropped)

    # -- gradients (record_attention(..., gradients=True)) -------------------------------------------------
    def keep(self, tap: AttentionTap, tensor: Any) -> None:
        """Called by a tap's forward hook with the tensor the tap passes on: keep it beside its record."""
        last = self.records[-1] if self.records else None  # the record this very call of the tap just made
        if (last is None or last.name != tap.record_name or not isinstance(tensor, torch.Tensor)
                or any(lv.record is last for lv in self._live)):
            return
        self._live.append(_Live(last, tensor))

    def keep_output(self, name: str, output: Any) -> None:
        """Called by a spatial tap's block after its forward: its output, for the ``"output"`` route."""
        live = next((lv for lv in reversed(self._live) if lv.record.name == name), None)
        if live is not None and live.output is None and isinstance(output, torch.Tensor) and output.dim() == 4:
            live.output = output

    def backward(self, output: Any, target: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Differentiate ``sum_b logits[b, target[b]]`` once (the model's ``output``: logits ``(B, classes)``, or
        a tuple whose first element they are; ``target``: ``(B,)`` classes, None: the predicted ones) with respect
        to every tensor kept since the last call, and turn their records into :class:`GradientRecord`s. Each
        image's relevance is its own logit's as long as the model treats images independently (eval mode).
        Returns the target classes (also kept as ``target``)."""
        logits = output[0] if isinstance(output, (tuple, list)) else output
        target = (logits.detach().argmax(-1) if target is None else target).to(logits.device).long()
        self.target = target
        live = [lv for lv in self._live if lv.tensor.requires_grad]
        self._live = []
        if live and not logits.requires_grad:
            warnings.warn("AttentionRecorder.backward: the logits do not require grad (run the model with gradients "
                          "enabled, e.g. on an input with requires_grad); no relevance recorded", RuntimeWarning,
                          stacklevel=2)
        if not live or not logits.requires_grad:
            return target
        inputs: List[torch.Tensor] = []
        slots = []
        for lv in live:
            routes = _routes(lv)
            slots.append([(via, len(inputs) + i) for i, (via, _) in enumerate(routes)])
            inputs += [t for _, t in routes]
        score = logits.float().gather(1, target[:, None]).sum()
        grads = torch.autograd.grad(score, inputs, allow_unused=True)
        done = {}
        for lv, routes in zip(live, slots):
            via, g = next(((v, grads[i]) for v, i in routes if grads[i] is not None), (None, None))
            if g is not None:
                done[id(lv.record)] = self._relevant(lv, via, g)
        self.records = [done.get(id(r), r) for r in self.records]
        return target

    def _relevant(self, lv: _Live, via: str, g: torch.Tensor) -> GradientRecord:
        t = lv.tensor.detach()
        if via == "output":
            rel = (lv.output.detach().float() * g.float()).sum(1, keepdim=True)
        elif via == "view":
            rel = t.float() * g.contiguous().reshape(t.shape).float()
        else:
            rel = t.float() * g.float()
        rel = rel.to(device=self.device or rel.device, copy=True)
        base = {f.name: getattr(lv.record, f.name) for f in fields(AttentionRecord)}
        return GradientRecord(**base, relevance=rel, via=via)

    # -- reading ------------------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes held by the kept records' weights."""
        return sum(r.weights.untyped_storage().nbytes() for r in self.records)

    def passes(self) -> List[int]:
        return sorted({r.pass_index for r in self.records})

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

    def by_pass(self, index: int) -> List[AttentionRecord]:
        return [r for r in self.records if r.pass_index == index]

    def clear(self) -> None:
        self.records.clear()
        self._live.clear()

    def __repr__(self) -> str:
        return f"AttentionRecorder({len(self.records)} records from {len(self.taps)} taps)"


def unwrap_model(model: nn.Module) -> nn.Module:
    """Look through torch.compile and (Distributed)DataParallel wrappers so names match the plain model."""
    while True:
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile's OptimizedModule
            model = model._orig_mod
        else:
            return model


def _routes(lv: _Live) -> List[Tuple[str, torch.Tensor]]:
    """The tensors whose gradient can give a kept tensor's relevance, in order of preference."""
    t = lv.tensor
    out = [("weights", t)]
    base = t._base
    if (base is not None and base.requires_grad and base.numel() == t.numel() and base.is_contiguous()
            and t.is_contiguous()):
        out.append(("view", base))
    o = lv.output
    if (lv.record.kind == "spatial" and o is not None and o.requires_grad and t.dim() == 4 and t.shape[1] == 1
            and o.shape[0] == t.shape[0] and o.shape[-2:] == t.shape[-2:]):
        out.append(("output", o))
    return out


def _record_name(path: str) -> str:
    # "layer2.1.attn.tap" -> "layer2.1.attn"; a tap on the recorded module itself keeps its path "tap".
    return path[: -len(".tap")] if path.endswith(".tap") else path


def find_taps(model: nn.Module) -> List[Tuple[str, AttentionTap]]:
    """``(record name, tap)`` for every tap in ``model`` (and every foreign attention module already given a
    tap by :func:`~visattn.maps.adapters.add_taps`), in module-definition order."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"record_attention expects an nn.Module, got {type(model).__name__}")
    base = unwrap_model(model)
    own = [(_record_name(p), m) for p, m in base.named_modules() if isinstance(m, AttentionTap)]
    return own + adapter_taps(base)


@contextmanager
def tap_sinks(model: nn.Module, sink: Any, taps: Optional[List[Tuple[str, AttentionTap]]] = None) -> Iterator[None]:
    """Point every tap of ``model`` at ``sink`` (anything with ``append``) inside the block; restore after."""
    taps = find_taps(model) if taps is None else taps
    saved = [(tap, tap.sink, tap.record_name) for _, tap in taps]
    try:
        for name, tap in taps:
            tap.record_name = name
            tap.sink = sink
        yield
    finally:
        for tap, old, name in saved:
            tap.sink = old
            tap.record_name = name


@contextmanager
def record_attention(model: nn.Module, max_passes: Optional[int] = DEFAULT_MAX_PASSES,
                     device: Optional[Any] = "cpu", warn: bool = True,
                     gradients: bool = False) -> Iterator[AttentionRecorder]:
    """Record every tap of ``model`` while the ``with`` block runs; yields an :class:`AttentionRecorder`.

    The model's outputs, train/eval mode, parameters and buffers are not touched: taps are identities.
    On exit (also on an exception) each tap gets back the sink and name it had before, so recorders nest:
    an inner recorder of the same model takes the records made inside it and the outer one resumes after.
    Two models recorded at once fill two separate recorders.

    ``max_passes``: passes kept (None: all); ``device``: where records are copied to (None: where they were
    made). ``warn``: a model with nothing recordable gets a warning naming what was searched.
    ``gradients``: also keep the recorded tensors in the autograd graph for one
    :meth:`AttentionRecorder.backward` (module docstring); run the model with gradients enabled.

    Inside the block ``torch.compile``'d code runs eagerly (``torch.compiler.set_stance("force_eager")``), so
    recording a compiled model (``torch.compile(model)`` or ``model.compile()``) neither compiles a recording
    version nor recompiles: its compiled graph is reused as soon as the block ends. A pass is one call of
    ``model`` as given (pass the compiled wrapper when that is what you call).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"record_attention expects an nn.Module, got {type(model).__name__}")
    base = unwrap_model(model)
    add_taps(base)
    taps = find_taps(model)
    if not taps and warn:
        warnings.warn(f"record_attention: {type(base).__name__} has nothing to record; searched for "
                      f"{', '.join(SEARCHED)} and found none", RuntimeWarning, stacklevel=3)
    recorder = AttentionRecorder({name: tap.kind for name, tap in taps}, max_passes, device)
    handles = [model.register_forward_pre_hook(lambda m, args: recorder.start_pass())]
    try:
        if gradients:
            handles += _keep_hooks(base, taps, recorder)
        with tap_sinks(model, recorder, taps), _eager(), (own_attention(base) if gradients else nullcontext()):
            yield recorder
    finally:
        for h in handles:
            h.remove()


def _keep_hooks(base: nn.Module, taps: List[Tuple[str, AttentionTap]], recorder: AttentionRecorder) -> List[Any]:
    """Forward hooks that hand the recorder what each tap passes on, and each spatial tap's block output."""
    handles = []
    for name, tap in taps:
        if tap.kind == "channel":
            continue  # channel gates have no map
        handles.append(tap.register_forward_hook(lambda m, args, out: recorder.keep(m, out)))
        owner = _owner_module(base, name, tap)
        if tap.kind == "spatial" and owner is not None:
            handles.append(owner.register_forward_hook(lambda m, args, out, n=name: recorder.keep_output(n, out)))
    return handles


def _owner_module(base: nn.Module, name: str, tap: AttentionTap) -> Optional[nn.Module]:
    """The block that owns ``tap`` (the module its record is named after), or None for a tap on the model."""
    try:
        owner = base.get_submodule(name)
    except AttributeError:
        return None
    return owner if owner is not base and owner is not tap else None


def _eager():
    """Compiled code runs eagerly while recording: a recording never compiles, nor invalidates compiled graphs."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else nullcontext()


@contextmanager
def probe_mode(model: nn.Module, grad: bool = False) -> Iterator[None]:
    """Eval mode, no gradients (``grad=True``: gradients on) and a forked RNG for a look at the model; every
    module's train/eval flag is restored afterwards (per module, so deliberately frozen submodules stay as
    they were)."""
    modes = [(m, m.training) for m in model.modules()]
    param = next(model.parameters(), None)
    devices = [param.device] if param is not None and param.device.type == "cuda" else []
    try:
        model.eval()
        with (torch.enable_grad() if grad else torch.no_grad()), torch.random.fork_rng(devices=devices):
            yield
    finally:
        for m, training in modes:
            m.training = training


def probe_pass(model: nn.Module, images: torch.Tensor, target: Optional[torch.Tensor] = None,
               gradients: bool = True, device: Optional[Any] = "cpu") -> Tuple[AttentionRecorder, torch.Tensor]:
    """One recorded eval pass of ``images`` (``probe_mode``), with ``gradients`` one backward pass for the
    ``target`` classes (``(B,)``; None: the predicted ones), batched: every record that can carry one is a
    :class:`GradientRecord`. Returns ``(recorder, logits)`` (logits detached; ``recorder.target``: the classes
    explained). A compiled or (Distributed)DataParallel model is run unwrapped for the gradient pass (eagerly
    either way while recording; no gradient reduction). Parameters' ``.grad`` are left as they were."""
    net = unwrap_model(model) if gradients else model
    with probe_mode(net, grad=gradients), record_attention(net, warn=False, device=device, gradients=gradients) as rec:
        x = images.detach().requires_grad_(True) if gradients and images.is_floating_point() else images
        out = net(x)
        logits = out[0] if isinstance(out, (tuple, list)) else out
        if gradients:
            rec.backward(logits, target)
        elif target is not None:
            rec.target = target
    return rec, logits.detach()


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
        return _token_heatmap(record, w, p, image_hw, query)
    raise ValueError(f"record {record.name!r} has unknown kind {record.kind!r}; valid: {', '.join(KINDS)}")


def _token_heatmap(record: AttentionRecord, w: torch.Tensor, p: int, image_hw, query: str) -> torch.Tensor:
    if w.dim() != 4:
        raise ValueError(f"record {record.name!r}: token weights must be (B, heads, N, N), got {tuple(w.shape)}")
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
    if record.kind == "spatial" and rel.dim() == 4:
        rel = rel.sum(1, keepdim=True)
    heat = spatial_heatmap(replace(record, weights=rel.clamp_min(0)), image_hw, query)
    total = heat.flatten(1).sum(1).clamp_min(torch.finfo(torch.float32).tiny)
    return heat / total[:, None, None]
