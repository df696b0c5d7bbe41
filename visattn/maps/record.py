"""Record the attention weights of every block in a model (the maps are read out in :mod:`.readout`).

    with record_attention(model) as rec:   # every tap appends an AttentionRecord per call, in call order
        model(images)
    heat = spatial_heatmap(rec.records[0])  # (B, h, w), or ValueError for a channel record

Outside the ``with`` block the taps hold ``sink=None`` again, so recording costs nothing when it is off.
**Memory bound**: records are copied off the accelerator (``device="cpu"``) as they are made, and the recorder
keeps the last ``max_passes`` passes of the model (default 64), dropping older ones with one warning.

**Gradients** (``record_attention(model, gradients=True)``): the tensor each spatial, token and pool tap passes
on is kept in the autograd graph until :meth:`AttentionRecorder.backward` differentiates the target class's
logit once for the batch; each record then becomes a :class:`GradientRecord` with ``relevance = weights * d
logit / d weights``. A tap handed a reshaped view (GC's softmax) gets the gradient of the tensor it views; a
spatial tap handed an unused summary (coordinate attention) gets its block's ``output * d logit / d output``
summed over channels (equal to the gate's for a gate that multiplies its input). Parameters' ``.grad`` are
never touched. :func:`probe_pass` does the whole eval pass (mode, RNG and flags restored after).

**Other models**: :func:`add_taps` gives every timm ``Attention`` and ``nn.MultiheadAttention`` a tap (held
here, not registered, so ``state_dict`` and ``print(model)`` do not change) fed by forward hooks that
recompute the weights in fp32 on recording passes only (timm: from the ``q`` and ``k`` its ``q_norm`` /
``k_norm`` see, so fused attention stays on; MHA: from its projections and masks). The grid and class-token
count come from the model around the module (timm's ``patch_embed.grid_size``, torchvision's ``image_size //
patch_size``; else a square after 0 or 1 prefix tokens). For gradients :func:`own_attention` makes the
taps see the weights the output is computed from, for one recording: timm's unfused path, MHA's per-head
weights (its caller still gets what it asked for).
"""
from __future__ import annotations

import math
import warnings
import weakref
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, fields
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..attention.tap import KINDS, AttentionRecord, AttentionTap
from . import families
from .kinds import kind_of

DEFAULT_MAX_PASSES = 64


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
        elif via == "placed":  # weights placed from the ones the model used (windows): place their relevance
            used, place = lv.tensor.visattn_placed
            rel = place(used.detach().float() * g.float())
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
        return [r for r in self.records if r.kind in {kind}]

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
    if (kind_of(lv.record.kind).output_route and o is not None and o.requires_grad and t.dim() == 4 and t.shape[1] == 1
            and o.shape[0] == t.shape[0] and o.shape[-2:] == t.shape[-2:]):
        out.append(("output", o))
    placed = getattr(t, "visattn_placed", None)  # (weights the model used, how they were placed): families
    if placed is not None and placed[0].requires_grad:
        out.append(("placed", placed[0]))
    return out


def _record_name(path: str) -> str:
    # "layer2.1.attn.tap" -> "layer2.1.attn"; a tap on the recorded module itself keeps its path "tap".
    return path[: -len(".tap")] if path.endswith(".tap") else path


def find_taps(model: nn.Module) -> List[Tuple[str, AttentionTap]]:
    """``(record name, tap)`` for every tap in ``model`` (and every foreign attention module already given a
    tap by :func:`add_taps`), in module-definition order."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"record_attention expects an nn.Module, got {type(model).__name__}")
    base = unwrap_model(model)
    own = [(_record_name(p), m) for p, m in base.named_modules() if isinstance(m, AttentionTap)]
    return own + adapter_taps(base) + [(s.path, s.tap) for s in families.sites(base)]


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
        why = "; ".join(families.unrecordable(base))
        warnings.warn(f"record_attention: {type(base).__name__} has nothing to record; searched for "
                      f"{', '.join(SEARCHED)} and found none" + (f" ({why})" if why else ""), RuntimeWarning,
                      stacklevel=3)
    recorder = AttentionRecorder({name: tap.kind for name, tap in taps}, max_passes, device)
    handles = [model.register_forward_pre_hook(lambda m, args: recorder.start_pass())]
    try:
        if gradients:
            handles += _keep_hooks(base, taps, recorder)
        with (tap_sinks(model, recorder, taps), _eager(), families.recording(base, unfused=gradients),
              (own_attention(base) if gradients else nullcontext())):
            yield recorder
    finally:
        for h in handles:
            h.remove()


def _keep_hooks(base: nn.Module, taps: List[Tuple[str, AttentionTap]], recorder: AttentionRecorder) -> List[Any]:
    """Forward hooks that hand the recorder what each tap passes on, and each spatial tap's block output."""
    handles = []
    for name, tap in taps:
        kind = kind_of(tap.kind)
        if kind.gradient_words is None:
            continue  # no gradient map for this kind (channel gates, covariance matrices)
        handles.append(tap.register_forward_hook(lambda m, args, out: recorder.keep(m, out)))
        owner = _owner_module(base, name, tap)
        if kind.output_route and owner is not None:
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


# ----------------------------------------------------------------------------- other models' attention


SEARCHED = (
    "visattn AttentionTap modules",
    "timm Attention (timm.layers.Attention = timm.models.vision_transformer.Attention)",
    "torch.nn.MultiheadAttention",
    "the vision transformer families of visattn.maps.families",
)


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
        if isinstance(getattr(m, "conv_proj", None), nn.Module) and hasattr(m, "image_size"):  # torchvision
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
    """``(path, module)`` of every timm ``Attention`` and ``nn.MultiheadAttention`` in ``model`` that no family of
    :mod:`.families` records (MobileViT's)."""
    from timm.layers import Attention

    mine = families.claimed(model)
    return [(p, m) for p, m in model.named_modules()
            if isinstance(m, (Attention, nn.MultiheadAttention)) and id(m) not in mine]


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
    return n + families.forget(model)
