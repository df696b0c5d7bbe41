"""Do the maps point at the object? Checkpoints trained on placed objects (``data.source=placed``, configs/placed/)
scored against each held-out canvas's known box, into ``bench/results/localization.json``; ``--report`` writes
the table into docs/maps.md (between its localization markers) and prints it.

    python -m bench.localization runs/placed                  # every run below; 1,000 canvases each
    python -m bench.localization --report                     # the docs table, from the JSON

Per checkpoint (:func:`visattn.maps.faithful.localization`): the first ``--images`` held-out canvases, one class
at a time, with their true labels, under the run's precision; every map kind (``kind``: attention,
attention_gradient, layers_gradient, rollout, gradient_rollout, input_x_gradient, gradcam, centre, random):
``pointing`` (the map's peak within the run's ``data.placed.tolerance`` px of the box) and ``energy`` (the share of
its positive mass in the box), ``[mean, lo, hi]`` with 95% bootstrap intervals over canvases, beside their chance
levels; and deletion/insertion scores (:func:`visattn.faithfulness`, against random orders) on the first
``--faith-images`` of the same canvases. Beside the maps, the **seam control** (:func:`seam_map`, kind ``seam``): a
detector with no model and no class that points at the pasted patch by the mosaic's lattice seams, which the patch
lacks; where it scores as well as the maps, pointing at the box says the map found the patch, not class evidence
(``bench/grid_game.py`` asks that). A checkpoint trained with ``data.placed.object=false`` (the
background-only check) is reported by its held-out accuracy against chance. A checkpoint scored again
replaces its rows.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F

from bench.common import ROOT, command, parser, provenance, splice
from bench.faithfulness import ROW, by_checkpoint, find_checkpoints, kind_of, val_acc
from bench.faithfulness import load as load_results  # (the same file form)
from visattn.errors import DataError, run_main
from visattn.options import check_at_least
from visattn.results import check_rows, write_atomic

RESULTS = ROOT / "bench" / "results" / "localization.json"
DOCS = ROOT / "docs" / "maps.md"
BEGIN = "<!-- localization table: python -m bench.localization --report -->"
END = "<!-- end of localization table -->"
ATTENTION_KINDS = ("attention", "attention_gradient", "layers_gradient", "rollout", "gradient_rollout")
FAMILIES = (("raw attention", ("attention",)), ("attention x gradient", ("attention_gradient", "layers_gradient")),
            ("rollout", ("rollout", "gradient_rollout")), ("input x gradient", ("input_x_gradient",)),
            ("Grad-CAM", ("gradcam",)), ("centre prior", ("centre",)), ("random", ("random",)))
SEAM = ("seam control", ("seam",))  # a column once a checkpoint's rows hold the seam control
CONTROLS = ("centre", "random", "seam")  # never "the map that finds the object"


def seam_map(x: torch.Tensor, patch: int) -> Any:
    """The seam control: a detector that uses no model and no class. The mosaic background changes source image
    at every ``patch``-px lattice line, the pasted object does not; the map is high where the jumps across lattice
    lines (absolute differences of neighbouring pixels, summed over channels) are fewest in a ``3 * patch`` px
    window (whole windows only, each at its centre pixel; 0 where no whole window is centred), so its peak lies
    where the canvas is one image: the pasted patch. A benchmark it scores well on rewards finding the patch,
    not the evidence for its class (issue 93). ``x``: ``(B, C, H, W)`` canvases; a :class:`LayerMap` on the
    pixels."""
    from visattn.maps import GridGeometry, LayerMap

    x = x.float().cpu()
    h, w = x.shape[-2:]
    jumps = torch.zeros(len(x), h, w)
    on_cols = (torch.arange(1, w) % patch == 0).float()  # the jump between column j - 1 and j, j on the lattice
    on_rows = (torch.arange(1, h) % patch == 0).float()
    jumps[:, :, 1:] += (x[..., :, 1:] - x[..., :, :-1]).abs().sum(1) * on_cols
    jumps[:, 1:, :] += (x[..., 1:, :] - x[..., :-1, :]).abs().sum(1) * on_rows[:, None]
    k = 3 * patch  # a multiple of the lattice: every window crosses the same number of lattice lines
    energy = F.avg_pool2d(jumps[:, None], k, stride=1)[:, 0]  # (B, H - k + 1, W - k + 1)
    heat = torch.zeros(len(x), h, w)
    c = (k - 1) // 2
    heat[:, c:c + energy.shape[-2], c:c + energy.shape[-1]] = energy.flatten(1).amax(1)[:, None, None] - energy
    return LayerMap("seam", "seam", heat, "gate", 0, GridGeometry.image((h, w)),
                    f"the seam control: the fewest jumps across the {patch}-px mosaic's lattice (no model, no class)")


def _iv(iv: Any) -> List[float]:
    return [iv.mean, iv.lo, iv.hi]


def score(ckpt: Path, images: int, faith_images: int, options: Dict[str, Any], data: Optional[str],
          device: str, command: str, seam_only: bool = False) -> List[Dict[str, Any]]:
    """Every map of one checkpoint on ``images`` held-out canvases (``seam_only``: the seam control alone);
    returns its rows."""
    from visattn import evaluate
    from visattn.maps.faithful import faithfulness, localization, random_map
    from visattn.visualize import heldout_batch

    model, cfg, _, x, y, boxes = heldout_batch(str(ckpt), images, data, device, "spread", with_boxes=True)
    if boxes is None:
        raise DataError(f"{ckpt}: trained on data.source={cfg.data.source}, not placed objects: no boxes to score")
    from visattn.rundir import load_checkpoint

    state = load_checkpoint(ckpt)
    head = {"model": cfg.model.name, "checkpoint": {"path": str(ckpt), "config": cfg.name, "seed": cfg.seed,
                                                    "epoch": state.get("epoch")},
            "val_acc": val_acc(ckpt, state), "object": cfg.data.placed.object, "images": len(x),
            "canvas": cfg.data.placed.canvas, "object_size": cfg.data.image_size,
            "tolerance": cfg.data.placed.tolerance, "command": command}
    if not cfg.data.placed.object:  # the background-only check: its accuracy is the result
        return [{**head, "map": None, "kind": None, "val_images": cfg.data.val_size}]
    seam = seam_row(head, x, boxes, cfg.data.placed, options["seed"])
    if seam_only:
        return [seam]
    precision = evaluate.resolve_precision(cfg.precision, x.device)
    with evaluate.autocast(x.device, precision):
        loc = localization(model, x, y, boxes, cfg.data.placed.tolerance, seed=options["seed"])
        n = min(faith_images, len(x))
        faith = faithfulness(model, x[:n], y[:n], sanity=False, extra_maps={"random": random_map(n, x.shape[-2:],
                             options["seed"], x.device)}, **{k: v for k, v in options.items() if k != "seed"},
                             seed=options["seed"]) if n else None
    fr = {r.name: r for r in faith.rows} if faith is not None else {}
    rows = [seam]
    for r in loc.rows:
        f = fr.get(r.name)
        rows.append({**head, "map": r.name, "kind": kind_of(r), "pointing": _iv(r.pointing), "energy": _iv(r.energy),
                     "pointing_chance": loc.pointing_chance, "energy_chance": loc.energy_chance, "seed": loc.seed,
                     "faith_images": n, "deletion_score": _iv(f.deletion_score) if f else None,
                     "insertion_score": _iv(f.insertion_score) if f else None,
                     "faith_settings": {k: v for k, v in options.items() if k != "seed"}})
    return rows


def seam_row(head: Dict[str, Any], x: torch.Tensor, boxes: torch.Tensor, placed: Any, seed: int) -> Dict[str, Any]:
    """The seam control's row (:func:`seam_map`) on the same canvases, scored as the maps are."""
    from visattn.data.placed import box_share
    from visattn.maps.faithful import bootstrap, box_scores

    hw = tuple(x.shape[-2:])
    hit, energy = box_scores(seam_map(x, placed.patch), boxes, placed.tolerance, hw,
                             torch.Generator().manual_seed(seed))
    b = boxes.cpu().numpy()
    return {**head, "map": "seam", "kind": "seam", "pointing": _iv(bootstrap(hit, 1000, 0.95, seed)),
            "energy": _iv(bootstrap(energy, 1000, 0.95, seed)),
            "pointing_chance": float(box_share(b, hw[0], placed.tolerance).mean()),
            "energy_chance": float(((b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])).mean() / (hw[0] * hw[1])), "seed": seed,
            "faith_images": 0, "deletion_score": None, "insertion_score": None}


