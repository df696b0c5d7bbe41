"""The grid probe: one class-specific map per class of a 2x2 grid of probe images, so a picture shows class
evidence and not only saliency (the grid pointing game's setting: Böhle, Fritz, Schiele 2022, "B-cos Networks:
Alignment is All We Need for Interpretability", CVPR 2022, arXiv 2205.10268; Rao, Böhle, Schiele 2022, "Towards
Better Understanding Attribution Methods", CVPR 2022, arXiv 2203.10813).

:func:`grid_cells` picks the first image of each of the first ``n*n`` distinct classes of a probe batch (a fixed
batch gives the same grid at every logging step), :func:`tile` lays them out row-major, and :func:`grid_probe`
computes, in one recorded pass over ``n*n`` copies of the grid (one per class), the map for each cell's class:

* a CNN with attention blocks: ``layers_grad`` (its blocks' weights x gradient joined on the input), or its one
  block's ``<layer>/grad`` (Chefer, Gur, Wolf 2021, "Generic Attention-model Explainability for Interpreting
  Bi-Modal and Encoder-Decoder Transformers", arXiv 2103.15679);
* a token model: ``rollout_grad``, the gradient-weighted rollout of :mod:`.readout` (the same paper);
* otherwise Grad-CAM (Selvaraju et al. 2017, "Grad-CAM: Visual Explanations from Deep Networks via
  Gradient-based Localization", arXiv 1610.02391) at the last stage's output, or on the grid tokens after a
  token model's final LayerNorm.

Each map keeps its traced geometry (:func:`~visattn.maps.geometry.place`), so cells lie where the model saw them;
``share`` is the share of the map's positive mass inside its class's cell (chance ``1/n^2``). A model that takes
only its training size (a ViT's fixed position embedding) sees the grid downscaled to it by area averaging, as
``bench/grid_game.py`` does, and the picture says so.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .geometry import place, trace_geometry
from .readout import LayerMap, read_maps
from .record import probe_mode, probe_pass, unwrap_model
from .render import DIM, RIGHT, WRONG, Line, images_to_float, map_picture

PREFERRED = ("layers_grad", "rollout_grad")  # the gradient maps a grid probe reads first, in this order


@dataclass
class GridProbe:
    """One grid and its maps: ``grid`` ``(1, 3, n*s, n*s)`` (normalised), ``classes`` ``(n*n,)`` row-major,
    ``map`` the class maps (batch ``n*n``: row ``k`` explains ``classes[k]``), ``share`` ``(n*n,)``,
    ``input_hw`` what the model saw, ``downscaled`` whether that is smaller than the grid."""

    grid: torch.Tensor
    classes: torch.Tensor
    map: LayerMap
    share: torch.Tensor
    input_hw: Tuple[int, int]
    downscaled: bool
    n: int


def grid_cells(labels: torch.Tensor, n: int = 2) -> Optional[List[int]]:
    """Indices of the first image of each of the first ``n*n`` distinct classes in ``labels``; None if fewer."""
    seen: dict = {}
    for i, c in enumerate(labels.tolist()):
        seen.setdefault(int(c), i)
        if len(seen) == n * n:
            return list(seen.values())
    return None


def tile(cells: torch.Tensor, n: int) -> torch.Tensor:
    """``(n*n, C, s, s)`` cells, row-major -> one ``(1, C, n*s, n*s)`` grid."""
    k, c, s, t = cells.shape
    if k != n * n:
        raise ValueError(f"a {n}x{n} grid needs {n * n} cells, got {k}")
    return cells.view(n, n, c, s, t).permute(2, 0, 3, 1, 4).reshape(1, c, n * s, n * t)


def takes_size(model: nn.Module, hw: Sequence[int], like: torch.Tensor) -> bool:
    """Whether the model runs on ``hw`` images like ``like`` (a ViT with one position embedding does not)."""
    try:
        with torch.no_grad():
            model(like.new_zeros(1, like.shape[1], *hw))
        return True
    except (ValueError, RuntimeError, AssertionError):
        return False


def _sites(model: nn.Module) -> List[nn.Module]:
    """Grad-CAM's site: a token model's final LayerNorm, else the top-level units (a ``Sequential`` of stages
    opened one level), whose last one with a spatial output is the last stage."""
    if isinstance(getattr(model, "norm", None), nn.LayerNorm) and hasattr(model, "grid_size"):
        return [model.norm]
    out: List[nn.Module] = []
    for child in model.children():
        opened = isinstance(child, (nn.Sequential, nn.ModuleList)) and len({type(c) for c in child}) == 1
        out += list(child.children()) if opened else [child]
    return out


def stage_gradcam(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> Optional[LayerMap]:
    """Grad-CAM ``relu(sum_c mean(dlogit/dA_c) A_c)`` for ``target`` ``(B,)`` at the last stage output with a
    spatial map (or on a token model's grid tokens after its final LayerNorm); None when there is none."""
    net = unwrap_model(model)
    seen: List[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda mod, a, out: seen.append(out)) for m in _sites(net)]
    try:
        with torch.enable_grad():
            out = model(x.detach().clone().requires_grad_(True))
    finally:
        for h in hooks:
            h.remove()
    logits = out[0] if isinstance(out, (tuple, list)) else out
    token = hasattr(net, "grid_size") and isinstance(getattr(net, "norm", None), nn.LayerNorm)
    acts = [a for a in seen if isinstance(a, torch.Tensor) and a.requires_grad
            and (a.dim() == 3 if token else a.dim() == 4 and min(a.shape[-2:]) > 1)]
    if not acts:
        return None
    (g,) = torch.autograd.grad(logits.float().gather(1, target[:, None]).sum(), [acts[-1]])
    a, g = acts[-1].detach().float(), g.float()
    if token:  # (B, N, D): the grid tokens follow the prefix tokens
        gh, gw = net.grid_size
        a, g = (t[:, -gh * gw:].transpose(1, 2).reshape(len(t), -1, gh, gw) for t in (a, g))
    cam = F.relu((g.mean((2, 3), keepdim=True) * a).sum(1))
    geo = trace_geometry(model, x.shape).lookup(cam.shape[-2:])
    return LayerMap("gradcam", "gradient", cam, "gate", 0, geo,
                    f"Grad-CAM at the {'final LayerNorm tokens' if token else 'last stage output'}")


