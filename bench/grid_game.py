"""The grid pointing game: do the maps show the evidence for a class? Played for any checkpoint, into
bench/results/grid_game.json; with --report --write its table goes into docs/maps.md, section "Grid pointing game".

    python -m bench.grid_game runs/grid/resnet_fast_cbam-s0 runs/grid/vit_cpu-s0 ...   # run folders or last.pt
    python -m bench.grid_game --report --write                                          # the docs table

**Grids** (Böhle, Fritz, Schiele 2022, "B-cos Networks: Alignment is All We Need for Interpretability", CVPR 2022,
arXiv 2205.10268; Rao, Böhle, Schiele 2022, "Towards Better Understanding Attribution Methods", CVPR 2022, arXiv
2203.10813): ``n x n`` grids (2x2 and 3x3) of held-out images of distinct classes, every cell at the model's
input scale (32 px: the grid is 64 or 96 px and the model sees it whole). Only images the model classifies
confidently on their own (softmax of the true class >= ``--threshold``), as Rao et al. do, so each cell holds
evidence to find. The held-out split is the run's own (:func:`visattn.data.load_splits`: the stratified, seeded
split the run was scored on), the grids a seeded function of it. A model that takes only its training size (the
ViT and CCT: learned position embeddings for one token grid) sees the grid downscaled to that size (area
averaging), and its rows say so (``downscaled``).

**Score**: for every class in a grid, each map for that class, drawn on the grid's pixels where its cells lie
(:func:`visattn.maps.geometry.place`); ``share``: the share of its positive mass in that class's cell;
``pointing``: whether its maximum (ties broken at random) lies in the cell. Chance: ``1/n^2``. Means over grids
with 95% bootstrap intervals over grids.

**Maps**: what :func:`visattn.maps.read_maps` gives for the class (raw gates / attention / pooling weights and
rollout: the same for every class; ``<layer>/grad``, ``layers_grad``, ``rollout_grad``: weighted by the class's
gradient, Chefer, Gur, Wolf 2021, arXiv 2103.15679); Grad-CAM (Selvaraju et al. 2017, "Grad-CAM", arXiv
1610.02391) at each stage's output (``gradcam@<stage>``, where pytorch-grad-cam's users place it; the last one is
the usual choice), for a CNN also at the last convolution before its BatchNorm (``gradcam_pre_bn``,
:func:`visattn.maps.faithful.gradient_map`), for a token model at the final LayerNorm's grid tokens
(``gradcam@norm``); input x gradient; integrated gradients (Sundararajan, Taly, Yan 2017, "Axiomatic Attribution
for Deep Networks", arXiv 1703.01365; captum's ``IntegratedGradients`` where captum is installed, a Riemann sum
of the same path otherwise; baseline: the dataset's mean colour).

**Controls** that must sit at chance: ``agnostic_gradient`` (the input gradient's magnitude summed over the
grid's classes: the same map for every class), ``edge`` (the image's Sobel magnitude), ``centre`` (the centre
prior, :func:`visattn.maps.faithful.centre_prior`), ``random``. A map that is the same for every class in a grid
scores exactly ``1/n^2`` on ``share``: its cells' shares sum to one.

**Model randomisation** (Adebayo et al. 2018, "Sanity Checks for Saliency Maps", NeurIPS 2018, arXiv
1810.03292), on the first ``--random-grids`` 2x2 grids: the model's top units re-initialised in cascade (the
head, then the last stage or block, ...), each map recomputed, its Spearman rank correlation with the trained
model's map (on the grid's pixels, mean over grid and class) per cascade step.

A (run, map, grid size) row already in the results file is kept and not scored again (``--redo`` scores again).
"""
from __future__ import annotations

import copy
import json
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from bench.common import ROOT, command, parser, provenance, splice
from visattn.errors import CheckpointError, DataError, run_main
from visattn.options import check_at_least, check_range
from visattn.results import write_atomic

RESULTS = ROOT / "bench" / "results" / "grid_game.json"
DOCS = ROOT / "docs" / "maps.md"
BEGIN = "<!-- grid game table: python -m bench.grid_game --report --write -->"
END = "<!-- end of grid game table -->"
CONTROLS = ("agnostic_gradient", "edge", "centre", "random")
KIND_OF = {"spatial": "attention", "token": "attention", "pool": "attention", "rollout": "rollout",
           "attention_gradient": "attention_gradient", "layers_gradient": "layers_gradient",
           "gradient_rollout": "gradient_rollout"}
