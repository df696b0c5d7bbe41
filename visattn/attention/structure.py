"""Where a block goes in any CNN, found in the model's own forward: residual branches and SE slots.

One forward pass of a small probe image is traced: every tensor operation (a ``TorchFunctionMode``) and every
module call (forward hooks), with the tensors kept, so the data flow is known exactly, control flow included
(a dynamic trace; ``torch.fx``'s symbolic trace fails on many models' Python control flow). Each *add* of two
feature maps of one shape is a candidate residual: the nearest tensor both operands come from is the block's
input; the side with the most convolution weight is the **branch**, the other the **skip**, which must be the
input itself or a short projection (at most one convolution). The papers' placements follow:

* **after the branch's last norm, before the add** (Squeeze-and-Excitation, Hu et al. 2018, arXiv:1709.01507,
  Fig. 3; CBAM, Woo et al. 2018, arXiv:1807.06521, Fig. 3): the walk back from the branch's operand passes
  activations, dropouts, drop paths, layer scales and layout permutes, and stops at the first norm (or
  convolution / linear layer, where there is none); a gate module found there (the model's own SE) is kept and
  the block follows it;
* a residual inside another's branch (a re-parameterisation sum inside a RepGhost module) is left to the outer
  one where that has a site;
* in an **inverted residual** (a branch whose last pointwise projection reads an expanded width, or follows a
  depthwise convolution: MobileNetV2, Sandler et al. 2018, arXiv:1801.04381; MobileNetV3, Howard et al. 2019,
  arXiv:1905.02244; EfficientNet, Tan & Le 2019, arXiv:1905.11946), **at the SE slot**: the projection's
  input, after the depthwise convolution, its norm and activation and the family's own SE where it has one
  (Coordinate Attention's placement, Hou et al. 2021, arXiv:2103.02907, Fig. 3).

A sum without a skip (a concatenation's aggregation, HRNet's multi-resolution fusion, a transformer's token
add) is no site, so a block never sits on a main path without a skip. Sites are reported as the module to
follow (the last module whose output is the site's tensor, so an empty ``se`` slot is filled as the family
rule fills it); a site whose tensor no module outputs (a purely functional branch) is left out.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .functional import NORMS_WITH_STATS

__all__ = ["StructSite", "TraceError", "find_sites", "trace"]

Key = Tuple[int, int]  # (id of the tensor object, its version counter): one value of one tensor

_ADDS = {"add", "__add__", "__radd__", "add_", "__iadd__"}
_CONVS = {"conv1d", "conv2d", "conv3d", "conv_transpose2d"}
_NORMS = {"batch_norm", "group_norm", "layer_norm", "instance_norm", "rms_norm"}
_SPLITS = {"__getitem__", "split", "chunk", "narrow", "split_with_sizes", "tensor_split"}


class TraceError(RuntimeError):
    """The model did not run on the probe input (its message says why, in one line)."""


@dataclass
class Event:
    index: int
    name: str
    inputs: List[Key]  # activation inputs, in argument order
    outputs: List[Key]
    weight: Optional[torch.Tensor] = None  # a convolution's or linear layer's weight
    groups: int = 1
    small: bool = True  # every non-activation tensor input has at most as many values as the output has channels


@dataclass
class Call:
    path: str
    module: nn.Module
    start: int
    in_key: Optional[Key] = None
    out_key: Optional[Key] = None


@dataclass
class Trace:
    """The recorded forward: events by index, the producer of each activation, module calls by output."""
    tensors: Dict[Key, torch.Tensor] = field(default_factory=dict)
    producer: Dict[Key, int] = field(default_factory=dict)  # key -> event index (the input: -1)
    events: Dict[int, Event] = field(default_factory=dict)
    calls: List[Call] = field(default_factory=list)
    by_output: Dict[Key, List[Call]] = field(default_factory=dict)
    count: Dict[str, int] = field(default_factory=dict)
    clock: int = 0

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def order(self, key: Key) -> int:
        return self.producer.get(key, -1)


def _key(t: torch.Tensor) -> Optional[Key]:
    try:
        return (id(t), t._version)
    except RuntimeError:  # an inference tensor has no version counter
        return None


def _tensors(obj: Any, depth: int = 0) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)) and depth < 2:
        for item in obj:
            yield from _tensors(item, depth + 1)


class _Recorder(TorchFunctionMode):
    def __init__(self, tr: Trace):
        super().__init__()
        self.tr = tr

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ins = [t for t in _tensors(list(args) + list(kwargs.values()))]
        before = [(t, _key(t)) for t in ins]
        acts = [k for _, k in before if k in self.tr.producer]
        out = func(*args, **kwargs)
        if acts:
            self._record(func, args, kwargs, before, acts, out)
        return out

    def _record(self, func, args, kwargs, before, acts, out) -> None:
        tr = self.tr
        name = getattr(func, "__name__", str(func))
        outs = [t for t in _tensors(out)] + [t for t, k in before if _key(t) != k]  # results, tensors changed in place
        keys: List[Key] = []
        for t in outs:
            k = _key(t)
            if k is not None and k not in keys and k not in acts:
                keys.append(k)
        if not keys:
            return
        index = tr.tick()
        width = max(outs[0].shape[1], outs[0].shape[-1]) if outs[0].dim() > 1 else 1  # channels first or last
        ev = Event(index, name, acts, keys,
                   small=all(t.numel() <= width for t, k in before if k not in tr.producer))
        if name in _CONVS or name == "linear":
            ev.weight = args[1] if len(args) > 1 else kwargs.get("weight")
            ev.groups = int(args[6] if len(args) > 6 else kwargs.get("groups", 1)) if name in _CONVS else 1
        tr.events[index] = ev
        for t, k in zip(outs, [_key(t) for t in outs]):
            if k in keys and k not in tr.producer:
                tr.producer[k] = index
                tr.tensors[k] = t


def _hooks(model: nn.Module, tr: Trace) -> List[Any]:
    handles = []

    def pre(module, args, path):
        call = Call(path, module, tr.tick())
        first = next(iter(_tensors(list(args))), None)
        call.in_key = _key(first) if first is not None else None
        tr.calls.append(call)
        tr.count[path] = tr.count.get(path, 0) + 1
        module.__dict__.setdefault("_visattn_trace_stack", []).append(call)

    def post(module, args, out, path):
        call = module.__dict__["_visattn_trace_stack"].pop()
        if isinstance(out, torch.Tensor):
            call.out_key = _key(out)
            if call.out_key in tr.producer or call.out_key == call.in_key:
                tr.by_output.setdefault(call.out_key, []).append(call)

    for path, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(lambda m, a, p=path: pre(m, a, p)))
        handles.append(module.register_forward_hook(lambda m, a, o, p=path: post(m, a, o, p)))
    return handles


def _probe_sizes(model: nn.Module) -> List[Tuple[int, int, int]]:
    first = next((m for m in model.modules() if isinstance(m, nn.Conv2d)), None)
    cfg = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None) or {}
    chans = tuple(cfg["input_size"])[0] if "input_size" in cfg else first.in_channels if first is not None else 3
    size = tuple(cfg.get("input_size", (chans, 224, 224)))[-2:]
    fixed = next((getattr(m, "img_size") for m in model.modules() if isinstance(getattr(m, "img_size", None),
                                                                            (int, tuple, list))), None)
    sizes = [(chans, *((fixed, fixed) if isinstance(fixed, int) else tuple(fixed)[-2:]))] if fixed else []
    sizes += [(chans, 64, 64), (chans, *size), (chans, 32, 32)]  # a model's own image size first, where it says
    return [s for i, s in enumerate(sizes) if s not in sizes[:i]]


def trace(model: nn.Module, example: Optional[torch.Tensor] = None) -> Trace:
    """Run ``model`` once (eval mode, no grad, RNG untouched, modes restored) on ``example`` or a small probe
    image, recording its data flow; :class:`TraceError` if it does not run."""
    like = next(iter(model.parameters()), None)
    device, dtype = (like.device, like.dtype) if like is not None else (torch.device("cpu"), torch.float32)
    probes = [example] if example is not None else [
        torch.randn(1, *s, generator=torch.Generator().manual_seed(0)).to(device, dtype) for s in _probe_sizes(model)]
    modes = {m: m.training for m in model.modules()}
    errors = []
    try:
        model.eval()
        for x in probes:
            tr = Trace()
            x = x.clone()
            tr.producer[_key(x)], tr.tensors[_key(x)] = -1, x
            handles = _hooks(model, tr)
            try:
                with torch.random.fork_rng(devices=[]), torch.no_grad(), _Recorder(tr):
                    model(x)
                return tr
            except Exception as e:  # noqa: BLE001 - any failure of the host's forward means "does not trace"
                errors.append(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160])
            finally:
                for h in handles:
                    h.remove()
                for m in model.modules():
                    m.__dict__.pop("_visattn_trace_stack", None)
    finally:
        for m, mode in modes.items():
            m.training = mode
    raise TraceError(errors[-1] if errors else "no probe input")


# ---- the analysis ---------------------------------------------------------------------------------------------


@dataclass
class StructSite:
    """A site: the block follows module ``path`` (which outputs the site's tensor), ``channels`` wide;
    ``channels_last``: that tensor is ``(B, H, W, C)``; ``kind``: ``"branch"`` (after the branch's last norm) or
    ``"se-slot"`` (an inverted residual's); ``anchor``: the module the walk stopped at (a norm, conv or gate)."""
    path: str
    channels: int
    channels_last: bool
    kind: str
    anchor: str
    add: int = field(default=-1, repr=False, compare=False)  # the event that joins branch and skip
    branch: frozenset = field(default=frozenset(), repr=False, compare=False)  # the branch's events


def _meet(tr: Trace, p: Key, q: Key) -> Tuple[Optional[Key], set, set]:
    """The latest tensor both ``p`` and ``q`` come from, and the keys on each side after it."""
    marks: Dict[Key, int] = {p: 1, q: 2} if p != q else {p: 3}
    heap = [(-tr.order(p), p), (-tr.order(q), q)]
    heapq.heapify(heap)
    seen = set()
    while heap:
        _, k = heapq.heappop(heap)
        if k in seen:
            continue
        seen.add(k)
        if marks[k] == 3:
            side_p = {s for s in seen if marks[s] & 1 and s != k}
            side_q = {s for s in seen if marks[s] & 2 and s != k}
            return k, side_p, side_q
        ev = tr.events.get(tr.producer.get(k, -1))
        for a in ev.inputs if ev is not None else []:
            if a not in marks:
                heapq.heappush(heap, (-tr.order(a), a))
            marks[a] = marks.get(a, 0) | marks[k]
    return None, set(), set()


def _side_events(tr: Trace, keys: set) -> List[Event]:
    return sorted({tr.producer[k]: tr.events[tr.producer[k]] for k in keys if tr.producer.get(k, -1) in tr.events}
                  .values(), key=lambda e: e.index)


def _conv_weight(events: Sequence[Event]) -> Tuple[int, int]:
    convs = [e for e in events if e.weight is not None]
    return len(convs), sum(e.weight.numel() for e in convs)


def _is_norm_module(m: nn.Module) -> bool:
    from timm.layers import LayerNorm2d

    return isinstance(m, (NORMS_WITH_STATS, nn.GroupNorm, nn.LayerNorm, LayerNorm2d)) \
        or "Norm" in type(m).__name__ and "Act" in type(m).__name__ or type(m).__name__ == "FrozenBatchNorm2d"


def _is_conv_module(m: nn.Module) -> bool:
    return isinstance(m, (nn.Conv2d, nn.Linear)) or (hasattr(m, "in_channels") and hasattr(m, "out_channels")
                                                      and not list(m.children()) or type(m).__name__ == "MixedConv2d")


def _module_width(m: nn.Module) -> Optional[int]:
    """The channels a conv, norm or linear layer outputs (its last dimension for a layer norm or linear)."""
    for attr in ("out_channels", "num_features", "num_channels", "out_features"):
        if isinstance(getattr(m, attr, None), int):
            return getattr(m, attr)
    shape = getattr(m, "normalized_shape", None)
    return int(shape[-1]) if isinstance(shape, (tuple, list)) and shape else None


def _module_kind(call: Call, tr: Trace, width: int) -> str:
    m = call.module
    if _is_norm_module(m) or _is_conv_module(m):
        return "anchor"
    params = list(m.parameters())
    if not params:
        return "free"
    if all(p.numel() <= width for p in params):
        return "scale"
    t_in, t_out = tr.tensors.get(call.in_key), tr.tensors.get(call.out_key)
    if t_in is not None and t_out is not None and t_in.shape == t_out.shape:
        return "gate"
    return "other"


def _step_op(tr: Trace, key: Key) -> Tuple[Optional[Key], bool]:
    """The tensor a pass-through op read (an activation, a dropout, a scale, a permute), and whether it was
    a permute from ``(B, H, W, C)``; ``(None, False)`` where the op is anything else."""
    ev = tr.events.get(tr.producer.get(key, -1))
    if ev is None or len(ev.inputs) != 1 or ev.weight is not None or ev.name in _NORMS or ev.name in _ADDS \
            or not ev.small:
        return None, False
    src, out = tr.tensors.get(ev.inputs[0]), tr.tensors[key]
    if src is None:
        return None, False
    if ev.name == "permute" and src.dim() == 4 and src.shape[1:] == (out.shape[2], out.shape[3], out.shape[1]):
        return ev.inputs[0], True
    return (ev.inputs[0], False) if src.shape == out.shape else (None, False)


def _branch_end(tr: Trace, key: Key, start: Key) -> Optional[Tuple[Key, bool, str]]:
    """Walk back from a branch's operand to its last norm / conv / gate: (tensor, channels-last, anchor path)."""
    last = False
    for _ in range(64):
        width = tr.tensors[key].shape[-1 if last else 1]
        step: Optional[Key] = None
        calls = [c for c in tr.by_output.get(key, []) if c.in_key not in (key, start) and c.start > tr.order(start)]
        norm = next((c for c in calls if _is_norm_module(c.module) or _is_conv_module(c.module)), None)
        if norm is not None:  # a norm with its activation inside (timm's BatchNormAct2d): after both
            return (key, last, norm.path) if _module_width(norm.module) in (width, None) else None
        for call in sorted(tr.by_output.get(key, []), key=lambda c: -c.start):
            if call.in_key == key:
                continue  # an identity: the next module out
            if call.in_key == start or call.start < tr.order(start):
                break  # a container of the whole branch: look at the ops
            kind = _module_kind(call, tr, width)
            if kind == "anchor" and _module_width(call.module) not in (width, None):
                return None  # not channels-first (a (B, T, N, C) transformer's tokens): no site
            if kind in ("anchor", "gate"):
                return key, last, call.path
            if kind in ("free", "scale") and call.in_key in tr.tensors \
                    and tr.tensors[call.in_key].shape == tr.tensors[key].shape:
                step = call.in_key
            break
        if step is None:
            step, permuted = _step_op(tr, key)
            if step is None:
                return None
            last = last or permuted
        key = step
    return None


def _slot_input(tr: Trace, branch: List[Event], width: int, start_width: int) -> Optional[Key]:
    """An inverted residual's SE slot: the input of the branch's last pointwise projection that follows a
    depthwise conv of its input width, or reads a width expanded beyond the block's input and output with no
    depthwise conv at the block's width before it (a fused expansion; ConvNeXt's depthwise-first MLP is no
    inverted residual here: its site is the branch end); ``None`` for any other branch."""
    dw_widths: List[int] = []
    slot = None
    for ev in branch:
        if ev.weight is None or ev.name != "conv2d" or ev.weight.dim() != 4:
            continue
        w, groups = ev.weight, ev.groups
        reads = w.shape[1] * groups
        if groups > 1 and w.shape[1] == 1:
            dw_widths.append(reads)
        elif groups == 1 and w.shape[-2:] == (1, 1):  # the last pointwise conv: the projection, if any
            slot = ev if reads in dw_widths or reads > max(width, start_width) and width not in dw_widths else None
    if slot is None:
        return None
    key = slot.inputs[0]
    ev = tr.events.get(tr.producer.get(key, -1))
    if ev is not None and ev.name in _SPLITS and len(ev.inputs) == 1 and not tr.by_output.get(key):
        key = ev.inputs[0]  # a mixed (split) projection: the tensor before the split
        ev = tr.events.get(tr.producer.get(key, -1))
    if ev is not None and ev.name == "cat":
        return None  # an aggregation of concatenated features (VoVNet), not an expanded width
    return key


def _install_path(tr: Trace, key: Key, start: Key) -> Optional[str]:
    calls = [c for c in tr.by_output.get(key, []) if c.path and c.start > tr.order(start) and c.in_key != start
             and tr.count.get(c.path, 0) == 1]  # a module called twice (a shared dropout) is no slot
    return max(calls, key=lambda c: c.start).path if calls else None


def _site_of_add(tr: Trace, ev: Event) -> Optional[StructSite]:
    p, q = ev.inputs[0], ev.inputs[1]
    tp, tq = tr.tensors[p], tr.tensors[q]
    if tp.dim() != 4 or tp.shape != tq.shape:
        return None
    start, side_p, side_q = _meet(tr, p, q)
    if start is None:
        return None
    (np_, wp), (nq, wq) = _conv_weight(_side_events(tr, side_p)), _conv_weight(_side_events(tr, side_q))
    if (wq, nq) > (wp, np_):
        p, q, side_p, (np_, wp), (nq, wq) = q, p, side_q, (nq, wq), (np_, wp)
    if np_ < 1 or nq > 2 or wp <= wq or any(e.name in _SPLITS for e in _side_events(tr, side_q)):
        return None  # no branch; no skip (both sides long: a fusion); a skip of a split (Res2Net's hierarchy)
    branch = _side_events(tr, side_p)
    slot = _slot_input(tr, branch, tp.shape[1], tr.tensors[start].shape[1])
    if slot is not None:
        path = _install_path(tr, slot, start)
        t = tr.tensors[slot]
        return StructSite(path, t.shape[1], False, "se-slot", path, ev.index, frozenset(e.index for e in branch)) \
            if path and t.dim() == 4 else None
    end = _branch_end(tr, p, start)
    if end is None:
        return None
    key, last, anchor = end
    path = _install_path(tr, key, start)
    if path is None:
        return None
    t = tr.tensors[key]
    return StructSite(path, t.shape[-1] if last else t.shape[1], last, "branch", anchor, ev.index,
                      frozenset(e.index for e in branch))


def _site_of_cat(tr: Trace, ev: Event) -> Optional[StructSite]:
    """ShuffleNet V2's unit (Ma et al. 2018, arXiv:1807.11164, Fig. 3c): half the input is the skip, the other
    half the branch, concatenated back to the input's shape. A concatenation that grows the width (DenseNet's)
    or joins two branches is no site."""
    if len(ev.inputs) != 2:
        return None
    p, q = ev.inputs
    tp, tq, out = tr.tensors[p], tr.tensors[q], tr.tensors[ev.outputs[0]]
    if tp.dim() != 4 or tp.shape[2:] != tq.shape[2:]:
        return None
    start, side_p, side_q = _meet(tr, p, q)
    if start is None or tr.tensors[start].shape != out.shape:
        return None
    (np_, _), (nq, _) = _conv_weight(_side_events(tr, side_p)), _conv_weight(_side_events(tr, side_q))
    if np_ == 0 and nq > 0:
        p, np_, nq = q, nq, np_
    if nq or not np_ or any(e.name in _ADDS and len(e.inputs) == 2 for e in _side_events(tr, side_p)):
        return None  # no skip half, or a branch of residual blocks (CSPNet's cross-stage half: its blocks are sites)
    end = _branch_end(tr, p, start)
    path = _install_path(tr, end[0], start) if end is not None else None
    if path is None:
        return None
    t = tr.tensors[end[0]]
    return StructSite(path, t.shape[-1] if end[1] else t.shape[1], end[1], "branch", end[2], ev.index,
                      frozenset(tr.producer[k] for k in side_p if tr.producer.get(k, -1) >= 0))


def find_sites(model: nn.Module, tr: Optional[Trace] = None) -> List[StructSite]:
    """The sites of ``model`` in forward order, one per module (:func:`trace` first unless ``tr`` is given)."""
    tr = tr if tr is not None else trace(model)
    sites: List[StructSite] = []
    seen = set()
    for index in sorted(tr.events):
        ev = tr.events[index]
        if ev.name == "cat":
            site = _site_of_cat(tr, ev)
        elif ev.name in _ADDS and len(ev.inputs) == 2:
            site = _site_of_add(tr, ev)
        else:
            continue
        if site is not None and site.path not in seen:
            seen.add(site.path)
            sites.append(site)
    # a residual inside another's branch (RepGhost's re-parameterisation sums inside its ghost modules) is left
    # to the outer one, where that has a site
    return [s for s in sites if not any(s.add in o.branch for o in sites if o is not s)]
