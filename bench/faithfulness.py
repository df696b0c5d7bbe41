"""The faithfulness table as data: every map of trained checkpoints scored by deletion and insertion against
random orders, into ``bench/results/faithfulness.json``; ``--report`` prints it as a markdown table that says,
per model, which map is the most faithful.

    python -m bench.faithfulness runs/cbam runs/gc runs/coord runs/cct_2 runs/vit_tiny      # 500 images each
    python -m bench.faithfulness runs/attention_table --images 500 --vit-images 200        # every run found below
    python -m bench.faithfulness --report                                                  # the table, no scoring
    python -m bench.faithfulness --summary                                                 # the README's table

Checkpoints: each path is a run directory (``last.pt`` beside the run's ``config.yaml``), or a folder searched
for run directories (any depth). The model, its config name and seed come from the checkpoint; ``val_acc`` is
the run's validation accuracy at the checkpoint's epoch (``metrics.jsonl``; the checkpoint's best accuracy
when the run kept no metrics).

Scoring (:func:`visattn.visualize.faithfulness_table`, as ``python -m visattn.visualize --faithfulness N``): the
first ``--images`` images of the run's held-out split picked one class at a time (``--vit-images`` for models
whose name starts with ``vit``), with their true labels, under the run's precision; every map ``read_maps``
gives (each gate or attention layer, the rollout), their gradient-weighted versions (``<layer>/grad``,
``rollout_grad``, and for a CNN the stages' ``/grad`` maps joined on the pixels, ``layers_grad``), and the gradient
baselines ``input_x_gradient`` and ``gradcam`` and the ``centre`` prior; ``--steps`` deletion steps
of ``--regions`` x ``--regions`` squares, ``--draws`` random orders per image, 95% bootstrap intervals, the
model-randomisation sanity check.

Rows (one per checkpoint and map): ``model``, ``checkpoint`` (``path``, ``config``, ``seed``, ``epoch``),
``val_acc``, ``images``, ``map``, ``kind`` (:data:`KINDS`), ``deletion_score`` and ``insertion_score`` as
``[mean, lo, hi]``, ``sanity_rho`` (None where undefined), ``vs_centre`` (each map's deletion and insertion
scores minus the centre prior's, image by image, ``[mean, lo, hi]``: the paired comparison), the areas and the
settings, and the ``command`` and ``git`` revision that scored it (:func:`bench.common.provenance`). A checkpoint
scored again replaces its rows; the others stay.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

from bench.common import ROOT, parser, provenance
from visattn.errors import DataError, run_main
from visattn.options import check_at_least
from visattn.results import check_rows, read_json, write_atomic
from visattn.rundir import complete_rows

RESULTS = ROOT / "bench" / "results" / "faithfulness.json"
KINDS = ("attention", "attention_gradient", "layers_gradient", "rollout", "gradient_rollout", "input_x_gradient",
         "gradcam", "centre")
# LayerMap kinds -> the table's kinds (the baselines are named by their own kind)
KIND_OF = {"spatial": "attention", "token": "attention", "pool": "attention", "head": "attention",
           "rollout": "rollout", "attention_gradient": "attention_gradient", "layers_gradient": "layers_gradient",
           "gradient_rollout": "gradient_rollout"}
CHECKPOINT = "last.pt"


def find_checkpoints(paths: Iterable[str]) -> List[Path]:
    """``last.pt`` of each run directory given, or of every run directory below a folder given."""
    out: List[Path] = []
    for p in map(Path, paths):
        if p.is_file():
            found = [p]
        elif (p / CHECKPOINT).is_file():
            found = [p / CHECKPOINT]
        else:
            found = sorted(p.rglob(CHECKPOINT))
        if not found:
            raise DataError(f"no {CHECKPOINT} in {p}")
        out += [f for f in found if f not in out]
    return out


def val_acc(ckpt: Path, state: Dict[str, Any]) -> Optional[float]:
    """The run's validation accuracy at the checkpoint's epoch (metrics.jsonl), else its best accuracy."""
    metrics = ckpt.parent / "metrics.jsonl"
    if metrics.is_file():
        rows = [r for r in complete_rows(metrics) if r.get("val_acc") is not None]
        at = [r for r in rows if r.get("epoch") == state.get("epoch")]
        if at or rows:
            return float((at or rows)[-1]["val_acc"])
    best = state.get("best_acc")
    return float(best) if isinstance(best, (int, float)) and math.isfinite(best) and best >= 0 else None


def kind_of(row: Any) -> str:
    return row.name if row.kind in ("gradient", "prior") else KIND_OF.get(row.kind, row.kind)


def _interval(iv: Any) -> List[float]:
    return [iv.mean, iv.lo, iv.hi]


def score(ckpt: Path, images: int, vit_images: Optional[int], options: Dict[str, Any], data: Optional[str],
          device: str) -> List[Dict[str, Any]]:
    """Score every map of one checkpoint on ``images`` held-out images (``vit_images`` for a vit_* model, when
    given); returns its rows."""
    from visattn.config import build_config
    from visattn.rundir import load_checkpoint
    from visattn.visualize import faithfulness_table

    state = load_checkpoint(ckpt)
    cfg = build_config(state["config"])
    if vit_images is not None and cfg.model.name.startswith("vit"):
        images = vit_images
    report = faithfulness_table(str(ckpt), images, data=data, device=device, pick="spread", **options)
    head = {"model": cfg.model.name,
            "checkpoint": {"path": str(ckpt), "config": cfg.name, "seed": cfg.seed, "epoch": state.get("epoch")},
            "val_acc": val_acc(ckpt, state), "images": report.images}
    settings = {"steps": report.steps, "regions": report.regions, "fill": report.fill, "draws": report.draws,
                "confidence": report.confidence}
    rows = []
    centre = any(r.name == "centre" for r in report.rows)
    for r in report.rows:
        rho = r.sanity_rho if r.sanity_rho is not None and math.isfinite(r.sanity_rho) else None
        extra = {}
        if centre and r.name != "centre":  # paired, image by image: the map's scores minus the centre prior's
            d, i = report.versus(r.name, "centre")
            extra = {"vs_centre": {"deletion": _interval(d), "insertion": _interval(i)}}
        rows.append({**head, "map": r.name, "kind": kind_of(r), "deletion_score": _interval(r.deletion_score),
                     "insertion_score": _interval(r.insertion_score), "sanity_rho": rho, **extra,
                     "deletion_auc": r.deletion_auc, "insertion_auc": r.insertion_auc,
                     "random_deletion_auc": report.random_deletion_auc,
                     "random_insertion_auc": report.random_insertion_auc, "settings": settings})
    return rows


# what every row holds (results.check_rows): the merge, the report and the summary read these
ROW = {"model": "str", "checkpoint.path": "str", "checkpoint.config": "str", "checkpoint.seed": "int",
       "val_acc": "number?", "images": "int"}
SCORED_ROW = {**ROW, "map": "str", "kind": "str", "deletion_score": "interval", "insertion_score": "interval",
              "sanity_rho": "number?", "vs_centre.deletion": "interval?", "vs_centre.insertion": "interval?"}


def load(path: Path, fields: Dict[str, str] = SCORED_ROW) -> List[Dict[str, Any]]:
    """The rows of a results file (none where there is no file); a damaged row is one line naming it."""
    return check_rows(path, read_json(path, dict, missing={"rows": []}).get("rows"), fields)


def save(path: Path, rows: List[Dict[str, Any]]) -> None:
    doc = {"about": "faithfulness of attention maps, their gradient-weighted versions and gradient baselines: "
                    "deletion score = random-order deletion area - the map's, insertion score = the map's insertion "
                    "area - random order's, [mean, lo, hi] with 95% bootstrap intervals over images "
                    "(bench/faithfulness.py)", "rows": rows}
    write_atomic(path, json.dumps(doc, indent=2) + "\n")


def merge(old: List[Dict[str, Any]], new: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """``old`` without the checkpoints ``new`` scores again, then ``new``."""
    again = {r["checkpoint"]["path"] for r in new}
    return [r for r in old if r["checkpoint"]["path"] not in again] + new


def _fmt(iv: List[float]) -> str:
    return f"{iv[0]:+.3f} [{iv[1]:+.3f}, {iv[2]:+.3f}]"


def merit(row: Dict[str, Any]) -> float:
    """How a map ranks for "most faithful": the mean of its deletion and insertion scores."""
    return (row["deletion_score"][0] + row["insertion_score"][0]) / 2


def by_checkpoint(rows: List[Dict[str, Any]]) -> List[List[Dict[str, Any]]]:
    """The rows grouped by checkpoint, in the order the checkpoints first appear."""
    groups: Dict[str, List[Dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r["checkpoint"]["path"], []).append(r)
    return list(groups.values())


def report(rows: List[Dict[str, Any]]) -> str:
    """The markdown table, one section per checkpoint, and per model which map is the most faithful."""
    out = ["| model | checkpoint | val acc | images | map | kind | deletion score | insertion score | sanity rho |",
           "|---|---|---|---|---|---|---|---|---|"]
    verdicts = []
    for group in by_checkpoint(rows):
        c = group[0]["checkpoint"]
        acc = "-" if group[0]["val_acc"] is None else f"{group[0]['val_acc']:.4f}"
        for r in group:
            rho = "-" if r["sanity_rho"] is None else f"{r['sanity_rho']:.2f}"
            out.append(f"| {r['model']} | {c['config']} seed {c['seed']} | {acc} | {r['images']} | `{r['map']}` | "
                       f"{r['kind']} | {_fmt(r['deletion_score'])} | {_fmt(r['insertion_score'])} | {rho} |")
        best = max(group, key=merit)
        sure = round(best["deletion_score"][1], 3) > 0 and round(best["insertion_score"][1], 3) > 0  # as printed
        verdicts.append(f"- **{group[0]['model']}** ({c['config']} seed {c['seed']}): most faithful map `{best['map']}` "
                        f"({best['kind']}; deletion {_fmt(best['deletion_score'])}, insertion "
                        f"{_fmt(best['insertion_score'])}) - "
                        + ("better than random on both (intervals above zero)" if sure
                           else "not better than random on both with confidence"))
        verdicts.append(_against_gradient(group))
        if any(r["kind"] == "centre" for r in group):
            verdicts.append(_against_gradient(group, "centre"))
    return "\n".join(out + ["", "Most faithful map per model (highest mean of the deletion and insertion scores):", *verdicts])


ATTENTION_KINDS = ("attention", "attention_gradient", "layers_gradient", "rollout", "gradient_rollout")
README_BEGIN = "<!-- faithfulness table: python -m bench.faithfulness --summary -->"
README_END = "<!-- end of faithfulness table -->"


def _means(row: Optional[Dict[str, Any]]) -> str:
    return "-" if row is None else f"{row['deletion_score'][0]:+.3f} / {row['insertion_score'][0]:+.3f}"


def _best(group: List[Dict[str, Any]], kinds: Iterable[str]) -> Optional[Dict[str, Any]]:
    rows = [r for r in group if r["kind"] in tuple(kinds)]
    return max(rows, key=merit) if rows else None


def summary(rows: List[Dict[str, Any]]) -> str:
    """The README's table: one line per checkpoint with the best map of each family (deletion / insertion
    score, means), the most faithful map, and whether a map derived from attention is at least as faithful as
    input x gradient, and as the centre prior, on both curves ("-": the checkpoint was scored without it)."""
    out = [README_BEGIN,
           "| model (config, seed) | val acc | images | raw attention | attention x gradient | rollout "
           "| input x gradient | Grad-CAM | centre prior | most faithful | attention-derived >= input x gradient "
           "on both | >= centre prior on both |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for group in by_checkpoint(rows):
        c, g = group[0]["checkpoint"], _best(group, ["input_x_gradient"])
        acc = "-" if group[0]["val_acc"] is None else f"{100 * group[0]['val_acc']:.2f}%"
        best = max(group, key=merit)
        verdicts = []
        for ref in ("input_x_gradient", "centre"):
            _, r, both = _as_faithful_on_both(group, ref)
            verdicts.append("-" if r is None else ("yes" if both else "no"))
        out.append(f"| {group[0]['model']} ({c['config']}, {c['seed']}) | {acc} | {group[0]['images']} "
                   f"| {_means(_best(group, ['attention']))} "
                   f"| {_means(_best(group, ['attention_gradient', 'layers_gradient']))} "
                   f"| {_means(_best(group, ['rollout', 'gradient_rollout']))} | {_means(g)} "
                   f"| {_means(_best(group, ['gradcam']))} | {_means(_best(group, ['centre']))} "
                   f"| `{best['map']}` ({best['kind']}) | {' | '.join(verdicts)} |")
    return "\n".join(out + [README_END])


def _as_faithful_on_both(group: List[Dict[str, Any]], reference: str = "input_x_gradient"):
    """(maps derived from attention, the ``reference`` baseline's row or None, those derived maps whose mean
    scores are at least the reference's on both curves)."""
    derived = [r for r in group if r["kind"] in ATTENTION_KINDS]
    g = _best(group, [reference])
    both = [] if g is None else [r for r in derived if r["deletion_score"][0] >= g["deletion_score"][0]
                                 and r["insertion_score"][0] >= g["insertion_score"][0]]
    return derived, g, both


def _against_gradient(group: List[Dict[str, Any]], reference: str = "input_x_gradient") -> str:
    """The issue's aim, per model: is a map derived from attention at least as faithful as input x gradient
    (or another baseline, ``reference``) on both curves (mean scores)?"""
    derived, g, both = _as_faithful_on_both(group, reference)
    what = {"input_x_gradient": "input x gradient", "centre": "the centre prior"}.get(reference, reference)
    if not derived or g is None:
        return f"  - no attention-derived map or no {what} row to compare"
    best = max(both or derived, key=merit)
    paired = best.get("vs_centre") if reference == "centre" else None
    paired = ("" if paired is None else f"; paired difference, image by image: deletion {_fmt(paired['deletion'])}, "
              f"insertion {_fmt(paired['insertion'])}")
    if both:
        return (f"  - at least as faithful as {what} on both curves: `{best['map']}` ({best['kind']}; "
                f"deletion {best['deletion_score'][0]:+.3f} vs {g['deletion_score'][0]:+.3f}, insertion "
                f"{best['insertion_score'][0]:+.3f} vs {g['insertion_score'][0]:+.3f}{paired})")
    return (f"  - no attention-derived map is as faithful as {what} on both curves; the best, `{best['map']}` "
            f"({best['kind']}), has deletion {best['deletion_score'][0]:+.3f} vs {g['deletion_score'][0]:+.3f} and "
            f"insertion {best['insertion_score'][0]:+.3f} vs {g['insertion_score'][0]:+.3f}{paired}")


def main(argv: Optional[List[str]] = None) -> int:
    ap = parser(__doc__, device="auto", out=RESULTS)
    ap.add_argument("runs", nargs="*", help="run directories (with last.pt), or folders holding them")
    ap.add_argument("--report", action="store_true", help="print the markdown table of --out and stop")
    ap.add_argument("--summary", action="store_true", help="print the README's table of --out and stop")
    ap.add_argument("--images", type=int, default=500, help="held-out images per checkpoint")
    ap.add_argument("--vit-images", type=int, default=None, help="held-out images for vit_* models (default: --images)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--regions", type=int, default=8)
    ap.add_argument("--draws", type=int, default=3)
    ap.add_argument("--fill", choices=["mean", "blur"], default="mean")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--no-sanity", dest="sanity", action="store_false", help="skip the model-randomisation check")
    ap.add_argument("--data", default=None, help="dataset path or 'synthetic' (default: each run's data.root)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.report or args.summary:
        rows = load(out)
        if not rows:
            raise DataError(f"{'--report' if args.report else '--summary'}: {out} holds no results")
        print(report(rows) if args.report else summary(rows))
        return 0
    if not args.runs:
        ap.error("give run directories to score, or --report")
    for flag in ("images", "vit_images", "steps", "regions", "draws", "batch_size"):
        check_at_least(f"--{flag.replace('_', '-')}", getattr(args, flag), 1)
    load(out)  # a damaged results file is refused before any scoring, not after the first checkpoint's
    options = {"steps": args.steps, "regions": args.regions, "draws": args.draws, "fill": args.fill,
               "batch_size": args.batch_size, "sanity": args.sanity, "gradient_maps": True}
    made = {k: v for k, v in provenance(device=args.device).items() if k in ("command", "git")}
    for ckpt in find_checkpoints(args.runs):
        rows = [dict(r, **made) for r in score(ckpt, args.images, args.vit_images, options, args.data, args.device)]
        save(out, merge(load(out), rows))  # after every checkpoint: an interrupted sweep keeps what it scored
        best = max(rows, key=merit)
        print(f"{ckpt}: {len(rows)} maps on {rows[0]['images']} images; most faithful: {best['map']} ({best['kind']})")
    return 0


if __name__ == "__main__":
    run_main(lambda: sys.exit(main()), "faithfulness.py")