def class_map(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> LayerMap:
    """The map for class ``target[b]`` of image ``x[b]``: ``layers_grad`` or ``rollout_grad``, else a single
    ``<layer>/grad`` map, else Grad-CAM at the last stage (:func:`stage_gradcam`)."""
    rec, _ = probe_pass(model, x, target, gradients=True)
    maps = {m.name: m for m in read_maps(rec.records, model, x.shape, head_maps="none") if m.placed and m.finite()}
    grads = [m for name, m in maps.items() if name.endswith("/grad")]
    for name in PREFERRED:
        if name in maps:
            return maps[name]
    if len(grads) == 1:
        return grads[0]
    cam = stage_gradcam(model, x, target)
    if cam is None:
        raise ValueError("the model has no gradient map and no spatial stage output for Grad-CAM")
    return cam


def cell_share(lm: LayerMap, grid_hw: Sequence[int], input_hw: Sequence[int], n: int) -> torch.Tensor:
    """Per row ``k`` of ``lm``: the share of its positive mass, drawn on the grid's pixels, in cell ``k``."""
    values = torch.nan_to_num(lm.heat.detach().float().cpu(), nan=0.0, posinf=0.0, neginf=0.0)
    v, covered = place(values, lm.geometry, tuple(grid_hw), tuple(input_hw))
    cy = torch.arange(grid_hw[0]) * n // grid_hw[0]
    cx = torch.arange(grid_hw[1]) * n // grid_hw[1]
    cell = cy[:, None] * n + cx[None, :]
    mass = v.clamp(min=0) * covered.cpu()
    mine = cell[None] == torch.arange(len(v))[:, None, None]
    total = mass.flatten(1).sum(1)
    return torch.where(total > 0, (mass * mine).flatten(1).sum(1) / total.clamp(min=1e-30),
                       torch.full_like(total, 1.0 / n ** 2))


def grid_probe(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, n: int = 2) -> Optional[GridProbe]:
    """The ``n x n`` grid of ``images``' first images of distinct classes and each cell's class map; None when
    ``labels`` hold fewer than ``n*n`` classes. The model sees the grid itself, or downscaled to ``images``'
    size when it cannot take the grid's (area averaging)."""
    pick = grid_cells(labels, n)
    if pick is None:
        return None
    grid = tile(images[pick], n)
    classes = labels[pick].to(images.device)
    hw = tuple(grid.shape[-2:])
    with probe_mode(model, grad=True):  # eval mode, RNG forked, train flags restored; no parameter .grad
        input_hw = hw if takes_size(model, hw, images) else tuple(images.shape[-2:])
        x = grid if input_hw == hw else F.interpolate(grid, size=input_hw, mode="area")
        lm = class_map(model, x.expand(n * n, -1, -1, -1).contiguous(), classes)
    return GridProbe(grid, classes, lm, cell_share(lm, hw, input_hw, n), input_hw, input_hw != hw, n)


def grid_picture(gp: GridProbe, mean: Optional[Sequence[float]] = None, std: Optional[Sequence[float]] = None,
                 class_names: Optional[Sequence[str]] = None, scale: int = 2, colormap: str = "jet",
                 alpha: float = 0.5) -> np.ndarray:
    """The grid beside each class's map (HWC uint8), titled with the class and its map's share in its cell
    (green above chance, red at or below), each map stretched to its own range."""
    k = gp.n ** 2
    hw = gp.grid.shape[-2:]
    base = images_to_float(gp.grid, mean, std, (hw[0] * scale, hw[1] * scale)).expand(k, -1, -1, -1)
    names = [str(class_names[c]) if class_names is not None and 0 <= c < len(class_names) else str(c)
             for c in gp.classes.tolist()]
    captions: List[List[Line]] = []
    for r, (name, s) in enumerate(zip(names, gp.share.tolist())):
        captions.append([(f"cell {r // gp.n},{r % gp.n}: {name}", RIGHT if s > 1 / k else WRONG),
                         (f"{s:.0%} of its map in its cell", DIM)])
    notes = [(f"{gp.map.name} per class, chance {1 / k:.0%}" + (f"; seen at {gp.input_hw[0]} px" if gp.downscaled
                                                                else ""), DIM)]
    return map_picture(base, gp.map, gp.input_hw, captions, norm="per_image", colormap=colormap, alpha=alpha,
                       max_width=10 ** 6, notes=notes)


def describe(gp: GridProbe) -> str:
    """One line for ``maps/descriptions``."""
    return (f"a fixed {gp.n}x{gp.n} grid of probe images of distinct classes and, per class, its {gp.map.name} map "
            f"(row-major cells); each title: the share of that map's positive mass in its class's cell (chance "
            f"{1 / gp.n ** 2:.0%})" + ("; the model saw the grid downscaled to its input size" if gp.downscaled else ""))

