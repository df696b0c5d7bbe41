"""Fine-tuning a block into a trained network: what adding attention to a network that has already trained pays.

    python -m bench.finetune --lr 0.25                  # every block x seed; runs already in the results are skipped
    python -m bench.finetune --report                   # the table, and docs/results.md's section rewritten from it
    python -m bench.finetune --blocks none cbam --seeds 0 --base 'runs/ft/base_none_s{seed}/best.pt'

Base: the CPU recipe's ``none`` checkpoints, ``runs/ft/base_none_s{seed}/best.pt`` (``--base``): trained with
``configs/attention/resnet_fast_none.yaml`` (the recipe, 4 epochs) and that seed. Fine-tune: for each block,
``configs/attention/resnet_fast_<block>.yaml`` (the block at ``unit_bn``, ``init: identity``) with
``model.init_from=<base>``, the same seed, ``train.epochs=2`` and a fresh one-cycle schedule of its own: 20% warmup
from 0.2x to the peak ``--lr`` (``sched.warmup_epochs=0.4``), then linear to 0; everything else is the recipe's.
``none`` is the same fine-tune with no block. Each run is scored once, at its end, on the same 5,000 held-out
images with the recipe's test-time augmentation, and records its step-0 accuracy (before any step: with the
blocks at identity it must equal the base checkpoint's). The summary pairs each block with ``none`` on the same
seed (same base, same data order) and gives the mean difference with a 95% t interval.

Results go to ``bench/results/finetune.json`` after every run (rows, each with the command that made it and its
run's git revision, then the paired summary); a run killed part-way resumes from its last checkpoint on the next
call. The lr pilot is the same with ``--blocks none --seeds 0 --results bench/results/finetune_pilot.json``.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from bench.attention_report import mean_ci
from bench.attention_table import run_resuming
from bench.common import ROOT, command, cpu_name, parser, splice
from visattn.errors import ConfigError, run_main
from visattn.options import check_at_least
from visattn.results import check_rows, read_json, write_atomic
from visattn.rundir import complete_rows
from visattn.signals import Interrupted

RESULTS = ROOT / "bench" / "results" / "finetune.json"
DOC = ROOT / "docs" / "results.md"
BLOCKS = ("none", "se", "eca", "cbam", "coord")
EPOCHS = 2
WARMUP = 0.4  # epochs: 20% of the fine-tune, as the recipe's 0.8 of 4
BASE = "runs/ft/base_none_s{seed}/best.pt"
BEGIN = "<!-- finetune table: python -m bench.finetune --report -->"
END = "<!-- end of finetune table -->"


def overrides(block: str, seed: int, lr: float, base: str, run_dir: Path, extra: Sequence[str] = ()) -> List[str]:
    return [*extra, f"model.init_from={base}", f"seed={seed}", f"run_dir={run_dir}", f"train.epochs={EPOCHS}",
            f"optim.lr={lr}", f"sched.warmup_epochs={WARMUP}", f"eval.every={EPOCHS}", "log.maps_every=0",
            "log.progress=false"]  # (extra first: the fine-tune's own settings win)


def run_one(block: str, seed: int, lr: float, base_pattern: str, run_root: Path, extra: Sequence[str] = ()) -> dict:
    import torch

    base = os.path.expanduser(base_pattern.format(seed=seed))  # "~/base{seed}.pt" is the home folder's
    if not Path(base).is_file():
        raise ConfigError(f"--base: {base} not found (train it first: configs/attention/resnet_fast_none.yaml, "
                          f"seed={seed}, run_dir={Path(base).parent})")
    run_dir = run_root / f"{block}-lr{lr:g}-s{seed}"
    config = ROOT / "configs" / "attention" / f"resnet_fast_{block}.yaml"
    summary, resumed = run_resuming(config, overrides(block, seed, lr, base, run_dir, extra), run_dir, log=lambda *a: None)
    rows, info = complete_rows(run_dir / "metrics.jsonl"), read_json(run_dir / "run_info.json")
    origin = info["init_from"]
    return {"block": block, "seed": seed, "lr": lr, "epochs": EPOCHS, "base": base, "base_epoch": origin["epoch"],
            "base_val_acc": origin["best_acc"], "step0_val_acc": origin["val_acc"], "val_acc": rows[-1]["val_acc"],
            "train_seconds": round(sum(r["epoch_seconds"] for r in rows), 1), "precision": info["precision"],
            "cpu": cpu_name(), "threads": torch.get_num_threads(), "git": info["git"], "run_dir": str(run_dir),
            **({"overrides": list(extra)} if extra else {}), **({"resumed": True} if resumed else {})}


def paired(runs: List[dict]) -> List[dict]:
    """Each block against ``none`` at the same lr and seed: mean difference (points) with its 95% t interval."""
    out = []
    none = {(r["lr"], r["seed"]): r["val_acc"] for r in runs if r["block"] == "none"}
    for block in BLOCKS[1:]:
        for lr in sorted({r["lr"] for r in runs if r["block"] == block}):
            diffs = {r["seed"]: 100 * (r["val_acc"] - none[(lr, r["seed"])]) for r in runs
                     if r["block"] == block and r["lr"] == lr and (lr, r["seed"]) in none}
            if diffs:
                m, h = mean_ci(list(diffs.values()))
                out.append({"block": block, "lr": lr, "seeds": sorted(diffs), "mean_diff": round(m, 3),
                            "ci95": round(h, 3) if h != float("inf") else None,
                            "diffs": {str(s): round(d, 2) for s, d in sorted(diffs.items())}})
    return out


# what the table and the pairing read of every run and every paired row (results.check_rows)
RUN = {"block": "str", "seed": "int", "lr": "number", "epochs": "int", "base_epoch": "int", "base_val_acc": "number",
       "step0_val_acc": "number", "val_acc": "number", "train_seconds": "number", "precision": "str", "cpu": "str",
       "threads": "int"}
PAIRED = {"block": "str", "lr": "number", "mean_diff": "number", "ci95": "number?"}


def read(path: Path = RESULTS) -> Dict[str, list]:
    """The results file: {"runs": [...], "paired": [...]}; a damaged one (or a damaged row) is one error line,
    never an empty table."""
    if not path.is_file():
        return {"runs": [], "paired": []}
    try:
        data = json.loads(path.read_text())
        if not (isinstance(data, dict) and isinstance(data.get("runs"), list)):
            raise ValueError("not a mapping with a list of runs")
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: unreadable results file ({str(e).splitlines()[0][:120]}); move it aside") from None
    check_rows(path, data["runs"], RUN)
    check_rows(path, data.setdefault("paired", []), PAIRED)
    return data


def table(data: Dict[str, list]) -> str:
    runs = data["runs"]
    if not runs:
        return "(no fine-tune runs yet: python -m bench.finetune --lr LR)"
    base_epochs = "/".join(sorted({str(r["base_epoch"]) for r in runs}))
    lines = [f"| block | peak lr | seeds | base ({base_epochs} epochs) | step 0 | after {EPOCHS} more epochs | "
             "vs none, points (95% CI) |",
             "|---|---|---|---|---|---|---|"]
    diff = {(p["block"], p["lr"]): p for p in data.get("paired") or paired(runs)}
    for block in BLOCKS:
        for lr in sorted({r["lr"] for r in runs if r["block"] == block}):
            rs = sorted((r for r in runs if r["block"] == block and r["lr"] == lr), key=lambda r: r["seed"])

            def pct(key: str) -> str:
                m, h = mean_ci([100 * r[key] for r in rs])
                return f"{m:.2f}" + (f" ± {h:.2f}" if h != float("inf") else "")

            p = diff.get((block, lr))
            vs = "—" if block == "none" else "n/a" if p is None else (
                f"{p['mean_diff']:+.2f}" + (f" ({p['mean_diff'] - p['ci95']:+.2f} to {p['mean_diff'] + p['ci95']:+.2f})"
                                            if p["ci95"] is not None else ""))
            lines.append(f"| {block} | {lr:g} | {', '.join(str(r['seed']) for r in rs)} | {pct('base_val_acc')} | "
                         f"{pct('step0_val_acc')} | {pct('val_acc')} | {vs} |")
    r0 = runs[0]
    secs = statistics.median(r["train_seconds"] for r in runs)
    lines.append("")
    lines.append(f"{len(runs)} runs on {r0['cpu']} ({r0['threads']} threads, {r0['precision']}), a median "
                 f"{secs:.0f} s of training each; accuracies in % (mean ± 95% t half-width over seeds).")
    return "\n".join(lines)


def write_doc(text: str, doc: Path = DOC) -> None:
    splice(doc, BEGIN, END, text)


def main(argv: Optional[List[str]] = None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--lr", type=float, default=None, help="the fine-tune's peak lr (required to train)")
    ap.add_argument("--blocks", nargs="*", default=list(BLOCKS), choices=list(BLOCKS))
    ap.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2])
    ap.add_argument("--base", default=BASE, help="the base checkpoints, {seed} filled in (default: %(default)s)")
    ap.add_argument("--runs", default=str(ROOT / "runs" / "ft"), help="where the fine-tune runs go")
    ap.add_argument("--results", default=str(RESULTS))
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more overrides (e.g. a smoke test's data)")
    ap.add_argument("--report", action="store_true", help="print the table, rewrite --doc's; no training")
    ap.add_argument("--doc", default=str(DOC), help="the page whose finetune table --report rewrites")
    args = ap.parse_args(argv)
    for seed in args.seeds:
        check_at_least("--seeds", seed, 0)
    if not args.report and (args.lr is None or not 0 < args.lr <= 10):
        ap.error("--lr: give the fine-tune's peak learning rate (0 < lr <= 10)")
    path = Path(args.results)
    data = read(path)
    made = command(argv, __file__)  # python -m bench.finetune ARGS
    if args.report:
        if not data["runs"]:  # a missing or empty file would replace the page's table with "no runs yet"
            raise ConfigError(f"--report: {path} holds no fine-tune runs")
        text = table(data)
        print(text)
        write_doc(text, Path(args.doc))
        return
    for seed in args.seeds:  # seed-major: a partial sweep still pairs every block with none
        for block in args.blocks:
            if any(r["block"] == block and r["seed"] == seed and r["lr"] == args.lr for r in data["runs"]):
                continue
            print(f"== {block} seed {seed} lr {args.lr:g}", flush=True)
            row = {**run_one(block, seed, args.lr, args.base, Path(args.runs), args.set), "command": made}
            print(f"   step 0 {row['step0_val_acc']:.4f} (base {row['base_val_acc']:.4f}) -> {row['val_acc']:.4f}",
                  flush=True)
            data["runs"].append(row)
            data["paired"] = paired(data["runs"])
            write_atomic(path, json.dumps(data, indent=1))  # a kill mid-write keeps the old file
    print(table(data))


if __name__ == "__main__":
    try:  # a missing base, bad results file or bad config: one line (run_main); finished runs are kept
        run_main(main, "finetune.py")
    except Interrupted as e:
        print(str(e), file=sys.stderr)
        sys.exit(e.exit_code)
