"""Are the maps faithful, and do they point at the object? (docs/maps.md has the method and the results.)

    report = visattn.faithfulness(model, images, labels)
    print(report.table())

**Deletion / insertion** (Petsiuk, Das, Saenko 2018, "RISE", arXiv 1806.07421): the input is cut into
``regions x regions`` squares ranked by each map's mean over them (the map placed where its cells lie);
deletion fills them in that order, most attended first, insertion puts them back, and the true class's
probability is read after each of ``steps`` steps. Against ``draws`` random orders per image: **deletion
score** = random area - map area, **insertion score** = map area - random area, each with a bootstrap
interval over images (an interval containing zero: no better than random). Baselines scored the same way:
``input_x_gradient``, ``gradcam`` (Selvaraju et al. 2017, arXiv 1610.02391) and the ``centre`` prior (a
Gaussian on the image centre, sigma a quarter of the shorter side: what a map must beat to say more than "the
object is in the middle"). **Sanity check** (Adebayo et al. 2018, arXiv 1810.03292): Spearman rank correlation
with the maps of a copy of the model whose weights are re-initialised (rho near 1: the map ignores training).

**Localization** (:func:`localization`, ``data.source=placed``): the **pointing game** (Zhang et al. 2016,
arXiv 1608.00507: a hit when the map's maximum over the pixels its cells cover, ties broken at random, lies
within ``tolerance`` px of the box; chance: :func:`visattn.data.placed.box_share`) and the **energy in the
box** (the share of the map's positive mass inside it, against the box's share of the canvas), for every map,
the baselines and a ``random`` map, with 95% bootstrap intervals over canvases.
"""
from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.transforms.functional import gaussian_blur

from .geometry import GridGeometry, place, trace_geometry
from .kinds import kind_of
from .readout import GRADIENT_KINDS, LayerMap, read_maps
from .record import probe_mode, probe_pass, unwrap_model

FILLS = ("mean", "blur")
GRADIENT_BASELINES = ("input_x_gradient", "gradcam")
PRIOR = "centre"  # the centre prior's name, as a map and as a baseline
BASELINES = GRADIENT_BASELINES + (PRIOR,)


@dataclass
class Interval:
    mean: float
    lo: float
    hi: float

    def __str__(self) -> str:
        return f"{self.mean:+.3f} [{self.lo:+.3f}, {self.hi:+.3f}]"


@dataclass
class FaithfulnessRow:
    name: str  # map name (TensorBoard tag without "maps/"), or a baseline's name
    kind: str
    deletion_auc: float  # mean over images; lower = the prediction falls sooner
    insertion_auc: float  # higher = the prediction comes back sooner
    deletion_score: Interval  # random deletion area - map deletion area, with its CI
    insertion_score: Interval  # map insertion area - random insertion area, with its CI
    sanity_rho: Optional[float] = None  # Spearman rho with the re-initialised model's map (None: not run)
    deletion_curve: List[float] = field(default_factory=list)  # mean probability at each step
    insertion_curve: List[float] = field(default_factory=list)


