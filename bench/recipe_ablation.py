"""The recipes' ablations: a recipe as shipped, and that with one lever changed or taken back, one row per lever.

    python -m bench.recipe_ablation                       # the CNN recipe (configs/cifar10_cpu.yaml), seed 0
    python -m bench.recipe_ablation --variants recipe all_levers --seeds 0 1
    python -m bench.recipe_ablation --recipe vit_cpu      # the transformer recipe (configs/vit_cpu.yaml)
    python -m bench.recipe_ablation --recipe vit_cpu --table

Recipes (:data:`RECIPES`): ``cpu`` is ``configs/cifar10_cpu.yaml`` against airbench's setting of its levers,
results in ``bench/results/recipe_ablation.json``; ``vit_cpu`` is ``configs/vit_cpu.yaml``, results in
``bench/results/vit_ablation.json``. Every run trains its config for its fixed number of epochs (a busy machine
changes only the time, never the budget) and is scored once, at the end, on the 5,000-image validation split
held out from the 45,000 training images (stratified, ``data.split_seed=0``: the same images for every run)
with the config's test-time augmentation (unless the variant changes it). Each finished run is appended to its
results file with the precision it ran under (runs already there are skipped, so an interrupted sweep
continues where it stopped), with the command that made it (``command``) and the run's git revision (``git``);
``--table`` prints the markdown table from that file without training.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.attention_table import numerics, run_resuming
from bench.common import ROOT, kernels, parser, provenance
from visattn.errors import CheckpointError, ConfigError, run_main
from visattn.results import check_rows, read_json, write_atomic
from visattn.rundir import complete_rows
from visattn.signals import Interrupted

# airbench94's setting of the levers: batch 1024 (lr 1.5 in mean-loss form) with lookahead averaging
AIRBENCH = ["train.batch_size=1024", "optim.lr=1.5", "train.lookahead_every=5"]

# name -> (what the variant changes, overrides on top of configs/cifar10_cpu.yaml)
CPU_VARIANTS = {
    "recipe": ("nothing: configs/cifar10_cpu.yaml as shipped (batch 512, no lookahead)", []),
    "all_levers": ("airbench's setting: batch 1024 and lookahead averaging", AIRBENCH),
    "no_lookahead": ("all_levers without lookahead", [*AIRBENCH, "train.lookahead_every=0"]),
    "batch_512": ("all_levers at batch 512 (lr 0.75: the same lr per example, twice the steps)",
                  [*AIRBENCH, "train.batch_size=512", "optim.lr=0.75"]),
    "random_flip": ("all_levers with random flips instead of alternating ones",
                    [*AIRBENCH, "data.augment.hflip_mode=random"]),
    "default_bn": ("all_levers with PyTorch's BatchNorm (momentum 0.1, eps 1e-5, learned scales, 1x bias lr)",
                   [*AIRBENCH, "model.bn_momentum=0.1", "model.bn_eps=1e-5", "model.bn_scale=learn",
                    "optim.norm_bias_lr_scale=1"]),
    "kaiming_init": ("all_levers without the dirac initialisation (Kaiming only)", [*AIRBENCH, "model.conv_init=kaiming"]),
    "residual": ("all_levers with visattn's residual units instead of plain ones", [*AIRBENCH, "model.block=residual"]),
    "whiten_bias_always": ("all_levers with the whitening bias trained throughout (not frozen after epoch 1)",
                           [*AIRBENCH, "model.whiten_bias_epochs=0"]),
    "v1_recipe": ("visattn's first recipe: none of the levers, batch 256, lr 0.3, momentum 0.9, wd 5e-4",
                  ["train.lookahead_every=0", "data.augment.hflip_mode=random", "model.bn_momentum=0.1",
                   "model.bn_eps=1e-5", "model.bn_scale=learn", "optim.norm_bias_lr_scale=1", "model.conv_init=kaiming",
                   "model.block=residual", "model.whiten_bias_epochs=0", "model.head_scale=1.0", "train.batch_size=256",
                   "optim.lr=0.3", "optim.momentum=0.9", "optim.weight_decay=0.0005", "sched.start_lr_ratio=0.04",
                   "sched.warmup_epochs=1"]),
    # the longer budget of the attention table (issue: a budget where a block's gain can show)
    "epochs_16": ("16 epochs, the recipe otherwise as shipped (warmup 0.8 epochs)", ["train.epochs=16"]),
    "epochs_32": ("32 epochs, the recipe otherwise as shipped (warmup 0.8 epochs): is 92% reachable at all",
                  ["train.epochs=32"]),
    "epochs_16_wide": ("16 epochs at airbench95's widths 128/384/384 (about 2.5x the FLOPs), the recipe otherwise as "
                       "shipped: does a wider network reach 92% on this data", ["train.epochs=16", "model.widths=[128,384,384]"]),
    "epochs_10_airbench": ("10 epochs with airbench94's setting: batch 1024, lookahead, warmup 23% of the steps, "
                           "whitening bias trained 3 epochs", ["train.epochs=10", *AIRBENCH, "sched.warmup_epochs=2.3",
                                                              "model.whiten_bias_epochs=3"]),
    "epochs_16_airbench": ("16 epochs with airbench94's setting: batch 1024, lookahead, warmup 23% of the steps, "
                           "whitening bias trained 3 epochs", ["train.epochs=16", *AIRBENCH, "sched.warmup_epochs=3.7",
                                                              "model.whiten_bias_epochs=3"]),
    "epochs_16_regularised": ("16 epochs with batch 1024, lookahead, warmup 23% of the steps, 4-pixel translation "
                              "and an 8-pixel cutout", ["train.epochs=16", *AIRBENCH, "sched.warmup_epochs=3.7",
                                                        "data.augment.crop_padding=4", "data.augment.cutout=8"]),
    "epochs_32_regularised": ("32 epochs with airbench96's augmentation (4-pixel translation, a 12-pixel cutout), the "
                              "recipe otherwise as shipped: does regularisation lift the plateau once the training "
                              "images are fitted", ["train.epochs=32", "data.augment.crop_padding=4",
                                                    "data.augment.cutout=12"]),
}


# name -> (what the variant changes, overrides on top of configs/vit_cpu.yaml)
VIT_VARIANTS = {
    "recipe": ("nothing: configs/vit_cpu.yaml as shipped", []),
    "adamw": ("AdamW for every parameter instead of Muon (same lr)", ["optim.name=adamw"]),
    "kaiming_tokenizer": ("the first convolution Kaiming-initialised, not whitened", ["model.tokenizer_init=kaiming"]),
    "paper_tokenizer": ("CCT's own tokenizer: no BatchNorm, ReLU, 3x3 stride-2 max-pool, Kaiming",
                        ["model.tokenizer_norm=none", "model.tokenizer_act=relu", "model.pool_kernel=3",
                         "model.tokenizer_init=kaiming"]),
    "layer_scale": ("LayerScale 1e-4 on every residual branch", ["model.layer_scale=1e-4"]),
    "pos_bias": ("a local position bias in every attention (heads start as local kernels)",
                 ["model.attn_kwargs.pos_bias=local"]),
    "batch_128": ("batch 128 at the same lr (twice the steps)", ["train.batch_size=128"]),
    "no_label_smoothing": ("no label smoothing (0.1)", ["train.label_smoothing=0.0"]),
    "cls_token": ("a class token instead of sequence pooling", ["model.pool=cls"]),
    "no_tta": ("one view at evaluation instead of 6", ["eval.tta=none"]),
}

# recipe -> (config, variants, results file)
RECIPES = {
    "cpu": (ROOT / "configs" / "cifar10_cpu.yaml", CPU_VARIANTS, ROOT / "bench" / "results" / "recipe_ablation.json"),
    "vit_cpu": (ROOT / "configs" / "vit_cpu.yaml", VIT_VARIANTS, ROOT / "bench" / "results" / "vit_ablation.json"),
}


def eval_only(overrides: list[str]) -> bool:
    """Whether a variant changes only how the trained network is scored (``eval.tta=none``): its training is
    the recipe's to the step, so its row scores the recipe run's checkpoint instead of training again."""
    return bool(overrides) and all(o.startswith("eval.") for o in overrides)


def _run_dir(recipe: str, variant: str, seed: int, run_root: Path, data_root: str | None) -> tuple[Path, list[str]]:
    from visattn.config import load_config

    config, variants, _ = RECIPES[recipe]
    overrides = [f"seed={seed}", "log.progress=false", *variants[variant][1]]
    if data_root:
        overrides.append(f"data.root={data_root}")
    # one folder per kernel family: a run killed part-way goes on only where it started
    return run_root / f"{variant}-s{seed}-{kernels(load_config(config, overrides).device)}", overrides


def score_recipe_run(recipe: str, variant: str, seed: int, run_root: Path, data_root: str | None,
                     results: list[dict]) -> dict:
    """An eval-only variant's row: the recipe run of this seed and kernel family (trained first if missing),
    its final checkpoint scored with the variant's evaluation settings, and rescored with the recipe's own as a
    check that the scoring path is the trainer's (``recipe_rescored`` beside the recipe's ``val_acc``)."""
    from visattn.config import load_config
    from visattn.evaluate import evaluate_checkpoint

    config, variants, _ = RECIPES[recipe]
    run_dir, _ = _run_dir(recipe, "recipe", seed, run_root, data_root)
    fam = kernels(load_config(config).device)
    base = next((r for r in results if r["variant"] == "recipe" and r["seed"] == seed
                 and r.get("kernels") == fam), None)
    if base is None:
        print(f"== recipe seed {seed} (to score {variant})", flush=True)
        base = run_one(recipe, "recipe", seed, run_root, data_root)
        results.append(base)
    if not (run_dir / "last.pt").is_file():
        raise CheckpointError(f"{variant}: the recipe run it scores, {run_dir}, has no last.pt (moved or deleted?)")
    cfg = load_config(config, list(variants[variant][1]))
    scored = evaluate_checkpoint(str(run_dir / "last.pt"), data=data_root, tta=cfg.eval.tta)
    again = evaluate_checkpoint(str(run_dir / "last.pt"), data=data_root)
    return dict(base, variant=variant, overrides=variants[variant][1], val_acc=scored["acc"],
                recipe_rescored=again["acc"], scored_from=run_dir.name, command=provenance()["command"])


def run_one(recipe: str, variant: str, seed: int, run_root: Path, data_root: str | None) -> dict:
    from visattn.config import load_config

    config, variants, _ = RECIPES[recipe]
    run_dir, overrides = _run_dir(recipe, variant, seed, run_root, data_root)
    overrides.append(f"run_dir={run_dir}")
    cfg = load_config(config, overrides)
    summary, resumed = run_resuming(config, overrides, run_dir)  # a run killed part-way goes on from its checkpoint
    rows, info = complete_rows(run_dir / "metrics.jsonl"), read_json(run_dir / "run_info.json")
    return {"variant": variant, "seed": seed, "overrides": variants[variant][1], "epochs": cfg.train.epochs,
            "precision": info.get("precision"), "kernels": kernels(cfg.device), "val_acc": rows[-1]["val_acc"], "train_seconds": sum(r["epoch_seconds"] for r in rows),
            "images_per_s": sum(r["images_per_s"] for r in rows) / len(rows), "parameters": info["parameters"],
            "eval_split": summary["eval_split"], "git": info["git"], "command": provenance()["command"],
            **({"resumed": True} if resumed else {})}


# what the table and the skip of runs already made read of every row (results.check_rows)
ROW = {"variant": "str", "seed": "int", "val_acc": "number", "train_seconds": "number", "images_per_s": "number",
       "epochs": "int?", "precision": "str?", "kernels": "str?"}


def table(results: list[dict], variants: dict) -> str:
    """Markdown rows in the variants' order, each with its budget and numerics (rows recorded before these were
    kept: 4 epochs, and the precision's legacy kernel family, as in ``bench/attention_table.py``)."""
    lines = ["| variant | what it changes | seed | epochs | numerics | val acc % | vs recipe, points | train time s | images/s |",
             "|---|---|---:|---:|---|---:|---:|---:|---:|"]
    order = list(variants)

    def num(r: dict) -> str:
        return numerics(dict(r, precision=r.get("precision") or "bf16"))

    recipe = {(r["seed"], num(r)): r["val_acc"] for r in results if r["variant"] == "recipe"}
    for r in sorted(results, key=lambda r: (order.index(r["variant"]) if r["variant"] in order else 99, r["seed"])):
        what = variants.get(r["variant"], ("?", []))[0] + (" (the recipe run, rescored)" if r.get("scored_from") else "")
        base = recipe.get((r["seed"], num(r)))
        vs = "—" if r["variant"] == "recipe" or base is None else f"{100 * (r['val_acc'] - base):+.2f}"
        lines.append(f"| `{r['variant']}` | {what} | {r['seed']} | {r.get('epochs', 4)} | {num(r)} "
                     f"| {100 * r['val_acc']:.2f} | {vs} | {r['train_seconds']:.0f} | {r['images_per_s']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--recipe", default="cpu", choices=list(RECIPES))
    ap.add_argument("--variants", nargs="*", default=None, help="default: every variant of the recipe")
    ap.add_argument("--seeds", nargs="*", type=int, default=[0])
    ap.add_argument("--runs", default=None, help="default: runs/recipe_ablation (cpu), runs/RECIPE_ablation (others)")
    ap.add_argument("--data-root", default=None, help="default: the config's data.root")
    ap.add_argument("--table", action="store_true", help="print the table from the results file and exit")
    args = ap.parse_args()
    _, variants, results_file = RECIPES[args.recipe]
    unknown = sorted(set(args.variants or []) - set(variants))
    if unknown:
        ap.error(f"unknown variant(s) of {args.recipe}: {', '.join(unknown)}; valid: {', '.join(variants)}")
    name = "recipe_ablation" if args.recipe == "cpu" else f"{args.recipe}_ablation"
    run_root = Path(args.runs or ROOT / "runs" / name)
    results = check_rows(results_file, read_json(results_file, list, missing=[]), ROW)
    if args.table and not results:
        raise ConfigError(f"--table: {results_file} holds no results")
    if not args.table:
        for variant in args.variants or list(variants):
            for seed in args.seeds:
                if any(r["variant"] == variant and r["seed"] == seed for r in results):
                    continue
                print(f"== {variant} seed {seed}", flush=True)
                if eval_only(variants[variant][1]):
                    results.append(score_recipe_run(args.recipe, variant, seed, run_root, args.data_root, results))
                else:
                    results.append(run_one(args.recipe, variant, seed, run_root, args.data_root))
                write_atomic(results_file, json.dumps(results, indent=1))  # a kill mid-write keeps the old file
    print(table(results, variants))


if __name__ == "__main__":
    try:  # a missing or bad config, data or checkpoint: one line (run_main); the finished runs are kept
        run_main(main, "recipe_ablation.py")
    except Interrupted as e:  # SIGTERM or SIGINT mid-run: one line; the finished runs are in the results file
        print(str(e), file=sys.stderr)
        sys.exit(e.exit_code)