# what the report reads of every row, and of every map's row (results.check_rows)
LOCALIZATION_ROW = {**ROW, "object": "bool", "canvas": "int", "object_size": "int", "tolerance": "int",
                    "map": "str?", "kind": "str?", "val_images": "int?"}
MAP_ROW = {"map": "str", "kind": "str", "pointing": "interval", "energy": "interval", "pointing_chance": "number",
           "energy_chance": "number", "deletion_score": "interval?", "insertion_score": "interval?"}


def load(path: Path) -> List[Dict[str, Any]]:
    """The rows of a results file (none where there is none); a damaged row is one line naming the file and row."""
    rows = load_results(path, LOCALIZATION_ROW)
    return check_rows(path, rows, MAP_ROW, only=lambda r: r["object"] and r["map"] is not None)


def save(path: Path, rows: List[Dict[str, Any]]) -> None:
    doc = {"about": "maps scored against the known box of placed objects (bench/localization.py): pointing = share "
                    "of canvases whose map peaks within the tolerance of the box, energy = share of the map's positive "
                    "mass in the box, [mean, lo, hi] with 95% bootstrap intervals over canvases; deletion/insertion "
                    "scores against random orders on the first faith_images of the same canvases", "rows": rows}
    write_atomic(path, json.dumps(doc, indent=2) + "\n")


