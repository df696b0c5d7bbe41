"""Where each cell of a recorded map lies on the input image, derived from the model.

A map on an ``h x w`` grid is drawn over the input pixels its cells see, not stretched over the image. The
geometry of a grid (:class:`GridGeometry`) is affine per axis: cell ``i``'s receptive-field centre is at input
pixel ``offset + stride * i`` (pixel index coordinates: pixel ``k``'s centre is ``k``), and it sees a
receptive field ``field`` pixels wide around it.

:func:`trace_geometry` runs the model once on a blank image of the input's size with a
``TorchFunctionMode`` that follows every ``conv2d``, ``max_pool2d``, ``avg_pool2d``, ``pad`` and ``unfold``
call (through modules or called functionally): each maps an input grid geometry to an output one,
``offset' = offset + stride * (dilation * (kernel - 1) / 2 - padding)``, ``stride' = stride * step``,
``field' = field + (kernel - 1) * dilation * stride``. Geometries are kept by spatial size (the most recent
one of each size); each tap call takes the geometry of its grid's size at that moment. This covers
visattn's stems (the 3x3 conv stem, the 2x2 valid whitening conv, whose cells sit half a pixel off),
max-pools, CCT's tokenizer and any patch embedding that is a strided conv (timm's ``PatchEmbed``,
torchvision's ``conv_proj``).

**Declaring a geometry.** A module whose forward is not a chain of those calls (a tokenizer that reshapes
pixels into patches, a crop, an upsampling) declares how its output grid sits on its input grid, as the
one convolution it is equivalent to::

    class MyPatchify(nn.Module):
        visattn_geometry = ConvGeometry(kernel=4, stride=4)  # like a 4x4 stride-4 conv on its input

(or a method ``visattn_geometry(self, input_hw) -> ConvGeometry``). Calls inside a declaring module are not
followed; its output grid is the declared one. visattn's own ``ShiftedPatchTokenizer`` is declared here
(:data:`DECLARED`). A tap whose grid size was never seen gets the grid stretched over the image, marked
``exact=False``.
"""
from __future__ import annotations

import math
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

Pair = Tuple[int, int]
IntOrPair = Union[int, Sequence[int]]


def _pair(v: IntOrPair) -> Pair:
    if isinstance(v, int):
        return (v, v)
    v = tuple(int(x) for x in v)
    return (v[0], v[0]) if len(v) == 1 else (v[0], v[1])