Maps = Dict[str, Tuple[str, torch.Tensor, Any]]  # name -> (kind, heat (B, h, w), GridGeometry)
TRACES: "weakref.WeakKeyDictionary[nn.Module, Dict[tuple, Any]]" = weakref.WeakKeyDictionary()


# --------------------------------------------------------------------------------------------- grids


@dataclass
class Grids:
    images: torch.Tensor  # (G, 3, n*s, n*s), normalised as the model takes them
    labels: torch.Tensor  # (G, n*n): the class in each cell, row-major
    sources: np.ndarray  # (G, n*n): the held-out index of each cell's image
    n: int


def confident(model: nn.Module, x: torch.Tensor, y: torch.Tensor, threshold: float, batch: int = 500) -> np.ndarray:
    """Indices of the images whose true class gets a softmax of at least ``threshold`` on their own."""
    keep = []
    with torch.no_grad():
        for lo in range(0, len(x), batch):
            p = logits_of(model(x[lo:lo + batch])).float().softmax(-1)
            keep.append((p.gather(1, y[lo:lo + batch, None])[:, 0] >= threshold).cpu())
    return np.nonzero(torch.cat(keep).numpy())[0] if keep else np.zeros(0, np.int64)


def tile(cells: torch.Tensor, n: int) -> torch.Tensor:
    """``(k, n*n, C, s, s)`` cells, row-major -> ``(k, C, n*s, n*s)`` grids."""
    k, _, c, s, _ = cells.shape
    return cells.view(k, n, n, c, s, s).permute(0, 3, 1, 4, 2, 5).reshape(k, c, n * s, n * s)


def make_grids(x: torch.Tensor, y: np.ndarray, pool: np.ndarray, n: int, count: int, seed: int) -> Grids:
    """``count`` grids of ``n x n`` images from ``pool`` (indices into ``x``/``y``), each of ``n*n`` distinct
    classes in a random arrangement; a seeded function of its arguments."""
    by_class = {int(c): pool[y[pool] == c] for c in np.unique(y[pool])}
    if len(by_class) < n * n:
        raise DataError(f"{n}x{n} grids need {n * n} classes with a confident held-out image; "
                        f"{len(by_class)} have one (lower --threshold)")
    rng = np.random.default_rng([seed, n])
    classes = np.array(sorted(by_class))
    cls = np.stack([rng.choice(classes, n * n, replace=False) for _ in range(count)])
    src = np.array([[rng.choice(by_class[int(c)]) for c in row] for row in cls], dtype=np.int64)
    images = tile(x[torch.from_numpy(src.ravel())].view(count, n * n, *x.shape[1:]), n)
    return Grids(images, torch.from_numpy(cls).long(), src, n)


# --------------------------------------------------------------------------------------------- maps