def _best(group: List[Dict[str, Any]], kinds) -> Optional[Dict[str, Any]]:
    rows = [r for r in group if r["kind"] in kinds]
    return max(rows, key=merit) if rows else None


def merit(row: Dict[str, Any]) -> float:
    """How a map ranks for "finds the object": pointing, then energy."""
    return row["pointing"][0] + 1e-3 * row["energy"][0]


def _pe(row: Optional[Dict[str, Any]]) -> str:
    return "-" if row is None else f"{100 * row['pointing'][0]:.0f}% / {row['energy'][0]:.2f}"


def _ci(iv: List[float], pct: bool = False) -> str:
    f = (lambda v: f"{100 * v:.1f}%") if pct else (lambda v: f"{v:.3f}")
    return f"{f(iv[0])} [{f(iv[1])}, {f(iv[2])}]"


def _verdict(group: List[Dict[str, Any]]) -> str:
    """Is a map derived from attention at least as good as input x gradient and Grad-CAM, on both scores?"""
    refs = [r for r in (_best(group, ("input_x_gradient",)), _best(group, ("gradcam",))) if r is not None]
    derived = [r for r in group if r["kind"] in ATTENTION_KINDS]
    good = [r for r in derived if all(r["pointing"][0] >= g["pointing"][0] and r["energy"][0] >= g["energy"][0]
                                      for g in refs)]
    if not derived:
        return "no attention-derived map"
    if good:
        b = max(good, key=merit)
        return f"yes: `{b['map']}` ({_pe(b)})"
    b = max(derived, key=merit)
    return f"no (best: `{b['map']}`, {_pe(b)})"


