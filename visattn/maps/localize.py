"""Do the maps point at the object? Scores against a known box (``data.source=placed``: each image at a seeded
place on a larger canvas, :mod:`visattn.data.placed`).

* **Pointing game** (Zhang et al. 2016, "Top-down Neural Attention by Excitation Backprop", arXiv 1608.00507):
  a hit when the map's maximum (over the pixels its cells cover, ties broken at random) lies within
  ``tolerance`` px of the box. Chance is the share of the canvas's pixels that would be a hit: what a uniformly
  random point scores (:func:`visattn.data.placed.box_share`).
* **Energy in the box**: the share of the map's positive mass (over the covered pixels) inside the box, against
  the box's share of the canvas (a flat map's).

Each map is scored where its cells lie on the input (:func:`visattn.maps.geometry.place`), every map kind the
project draws (:func:`~visattn.maps.faithful.attention_maps`: gates, attention, their gradient-weighted
versions, rollouts, ``layers_grad``), the baselines (input x gradient, Grad-CAM, the centre prior) and a
``random`` map; 95% bootstrap intervals over canvases (:func:`~visattn.maps.faithful.bootstrap`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..data.placed import box_share
from .faithful import BASELINES, Interval, attention_maps, baseline_map, bootstrap
from .geometry import GridGeometry, place
from .readout import LayerMap

RANDOM = "random"


@dataclass
class LocalizationRow:
    name: str
    kind: str
    pointing: Interval  # share of canvases whose map peaks within the tolerance of the box
    energy: Interval  # share of the map's positive mass inside the box


@dataclass
class LocalizationReport:
    rows: List[LocalizationRow]
    images: int
    canvas: Tuple[int, int]
    tolerance: int
    pointing_chance: float  # a uniformly random point's hit rate, mean over canvases
    energy_chance: float  # the box's share of the canvas, mean over canvases
    confidence: float
    bootstrap_draws: int
    seed: int
    per_image: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)

    def row(self, name: str) -> LocalizationRow:
        return next(r for r in self.rows if r.name == name)


def random_map(batch: int, image_hw: Sequence[int], seed: int = 0, device=None) -> LayerMap:
    """Uniform noise, one value per pixel: the map that knows nothing."""
    gen = torch.Generator().manual_seed(seed)
    heat = torch.rand(batch, *image_hw, generator=gen).to(device)
    return LayerMap(RANDOM, RANDOM, heat, "gate", 0, GridGeometry.image(image_hw), "uniform noise per pixel")


def box_scores(lm: LayerMap, boxes: torch.Tensor, tolerance: int, image_hw: Sequence[int],
               gen: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(hit, energy)`` per image ``(B,)`` of one map against ``boxes`` ``(B, 4)`` (x0, y0, x1, y1 in input px)."""
    values = torch.nan_to_num(lm.heat.float(), nan=0.0, posinf=0.0, neginf=0.0)
    v, covered = place(values, lm.geometry, image_hw, image_hw)  # (B, H, W) on the input's pixels
    v, covered = v.cpu(), covered.cpu()
    b = v.shape[0]
    flat = v.flatten(1).masked_fill(~covered.flatten()[None], float("-inf"))
    top = flat.max(1, keepdim=True).values
    tie = torch.rand(flat.shape, generator=gen)  # a flat map's peak is any of its maxima, not the first pixel
    peak = torch.where(flat >= top, tie, torch.full_like(tie, -1.0)).argmax(1)
    h, w = image_hw
    py, px = (peak // w).double() + 0.5, (peak % w).double() + 0.5  # pixel centres
    bx = boxes.cpu().double()
    hit = ((px >= bx[:, 0] - tolerance) & (px <= bx[:, 2] + tolerance)
           & (py >= bx[:, 1] - tolerance) & (py <= bx[:, 3] + tolerance))
    ys, xs = torch.arange(h)[None, :, None], torch.arange(w)[None, None, :]
    inbox = ((xs >= bx[:, 0, None, None]) & (xs < bx[:, 2, None, None])
             & (ys >= bx[:, 1, None, None]) & (ys < bx[:, 3, None, None]))  # (B, H, W)
    mass = v.clamp(min=0) * covered
    total = mass.flatten(1).sum(1)
    flat_share = (inbox & covered).flatten(1).sum(1) / covered.sum().clamp(min=1)  # a map with no mass: no preference
    energy = torch.where(total > 0, (mass * inbox).flatten(1).sum(1) / total.clamp(min=1e-30), flat_share)
    return hit.double().reshape(b), energy.double()


def localization(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, boxes: torch.Tensor, tolerance: int,
                 maps: Optional[Sequence[LayerMap]] = None, baselines: Sequence[str] = BASELINES,
                 batch_size: int = 250, bootstrap_draws: int = 1000, confidence: float = 0.95, seed: int = 0,
                 gradient_maps: bool = True) -> LocalizationReport:
    """Pointing game and energy in the box of every map of ``model`` on ``images`` (normalised ``(B, 3, H, W)``),
    explaining ``labels``, against ``boxes`` ``(B, 4)``; ``maps``: score these instead of the model's own
    (one batch: ``batch_size`` is then ignored). The baselines and a ``random`` map are scored beside them."""
    param = next(model.parameters(), None)
    x = images.to(param.device) if param is not None else images
    labels, boxes = labels.to(x.device).long(), torch.as_tensor(boxes)
    image_hw = tuple(x.shape[-2:])
    gen = torch.Generator().manual_seed(seed)
    kinds: Dict[str, str] = {}
    scores: Dict[str, List[Tuple[torch.Tensor, torch.Tensor]]] = {}
    step = len(x) if maps is not None else batch_size
    for lo in range(0, len(x), step):
        xb, yb, bb = x[lo:lo + step], labels[lo:lo + step], boxes[lo:lo + step]
        found = list(maps) if maps is not None else attention_maps(model, xb, labels=yb, gradients=gradient_maps)
        found += [g for g in (baseline_map(model, xb, yb, b) for b in baselines) if g is not None]
        found.append(random_map(len(xb), image_hw, seed + lo, xb.device))
        for lm in found:
            if lm.kind == "head":
                continue
            kinds[lm.name] = lm.kind
            scores.setdefault(lm.name, []).append(box_scores(lm, bb, tolerance, image_hw, gen))
    rows, per_image = [], {}
    for name, parts in scores.items():
        hit, energy = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        per_image[name] = (hit, energy)
        rows.append(LocalizationRow(name, kinds[name], bootstrap(hit, bootstrap_draws, confidence, seed),
                                    bootstrap(energy, bootstrap_draws, confidence, seed)))
    b = boxes.cpu().numpy()
    area = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1]) / (image_hw[0] * image_hw[1])
    return LocalizationReport(rows, len(x), image_hw, tolerance, float(box_share(b, image_hw[0], tolerance).mean()),
                              float(area.mean()), confidence, bootstrap_draws, seed, per_image)


__all__ = ["LocalizationReport", "LocalizationRow", "RANDOM", "box_scores", "localization", "random_map"]