@dataclass
class FaithfulnessReport:
    rows: List[FaithfulnessRow]
    images: int
    steps: int
    regions: int
    fill: str
    draws: int
    confidence: float
    random_deletion_auc: float
    random_insertion_auc: float
    random_deletion_curve: List[float]
    random_insertion_curve: List[float]
    # per map: each image's (deletion score, insertion score), for paired comparisons (not in as_dict)
    per_image: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)
    bootstrap_draws: int = 1000
    seed: int = 0

    def row(self, name: str) -> FaithfulnessRow:
        return next(r for r in self.rows if r.name == name)

    def versus(self, name: str, reference: str) -> Tuple[Interval, Interval]:
        """``name``'s deletion and insertion scores minus ``reference``'s, image by image (the same images,
        the same random orders), with bootstrap intervals: above zero = ``name`` is the more faithful."""
        missing = [n for n in (name, reference) if n not in self.per_image]
        if missing:
            raise KeyError(f"no map named {', '.join(missing)}; maps: {', '.join(self.per_image)}")
        (d, i), (rd, ri) = self.per_image[name], self.per_image[reference]
        return (bootstrap(d - rd, self.bootstrap_draws, self.confidence, self.seed),
                bootstrap(i - ri, self.bootstrap_draws, self.confidence, self.seed))

    def as_dict(self) -> Dict[str, Any]:
        """Plain data (JSON-ready: an undefined rho is None, not NaN)."""
        def clean(v: Any) -> Any:
            if isinstance(v, float) and math.isnan(v):
                return None
            if isinstance(v, dict):
                return {k: clean(x) for k, x in v.items()}
            if isinstance(v, list):
                return [clean(x) for x in v]
            return v

        out = asdict(replace(self, per_image={}))
        del out["per_image"]
        return clean(out)

    def table(self) -> str:
        pct = f"{self.confidence:.0%}"
        lines = [f"faithfulness on {self.images} images: {self.regions}x{self.regions} regions in {self.steps} steps, "
                 f"fill {self.fill}, {self.draws} random orders per image; scores with {pct} bootstrap intervals",
                 f"random order: deletion area {self.random_deletion_auc:.3f}, "
                 f"insertion area {self.random_insertion_auc:.3f}",
                 f"{'map':<34}{'del. area':>10}{'deletion score':>26}{'ins. area':>10}{'insertion score':>26}"
                 f"{'sanity rho':>11}"]
        for r in self.rows:
            rho = "-" if r.sanity_rho is None or math.isnan(r.sanity_rho) else f"{r.sanity_rho:.2f}"
            lines.append(f"{r.name[-34:]:<34}{r.deletion_auc:>10.3f}{str(r.deletion_score):>26}{r.insertion_auc:>10.3f}"
                         f"{str(r.insertion_score):>26}{rho:>11}")
        lines.append("deletion score = random area - map area, insertion score = map area - random area: above zero "
                     "(interval too) = better than random; sanity rho: rank correlation with the map of the model "
                     "with re-initialised weights (near 1 = the map ignores what was learned)")
        others = [r.name for r in self.rows if r.name != PRIOR]
        if PRIOR in self.per_image and others:
            lines += [f"paired against the centre prior (the same images and random orders; {pct} bootstrap "
                      "intervals): each map's score minus the prior's",
                      f"{'map':<34}{'deletion':>26}{'insertion':>26}  verdict"]
            for name in others:
                d, i = self.versus(name, PRIOR)
                d_says, i_says = (("above" if v.lo > 0 else "below" if v.hi < 0 else "not told apart") for v in (d, i))
                verdict = f"{d_says} on both" if d_says == i_says else f"{d_says} on deletion, {i_says} on insertion"
                lines.append(f"{name[-34:]:<34}{str(d):>26}{str(i):>26}  {verdict}")
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------- perturbation


def _region_index(image_hw: Sequence[int], regions: int, device) -> torch.Tensor:
    """``(H, W)`` long: which of the ``regions x regions`` squares each pixel belongs to."""
    h, w = image_hw
    ry = (torch.arange(h, device=device) * regions) // h
    rx = (torch.arange(w, device=device) * regions) // w
    return ry[:, None] * regions + rx[None, :]


def _region_scores(pixel_map: torch.Tensor, regions: int) -> torch.Tensor:
    """``(B, H, W)`` -> ``(B, regions**2)``: the mean over each square."""
    return F.adaptive_avg_pool2d(pixel_map[:, None].float(), regions).flatten(1)