@dataclass(frozen=True)
class ConvGeometry:
    """A convolution-like step from one grid to the next: ``kernel``, ``stride``, ``padding`` (the padding
    before the first cell), ``dilation``; ints or ``(h, w)`` pairs."""

    kernel: IntOrPair = 1
    stride: IntOrPair = 1
    padding: IntOrPair = 0
    dilation: IntOrPair = 1

    def out_size(self, in_hw: Pair, padding_after: Optional[Pair] = None, ceil_mode: bool = False) -> Pair:
        k, s, p, d = _pair(self.kernel), _pair(self.stride), _pair(self.padding), _pair(self.dilation)
        after = p if padding_after is None else padding_after
        out = []
        for a in range(2):
            span = in_hw[a] + p[a] + after[a] - d[a] * (k[a] - 1) - 1
            out.append((math.ceil(span / s[a]) if ceil_mode else span // s[a]) + 1)
        return out[0], out[1]


@dataclass(frozen=True)
class GridGeometry:
    """Cell ``(i, j)`` of a ``size`` grid is centred on input pixel ``(offset[0] + stride[0] * i,
    offset[1] + stride[1] * j)`` and sees ``field`` pixels around it; ``exact=False``: not derived from the
    model (the grid is stretched over the image)."""

    size: Pair
    stride: Tuple[float, float] = (1.0, 1.0)
    offset: Tuple[float, float] = (0.0, 0.0)
    field: Tuple[float, float] = (1.0, 1.0)
    exact: bool = True

    @staticmethod
    def image(image_hw: Sequence[int]) -> "GridGeometry":
        return GridGeometry((int(image_hw[0]), int(image_hw[1])))

    @staticmethod
    def stretched(size: Sequence[int], image_hw: Sequence[int]) -> "GridGeometry":
        """Each cell covers an equal share of the image (the placement used when nothing is known)."""
        st = tuple(image_hw[a] / size[a] for a in range(2))
        return GridGeometry((int(size[0]), int(size[1])), st, tuple((s - 1) / 2 for s in st), st, exact=False)

    def then(self, op: ConvGeometry, out_size: Pair) -> "GridGeometry":
        """The geometry after ``op`` is applied to a tensor on this grid."""
        k, s, p, d = _pair(op.kernel), _pair(op.stride), _pair(op.padding), _pair(op.dilation)
        off = tuple(self.offset[a] + self.stride[a] * (d[a] * (k[a] - 1) / 2 - p[a]) for a in range(2))
        st = tuple(self.stride[a] * s[a] for a in range(2))
        field = tuple(self.field[a] + (k[a] - 1) * d[a] * self.stride[a] for a in range(2))
        return GridGeometry((int(out_size[0]), int(out_size[1])), st, off, field, self.exact)

    def centres(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """Input-pixel coordinates of the cell centres: rows ``(h,)`` and columns ``(w,)``."""
        ys = self.offset[0] + self.stride[0] * torch.arange(self.size[0], dtype=torch.float64)
        xs = self.offset[1] + self.stride[1] * torch.arange(self.size[1], dtype=torch.float64)
        return ys, xs

    def describe(self) -> str:
        def num(v: float) -> str:
            return f"{v:g}" if abs(v - round(v, 2)) < 1e-9 else f"{v:.2f}"

        h, w = self.size
        st = num(self.stride[0]) if self.stride[0] == self.stride[1] else f"{num(self.stride[0])}x{num(self.stride[1])}"
        where = f"cell (0,0) at px ({num(self.offset[0])}, {num(self.offset[1])})"
        return f"{h}x{w} cells, stride {st} px, {where}" + ("" if self.exact else " (stretched: geometry unknown)")


def _declared_tokenizer(m: nn.Module, in_hw: Pair) -> ConvGeometry:
    p, s = int(m.patch_size), int(getattr(m, "shift", 0))
    # the patch plus its four diagonal half-patch shifts: a (p + 2s) window, stride p, padded by s
    return ConvGeometry(kernel=p + 2 * s, stride=p, padding=s)


def _declarations() -> Dict[type, Callable[[nn.Module, Pair], ConvGeometry]]:
    from ..models.vit import ShiftedPatchTokenizer

    return {ShiftedPatchTokenizer: _declared_tokenizer}


DECLARED: Dict[type, Callable[[nn.Module, Pair], ConvGeometry]] = {}  # filled on first use (import order)


def declared_geometry(module: nn.Module, in_hw: Pair) -> Optional[ConvGeometry]:
    """The geometry ``module`` declares (its ``visattn_geometry``, or :data:`DECLARED`), else None."""
    if not DECLARED:
        DECLARED.update(_declarations())
    decl = getattr(module, "visattn_geometry", None)
    if decl is None:
        fn = next((f for cls, f in DECLARED.items() if isinstance(module, cls)), None)
        return None if fn is None else fn(module, in_hw)
    if isinstance(decl, ConvGeometry):
        return decl
    if callable(decl):
        return decl(in_hw)
    raise TypeError(f"{type(module).__name__}.visattn_geometry must be a ConvGeometry or a method returning one")


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any) -> Any:
    if len(args) > i:
        return args[i]
    return kwargs.get(name, default)


def _op_of(name: str, args: tuple, kwargs: dict) -> Optional[Tuple[ConvGeometry, Optional[Pair], bool]]:
    """``(op, padding after, ceil_mode)`` of a followed call, or None."""
    if name == "conv2d":
        w = _arg(args, kwargs, 1, "weight", None)
        pad = _arg(args, kwargs, 4, "padding", 0)
        dil = _pair(_arg(args, kwargs, 5, "dilation", 1))
        k = tuple(w.shape[-2:])
        if isinstance(pad, str):  # "valid" or "same" (stride 1; the extra pixel of an even span goes after)
            total = [0, 0] if pad == "valid" else [dil[a] * (k[a] - 1) for a in range(2)]
            before = (total[0] // 2, total[1] // 2)
            return ConvGeometry(k, 1, before, dil), (total[0] - before[0], total[1] - before[1]), False
        return ConvGeometry(k, _arg(args, kwargs, 3, "stride", 1), pad, dil), None, False
    if name in ("max_pool2d", "max_pool2d_with_indices", "avg_pool2d"):
        k = _arg(args, kwargs, 1, "kernel_size", 1)
        s = _arg(args, kwargs, 2, "stride", None) or k
        p = _arg(args, kwargs, 3, "padding", 0)
        d = _arg(args, kwargs, 4, "dilation", 1) if name != "avg_pool2d" else 1
        ceil = bool(kwargs.get("ceil_mode", False))
        return ConvGeometry(k, s, p, d), None, ceil
    if name == "unfold":
        return ConvGeometry(_arg(args, kwargs, 1, "kernel_size", 1), _arg(args, kwargs, 4, "stride", 1),
                            _arg(args, kwargs, 3, "padding", 0), _arg(args, kwargs, 2, "dilation", 1)), None, False
    if name == "pad":
        pad = list(_arg(args, kwargs, 1, "pad", ()))
        if len(pad) < 4:
            return None
        left, right, top, bottom = (int(v) for v in pad[:4])
        return ConvGeometry(1, 1, (top, left)), (bottom, right), False
    return None


class _Tracer(TorchFunctionMode):
    """Follows spatial calls; ``sizes`` maps a grid size to its most recent geometry."""

    def __init__(self, image_hw: Pair):
        super().__init__()
        self.sizes: Dict[Pair, GridGeometry] = {tuple(image_hw): GridGeometry.image(image_hw)}
        self.quiet = 0  # > 0 inside a module that declares its own geometry

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.quiet:
            return out
        x = args[0] if args else kwargs.get("input")
        name = getattr(func, "__name__", "")
        if name == "unfold" and func is not torch.nn.functional.unfold:
            return out  # Tensor.unfold (a sliding window along one dim) is not F.unfold (im2col)
        if isinstance(x, torch.Tensor) and x.dim() == 4:
            found = _op_of(name, args, kwargs)
            if found is not None:
                self.step(tuple(x.shape[-2:]), *found)
        return out

    def step(self, in_hw: Pair, op: ConvGeometry, after: Optional[Pair], ceil: bool) -> None:
        src = self.sizes.get(in_hw)
        if src is None:  # a grid not derived from the image: its descendants are unknown too
            return
        out_hw = op.out_size(in_hw, after, ceil)
        self.sizes[out_hw] = src.then(op, out_hw)


class GeometryTrace:
    """The geometry each tap call saw in a traced pass, by record name and call number."""

    def __init__(self, image_hw: Pair, calls: Dict[Tuple[str, int], Dict[Pair, GridGeometry]],
                 final: Dict[Pair, GridGeometry]):
        self.image_hw = image_hw
        self.calls = calls
        self.final = final

    def lookup(self, grid: Sequence[int], name: Optional[str] = None, call: int = 0) -> GridGeometry:
        """The geometry of a ``grid``-sized map made by tap ``name``'s ``call``-th call; stretched if unknown."""
        size = (int(grid[0]), int(grid[1]))
        seen = self.calls.get((name, call)) if name is not None else None
        for table in (seen, self.final):
            if table and size in table:
                return table[size]
        return GridGeometry.stretched(size, self.image_hw)


class _TraceSink(list):
    """A recorder sink for the trace: notes the tracer's geometries at each tap call."""

    device = None

    def __init__(self, tracer: _Tracer):
        super().__init__()
        self.tracer = tracer
        self.calls: Dict[Tuple[str, int], Dict[Pair, GridGeometry]] = {}
        self.count: Dict[str, int] = {}

    def append(self, record) -> None:  # noqa: D401 - list protocol
        k = self.count.get(record.name, 0)
        self.count[record.name] = k + 1
        self.calls[(record.name, k)] = dict(self.tracer.sizes)


@contextmanager
def _declared_hooks(model: nn.Module, tracer: _Tracer) -> Iterator[None]:
    handles = []

    def pre(m, args):
        tracer.quiet += 1

    def post(m, args, out):
        tracer.quiet -= 1
        x = args[0] if args else None
        if tracer.quiet or not isinstance(x, torch.Tensor) or x.dim() != 4:
            return
        in_hw = tuple(x.shape[-2:])
        op = declared_geometry(m, in_hw)
        tracer.step(in_hw, op, None, False)

    try:
        for m in model.modules():
            if declared_geometry_known(m):
                handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
        yield
    finally:
        for h in handles:
            h.remove()


def declared_geometry_known(m: nn.Module) -> bool:
    if not DECLARED:
        DECLARED.update(_declarations())
    return getattr(m, "visattn_geometry", None) is not None or any(isinstance(m, c) for c in DECLARED)


_CACHE: "weakref.WeakKeyDictionary[nn.Module, Dict[Tuple[int, ...], GeometryTrace]]" = weakref.WeakKeyDictionary()


def trace_geometry(model: nn.Module, input_shape: Sequence[int]) -> GeometryTrace:
    """Trace the grid geometry of every tap of ``model`` for inputs of ``input_shape`` ``(C, H, W)`` or
    ``(B, C, H, W)``: one eval pass on a blank image (no gradients, RNG forked, train/eval flags restored).

    The result is cached per model and input shape.
    """
    from .record import add_taps, probe_mode, tap_sinks, unwrap_model

    base = unwrap_model(model)
    add_taps(base)
    shape = tuple(int(s) for s in input_shape[-3:])
    cached = _CACHE.setdefault(base, {})
    if shape in cached:
        return cached[shape]
    param = next(base.parameters(), None)
    x = torch.zeros((1, *shape), device=param.device if param is not None else "cpu",
                    dtype=param.dtype if param is not None and param.is_floating_point() else torch.float32)
    tracer = _Tracer(shape[-2:])
    sink = _TraceSink(tracer)
    with probe_mode(base), tap_sinks(base, sink), _declared_hooks(base, tracer), tracer:
        base(x)
    trace = GeometryTrace(shape[-2:], sink.calls, dict(tracer.sizes))
    cached[shape] = trace
    return trace


def place(values: torch.Tensor, geometry: GridGeometry, out_hw: Sequence[int],
          image_hw: Optional[Sequence[int]] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Draw ``(B, h, w)`` cell values onto an ``out_hw`` picture of the input: ``(values (B, H', W'),
    covered (H', W') bool)``.

    Output pixel ``(Y, X)`` shows input position ``((Y + 0.5) * H / H' - 0.5, ...)``; its value is the
    bilinear interpolation between the cell centres around it (mirrored past the outer centres, so a hot
    edge cell peaks at its centre). ``covered`` is False where no cell's tile (``stride`` wide around its
    centre) reaches.
    ``image_hw``: the input's size (default: the geometry's own image, i.e. ``out_hw``).
    """
    b, h, w = values.shape
    if (h, w) != tuple(geometry.size):
        raise ValueError(f"values are on a {h}x{w} grid but the geometry is for {geometry.size}")
    image_hw = tuple(out_hw) if image_hw is None else tuple(image_hw)
    dev = values.device
    coords, inside = [], []
    for a, (n_out, n_in, n_cells) in enumerate(zip(out_hw, image_hw, (h, w))):
        pix = (torch.arange(n_out, device=dev, dtype=torch.float64) + 0.5) * (n_in / n_out) - 0.5
        u = (pix - geometry.offset[a]) / geometry.stride[a]  # position in cell units
        inside.append((u >= -0.5) & (u <= n_cells - 0.5))
        # past the outer centres the map is mirrored, so each cell is a symmetric bump around its centre
        u = torch.where(u < 0, -u, torch.where(u > n_cells - 1, 2 * (n_cells - 1) - u, u))
        norm = torch.zeros_like(u) if n_cells == 1 else (u.clamp(0, n_cells - 1) / (n_cells - 1)) * 2 - 1
        coords.append(norm.float())
    gy, gx = torch.meshgrid(coords[0], coords[1], indexing="ij")
    grid = torch.stack([gx, gy], -1)[None].expand(b, -1, -1, -1)
    out = torch.nn.functional.grid_sample(values.float()[:, None], grid, mode="bilinear", align_corners=True)
    return out[:, 0], inside[0][:, None] & inside[1][None, :]
