"""The attention of vision transformers whose attention is not timm's ``Attention`` nor ``nn.MultiheadAttention``
(those two: :mod:`.record`), recorded while a recorder listens and placed on the image.

Each family is one :class:`Family` entry of :data:`FAMILIES`: which modules it records, the kind of their tap and
how their weights are placed. While :func:`~visattn.maps.record.record_attention` runs, each matched module's
``forward`` is wrapped (restored on exit; outside a recording nothing is wrapped, so training, ``torch.compile``,
fused kernels, ``state_dict`` and pickling are untouched): the call runs as it is under a torch function mode
(:class:`Capture`) that sees every softmax, every ``scaled_dot_product_attention`` (turned into explicit
fp32 weights, ``softmax(q k^T * scale + mask)``) and every dropout input inside it, and the family turns what it
saw into records:

* **windows** (Swin v1/v2: Liu et al., 2021, "Swin Transformer", arXiv:2103.14030, and Liu et al., 2022, "Swin
  Transformer V2", arXiv:2111.09883; TinyViT: Wu et al., 2022, arXiv:2207.10666; MaxViT's block and grid
  attention: Tu et al., 2022, "MaxViT", arXiv:2204.01697; EfficientViT (MSRA): Liu et al., 2023, arXiv:2305.07027):
  where each window token sits is found by running the block's own partition (its shift, padding, window or grid
  split) on a map of position numbers up to the attention call (:func:`positions`); each window's ``N x N``
  weights are then scattered into one ``(B, heads, H*W, H*W)`` token record on the block's ``(H, W)`` grid
  (0 between tokens of different windows; a padded key's share is dropped). The cost is ``(H*W)^2`` per head
  and image: fine for a probe batch at CIFAR or small ImageNet sizes.
* **global tokens**: CaiT (Touvron et al., 2021, "Going deeper with Image Transformers", arXiv:2103.17239): the
  patch layers' talking-heads weights (after ``proj_w``: what multiplies the values) and the class attention
  ``(B, heads, 1, 1+N)``; ConViT (d'Ascoli et al., 2021, arXiv:2103.10697): the gated positional self-attention
  as it multiplies the values, and the later layers' self-attention; LeViT (Graham et al., 2021,
  arXiv:2104.01136), including its subsampling attention (queries on the coarser grid); FastViT's attention
  stages (Vasu et al., 2023, arXiv:2303.14189); XCiT's class attention (El-Nouby et al., 2021, arXiv:2106.09681).
* **covariance**: XCiT's and EdgeNeXt's (Maaz et al., 2022, arXiv:2206.10589) cross-covariance attention
  ``(B, heads, d, d)``, channel x channel: kind ``"covariance"``, not placed on the image.
* **pool**: CoaT's factorized attention (Xu et al., 2021, "Co-Scale Conv-Attentional Image Transformers",
  arXiv:2104.06399) has no token-by-token map: its keys' softmax over the tokens, averaged over heads and
  channels, is the pooling the context is drawn from (``(B, 1+N)``, class token first); MobileViT v2's separable
  self-attention (Mehta & Rastegari, 2022, arXiv:2206.02680): its context scores, averaged over the pixels of a
  patch.
* **MobileViT** v1 (Mehta & Rastegari, 2021, arXiv:2110.02178): its timm ``Attention`` runs on ``B x P``
  sequences (one per pixel position inside a patch); the records average the ``P`` and lie on the patch grid.

Families that cannot be recorded say why (:data:`UNRECORDABLE`).
"""
from __future__ import annotations

import math
import warnings
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..attention.tap import AttentionTap

_SOFTMAX = {torch.softmax, torch.Tensor.softmax, F.softmax}
_DROPOUT = {F.dropout, torch.dropout}


@dataclass
class Caught:
    """One tensor seen inside a recorded call: ``what`` is ``"softmax"`` (over dimension ``dim``), ``"sdpa"``
    (``scaled_dot_product_attention``'s weights, made explicit) or ``"dropout"`` (its input)."""

    what: str
    tensor: torch.Tensor
    dim: int = -1