def _ranks(scores: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Rank of each region (0 = first removed), highest score first; ties broken at random."""
    size = scores.abs().amax(1, keepdim=True) + 1e-12
    jitter = torch.rand(scores.shape, generator=gen).to(scores.device) * 1e-6 * size
    order = (scores.float() + jitter).argsort(dim=1, descending=True)
    return order.argsort(dim=1)


def _blur(x: torch.Tensor) -> torch.Tensor:
    sigma = max(x.shape[-2:]) / 16
    size = 2 * max(1, math.ceil(2 * sigma)) + 1
    return gaussian_blur(x, [size, size], [sigma, sigma])  # reflect-padded, as the image's own edges


def _fill(images: torch.Tensor, fill: str) -> torch.Tensor:
    if fill == "mean":
        return images.float().mean(dim=(0, 2, 3), keepdim=True).expand_as(images).to(images.dtype)
    if fill == "blur":
        return _blur(images.float()).to(images.dtype)
    raise ValueError(f"unknown fill {fill!r}; valid: {', '.join(FILLS)}")


class _Scorer:
    """Runs the perturbed images through the model and reads the true class's probability."""

    def __init__(self, model: nn.Module, images: torch.Tensor, labels: torch.Tensor, fill: str, regions: int,
                 steps: int, batch_size: int):
        self.model, self.x, self.labels = model, images, labels
        self.filled = _fill(images, fill)
        self.index = _region_index(images.shape[-2:], regions, images.device)
        self.n_regions = regions * regions
        self.steps, self.batch_size = steps, batch_size

    def probs(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        out = []
        with probe_mode(self.model):
            for i in range(0, len(x), self.batch_size):
                logits = self.model(x[i : i + self.batch_size])
                logits = logits[0] if isinstance(logits, (tuple, list)) else logits
                p = logits.float().softmax(-1)
                out.append(p.gather(1, labels[i : i + self.batch_size, None])[:, 0])
        return torch.cat(out)

    def curves(self, ranks: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Deletion and insertion curves ``(B, steps + 1)`` for region ranks ``(B, regions**2)``."""
        dels, ins = [], []
        b = self.x.shape[0]
        ranks = ranks.to(self.x.device)  # maps are read out on the CPU (records are copied there)
        for t in range(self.steps + 1):
            k = round(t * self.n_regions / self.steps)
            gone = (ranks < k).float()  # (B, R*R): regions removed by step t
            m = gone.gather(1, self.index.flatten()[None].expand(b, -1)).view(b, 1, *self.x.shape[-2:]).to(self.x.dtype)
            dels.append(self.x * (1 - m) + self.filled * m)
            ins.append(self.filled * (1 - m) + self.x * m)
        both = torch.cat(dels + ins)
        p = self.probs(both, self.labels.repeat(2 * (self.steps + 1))).view(2, self.steps + 1, b)
        return p[0].T, p[1].T


def auc(curve: torch.Tensor) -> torch.Tensor:
    """Area under ``(..., steps + 1)`` curves over x in [0, 1] (trapezoids)."""
    n = curve.shape[-1] - 1
    return (curve[..., 0] / 2 + curve[..., 1:-1].sum(-1) + curve[..., -1] / 2) / n


def bootstrap(values: torch.Tensor, draws: int = 1000, confidence: float = 0.95, seed: int = 0) -> Interval:
    """Mean of ``values`` (one per image) with a percentile bootstrap interval over images."""
    v = values.double().cpu()
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(v), (draws, len(v)), generator=gen)
    means = v[idx].mean(1)
    a = (1 - confidence) / 2
    lo, hi = torch.quantile(means, torch.tensor([a, 1 - a], dtype=torch.float64)).tolist()
    return Interval(float(v.mean()), lo, hi)


# --------------------------------------------------------------------------------------------- maps


def _spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over rows of the Spearman rank correlation of ``a`` and ``b`` ``(B, n)`` (ties get mean ranks)."""
    def ranks(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x, dtype=torch.float64)
        for i, row in enumerate(x.double()):
            _, inverse, counts = torch.unique(row, return_inverse=True, return_counts=True)
            start = torch.cumsum(counts, 0) - counts
            out[i] = (start + (counts - 1) / 2.0).double()[inverse]
        return out

    ra, rb = ranks(a.flatten(1).cpu()), ranks(b.flatten(1).cpu())
    ra, rb = ra - ra.mean(1, keepdim=True), rb - rb.mean(1, keepdim=True)
    den = (ra.norm(dim=1) * rb.norm(dim=1))
    rho = (ra * rb).sum(1) / den
    rho = rho[den > 0]
    return float(rho.mean()) if len(rho) else float("nan")


def attention_maps(model: nn.Module, images: torch.Tensor, head_maps: str = "none",
                   labels: Optional[torch.Tensor] = None, gradients: bool = True) -> List[LayerMap]:
    """The model's maps for ``images`` (one recorded eval pass, :func:`read_maps`); with ``gradients`` also the
    gradient maps for the ``labels`` classes (None: the predicted ones), from one backward pass."""
    rec, _ = probe_pass(model, images, labels, gradients=gradients)
    return read_maps(rec.records, model, images.shape, head_maps=head_maps)


def _logit_grad(model: nn.Module, x: torch.Tensor, labels: torch.Tensor, wrt: List[torch.Tensor]) -> List[torch.Tensor]:
    out = model(x)
    out = out[0] if isinstance(out, (tuple, list)) else out
    return list(torch.autograd.grad(out.float().gather(1, labels[:, None]).sum(), wrt))


def centre_prior(image_hw: Sequence[int], batch: int, device: Any = None) -> LayerMap:
    """The ``centre`` baseline: the same map for every image and model, a Gaussian on the image's centre with
    sigma a quarter of its shorter side (8 px on 32x32), ``(batch, H, W)``."""
    h, w = int(image_hw[0]), int(image_hw[1])
    sigma = min(h, w) / 4
    ys = torch.arange(h, dtype=torch.float32, device=device) - (h - 1) / 2
    xs = torch.arange(w, dtype=torch.float32, device=device) - (w - 1) / 2
    heat = torch.exp(-(ys[:, None] ** 2 + xs[None, :] ** 2) / (2 * sigma ** 2))
    return LayerMap("centre", "prior", heat.expand(batch, h, w).contiguous(), "gate", 0, GridGeometry.image((h, w)),
                    f"a centred Gaussian (sigma {sigma:g} px): neither the model nor the image")


def baseline_map(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, method: str) -> Optional[LayerMap]:
    """A baseline of :data:`BASELINES` as a :class:`LayerMap`: the ``centre`` prior, or a gradient map
    (:func:`gradient_map`); None when the model has no convolution with a spatial output for Grad-CAM."""
    if method not in BASELINES:
        raise ValueError(f"unknown baseline {method!r}; valid: {', '.join(BASELINES)}")
    if method == PRIOR:
        return centre_prior(images.shape[-2:], images.shape[0], images.device)
    return gradient_map(model, images, labels, method)


def gradient_map(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, method: str) -> Optional[LayerMap]:
    """A gradient baseline as a :class:`LayerMap` (``"input_x_gradient"`` or ``"gradcam"``); None when the
    model has no convolution with a spatial output for Grad-CAM."""
    modes = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        with torch.enable_grad():
            if method == "input_x_gradient":
                x = images.detach().clone().requires_grad_(True)
                (g,) = _logit_grad(model, x, labels, [x])
                heat = (x.detach() * g).sum(1).float()  # (B, H, W): signed evidence for the class
                return LayerMap(method, "gradient", heat, "gate", 0, GridGeometry.image(images.shape[-2:]),
                                "input x gradient of the true class's logit, summed over channels")
            if method == "gradcam":
                return _gradcam(model, images, labels)
    finally:
        for m, training in modes:
            m.training = training
    raise ValueError(f"unknown gradient map {method!r}; valid: {', '.join(GRADIENT_BASELINES)}")


def _gradcam(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> Optional[LayerMap]:
    from ..registry import backbone_modules

    seen: List[torch.Tensor] = []

    def hook(m, args, out):
        if out.dim() == 4 and min(out.shape[-2:]) > 1 and out.requires_grad:
            seen.append(out)

    # the backbone's convolutions: an attention block's own (CBAM's 7x7 gate conv, GC's context conv) is not the
    # feature map Grad-CAM explains, and an identity-initialised gate's zero conv would give a constant map
    convs = [m for m in backbone_modules(unwrap_model(model)) if isinstance(m, nn.Conv2d)]
    handles = [m.register_forward_hook(hook) for m in convs]
    try:
        x = images.detach().clone().requires_grad_(True)
        out = model(x)
    finally:
        for h in handles:
            h.remove()
    out = out[0] if isinstance(out, (tuple, list)) else out
    grads = torch.autograd.grad(out.float().gather(1, labels[:, None]).sum(), seen, allow_unused=True) if seen else []
    # the last convolution with a spatial output that the logit depends on (a gate's own small convolution
    # may run on a detached side path)
    found = [(a, g) for a, g in zip(seen, grads) if g is not None]
    if not found:
        return None
    act, g = found[-1]
    cam = F.relu((g.float().mean((2, 3), keepdim=True) * act.detach().float()).sum(1))  # (B, h, w)
    geo = trace_geometry(model, images.shape).lookup(cam.shape[-2:])
    return LayerMap("gradcam", "gradient", cam, "gate", 0, geo,
                    f"Grad-CAM on the last convolution ({cam.shape[-2]}x{cam.shape[-1]})")


def _reinitialised(model: nn.Module, seed: int) -> nn.Module:
    """A copy of the model with every module's parameters re-initialised (``reset_parameters``)."""
    twin = copy.deepcopy(unwrap_model(model))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for m in twin.modules():
            if hasattr(m, "reset_parameters") and callable(m.reset_parameters):
                m.reset_parameters()
    return twin


# --------------------------------------------------------------------------------------------- entry point


def _placed(lm: LayerMap, image_hw: Sequence[int]) -> torch.Tensor:
    values = torch.nan_to_num(lm.heat.float(), nan=0.0, posinf=0.0, neginf=0.0)
    return place(values, lm.geometry, image_hw, image_hw)[0]


def _as_maps(extra: Optional[Dict[str, Union[torch.Tensor, LayerMap]]], image_hw) -> List[LayerMap]:
    out = []
    for name, m in (extra or {}).items():
        if isinstance(m, LayerMap):
            out.append(m)
        else:
            m = m[:, 0] if m.dim() == 4 else m
            out.append(LayerMap(name, "given", m.float(), "gate", 0, GridGeometry.stretched(m.shape[-2:], image_hw),
                                "a map given by the caller"))
    return out


def faithfulness(model: nn.Module, images: torch.Tensor, labels: Optional[torch.Tensor] = None,
                 maps: Optional[Sequence[LayerMap]] = None, extra_maps: Optional[Dict[str, Any]] = None,
                 steps: int = 16, regions: int = 8, fill: str = "mean", draws: int = 3,
                 baselines: Sequence[str] = BASELINES, sanity: bool = True, bootstrap_draws: int = 1000,
                 confidence: float = 0.95, batch_size: int = 256, seed: int = 0,
                 names: Optional[Sequence[str]] = None, gradient_maps: bool = True) -> FaithfulnessReport:
    """Deletion/insertion faithfulness of every attention map of ``model`` on ``images`` (normalised model
    input ``(B, C, H, W)``) for ``labels`` (``(B,)``; default: the model's own predictions).

    ``maps``: the maps to score (default: every map :func:`read_maps` gives for one recorded pass);
    ``extra_maps``: more, by name (``(B, h, w)`` tensors stretched over the image, or ``LayerMap``s);
    ``baselines``: baselines to add (:data:`BASELINES`: two gradient maps and the centre prior); ``sanity``:
    run the model-randomisation check. ``steps`` deletion steps over ``regions x regions`` squares; ``draws`` random orders per image;
    ``fill``: ``"mean"`` (the images' mean colour) or ``"blur"``; ``names``: score only the maps with these
    names (baselines aside); ``gradient_maps``: the default maps include the gradient-weighted ones
    (``<layer>/grad``, ``rollout_grad``, ``layers_grad``) for ``labels``. The model is run in eval mode (under
    the caller's autocast, if any); its train/eval flags, weights and gradients are left as they were.
    """
    if fill not in FILLS:
        raise ValueError(f"unknown fill {fill!r}; valid: {', '.join(FILLS)}")
    if steps < 1 or regions < 1 or draws < 1:
        raise ValueError(f"steps, regions and draws must be >= 1, got {steps}, {regions}, {draws}")
    param = next(model.parameters(), None)
    x = images.to(param.device) if param is not None else images
    if labels is None:
        with probe_mode(model):
            out = model(x)
        labels = (out[0] if isinstance(out, (tuple, list)) else out).argmax(-1)
    labels = labels.to(x.device).long()
    image_hw = tuple(x.shape[-2:])
    if maps is None:
        maps = attention_maps(model, x, labels=labels, gradients=gradient_maps)
    maps = list(maps) + _as_maps(extra_maps, image_hw)
    if names is not None:
        unknown = set(names) - {m.name for m in maps}
        if unknown:
            raise ValueError(f"no map named {', '.join(sorted(unknown))}; maps: {', '.join(m.name for m in maps)}")
        maps = [m for m in maps if m.name in set(names)]
    maps += [g for g in (baseline_map(model, x, labels, b) for b in baselines) if g is not None]
    scorer = _Scorer(model, x, labels, fill, regions, steps, batch_size)
    gen = torch.Generator().manual_seed(seed)
    rnd = [scorer.curves(torch.rand(x.shape[0], regions * regions, generator=gen).argsort(1).argsort(1).to(x.device))
           for _ in range(draws)]
    rnd_del = torch.stack([r[0] for r in rnd]).mean(0)  # (B, steps + 1), mean over draws
    rnd_ins = torch.stack([r[1] for r in rnd]).mean(0)
    rhos = _sanity(model, x, labels, maps, seed) if sanity else {}
    rows, per_image = [], {}
    for lm in maps:
        if not lm.finite():
            continue
        d, ins = scorer.curves(_ranks(_region_scores(_placed(lm, image_hw), regions), gen))
        scores = ((auc(rnd_del) - auc(d)).cpu(), (auc(ins) - auc(rnd_ins)).cpu())
        per_image[lm.name] = scores
        rows.append(FaithfulnessRow(
            lm.name, lm.kind, float(auc(d).mean()), float(auc(ins).mean()),
            bootstrap(scores[0], bootstrap_draws, confidence, seed),  # the same resamples for every map
            bootstrap(scores[1], bootstrap_draws, confidence, seed),
            rhos.get(lm.name) if sanity else None, d.mean(0).tolist(), ins.mean(0).tolist()))
    return FaithfulnessReport(rows, x.shape[0], steps, regions, fill, draws, confidence, float(auc(rnd_del).mean()),
                              float(auc(rnd_ins).mean()), rnd_del.mean(0).tolist(), rnd_ins.mean(0).tolist(),
                              per_image, bootstrap_draws, seed)


def _sanity(model: nn.Module, x: torch.Tensor, labels: torch.Tensor, maps: Sequence[LayerMap],
            seed: int) -> Dict[str, float]:
    """Spearman rho between each map and the same map of a re-initialised copy of the model."""
    twin = _reinitialised(model, seed + 1)
    gradients = any(m.kind in GRADIENT_KINDS for m in maps)
    theirs = {m.name: m for m in attention_maps(twin, x, labels=labels, gradients=gradients)}
    for b in {m.name for m in maps} & set(BASELINES):
        g = baseline_map(twin, x, labels, b)
        if g is not None:
            theirs[b] = g
    out = {}
    for m in maps:
        t = theirs.get(m.name)
        if t is not None and t.heat.shape == m.heat.shape:
            out[m.name] = _spearman(m.heat, t.heat)
    return out


# --------------------------------------------------------------------------------------------- localization


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
    from ..data.placed import box_share

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
            if not kind_of(lm.kind).scored:
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
