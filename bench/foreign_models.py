"""timm and torchvision models through ``train.py`` at the CPU recipe's budget, with each block inserted by the
default rule (``insert_attention``) and without, beside visattn's ``resnet_fast``.

    python -m bench.foreign_models                      # every recipe x {none, se, cbam, coord} x seeds 0 1 (resumable)
    python -m bench.foreign_models --recipes configs/timm/regnetx_002.yaml --seeds 0 --arms none eca
    python -m bench.foreign_models --report             # the table (no training)
    python -m bench.foreign_models --report --write     # ... written into docs/results.md

Each recipe (``configs/timm/*.yaml``: the CPU recipe's data, augmentation and 4 epochs, SGD for a BatchNorm
network) trains on the 45,000 training images left after holding out the stratified 5,000-image validation
split (``data.split_seed`` 0), once with ``attention: none`` and once per block arm, ``model.attention=<arm>``
(inserted by ``insert_attention``'s default rule, ``init: identity``; each row records the rule, ``placement``), and
is scored once, at the end, on that split with 6-view test-time
augmentation. ``configs/cifar10_cpu.yaml`` (visattn's ``resnet_fast``, the CPU recipe) runs beside them with no
block, after them. Runs go recipe by recipe in the order given (each recipe's arms and seeds together, so its row
completes first); each finished run is appended to
``bench/results/foreign_models.json`` as ``{model, attention, seed, epochs, val_acc, images_per_s, precision,
cpu, kernels, placement, blocks, ...}`` (runs already there on this machine's precision and kernels are skipped;
a run killed part-way resumes from its checkpoint). Runs pair only within one family of kernels: the report puts
each recipe's runs of each family on a row of their own. Images/s is the
run's own, with the machine's mean load beside it: compare speeds only between runs timed at the same load.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import json
import statistics
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence

from bench.attention_table import planned_numerics, run_one
from bench.common import ROOT, parser, splice
from visattn.errors import ConfigError, run_main
from visattn.results import check_rows, read_json, write_atomic
from visattn.signals import Interrupted

RESULTS = ROOT / "bench" / "results" / "foreign_models.json"
DOC = ROOT / "docs" / "results.md"
RECIPES = ["configs/timm/mobilenetv3_small.yaml", "configs/timm/tinynet_e.yaml", "configs/timm/tv_mobilenet_v3_small.yaml",
           "configs/timm/resnet18_quarter.yaml", "configs/timm/regnetx_002.yaml"]
REFERENCE = "configs/cifar10_cpu.yaml"  # visattn's resnet_fast, no block
ARMS = ("none", "se", "cbam", "coord", "eca")  # every arm the table has a column for
DEFAULT_ARMS = ("none", "se", "cbam", "coord")
LABEL = {"se": "SE", "cbam": "CBAM", "coord": "coord", "eca": "ECA"}
# --in-se-place: each block in the place of the model's own SE modules (insert_attention(replace_se=True)), as
# the CBAM and coordinate-attention papers compare blocks; rows say so in their placement
REPLACED = "se-replaced"
REPLACE_OVERRIDE = "model.attn_kwargs={replace_se: true}"
# the recipes whose block sites moved with the SE-slot rule (inverted residuals): their block runs without a
# ``placement`` were trained at the earlier sites and are history (docs/changelog.md), not rows of the table
MOVED = {"configs/timm/mobilenetv3_small.yaml", "configs/timm/tinynet_e.yaml", "configs/timm/tv_mobilenet_v3_small.yaml"}
# published deltas beside ours: top-1 points over the plain network, the same block family at the papers' sites
PUBLISHED = ("Hou et al. 2021 (Coordinate Attention, CVPR 2021), MobileNetV2 on ImageNet with each block at the SE "
             "slot, top-1 72.3% plain: SE +1.2, CBAM +1.3, coordinate +2.0; Woo et al. 2018 (CBAM, ECCV 2018) report "
             "MobileNet on ImageNet improved by SE and more by CBAM. ImageNet at full training, so a guide to the sign "
             "and order, not to the size at 4 CIFAR-10 epochs")
# where the reference has no runs of its own here: the attention table's, the same recipe and budget
# (configs/attention/resnet_fast_none.yaml is configs/cifar10_cpu.yaml with its maps logged each epoch;
# resnet_fast_cbam.yaml adds CBAM at identity, one per group)
TABLE_RESULTS = ROOT / "bench" / "results" / "attention_table.json"
TABLE_REFERENCE = {arm: f"configs/attention/resnet_fast_{arm}.yaml" for arm in ARMS}
TABLE_FIELDS = {"config": "str", "seed": "int", "epochs": "int", "val_acc": "number", "images_per_s": "number",
                "parameters": "int", "precision": "str?", "kernels": "str?", "overrides": "list?"}
BEGIN = "<!-- foreign models table: python -m bench.foreign_models --report --write -->"
END = "<!-- end of foreign models table -->"
ROW_FIELDS = {"model": "str", "recipe": "str", "attention": "str", "seed": "int", "epochs": "int", "val_acc": "number",
              "images_per_s": "number", "precision": "str", "cpu": "str", "kernels": "str", "threads": "int",
              "batch_size": "int", "lr": "number", "optimizer": "str", "parameters": "int", "eval_split": "str",
              "resumed": "bool?", "attn_lr_scale": "number?"}


def blocks_of(recipe: str, attention: str, replace: bool = False) -> int:
    """How many blocks the default rule (``replace``: the SE modules' places) puts into the recipe's model (0 for
    ``none``)."""
    if attention == "none":
        return 0
    import visattn
    from visattn.config import load_config
    from visattn.models import from_config

    model = from_config(load_config(ROOT / recipe), weights=False)
    return visattn.insert_attention(model, attention, replace_se=replace)


def row(recipe: str, attention: str, seed: int, run: dict, replace: bool = False) -> dict:
    """A results row from :func:`attention_table.run_one`'s record."""
    from visattn.attention.insert import PLACEMENT
    from visattn.config import load_config

    cfg = load_config(ROOT / recipe)
    placement = {"placement": REPLACED if replace else PLACEMENT, "blocks": blocks_of(recipe, attention, replace),
                 "attn_lr_scale": cfg.optim.attn_lr_scale} if attention != "none" else {}
    return {"model": cfg.model.name, "recipe": recipe, "attention": attention, "seed": seed, "epochs": run["epochs"],
            "val_acc": run["val_acc"], "images_per_s": round(run["images_per_s"], 1), "precision": run["precision"],
            "cpu": run["cpu"], "kernels": run["kernels"], "threads": run["threads"], "batch_size": cfg.train.batch_size,
            "lr": cfg.optim.lr, "optimizer": cfg.optim.name, "parameters": run["parameters"],
            "train_seconds": round(run["train_seconds"], 1), "load_mean": run["load_mean"],
            "eval_split": run["eval_split"], "git": run["git"], **({"resumed": True} if run.get("resumed") else {}),
            **placement, **({"head_init": cfg.model.options()["head_init"]} if cfg.model.options().get("head_init") else {}),
            "command": f"python train.py --config {recipe} seed={seed} precision={run['precision']}"
                       + (f" model.attention={attention}" if attention != "none" else "")
                       + (f" '{REPLACE_OVERRIDE}'" if replace and attention != "none" else "")}


def sited(r: dict) -> bool:
    """No block, or a block at this version's sites (not the earlier rule's)."""
    from visattn.attention.insert import PLACEMENT

    return r["attention"] == "none" or r["recipe"] not in MOVED or r.get("placement") in (PLACEMENT, REPLACED)


@functools.lru_cache(maxsize=None)
def recipe_settings(recipe: str) -> Dict[str, object]:
    """The recipe's own ``lr``, ``attn_lr_scale`` (``optim.*``) and ``head_init`` (``model.head_init``, None: the
    package's own), read once; for a recipe that is not a file here (the reference's rows): None, 1 and None."""
    from visattn.config import load_config

    path = ROOT / recipe
    if not path.is_file():
        return {"lr": None, "attn_lr_scale": 1.0, "head_init": None}
    cfg = load_config(path)
    return {"lr": cfg.optim.lr, "attn_lr_scale": cfg.optim.attn_lr_scale, "head_init": cfg.model.options().get("head_init")}


def at_recipe(r: dict) -> bool:
    """A run of the recipe as it stands, at its lr and head init: a recipe whose lr or ``model.head_init`` changed
    (TinyNet-E's lr 0.4 to 0.1, then back to 0.4 with a zero classifier) left its earlier runs, ``none``'s too, to
    history. Rows from before ``head_init`` was recorded trained at the package's own init."""
    own = recipe_settings(r["recipe"])
    return own["lr"] is None or (r["lr"] == own["lr"] and r.get("head_init") == own["head_init"])


def current(r: dict) -> bool:
    """A run the table counts: at this version's sites and at the recipe's lr and head init."""
    return sited(r) and at_recipe(r)


def replaced(r: dict) -> bool:
    """A block run in the place of the model's own SE modules (``--in-se-place``)."""
    return r.get("placement") == REPLACED


def family(r: dict) -> str:
    return f"{r['precision']} on {r['kernels']}"


def lr_scale(r: dict) -> float:
    """The rate a block run's blocks trained at, times the network's (``optim.attn_lr_scale``; rows from before the
    option: 1)."""
    return float(r.get("attn_lr_scale", 1.0))


def recipe_lr_scale(recipe: str) -> float:
    """The recipe's own ``optim.attn_lr_scale`` (1 for a recipe that is not a file here: the reference's rows)."""
    return float(recipe_settings(recipe)["attn_lr_scale"])


def as_recipe(r: dict) -> bool:
    """A run of the recipe as it stands: no block, or its blocks at the recipe's ``optim.attn_lr_scale``."""
    return r["attention"] == "none" or lr_scale(r) == recipe_lr_scale(r["recipe"])


def done(results: List[dict], recipe: str, attention: str, seed: int, epochs: int, numerics: Optional[str] = None,
         replace: bool = False) -> bool:
    """A current run of these settings (on this machine's precision and kernels, ``numerics``; ``replace``: in the
    SE's place; its blocks at the recipe's ``optim.attn_lr_scale``) is there."""
    return any(r["recipe"] == recipe and r["attention"] == attention and r["seed"] == seed and r["epochs"] == epochs
               and current(r) and as_recipe(r) and (numerics is None or family(r) == numerics)
               and (attention == "none" or replaced(r) == replace) for r in results)


def plan(recipes: Sequence[str], seeds: Sequence[int], reference: bool, arms: Sequence[str] = DEFAULT_ARMS) -> List[tuple]:
    """(recipe, attention, seed) in the order they train: recipe by recipe, each one's seeds and arms together
    (its row completes before the next starts), then the reference at every seed."""
    out = [(r, a, seed) for r in recipes for seed in seeds for a in arms]
    return out + ([(REFERENCE, "none", seed) for seed in seeds] if reference else [])


@contextlib.contextmanager
def cpu_lock(path: Optional[str]) -> Iterator[None]:
    """Hold ``flock(path)`` for one run (``--lock``): other jobs that take the same lock (``flock PATH CMD``) run
    between runs, never beside one; none without a path."""
    if not path:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def train(args: argparse.Namespace) -> None:
    results = read_json(Path(args.results), list, missing=[])
    for recipe, attention, seed in plan(args.recipes, args.seeds, not args.no_reference, args.arms):
        replace = args.in_se_place and attention != "none"
        if done(results, recipe, attention, seed, args.epochs, planned_numerics(recipe, args.precision), replace):
            continue
        extra = [f"model.attention={attention}", *([REPLACE_OVERRIDE] if replace else [])] if attention != "none" else []
        tag = f"{attention}-in-se" if replace else (attention if extra else "")
        with cpu_lock(args.lock):
            run = run_one(recipe, seed, args.epochs, Path(args.runs), args.data_root, tag, extra,
                          precision_override=args.precision)
        # read again before adding: another sweep may have added its rows meanwhile (a kill mid-write keeps the old file)
        results = [*read_json(Path(args.results), list, missing=[]), row(recipe, attention, seed, run, replace)]
        write_atomic(Path(args.results), json.dumps(results, indent=1))
        print(f"{recipe} {attention} seed {seed}: val {100 * run['val_acc']:.2f}% at {run['images_per_s']:.0f} img/s",
              flush=True)


def reference_rows(results: List[dict], table_results: Path = TABLE_RESULTS) -> List[dict]:
    """``resnet_fast`` beside the recipes: its runs in ``results`` (the sweep without ``--no-reference``), else the
    attention table's ``resnet_fast_none`` and ``resnet_fast_cbam`` runs at the same budget, precision and kernel
    family (their ``source`` names the file); none where neither has a run without a block. A damaged row of the
    attention table is one line naming it."""
    own = [r for r in results if r["recipe"] == REFERENCE]
    if own or not results or not table_results.is_file():
        return own
    from visattn.config import load_config

    first = results[0]
    arm_of = {config: arm for arm, config in TABLE_REFERENCE.items()}
    config = {c: load_config(ROOT / c) for c in arm_of}
    rows = check_rows(table_results, read_json(table_results, list), TABLE_FIELDS, lambda r: r.get("config") in arm_of)
    same = [r for r in rows if r.get("config") in arm_of and all(r.get(k) == first[k] for k in ("epochs", "precision",
                                                                                                  "kernels"))]
    # a run with overrides counts where they restate its file (the table's runs name the block's init and position)
    same = [r for r in same if not r.get("overrides") or load_config(ROOT / r["config"], r["overrides"]) == config[r["config"]]]
    if not any(arm_of[r["config"]] == "none" for r in same):
        return []
    cfg = config[TABLE_REFERENCE["none"]]
    return [{"model": cfg.model.name, "recipe": f"configs/attention/resnet_fast_{{{','.join(ARMS)}}}.yaml",
             "source": table_results.name, "attention": arm_of[r["config"]], "seed": r["seed"], "epochs": r["epochs"],
             "val_acc": r["val_acc"], "images_per_s": r["images_per_s"], "parameters": r["parameters"],
             "batch_size": cfg.train.batch_size, "lr": cfg.optim.lr, "optimizer": cfg.optim.name,
             "precision": first["precision"], "kernels": first["kernels"]} for r in same]


def _acc(runs: Dict[int, dict]) -> str:
    vals = [100 * r["val_acc"] for r in runs.values()]
    return "—" if not vals else f"{statistics.mean(vals):.2f}" + (f" ± {statistics.stdev(vals):.2f}" if len(vals) > 1 else "")


def _delta(arm: Dict[int, dict], none: Dict[int, dict]) -> str:
    """The paired difference to ``none`` in points: mean over the seeds both have, then each seed's."""
    pairs = [100 * (arm[s]["val_acc"] - none[s]["val_acc"]) for s in sorted(arm) if s in none]
    if not pairs:
        return "—"
    each = " / ".join(f"{d:+.2f}" for d in pairs)
    return f"**{statistics.mean(pairs):+.2f}** ({each})" if len(pairs) > 1 else each


def worst(results: List[dict]) -> Optional[tuple]:
    """(paired mean difference, recipe, arm, family) of the arm furthest below ``none``, over the current runs."""
    # the default rule's, as the recipe stands
    rows = [r for r in results if r["recipe"] != REFERENCE and current(r) and not replaced(r) and as_recipe(r)]
    out = []
    for key in dict.fromkeys((r["recipe"], family(r)) for r in rows):
        runs = [r for r in rows if (r["recipe"], family(r)) == key]
        none = {r["seed"]: r for r in runs if r["attention"] == "none"}
        for a in ARMS[1:]:
            pairs = [100 * (r["val_acc"] - none[r["seed"]]["val_acc"]) for r in runs if r["attention"] == a
                     and r["seed"] in none]
            if pairs:
                out.append((statistics.mean(pairs), key[0], a, key[1]))
    return min(out) if out else None


def table(results: List[dict], reference: Optional[List[dict]] = None) -> str:
    """Markdown: per model and kernel family, ``none``'s mean validation accuracy over its seeds and each block
    arm's paired difference to it (mean, then each seed), the blocks the rule puts in, images/s of ``none``;
    the papers' published differences under it."""
    if not results:
        raise ConfigError(f"{RESULTS.name}: no runs to report (train some first: python -m bench.foreign_models)")
    rows = [r for r in results if r["recipe"] != REFERENCE and current(r)]
    history = [r for r in results if not sited(r)]
    stale = [r for r in results if sited(r) and not at_recipe(r)]
    # block runs at another lr scale than the recipe's stay as the control of the recipe's runs on the same family;
    # where that family has none of the recipe's they are the earlier recipe's, and history
    ours = {(r["recipe"], family(r)) for r in rows if r["attention"] != "none" and as_recipe(r)}
    earlier = [r for r in rows if not as_recipe(r) and (r["recipe"], family(r)) not in ours]
    rows = [r for r in rows if not any(r is e for e in earlier)]
    rows += reference_rows(results) if reference is None else reference
    arms = [a for a in ARMS[1:] if any(r["attention"] == a for r in rows)]
    lines = ["| model (recipe) | numerics | params | blocks | none | " + " | ".join(f"{LABEL[a]} - none" for a in arms)
             + " | images/s none | seeds |", "|---|---|---|---|---|" + "---|" * len(arms) + "---|---|"]
    def fam(r: dict) -> str:
        return family(r) if "precision" in r else ""

    # a row per recipe, family and variant: (in the SE's place, the blocks' lr scale); none's runs join each variant
    variants = {(r["recipe"], fam(r)): {(False, recipe_lr_scale(r["recipe"]))} for r in rows}
    for r in rows:
        if r["attention"] != "none":
            variants[(r["recipe"], fam(r))].add((replaced(r), lr_scale(r)))
    ordered = lambda v, recipe: (v[0], v[1] != recipe_lr_scale(recipe), v[1])  # the recipe's own first  # noqa: E731
    keys = [(*rf, *v) for rf, vs in variants.items() for v in sorted(vs, key=lambda v: ordered(v, rf[0]))]
    for key in keys:
        runs = [r for r in rows if (r["recipe"], fam(r)) == key[:2]
                and (r["attention"] == "none" or (replaced(r), lr_scale(r)) == key[2:])]
        arm: Dict[str, Dict[int, dict]] = {a: {r["seed"]: r for r in runs if r["attention"] == a} for a in ARMS}
        blocked = any(arm[a] for a in ARMS[1:])
        # none alone: a row only where the recipe has no block runs on this family at all
        if not arm["none"] or not blocked and (key[2:] != (False, recipe_lr_scale(key[0])) or len(variants[key[:2]]) > 1):
            continue
        speeds = [r["images_per_s"] for r in arm["none"].values() if not r.get("resumed")]  # a resumed run's time is split
        first = runs[0]
        recipe = key[0]
        where = f"`{Path(recipe).name}`" + (f", runs of {first['source']}" if first.get("source") else "") \
            + (", **in the SE's place**" if key[2] else "") \
            + (f", blocks at **{key[3]:g}x** lr" if blocked and (key[3] != 1.0 or recipe_lr_scale(recipe) != 1.0) else "")
        blocks = sorted({r.get("blocks") or blocks_of(recipe, r["attention"], key[2]) for r in runs
                         if r["attention"] != "none" and not r.get("source")})  # rows before "blocks" was kept
        seeds = sorted({r["seed"] for r in runs})
        speed = f"{statistics.median(speeds):.0f}" if speeds else "—"
        lines.append(f"| {first['model']} ({where}) | {key[1] or 'as the sweep'} | {first['parameters'] / 1e6:.1f}M | "
                     f"{', '.join(map(str, blocks)) or '—'} | {_acc(arm['none'])} | "
                     + " | ".join(_delta(arm[a], arm["none"]) for a in arms) + f" | {speed} | {', '.join(map(str, seeds))} |")
    first = results[0]
    low = worst(results)
    lines.append("")
    lines.append(f"{first['epochs']} epochs, 2 threads, SGD at batch 512 (`configs/timm/base.yaml`); scored on the "
                 f"{first['eval_split']}; accuracies in %, differences in points paired by seed (**mean** over the seeds, "
                 "then each seed), within one row's numerics only; blocks: how many the default rule puts in "
                 "(`insert_attention`, `init: identity`; **in the SE's place**: `replace_se=True`, each of the "
                 "model's own SE modules replaced by the block, beside the same `none` runs); **Nx** lr: the blocks' "
                 "parameters train at N times the network's lr (`optim.attn_lr_scale`; the inverted-residual recipes "
                 "set 0.1, the others keep 1), a row of its own for each. Images/s: median of the runs timed in one "
                 "sitting, under the day's load." + (f" Furthest below `none`: {LABEL[low[2]]} in `{Path(low[1]).name}` ({low[3]}), "
                                      f"{low[0]:+.2f}." if low else "")
                 + (f" {len(history)} block runs at the earlier sites (after every inverted residual's projection) are "
                    "history: [changelog](changelog.md#blocks-at-the-earlier-sites-in-inverted-residuals)." if history else "")
                 + (f" {len(earlier)} block runs at another lr scale than their recipe's, on kernels with no run at the "
                    "recipe's own, are history: [changelog](changelog.md#blocks-at-the-networks-lr-in-inverted-residuals)."
                    if earlier else "")
                 + (f" {len(stale)} runs at an earlier lr or head init of their recipe are history: "
                    "[changelog](changelog.md#runs-at-a-recipes-earlier-settings)." if stale else ""))
    lines.append("")
    lines.append(f"Published, for scale: {PUBLISHED}.")
    return "\n".join(lines)


def write_doc(text: str, doc: Path = DOC) -> None:
    splice(doc, BEGIN, END, text)


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = parser(__doc__, threads=True, precision=True, precisions=("bf16", "fp32"), help={
        "precision": "instead of the recipe's auto (fp32 ran these depthwise-conv models 1.25x faster than bf16 on an "
                     "AMX CPU); the rows record it, and pair only within it",
        "threads": "torch threads (default: torch's own); 1 keeps a run's speed steady beside other work on 2 cores (no "
                   "thread waits on a preempted one)"})
    ap.add_argument("--recipes", nargs="*", default=RECIPES)
    ap.add_argument("--seeds", nargs="*", type=int, default=[0, 1])
    ap.add_argument("--arms", nargs="*", default=list(DEFAULT_ARMS), choices=ARMS, help="none and the blocks to insert")
    ap.add_argument("--in-se-place", action="store_true",
                    help="each block in the place of the model's own SE modules (replace_se=True), not after them")
    ap.add_argument("--epochs", type=int, default=4, help="the budget of every run (the CPU recipe's 4)")
    ap.add_argument("--no-reference", action="store_true", help=f"leave out {REFERENCE} (resnet_fast)")
    ap.add_argument("--data-root", default=None)
    ap.add_argument("--runs", default=str(ROOT / "runs" / "foreign_models"))
    ap.add_argument("--results", default=str(RESULTS))
    ap.add_argument("--lock", default=None, help="a lock file held for each run (other jobs wait: flock FILE CMD)")
    ap.add_argument("--report", action="store_true", help="print the table from the results file; no training")
    ap.add_argument("--write", action="store_true", help="with --report: write the table into docs/results.md")
    args = ap.parse_args(argv)
    if args.epochs < 1 or any(s < 0 for s in args.seeds) or not args.seeds:
        raise ConfigError("--epochs must be at least 1 and --seeds non-negative integers")
    for recipe in args.recipes:
        if not (ROOT / recipe).is_file():
            raise ConfigError(f"--recipes: {recipe} not found")
        if args.in_se_place and not args.report:  # before any run: a recipe whose model has no SE of its own
            try:
                blocks_of(recipe, "se", replace=True)
            except ValueError as e:
                raise ConfigError(f"--in-se-place: {recipe}: {e}") from None
    if args.report:
        path = Path(args.results)
        text = table(check_rows(path, read_json(path, list), ROW_FIELDS))  # a damaged row: one line naming it
        print(text)
        if args.write:
            write_doc(text)
        return
    train(args)


if __name__ == "__main__":
    try:
        run_main(main, "foreign_models.py")
    except Interrupted as e:  # SIGTERM or SIGINT mid-run: one line; the finished runs are in the results file
        print(str(e), file=sys.stderr)
        sys.exit(e.exit_code)