def sdpa_weights(q: torch.Tensor, k: torch.Tensor, v: Any = None, attn_mask: Optional[torch.Tensor] = None,
                 dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
                 enable_gqa: bool = False) -> torch.Tensor:
    """The weights ``scaled_dot_product_attention(q, k, v, ...)`` uses, explicitly, in fp32 (no dropout)."""
    with torch.autocast(q.device.type, enabled=False):
        qf, kf = q.float(), k.float()
        if enable_gqa and kf.shape[-3] != qf.shape[-3]:
            kf = kf.repeat_interleave(qf.shape[-3] // kf.shape[-3], dim=-3)
        s = 1.0 / math.sqrt(qf.shape[-1]) if scale is None else float(scale)
        logits = (qf @ kf.transpose(-2, -1)) * s
        if is_causal:
            n, m = logits.shape[-2:]
            logits = logits.masked_fill(torch.ones(n, m, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        if attn_mask is not None:
            logits = (logits.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool
                      else logits + attn_mask.float())
        return logits.softmax(-1)


class Capture(TorchFunctionMode):
    """Sees the softmaxes, attention kernels and dropout inputs of the code it is active around."""

    def __init__(self):
        super().__init__()
        self.caught: List[Caught] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _SOFTMAX and isinstance(out, torch.Tensor):
            dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
            if isinstance(dim, int):
                self.caught.append(Caught("softmax", out, dim % out.dim()))
        elif func is F.scaled_dot_product_attention:
            self.caught.append(Caught("sdpa", sdpa_weights(*args, **kwargs)))
        elif func in _DROPOUT and args and isinstance(args[0], torch.Tensor):
            self.caught.append(Caught("dropout", args[0]))
        return out

    def last_dim(self) -> List[torch.Tensor]:
        """The attention weights normalised over their last dimension (softmaxes and kernels), in call order."""
        return [c.tensor for c in self.caught if c.what == "sdpa" or (c.what == "softmax" and c.dim == c.tensor.dim() - 1)]


# ----------------------------------------------------------------------------- where window tokens sit


class _Stop(Exception):
    pass


class _Probe(nn.Module):
    """Stands in for an attention module: keeps its input and stops the call; other attributes are the module's."""

    def __init__(self, original: nn.Module):
        super().__init__()
        object.__setattr__(self, "original", original)  # not a submodule
        self.seen: Optional[torch.Tensor] = None

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "original"), name)

    def forward(self, x, *args, **kwargs):
        self.seen = x
        raise _Stop


class _FirstLinear(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.seen: Optional[torch.Tensor] = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.linear and args[0].shape[-1] == 1:  # the one-channel map of positions, not a bias table
            self.seen = args[0]
            raise _Stop
        return func(*args, **(kwargs or {}))


def positions(block: nn.Module, run: Callable[[nn.Module, torch.Tensor], Any], hw: Tuple[int, int], channels_last: bool,
              n: int, attn: Optional[str] = "attn") -> torch.Tensor:
    """``(windows, n)``: the flat image position (row-major on ``hw``) of each token of each window the block
    attends in, -1 for padding: ``run(block, x)`` is called on a map of position numbers (one image, one
    channel) and stopped where the attention module ``attn`` is called (None: at the first linear layer that
    takes it)."""
    h, w = hw
    idx = torch.arange(1, h * w + 1, dtype=torch.float64).view(1, h, w, 1)
    x = idx if channels_last else idx.permute(0, 3, 1, 2)
    if attn is None:
        mode = _FirstLinear()
        try:
            with mode:
                run(block, x)
        except _Stop:
            pass
        seen = mode.seen
    else:
        original = block.get_submodule(attn)
        probe = _Probe(original)
        _set(block, attn, probe)
        try:
            run(block, x)
        except _Stop:
            pass
        finally:
            _set(block, attn, original)
        seen = probe.seen
    if seen is None:
        raise ValueError(f"{type(block).__name__}: its attention was not reached on a {h}x{w} map of positions")
    return seen.reshape(-1, n).round().long() - 1


def _set(block: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(block.get_submodule(parent) if parent else block, name, module)


def scatter_windows(weights: torch.Tensor, pos: torch.Tensor, cells: int) -> torch.Tensor:
    """``(B * windows, heads, n, n)`` window weights -> ``(B, heads, cells, cells)`` on the image's positions
    (``pos``: :func:`positions`; entries with a padded query or key are dropped)."""
    r, n = pos.shape
    b, heads = weights.shape[0] // r, weights.shape[1]
    rows, cols = pos[:, :, None].expand(r, n, n), pos[:, None, :].expand(r, n, n)
    keep = (rows >= 0) & (cols >= 0)
    flat = (rows * cells + cols)[keep].to(weights.device)
    values = weights.reshape(b, r, heads, n, n).permute(0, 2, 1, 3, 4)[:, :, keep]  # (B, heads, kept)
    out = weights.new_zeros(b, heads, cells * cells)
    out[:, :, flat] = values
    return out.view(b, heads, cells, cells)


# ----------------------------------------------------------------------------- the families


Emit = Tuple[torch.Tensor, Optional[Tuple[int, int]], int]  # weights, grid, prefix tokens


@dataclass
class Site:
    """One recorded module: its path, its tap and what its family read off the model around it."""

    family: "Family"
    path: str
    module_ref: Any  # weakref.ref to the module: a site kept on its module must not keep it alive
    tap: AttentionTap
    context: Dict[str, Any] = field(default_factory=dict)
    failed: bool = False

    @property
    def module(self) -> nn.Module:
        return self.module_ref()


@dataclass(frozen=True)
class Family:
    """``modules``: ``(python module, class name)`` pairs it records; ``kind``: its tap's kind; ``place(site,
    args, kwargs, capture) -> [(weights, grid, prefix)]``; ``context(model, path, module) -> dict``: what it
    needs from around the module (None: nothing); ``where``: the line the map descriptions add."""

    name: str
    modules: Tuple[Tuple[str, str], ...]
    kind: str
    place: Callable[[Site, tuple, dict, Capture], List[Emit]]
    context: Optional[Callable[[nn.Module, str, nn.Module], Dict[str, Any]]] = None
    where: str = ""  # one line: what the record's axes are and where its cells lie
    label: str = ""  # the family as docs/maps.md names it

    def matches(self, module: nn.Module) -> bool:
        t = type(module)
        return (t.__module__, t.__name__) in self.modules


def _stacked(site: Site, capture: Capture) -> torch.Tensor:
    """The call's attention weights as ``(rows, heads, Nq, Nk)``: one 4-D softmax or kernel, per-head 3-D ones
    stacked (EfficientViT's cascaded heads), or a 5-D one with its leading dims merged (torchvision MaxViT)."""
    found = capture.last_dim()
    if not found:
        raise ValueError(f"{site.path}: no attention weights were computed")
    if all(t.dim() == 3 for t in found) and len({t.shape for t in found}) == 1:
        return torch.stack(found, 1)
    w = found[-1]
    if w.dim() == 4:
        return w  # the tensor the model used (a gradient recording differentiates it)
    return w.reshape(-1, *w.shape[-3:]) if w.dim() > 4 else w[:, None]


def _image_hw(x: torch.Tensor, channels_last: bool) -> Tuple[int, Tuple[int, int]]:
    return (x.shape[0], (x.shape[1], x.shape[2])) if channels_last else (x.shape[0], (x.shape[-2], x.shape[-1]))


MAX_PLACED_BYTES = 2**28  # a windowed record placed on its grid is at most this large (fp32), else not recorded


def _windows(channels_last: bool, run: Callable[[nn.Module, torch.Tensor], Any], attn: Optional[str] = "attn"):
    def place(site: Site, args: tuple, kwargs: dict, capture: Capture) -> List[Emit]:
        w = _stacked(site, capture)
        b, hw = _image_hw(args[0], channels_last)
        size = b * w.shape[1] * (hw[0] * hw[1]) ** 2 * 4
        if size > MAX_PLACED_BYTES:
            raise ValueError(f"its windows placed on the {hw[0]}x{hw[1]} grid would take {size / 2**20:.0f} MiB for "
                             f"{b} image(s) (more than {MAX_PLACED_BYTES / 2**20:.0f} MiB: record fewer images or a "
                             "smaller input, or raise visattn.maps.families.MAX_PLACED_BYTES)")
        key = (hw, w.shape[-1])
        pos = site.context.get(key)
        if pos is None:
            pos = site.context[key] = positions(site.module, run, hw, channels_last, w.shape[-1], attn)
        placed = scatter_windows(w, pos, hw[0] * hw[1])
        used = capture.last_dim()[-1]  # what the model multiplied its values by (w, or what w reshapes)
        if used.requires_grad and used.numel() == w.numel():  # a gradient recording: its relevance, placed alike
            placed.visattn_placed = (used, lambda t: scatter_windows(t.reshape(w.shape), pos, hw[0] * hw[1]))
        return [(placed, hw, 0)]

    return place


def _tokens(prefix: int, source: str = "last"):
    """Global attention over ``prefix`` class tokens then a grid (from the model, the input or the count)."""

    def place(site: Site, args: tuple, kwargs: dict, capture: Capture) -> List[Emit]:
        if source == "dropout":
            found = [c.tensor for c in capture.caught if c.what == "dropout" and c.tensor.dim() == 4]
            w = found[0] if found else _stacked(site, capture)
        else:
            w = _stacked(site, capture)
        x = args[0] if args else next(iter(kwargs.values()))
        grid = tuple(x.shape[-2:]) if x.dim() == 4 else site.context.get("grid")
        return [(w, _grid(grid, w.shape[-1] - prefix), prefix)]

    return place


def _grid(grid: Optional[Tuple[int, ...]], n: int) -> Optional[Tuple[int, int]]:
    if grid is not None and int(grid[0]) * int(grid[1]) == n:
        return int(grid[0]), int(grid[1])
    side = math.isqrt(max(n, 0))
    return (side, side) if side * side == n and side > 0 else None


def _covariance(site: Site, args: tuple, kwargs: dict, capture: Capture) -> List[Emit]:
    w = _stacked(site, capture)  # (B, heads, d, d)
    return [(w, None, 0)]


def _coat(site: Site, args: tuple, kwargs: dict, capture: Capture) -> List[Emit]:
    keys = [c.tensor for c in capture.caught if c.what == "softmax" and c.tensor.dim() == 4 and c.dim == 2]
    if not keys:
        raise ValueError(f"{site.path}: no key softmax was computed")
    size = args[1] if len(args) > 1 else kwargs.get("size")
    pool = keys[-1].mean(dim=(1, 3))  # (B, 1+N): over heads and channels, each channel's weights sum to 1
    return [(pool, _grid(size, pool.shape[-1] - 1), 1)]


def _mobilevit(site: Site, args: tuple, kwargs: dict, capture: Capture) -> List[Emit]:
    w = _stacked(site, capture)  # (B * P, heads, N, N)
    p = site.context["patch_area"]
    mean = w.reshape(w.shape[0] // p, p, *w.shape[1:]).mean(1)
    if w.requires_grad:
        mean.visattn_placed = (w, lambda t: t.reshape(t.shape[0] // p, p, *t.shape[1:]).mean(1))
    return [(mean, _grid(None, mean.shape[-1]), 0)]


def _mobilevit2(site: Site, args: tuple, kwargs: dict, capture: Capture) -> List[Emit]:
    scores = [c.tensor for c in capture.caught if c.what == "softmax" and c.tensor.dim() == 4]
    if not scores:
        raise ValueError(f"{site.path}: no context scores were computed")
    pool = scores[-1].mean(dim=(1, 2))  # (B, 1, P, N) -> (B, N): over the pixels of a patch
    return [(pool, _grid(None, pool.shape[-1]), 0)]


def _patch_grid(model: nn.Module, path: str, module: nn.Module) -> Dict[str, Any]:
    pe = getattr(model, "patch_embed", None)
    grid = getattr(pe, "grid_size", None)
    return {"grid": tuple(int(g) for g in grid)} if grid is not None else {}


def _patch_area(model: nn.Module, path: str, module: nn.Module) -> Dict[str, Any]:
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        owner = model.get_submodule(".".join(parts[:cut]))
        if hasattr(owner, "patch_area"):
            return {"patch_area": int(owner.patch_area)}
    raise ValueError(f"{path}: no enclosing MobileViT block")


def _call(method: str) -> Callable[[nn.Module, torch.Tensor], Any]:
    return lambda block, x: getattr(type(block), method)(block, x)  # the class's: not a recording wrapper


WINDOWS = "windows placed back on the block's grid (shifts undone), 0 between windows"
PARTITIONS = "block (window) or grid partitions placed back on the stage's grid, 0 between partitions"
PATCHES = "on the patch grid"
FAMILIES: Tuple[Family, ...] = (
    Family("swin", (("timm.models.swin_transformer", "SwinTransformerBlock"),
                    ("timm.models.swin_transformer_v2", "SwinTransformerV2Block")), "token",
           _windows(True, _call("_attn")), where=WINDOWS, label="Swin v1 and v2"),
    Family("tiny_vit", (("timm.models.tiny_vit", "TinyVitBlock"),), "token", _windows(True, _call("forward")),
           where="windows placed back on the block's grid (a padded key's share dropped), 0 between windows",
           label="TinyViT"),
    Family("maxvit", (("timm.models.maxxvit", "PartitionAttentionCl"),), "token",
           _windows(True, _call("_partition_attn")), where=PARTITIONS, label="MaxViT, MaxxViT (channels last)"),
    Family("maxvit", (("timm.models.maxxvit", "PartitionAttention2d"),), "token",
           _windows(False, _call("_partition_attn")), where=PARTITIONS, label="MaxViT (NCHW attention)"),
    Family("efficientvit_msra", (("timm.models.efficientvit_msra", "LocalWindowAttention"),), "token",
           _windows(False, _call("forward")),
           where="windows placed back on the block's grid, 0 between windows; cascaded heads stacked",
           label="EfficientViT (MSRA, `efficientvit_m*`)"),
    Family("torchvision_maxvit", (("torchvision.models.maxvit", "PartitionAttentionLayer"),), "token",
           _windows(False, _call("forward"), "attn_layer"), where=PARTITIONS, label="torchvision MaxViT"),
    Family("torchvision_swin", (("torchvision.models.swin_transformer", "ShiftedWindowAttention"),
                                ("torchvision.models.swin_transformer", "ShiftedWindowAttentionV2")), "token",
           _windows(True, _call("forward"), None), where=WINDOWS, label="torchvision Swin and Swin v2"),
    Family("cait", (("timm.models.cait", "TalkingHeadAttn"),), "token", _tokens(0, "dropout"), _patch_grid,
           where="patch-to-patch weights after the talking-heads mixing (what multiplies the values), " + PATCHES,
           label="CaiT (patch layers)"),
    Family("class_attention", (("timm.models.cait", "ClassAttn"),), "token", _tokens(1), _patch_grid,
           where="the class token's row over the class token and the patches, " + PATCHES,
           label="CaiT and XCiT (class attention)"),
    Family("convit", (("timm.models.convit", "GPSA"),), "token", _tokens(0, "dropout"), _patch_grid,
           where="gated positional and content attention as it multiplies the values, " + PATCHES,
           label="ConViT (gated positional layers)"),
    Family("convit", (("timm.models.convit", "MHSA"),), "token", _tokens(1), _patch_grid,
           where="class token first, then the patches, " + PATCHES, label="ConViT (later layers)"),
    Family("levit", (("timm.models.levit", "Attention"), ("timm.models.levit", "AttentionDownsample")), "token",
           _tokens(0), where="the stage's grid; a subsampling layer's queries lie on the coarser grid",
           label="LeViT"),
    Family("fastvit", (("timm.models.fastvit", "Attention"),), "token", _tokens(0),
           where="the attention stage's grid", label="FastViT (attention stages)"),
    Family("xcit", (("timm.models.xcit", "XCA"), ("timm.models.edgenext", "CrossCovarianceAttn")), "covariance",
           _covariance, where="rows and columns are channels of a head (cross-covariance), not image positions",
           label="XCiT, EdgeNeXt (cross-covariance)"),
    Family("coat", (("timm.models.coat", "FactorAttnConvRelPosEnc"),), "pool", _coat,
           where="the keys' softmax over the tokens (factorized attention), mean of heads and channels",
           label="CoaT, CoaT-Lite"),
    Family("mobilevit", (("timm.models.mobilevit", "LinearSelfAttention"),), "pool", _mobilevit2,
           where="context scores over the patches, mean of the pixels of a patch; one cell per patch",
           label="MobileViT v2"),
)
MOBILEVIT = Family("mobilevit", (("timm.layers.attention", "Attention"),), "token", _mobilevit, _patch_area,
                   where="patch-to-patch attention, mean of the pixel offsets inside a patch; one cell per patch",
                   label="MobileViT v1 (timm `Attention` inside a `MobileVitBlock`)")

UNRECORDABLE = {
    ("timm.models.efficientvit_mit", "LiteMLA"): "EfficientViT (MIT)'s LiteMLA is ReLU linear attention: it forms "
    "no attention weights (no softmax over tokens) to record",
    ("timm.models.maxxvit", "ParallelPartitionAttention"): "a parallel block-and-grid partition attention computes "
    "two maps in one call; not recorded",
}


def _in_mobilevit(model: nn.Module, path: str) -> bool:
    parts = path.split(".")
    return any(type(model.get_submodule(".".join(parts[:cut]))).__name__ == "MobileVitBlock"
               and type(model.get_submodule(".".join(parts[:cut]))).__module__ == "timm.models.mobilevit"
               for cut in range(1, len(parts)))


_SITES: "weakref.WeakKeyDictionary[nn.Module, Site]" = weakref.WeakKeyDictionary()


def family_of(model: nn.Module, path: str, module: nn.Module) -> Optional[Family]:
    from timm.layers import Attention

    if isinstance(module, Attention) and _in_mobilevit(model, path):
        return MOBILEVIT
    return next((f for f in FAMILIES if f.matches(module)), None)


def sites(model: nn.Module) -> List[Site]:
    """A :class:`Site` (with a tap) for every module of ``model`` that a family records, in module order."""
    out = []
    for path, m in model.named_modules():
        site = _SITES.get(m)
        if site is None:
            fam = family_of(model, path, m)
            if fam is None:
                continue
            try:
                context = fam.context(model, path, m) if fam.context is not None else {}
            except ValueError:
                continue
            site = Site(fam, path, weakref.ref(m), AttentionTap(fam.kind), context)
            _SITES[m] = site  # held beside the module: state_dict, print(model) and pickling do not change
        out.append(site)
    return out


def claimed(model: nn.Module) -> set:
    """ids of the modules a family records (the timm ``Attention`` inside MobileViT blocks among them)."""
    return {id(s.module) for s in sites(model)}


def where(model: nn.Module, name: str) -> str:
    """The placement line of the family module recorded as ``name`` ("" for any other record)."""
    try:
        site = _SITES.get(model.get_submodule(name.split("@")[0]))
    except AttributeError:
        return ""
    return site.family.where if site is not None else ""


def forget(model: nn.Module) -> int:
    """Drop the sites (and taps) of ``model``'s family modules; returns how many."""
    return sum(_SITES.pop(m, None) is not None for m in model.modules())


def unrecordable(model: nn.Module) -> List[str]:
    """One line per kind of module in ``model`` that cannot be recorded, saying why."""
    found = {(type(m).__module__, type(m).__name__) for m in model.modules()}
    return [f"{name}: {why}" for (mod, name), why in UNRECORDABLE.items() if (mod, name) in found]


def _wrapped(site: Site) -> Callable[..., Any]:
    original = site.module.forward  # the bound method of the class

    def forward(*args, **kwargs):
        if not site.tap.recording or site.failed:
            return original(*args, **kwargs)
        capture = Capture()
        with capture:
            out = original(*args, **kwargs)
        try:
            emits = site.family.place(site, args, kwargs, capture)
        except Exception as e:  # noqa: BLE001 - never break the model's forward: say it once, record nothing more
            site.failed = True
            warnings.warn(f"record_attention: {site.path} ({type(site.module).__name__}) not recorded: {e}",
                          RuntimeWarning, stacklevel=2)
            return out
        for weights, grid, prefix in emits:
            site.tap(weights, grid=grid, num_prefix_tokens=prefix)
        return out

    return forward


@contextmanager
def recording(model: nn.Module, unfused: bool = False) -> Iterator[List[Site]]:
    """For the ``with`` block, every family module of ``model`` runs through its recording wrapper (it records
    only while its tap has a sink); every ``forward`` is restored on exit. ``unfused`` (a gradient recording):
    modules with a ``fused_attn`` switch take their explicit softmax path meanwhile, so the recorded weights
    are the ones the output is computed from (and carry its gradient)."""
    found = sites(model)
    saved, switched = [], []
    try:
        for s in found:
            saved.append((s.module, "forward" in s.module.__dict__, s.module.__dict__.get("forward")))
            s.failed = False
            s.module.forward = _wrapped(s)
            for m in s.module.modules() if unfused else ():
                if getattr(m, "fused_attn", False) is True:
                    switched.append(m)
                    m.fused_attn = False
        yield found
    finally:
        for m in switched:
            m.fused_attn = True
        for module, had, old in saved:
            if had:
                module.forward = old
            else:
                del module.forward