def report(rows: List[Dict[str, Any]]) -> str:
    """The docs table: per checkpoint the best map of each family (pointing rate / energy in the box), the map
    that finds the object best (with intervals), and the verdict against the gradient baselines."""
    scored = [g for g in by_checkpoint(rows) if g[0]["object"]]
    checks = [g[0] for g in by_checkpoint(rows) if not g[0]["object"]]
    if not scored:
        return "\n".join([BEGIN, "No checkpoint scored yet (`bench/results/localization.json` holds none): train "
                           "configs/placed/*.yaml, then run the commands above.", END])
    r0 = scored[0][0]
    families = FAMILIES + ((SEAM,) if any(r["kind"] == "seam" for g in scored for r in g) else ())
    out = [BEGIN,
           f"{r0['images']} held-out canvases per checkpoint ({r0['object_size']}x{r0['object_size']} objects on "
           f"{r0['canvas']}x{r0['canvas']}, pointing tolerance {r0['tolerance']} px); each cell: pointing rate / "
           f"energy in the box (the best map of that family). Chance: pointing {100 * r0['pointing_chance']:.0f}%, "
           f"energy {r0['energy_chance']:.2f}.", "",
           "| model (config, seed) | val acc | " + " | ".join(f for f, _ in families)
           + " | finds the object best: pointing, energy [95% CI] | deletion / insertion of that map "
           "| attention-derived >= input x gradient and Grad-CAM on both |",
           "|---|---|" + "---|" * len(families) + "---|---|---|"]
    for g in scored:
        c = g[0]["checkpoint"]
        best = max((r for r in g if r["kind"] not in CONTROLS), key=merit)
        acc = "-" if g[0]["val_acc"] is None else f"{100 * g[0]['val_acc']:.1f}%"
        di = ("-" if best["deletion_score"] is None
              else f"{best['deletion_score'][0]:+.3f} / {best['insertion_score'][0]:+.3f}")
        out.append(f"| {g[0]['model']} ({c['config']}, {c['seed']}) | {acc} | "
                   + " | ".join(_pe(_best(g, kinds)) for _, kinds in families)
                   + f" | `{best['map']}` ({best['kind']}): {_ci(best['pointing'], True)}, {_ci(best['energy'])} "
                   f"| {di} | {_verdict(g)} |")
    for r in checks:
        n = r.get("val_images") or 0
        acc = r["val_acc"]
        half = 1.96 * math.sqrt(acc * (1 - acc) / n) if acc is not None and n else float("nan")
        out += ["", f"Background-only check ({r['checkpoint']['config']}, seed {r['checkpoint']['seed']}: the same "
                    f"training with each object's box filled with mosaic too): held-out accuracy "
                    + ("-" if acc is None else f"{100 * acc:.1f}% +- {100 * half:.1f}") + " (chance 10%)."]
    return "\n".join(out + [END])


def write_docs(table: str, path: Path = DOCS) -> None:
    """Put :func:`report`'s table (its markers included) between the page's markers."""
    splice(path, BEGIN, END, table.removeprefix(BEGIN + "\n").removesuffix("\n" + END))


def main(argv: Optional[List[str]] = None) -> int:
    ap = parser(__doc__, device="auto", out=RESULTS)
    ap.add_argument("runs", nargs="*", help="run directories (with last.pt), or folders holding them")
    ap.add_argument("--report", action="store_true", help="write the docs table from --out, print it and stop")
    ap.add_argument("--images", type=int, default=1000, help="held-out canvases per checkpoint")
    ap.add_argument("--faith-images", type=int, default=200, help="of those, scored by deletion/insertion too")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--regions", type=int, default=6)
    ap.add_argument("--draws", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", default=None, help="dataset path (default: each run's data.root)")
    ap.add_argument("--seam-only", action="store_true",
                    help="add (or replace) only the seam control's row of each checkpoint; its other rows stay")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.report:
        rows = load(out)
        if not rows:  # a missing or empty file would replace the docs table with "no checkpoint scored"
            raise DataError(f"--report: {out} holds no results")
        table = report(rows)
        write_docs(table)
        print(table)
        return 0
    if not args.runs:
        ap.error("give run directories to score, or --report")
    for flag, low in (("--images", 1), ("--faith-images", 0), ("--steps", 1), ("--regions", 1), ("--draws", 1),
                      ("--seed", 0)):
        check_at_least(flag, getattr(args, flag[2:].replace("-", "_")), low)
    load(out)  # a damaged results file is refused before any scoring
    options = {"steps": args.steps, "regions": args.regions, "draws": args.draws, "seed": args.seed}
    made = command(argv, __file__)
    revision = provenance(device=args.device)["git"]
    for ckpt in find_checkpoints(args.runs):
        rows = [dict(r, git=revision) for r in score(ckpt, args.images, args.faith_images, options, args.data,
                                                      args.device, made, args.seam_only)]
        again = {r["checkpoint"]["path"] for r in rows}
        if args.seam_only:  # the checkpoint's other rows stay as they are
            keep = [r for r in load(out) if r["checkpoint"]["path"] not in again or r["kind"] != "seam"]
            save(out, keep + [r for r in rows if r["kind"] == "seam"])
            continue
        save(out, [r for r in load(out) if r["checkpoint"]["path"] not in again] + rows)
        best = max((r for r in rows if r["map"] and r["kind"] not in CONTROLS), key=merit, default=None)
        print(f"{ckpt}: {len(rows)} rows on {rows[0]['images']} canvases"
              + (f"; finds the object best: {best['map']} ({best['kind']})" if best else
                 f"; background only, val acc {rows[0]['val_acc']}"), flush=True)
    return 0


if __name__ == "__main__":
    run_main(lambda: sys.exit(main()), "localization.py")