def logits_of(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def takes_size(model: nn.Module, hw: Sequence[int]) -> bool:
    """Whether the model runs on ``hw`` images (a ViT with one position embedding does not)."""
    try:
        with torch.no_grad():
            model(torch.zeros(1, 3, *hw, device=next(model.parameters()).device))
        return True
    except (ValueError, RuntimeError, AssertionError):
        return False


def input_gradient(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """d logit_target / d x, ``(B, C, H, W)``."""
    with torch.enable_grad():
        xi = x.detach().clone().requires_grad_(True)
        (g,) = torch.autograd.grad(logits_of(model(xi)).float().gather(1, target[:, None]).sum(), [xi])
    return g.detach()


def integrated_gradients(model: nn.Module, x: torch.Tensor, target: torch.Tensor, steps: int) -> torch.Tensor:
    """Integrated gradients from the zero input (the dataset's mean colour once normalised), summed over channels
    ``(B, H, W)``: captum's where captum is installed, else the same Riemann sum (midpoints) written out."""
    base = torch.zeros_like(x)
    try:
        from captum.attr import IntegratedGradients
    except ImportError:
        total = torch.zeros_like(x)
        for i in range(steps):
            total += input_gradient(model, base + (i + 0.5) / steps * (x - base), target)
        return ((x - base) * total / steps).sum(1)
    ig = IntegratedGradients(lambda z: logits_of(model(z)).float())
    with torch.enable_grad():
        a = ig.attribute(x.detach(), baselines=base, target=target, n_steps=steps, method="riemann_middle",
                         internal_batch_size=max(len(x), 1) * 8)
    return a.detach().sum(1).float()


def ig_backend() -> str:
    try:
        import captum
        return f"captum {captum.__version__} IntegratedGradients (riemann_middle)"
    except ImportError:
        return "visattn's own Riemann sum (midpoints): captum is not installed"


def units(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """The model's top-level children in order, a ``Sequential``/``ModuleList`` of one module type opened one level
    (a ResNet's stages, a ViT's blocks; not a stem of conv, norm and activation): the units of Grad-CAM's stage
    outputs and of the randomisation cascade."""
    out = []
    for name, child in model.named_children():
        if isinstance(child, (nn.Sequential, nn.ModuleList)) and len({type(c) for c in child}) == 1:
            out += [(f"{name}.{i}", c) for i, c in child.named_children()]
        else:
            out.append((name, child))
    return out


def token_model(model: nn.Module) -> bool:
    """A model whose features are tokens on a grid, normed last (visattn's ViT and CCT)."""
    return isinstance(getattr(model, "norm", None), nn.LayerNorm) and hasattr(model, "grid_size")


def gradcams(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> Maps:
    """Grad-CAM for ``target``: at every stage's output of a CNN (``gradcam@<stage>``; the stem aside), or at a
    token model's final LayerNorm, on its grid tokens (``gradcam@norm``): ``relu(sum_c mean(dlogit/dA_c) A_c)``."""
    from visattn.maps import trace_geometry

    seen: List[Tuple[str, torch.Tensor]] = []
    if token_model(model):
        sites = [("norm", model.norm)]
    else:
        sites = [(n, m) for n, m in units(model)[1:] if any(True for _ in m.parameters())]
    hooks = [m.register_forward_hook(lambda mod, a, out, n=n: seen.append((n, out))) for n, m in sites]
    try:
        with torch.enable_grad():
            logits = logits_of(model(x.detach().clone().requires_grad_(True)))
    finally:
        for h in hooks:
            h.remove()
    acts = [(n, a) for n, a in seen if isinstance(a, torch.Tensor) and a.requires_grad
            and (a.dim() == 3 if token_model(model) else a.dim() == 4 and min(a.shape[-2:]) > 1)]
    if not acts:
        return {}
    grads = torch.autograd.grad(logits.float().gather(1, target[:, None]).sum(), [a for _, a in acts],
                                allow_unused=True)
    traces = TRACES.setdefault(model, {})
    key = tuple(x.shape[1:])
    trace = traces[key] = traces.get(key) or trace_geometry(model, x.shape)  # one per model and input size
    out: Maps = {}
    for (name, a), g in zip(acts, grads):
        if g is None:
            continue
        a, g = a.detach().float(), g.float()
        if a.dim() == 3:  # tokens (B, N, D): the grid tokens follow the prefix tokens
            gh, gw = model.grid_size
            a, g = (t[:, -gh * gw:].transpose(1, 2).reshape(len(t), -1, gh, gw) for t in (a, g))
        cam = F.relu((g.mean((2, 3), keepdim=True) * a).sum(1))
        out[f"gradcam@{name}"] = ("gradcam", cam, trace.lookup(cam.shape[-2:]))
    return out


def class_maps(model: nn.Module, x: torch.Tensor, target: torch.Tensor, ig_steps: int,
               pre_bn: bool) -> Tuple[Maps, torch.Tensor]:
    """Every map of the model for class ``target`` ``(B,)`` on model inputs ``x``, and the input gradient."""
    from visattn.maps import GridGeometry, probe_pass, read_maps
    from visattn.maps.faithful import gradient_map

    rec, _ = probe_pass(model, x, target, gradients=True)
    out: Maps = {}
    for lm in read_maps(rec.records, model, x.shape, head_maps="none"):
        if lm.kind in KIND_OF:
            out[lm.name] = (KIND_OF[lm.kind], lm.heat.float(), lm.geometry)
    out.update(gradcams(model, x, target))
    if pre_bn and not token_model(model):
        lm = gradient_map(model, x, target, "gradcam")
        if lm is not None:
            out["gradcam_pre_bn"] = ("gradcam_pre_bn", lm.heat.float(), lm.geometry)
    g = input_gradient(model, x, target)
    pixels = GridGeometry.image(x.shape[-2:])
    out["input_x_gradient"] = ("input_x_gradient", (x * g).sum(1).float(), pixels)
    if ig_steps:
        out["integrated_gradients"] = ("integrated_gradients", integrated_gradients(model, x, target, ig_steps),
                                       pixels)
    return out, g


def edge_map(x: torch.Tensor) -> torch.Tensor:
    """The image's Sobel gradient magnitude, summed over channels ``(B, H, W)``: no model, no class."""
    k = torch.tensor([[1.0, 0.0, -1.0], [2.0, 0.0, -2.0], [1.0, 0.0, -1.0]], device=x.device)
    c = x.shape[1]
    w = torch.stack([k, k.T])[:, None].repeat(c, 1, 1, 1)  # (2C, 1, 3, 3)
    g = F.conv2d(F.pad(x.float(), (1, 1, 1, 1), mode="replicate"), w, groups=c).view(len(x), c, 2, *x.shape[-2:])
    return g.pow(2).sum(2).sqrt().sum(1)


# --------------------------------------------------------------------------------------------- the scorer


def cell_index(hw: Sequence[int], n: int, device: Any = None) -> torch.Tensor:
    """``(H, W)`` long: which of the ``n x n`` cells each pixel lies in (row-major)."""
    cy = torch.arange(hw[0], device=device) * n // hw[0]
    cx = torch.arange(hw[1], device=device) * n // hw[1]
    return cy[:, None] * n + cx[None, :]


def on_grid(heat: torch.Tensor, geometry: Any, grid_hw: Sequence[int],
            input_hw: Sequence[int]) -> Tuple[torch.Tensor, torch.Tensor]:
    """A map drawn on the grid's pixels where its cells lie (``(B, H, W)`` values, ``(H, W)`` covered)."""
    from visattn.maps.geometry import place

    values = torch.nan_to_num(heat.float().cpu(), nan=0.0, posinf=0.0, neginf=0.0)
    v, covered = place(values, geometry, tuple(grid_hw), tuple(input_hw))
    return v, covered.cpu()


def cell_scores(values: torch.Tensor, covered: torch.Tensor, cell: torch.Tensor, n: int,
                tie: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(share, hit)`` per map ``(B,)``: the share of the map's positive mass in cell ``cell`` ``(B,)`` of an
    ``n x n`` grid, and whether its maximum over the covered pixels lies in that cell, ties broken by ``tie``
    ``(B, H*W)`` (random, drawn once per grid: a map that is the same for every class peaks in one cell). A map
    with no positive mass gets the cell's share of the covered pixels."""
    b = values.shape[0]
    idx = cell_index(values.shape[-2:], n)
    mine = idx[None] == cell.cpu()[:, None, None]  # (B, H, W)
    mass = values.clamp(min=0) * covered
    total = mass.flatten(1).sum(1)
    flat = (mine & covered).flatten(1).sum(1) / covered.sum().clamp(min=1)
    share = torch.where(total > 0, (mass * mine).flatten(1).sum(1) / total.clamp(min=1e-30), flat)
    scores = values.flatten(1).masked_fill(~covered.flatten()[None], float("-inf"))
    top = scores.max(1, keepdim=True).values
    peak = torch.where(scores >= top, tie, torch.full_like(tie, -1.0)).argmax(1)
    hit = idx.flatten()[peak] == cell.cpu()
    return share.double().reshape(b), hit.double()


# --------------------------------------------------------------------------------------------- one checkpoint


@dataclass
class Settings:
    grids: int = 100
    threshold: float = 0.8
    seed: int = 0
    batch: int = 16
    ig_steps: int = 16
    pre_bn: bool = True
    random_grids: int = 4


def model_input(grid: torch.Tensor, input_hw: Sequence[int]) -> torch.Tensor:
    """The grid as the model sees it: itself, or downscaled by area averaging to the model's size."""
    return grid if tuple(grid.shape[-2:]) == tuple(input_hw) else F.interpolate(grid, size=tuple(input_hw),
                                                                                 mode="area")


def grid_maps(model: nn.Module, xg: torch.Tensor, labels: torch.Tensor, input_hw: Sequence[int],
              s: Settings, controls: bool = True) -> List[Dict[str, Tuple[str, torch.Tensor, torch.Tensor]]]:
    """Per cell ``k`` of the grids ``xg`` ``(B, 3, H, W)``: ``{name: (kind, values on the grid's pixels (B, H, W),
    covered (H, W))}`` of every map for the class in that cell, the controls included."""
    from visattn.maps import GridGeometry
    from visattn.maps.faithful import centre_prior, random_map

    grid_hw, n2 = tuple(xg.shape[-2:]), labels.shape[1]
    x = model_input(xg, input_hw)
    per_cell, agnostic = [], torch.zeros(len(x), *x.shape[-2:])
    for k in range(n2):
        maps, g = class_maps(model, x, labels[:, k].to(x.device), s.ig_steps, s.pre_bn)
        agnostic += g.abs().sum(1).float().cpu()
        per_cell.append({name: (kind, *on_grid(heat, geo, grid_hw, input_hw)) for name, (kind, heat, geo)
                         in maps.items()})
    if controls:
        same = {"agnostic_gradient": on_grid(agnostic, GridGeometry.image(input_hw), grid_hw, input_hw),
                "edge": on_grid(edge_map(xg), GridGeometry.image(grid_hw), grid_hw, grid_hw),
                "centre": on_grid(centre_prior(grid_hw, len(x)).heat, GridGeometry.image(grid_hw), grid_hw, grid_hw)}
        for k, cell in enumerate(per_cell):
            cell.update({name: ("control", *vc) for name, vc in same.items()})
            rnd = random_map(len(x), grid_hw, seed=s.seed * 1000 + k + int(labels[0, k]))
            cell["random"] = ("control", *on_grid(rnd.heat, GridGeometry.image(grid_hw), grid_hw, grid_hw))
    return per_cell


def play(model: nn.Module, grids: Grids, input_hw: Sequence[int], s: Settings) -> Dict[str, Dict[str, Any]]:
    """Every map's per-grid mean share and pointing over the grids' classes: ``{name: {kind, share (G,), hit (G,)}}``."""
    n, n2 = grids.n, grids.n * grids.n
    gen = torch.Generator().manual_seed(s.seed)
    dev = next(model.parameters()).device
    found: Dict[str, Dict[str, Any]] = {}
    for lo in range(0, len(grids.images), s.batch):
        xg, lab = grids.images[lo:lo + s.batch].to(dev), grids.labels[lo:lo + s.batch]
        tie = torch.rand(len(xg), xg.shape[-2] * xg.shape[-1], generator=gen)
        for k, cell in enumerate(grid_maps(model, xg, lab, input_hw, s)):
            for name, (kind, v, cov) in cell.items():
                share, hit = cell_scores(v, cov, torch.full((len(xg),), k), n, tie)
                row = found.setdefault(name, {"kind": kind, "share": torch.zeros(len(grids.images), dtype=torch.float64),
                                              "hit": torch.zeros(len(grids.images), dtype=torch.float64)})
                row["share"][lo:lo + len(xg)] += share / n2
                row["hit"][lo:lo + len(xg)] += hit / n2
    return found


def spearman(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Spearman rank correlation of each row of ``a`` and ``b`` ``(B, n)`` (ties: mean ranks); NaN for a flat row."""
    def ranks(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x, dtype=torch.float64)
        for i, row in enumerate(x.double()):
            _, inverse, counts = torch.unique(row, return_inverse=True, return_counts=True)
            out[i] = ((torch.cumsum(counts, 0) - counts) + (counts - 1) / 2.0).double()[inverse]
        return out

    ra, rb = ranks(a.flatten(1)), ranks(b.flatten(1))
    ra, rb = ra - ra.mean(1, keepdim=True), rb - rb.mean(1, keepdim=True)
    den = ra.norm(dim=1) * rb.norm(dim=1)
    return torch.where(den > 0, (ra * rb).sum(1) / den.clamp(min=1e-300), torch.full_like(den, float("nan")))


def reinitialise(model: nn.Module, upto: int, seed: int) -> nn.Module:
    """A copy of ``model`` whose top ``upto`` units (:func:`units` with parameters, from the head down) have their
    parameters re-initialised (``reset_parameters``)."""
    twin = copy.deepcopy(model)
    top = [m for _, m in units(twin) if any(True for _ in m.parameters())][::-1][:upto]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for unit in top:
            for m in unit.modules():
                if callable(getattr(m, "reset_parameters", None)):
                    m.reset_parameters()
    return twin.eval()


def cascade(model: nn.Module, grids: Grids, input_hw: Sequence[int], s: Settings) -> Dict[str, List[Dict[str, Any]]]:
    """Per map: ``[{"reset": unit, "rho": mean Spearman rho with the trained model's map}, ...]``, one entry per
    cascade step (the head re-initialised, then the unit below it too, ...), on the first ``s.random_grids`` grids."""
    names = [n for n, m in units(model) if any(True for _ in m.parameters())][::-1]
    dev = next(model.parameters()).device
    xg, lab = grids.images[:s.random_grids].to(dev), grids.labels[:s.random_grids]
    mine = grid_maps(model, xg, lab, input_hw, s, controls=False)
    out: Dict[str, List[Dict[str, Any]]] = {}
    for step, unit in enumerate(names, 1):
        theirs = grid_maps(reinitialise(model, step, s.seed + step), xg, lab, input_hw, s, controls=False)
        rhos: Dict[str, List[torch.Tensor]] = {}
        for a, b in zip(mine, theirs):  # per cell (class) of the grids
            for name in a.keys() & b.keys():
                rhos.setdefault(name, []).append(spearman(a[name][1], b[name][1]))
        for name, r in sorted(rhos.items()):
            out.setdefault(name, []).append({"reset": unit, "rho": _nanmean(torch.cat(r))})
    return out


def _nanmean(v: torch.Tensor) -> Optional[float]:
    v = v[~torch.isnan(v)]
    return float(v.mean()) if len(v) else None


# --------------------------------------------------------------------------------------------- runs and rows


def load_run(ckpt: Path, data: Optional[str], device: str) -> Tuple[nn.Module, Any, Dict[str, Any], Any]:
    """``(model, config, state, held-out split)`` of a checkpoint: the split the run was scored on (its
    ``data.root`` replaced by ``data`` when given)."""
    from visattn.data import load_splits
    from visattn.evaluate import load_model_from_checkpoint
    from visattn.options import resolve_device

    try:
        model, cfg, state = load_model_from_checkpoint(str(ckpt), resolve_device(device))
    except (KeyError, TypeError) as e:  # a file that loads but holds no visattn checkpoint
        raise CheckpointError(f"{ckpt}: not a visattn checkpoint ({type(e).__name__}: {e})") from None
    dcfg = cfg.data.model_copy()
    if data is not None:
        dcfg.source, dcfg.root = ("synthetic", dcfg.root) if data == "synthetic" else ("auto", data)
    if dcfg.source == "placed":
        raise DataError(f"{ckpt}: trained on placed objects (data.source=placed): the grid game takes single images")
    return model.float().eval(), cfg, state, load_splits(dcfg, cfg.seed)


def ci(v: torch.Tensor) -> List[float]:
    from visattn.maps.faithful import bootstrap

    iv = bootstrap(v, 1000, 0.95, 0)
    return [iv.mean, iv.lo, iv.hi]


def score_run(ckpt: Path, sizes: Sequence[int], s: Settings, data: Optional[str], device: str, made: str,
              have: Dict[Tuple[str, int], Dict[str, Any]], redo: bool) -> List[Dict[str, Any]]:
    """The rows of one checkpoint, a (map, grid size) already in ``have`` kept as it is unless ``redo``."""
    from visattn.data import normalize
    from visattn.results import git_revision

    model, cfg, state, splits = load_run(ckpt, data, device)
    dev = next(model.parameters()).device
    x = normalize(torch.from_numpy(splits.eval.x).permute(0, 3, 1, 2), cfg.data.mean, cfg.data.std).float().to(dev)
    y = splits.eval.y
    pool = confident(model, x, torch.from_numpy(y).long().to(dev), s.threshold)
    side = int(x.shape[-1])
    head = {"run": str(ckpt.parent), "model": cfg.model.name, "git": git_revision(), "command": made,
            "checkpoint": {"path": str(ckpt), "config": cfg.name, "seed": cfg.seed, "epoch": state.get("epoch")},
            "heldout": splits.eval_split, "heldout_images": len(y), "confident_images": int(len(pool)),
            "threshold": s.threshold, "grid_seed": s.seed, "ig": ig_backend() if s.ig_steps else None,
            "ig_steps": s.ig_steps, "precision": "fp32"}
    rows = []
    for n in sizes:
        grids = make_grids(x.cpu(), y, pool, n, s.grids, s.seed)
        grid_hw = (n * side, n * side)
        input_hw = grid_hw if takes_size(model, grid_hw) else (side, side)
        probe = play(model, Grids(grids.images[:1], grids.labels[:1], grids.sources[:1], n), input_hw,
                     Settings(**{**s.__dict__, "ig_steps": min(s.ig_steps, 2)}))
        if not redo and all((name, n) in have for name in probe):
            rows += [have[(name, n)] for name in probe]
            print(f"{ckpt}: {n}x{n} already scored ({len(probe)} maps)", flush=True)
            continue
        found = play(model, grids, input_hw, s)
        rand = cascade(model, grids, input_hw, s) if n == 2 and s.random_grids else {}
        for name, f in found.items():
            if not redo and (name, n) in have:
                rows.append(have[(name, n)])
                continue
            rows.append({**head, "map": name, "kind": f["kind"], "control": name in CONTROLS, "grid": n,
                         "grid_px": grid_hw[0], "input_px": input_hw[0], "downscaled": input_hw != grid_hw,
                         "grids": len(grids.images), "chance": 1 / (n * n), "share": ci(f["share"]),
                         "pointing": ci(f["hit"]), "randomisation": rand.get(name)})
        print(f"{ckpt}: {n}x{n}, {len(grids.images)} grids, {len(found)} maps"
              + (f" (the model sees them downscaled to {input_hw[0]} px)" if input_hw != grid_hw else ""), flush=True)
    return rows


ROW = {"run": "str", "model": "str", "checkpoint.path": "str", "checkpoint.config": "str", "checkpoint.seed": "int", "map": "str", "kind": "str", "control": "bool", "grid": "int",
       "share": "interval", "pointing": "interval", "chance": "number", "grids": "int", "threshold": "number",
       "downscaled": "bool"}


def load(path: Path) -> List[Dict[str, Any]]:
    """The rows of a results file (none where there is none); a damaged file or row is one line naming it."""
    from visattn.results import check_rows, read_json

    if not path.is_file():
        return []
    doc = read_json(path)
    rows = doc.get("rows") if isinstance(doc, dict) else None
    if not isinstance(rows, list):
        raise DataError(f"{path}: not a grid game results file (no rows list)")
    return check_rows(path, rows, ROW)


def save(path: Path, rows: List[Dict[str, Any]], stamp: Dict[str, Any]) -> None:
    doc = {"about": "the grid pointing game (bench/grid_game.py): per run, map and grid size (n x n held-out images "
                    "of distinct classes, each classified confidently alone), share = the share of the map's positive "
                    "mass in the explained class's cell, pointing = its maximum in that cell, [mean, lo, hi] with 95% "
                    "bootstrap intervals over grids, chance 1/n^2; randomisation: Spearman rho with the map of the model "
                    "whose top units are re-initialised in cascade (2x2 grids)", "provenance": stamp, "rows": rows}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(doc, indent=2) + "\n")


def same_settings(row: Dict[str, Any], s: Settings) -> bool:
    return (row.get("threshold") == s.threshold and row.get("grid_seed") == s.seed and row.get("grids") == s.grids
            and row.get("ig_steps") == s.ig_steps)


# --------------------------------------------------------------------------------------------- report


def _mean(vals: List[float]) -> float:
    return sum(vals) / len(vals)


def _cell(rows: List[Dict[str, Any]], key: str) -> str:
    """Mean over seeds, the seeds' own values after it."""
    if not rows:
        return "-"
    v = [r[key][0] for r in rows]
    each = ", ".join(f"{100 * x:.0f}" for x in v)
    return f"{100 * _mean(v):.1f}" + (f" ({each})" if len(v) > 1 else "")


def _rho(rows: List[Dict[str, Any]]) -> str:
    """The randomisation rho after the head alone and after the whole cascade, mean over seeds."""
    steps = [r["randomisation"] for r in rows if r.get("randomisation")]
    if not steps:
        return "-"
    first = [s[0]["rho"] for s in steps if s[0]["rho"] is not None]
    last = [s[-1]["rho"] for s in steps if s[-1]["rho"] is not None]
    f = (lambda v: f"{_mean(v):.2f}" if v else "-")
    return f"{f(first)} / {f(last)}"


def report(rows: List[Dict[str, Any]]) -> str:
    """The docs table: per config and map, the share and pointing (%) on 2x2 and 3x3 grids (mean over seeds, each
    seed in brackets) and the randomisation rho (head re-initialised / whole cascade)."""
    if not rows:
        return "\n".join([BEGIN, "No checkpoint scored yet (`bench/results/grid_game.json` holds none).", END])
    configs = list(dict.fromkeys(r["checkpoint"]["config"] for r in rows))
    r0 = rows[0]
    down = sorted({r["checkpoint"]["config"] for r in rows if r["downscaled"]})
    ig = (f"integrated gradients: {r0['ig_steps']} steps ({r0.get('ig')}) from the mean colour"
          if r0.get("ig_steps") else "no integrated gradients")
    out = [BEGIN,
           "Commands: " + "; ".join(f"`{c}`" for c in dict.fromkeys(r.get("command", "python -m bench.grid_game")
                                                                   for r in rows)) + f". {r0['grids']} grids of each size per run, of "
           f"images from each run's {r0.get('heldout', 'held-out split')} (not trained on), each classified alone with "
           f"a true-class softmax >= {r0['threshold']}; {ig}; fp32. Share: % of the map's positive mass in the explained class's cell; "
           "pointing: % of maps peaking in it; chance 25.0 (2x2), 11.1 (3x3); mean over seeds (each seed in "
           "brackets). Randomisation: Spearman rho with the map after re-initialising the head / the whole cascade "
           "(2x2 grids; near 1: the map does not depend on what the model learned)."
           + (f" Downscaled to the model's 32 px (position embeddings for one token grid): {', '.join(down)}."
              if down else ""), "",
           "| config | map | kind | 2x2 share | 2x2 pointing | 3x3 share | 3x3 pointing | randomisation rho |",
           "|---|---|---|---|---|---|---|---|"]
    for c in configs:
        mine = [r for r in rows if r["checkpoint"]["config"] == c]
        maps = list(dict.fromkeys(r["map"] for r in sorted(mine, key=lambda r: (r["control"], r["map"]))))
        for m in maps:
            at = {n: sorted((r for r in mine if r["map"] == m and r["grid"] == n),
                            key=lambda r: r["checkpoint"]["seed"]) for n in (2, 3)}
            kind = next(r["kind"] for r in mine if r["map"] == m)
            out.append(f"| {c} | `{m}` | {kind} | {_cell(at[2], 'share')} | {_cell(at[2], 'pointing')} | "
                       f"{_cell(at[3], 'share')} | {_cell(at[3], 'pointing')} | {_rho(at[2])} |")
    return "\n".join(out + [END])


def write_docs(table: str, path: Path = DOCS) -> None:
    splice(path, BEGIN, END, table.removeprefix(BEGIN + "\n").removesuffix("\n" + END))


# --------------------------------------------------------------------------------------------- command line


def main(argv: Optional[List[str]] = None) -> int:
    from bench.faithfulness import find_checkpoints

    ap = parser(__doc__, device="cpu", out=RESULTS, threads=True)
    ap.add_argument("runs", nargs="*", help="run directories (last.pt), folders holding them, or checkpoint files")
    ap.add_argument("--report", action="store_true", help="print the docs table from --out and stop")
    ap.add_argument("--write", action="store_true", help="with --report: also write it into docs/maps.md")
    ap.add_argument("--grids", type=int, default=Settings.grids, help="grids of each size per run")
    ap.add_argument("--sizes", type=int, nargs="+", default=[2, 3], help="grid sizes n (n x n cells)")
    ap.add_argument("--threshold", type=float, default=Settings.threshold,
                    help="an image enters a grid when its true class's softmax alone is at least this")
    ap.add_argument("--ig-steps", type=int, default=Settings.ig_steps, help="integrated gradients' steps (0: none)")
    ap.add_argument("--random-grids", type=int, default=Settings.random_grids,
                    help="2x2 grids of the randomisation cascade (0: none)")
    ap.add_argument("--no-pre-bn", action="store_true", help="leave out Grad-CAM at the convolution before its BN")
    ap.add_argument("--batch", type=int, default=Settings.batch, help="grids a pass")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", default=None, help="dataset path (default: each run's data.root; 'synthetic')")
    ap.add_argument("--redo", action="store_true", help="score again the rows the results file holds")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.report:
        rows = load(out)
        if not rows:
            raise DataError(f"--report: {out} holds no results")
        table = report(rows)
        if args.write:
            write_docs(table)
        print(table)
        return 0
    if not args.runs:
        ap.error("give run directories or checkpoints to score, or --report")
    for flag, low in (("--grids", 1), ("--ig-steps", 0), ("--random-grids", 0), ("--batch", 1), ("--seed", 0)):
        check_at_least(flag, getattr(args, flag[2:].replace("-", "_")), low)
    check_range("--threshold", args.threshold, 0.0, 1.0)
    if args.ig_steps == 1:
        raise DataError("--ig-steps: 0 (no integrated gradients) or at least 2")
    bad = [n for n in args.sizes if n < 2]
    if bad:
        raise DataError(f"--sizes: a grid has at least 2x2 cells, got {bad}")
    s = Settings(args.grids, args.threshold, args.seed, args.batch, args.ig_steps, not args.no_pre_bn,
                 args.random_grids)
    load(out)  # a damaged results file is refused before any scoring
    made = command(argv, __file__)
    for ckpt in find_checkpoints(args.runs):
        kept = load(out)
        have = {(r["map"], r["grid"]): r for r in kept if r["checkpoint"]["path"] == str(ckpt) and same_settings(r, s)}
        rows = score_run(ckpt, args.sizes, s, args.data, args.device, made, have, args.redo)
        again = {(r["map"], r["grid"]) for r in rows}
        save(out, [r for r in kept if r["checkpoint"]["path"] != str(ckpt) or (r["map"], r["grid"]) not in again]
             + rows, {**provenance(precision="fp32", device=args.device), "command": made})
    return 0


if __name__ == "__main__":
    run_main(lambda: sys.exit(main()), "grid_game.py")
