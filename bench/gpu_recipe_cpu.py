"""The GPU recipe's epochs to 90% on this copy, measured on the CPU, against airbench94's at equal images.

    python bench/gpu_recipe_cpu.py [RUN_DIR ...]   # default: every run under runs/gpu_recipe_cpu/; -> bench/results/gpu_recipe_cpu.json
    python bench/gpu_recipe_cpu.py --table         # the markdown table in docs/results.md#gpu

Accuracy depends on the images a recipe has trained on, not on the device, so the GPU recipe's budget can be
set on the CPU. The runs are ``configs/cifar10_gpu.yaml`` trained on the CPU with every epoch evaluated, at the
budgets tried (``python train.py -c configs/cifar10_gpu.yaml seed=S compile=false train.epochs=E
run_dir=runs/gpu_recipe_cpu/eE_sS``); the recipe is the recipe ablation's ``epochs_10_airbench`` variant at the
config's budget (``tests/test_configs.py`` holds them equal), so that variant's recorded 10-epoch run counts too
(final epoch only). The budget is the shortest at which every seed reaches 90% (:func:`budgets`). The reference is ``bench/reference_airbench.py``'s
recorded 9.9-epoch runs in the same numerics on the same kernels (``bench/results/reference_airbench.json``).
Images count training images seen: steps times the batch (both drop each epoch's last partial batch).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from time_to_accuracy import rows, time_to  # noqa: E402

from visattn.config import safe_yaml  # noqa: E402
from visattn.errors import DataError  # noqa: E402
from visattn.options import describe  # noqa: E402
from visattn.rundir import check_rows, read_json, write_atomic  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "gpu_recipe_cpu.json"
TARGET = 0.90


def recorded_run(run_dir: Path) -> Dict[str, Any]:
    """One finished run folder as a results row; SystemExit naming the folder if it is not one."""
    info_path, cfg_path = run_dir / "run_info.json", run_dir / "config.yaml"
    if not (info_path.is_file() and cfg_path.is_file() and (run_dir / "metrics.jsonl").is_file()):
        sys.exit(f"error: {run_dir} is not a run folder (no run_info.json, config.yaml or metrics.jsonl)")
    from attention_table import kernels

    info, cfg = read_json(info_path), safe_yaml(cfg_path.read_text(errors="replace"), str(cfg_path))
    train = cfg.get("train") if isinstance(cfg, dict) else None
    epochs, batch = (train.get("epochs"), train.get("batch_size")) if isinstance(train, dict) else (None, None)
    if not (isinstance(epochs, int) and isinstance(batch, int) and epochs > 0 and batch > 0):
        sys.exit(f"error: {cfg_path}: no positive train.epochs and train.batch_size (a run's config.yaml?)")
    rs = rows(run_dir)
    if len(rs) < epochs or any(not isinstance(r.get("val_acc"), (int, float)) for r in rs):
        sys.exit(f"error: {run_dir}: {len(rs)} of {epochs} epochs, or an epoch not evaluated (train with eval.every=1)")
    hit = time_to(rs, TARGET)
    steps_to = None if hit is None else sum(r["epoch_steps"] for r in rs if r["epoch"] <= hit["epoch"])
    return {"recipe": "configs/cifar10_gpu.yaml", "seed": info["seed"], "epochs": epochs, "batch_size": batch,
            "precision": info["precision"], "kernels": kernels(info["device"]), "device": info["device"],
            "torch": info["versions"]["torch"], "git": info["git"], "val_acc": rs[-1]["val_acc"],
            "val_acc_by_epoch": [round(r["val_acc"], 4) for r in rs], "epoch_to_90": None if hit is None else hit["epoch"],
            "images_to_90": None if steps_to is None else steps_to * batch,
            "train_seconds": round(sum(r["epoch_seconds"] for r in rs), 1), "eval_split": info["eval_split"],
            "command": f"python train.py -c configs/cifar10_gpu.yaml seed={info['seed']} compile=false "
                       f"train.epochs={epochs} run_dir={run_dir}"}


def earlier_runs(kernels_: set) -> List[Dict[str, Any]]:
    """The recipe ablation's ``epochs_10_airbench`` runs (this recipe, final epoch only) on these kernels."""
    out = []
    for r in read_json(ROOT / "bench" / "results" / "recipe_ablation.json", list, []):
        if r.get("variant") == "epochs_10_airbench" and r.get("kernels") in kernels_:
            out.append({"recipe": "recipe_ablation.py epochs_10_airbench (this recipe)", "seed": r["seed"],
                        "epochs": r["epochs"], "precision": r["precision"], "kernels": r["kernels"],
                        "val_acc": r["val_acc"], "train_seconds": round(r["train_seconds"], 1), "git": r.get("git")})
    return out


def reference_runs(kernels_: set) -> List[Dict[str, Any]]:
    """airbench94's recorded runs (as-stored images) on these kernels, with the images they trained on."""
    out = []
    for r in read_json(ROOT / "bench" / "results" / "reference_airbench.json", list, []):
        if r.get("reencoded_quality") is None and r.get("kernels") in kernels_:
            steps = math.ceil(45000 // 1024 * r["epochs"])  # reference_airbench.train: 43 steps an epoch
            out.append({"recipe": "bench/reference_airbench.py (airbench94)", "seed": r["seed"], "epochs": r["epochs"],
                        "precision": r["precision"], "kernels": r["kernels"], "val_acc": r["val_acc"],
                        "images": steps * 1024, "train_seconds": r["train_seconds"]})
    return out


def budgets(result: Dict[str, Any]) -> List[str]:
    """Per epoch budget, the seeds' final accuracies and whether every one of them reached the target."""
    by: Dict[int, List[float]] = {}
    for r in result["runs"] + result["earlier"]:
        by.setdefault(r["epochs"], []).append(r["val_acc"])
    out = []
    for e, accs in sorted(by.items()):
        ok = len(accs) >= 2 and min(accs) >= result["target"]
        out.append(f"{e} epochs: {len(accs)} seed(s), {', '.join(f'{100 * a:.2f}' for a in accs)}%: "
                   + ("every seed at >= 90%" if ok else "not every seed at 90%" if len(accs) >= 2 else "one seed"))
    return out


RUN = {"seed": "int", "epochs": "number", "precision": "str", "kernels": "str", "val_acc": "number",
       "train_seconds": "number"}  # what the table reads of every row of each list (rundir.check_rows)
ROWS = {"runs": {**RUN, "epoch_to_90": "int?", "images_to_90": "int?"}, "earlier": RUN,
        "reference": {**RUN, "images": "int"}}


def read_result(path: Path) -> Dict[str, Any]:
    """The results file, its target and every row of its lists checked: a damaged one is one line naming it."""
    result = read_json(path)
    target = result.get("target")
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0 < target <= 1:
        raise DataError(f"{path}: its target is {target!r}, not an accuracy in (0, 1] (a damaged or foreign results file?)")
    for key, fields in ROWS.items():
        check_rows(path, result.get(key), fields)
    if not result["runs"]:
        raise DataError(f"{path} holds no runs: record them first (python bench/gpu_recipe_cpu.py)")
    return result


def table(result: Dict[str, Any]) -> str:
    lines = ["| recipe | seed | numerics | epochs | val acc % | first epoch at >= 90% | training images to 90% "
             "| train time s (2 CPU cores) |", "|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in sorted(result["runs"], key=lambda r: (r["precision"], r["kernels"], r["epochs"], r["seed"])):
        first = "not reached" if r["epoch_to_90"] is None else str(r["epoch_to_90"])
        images = "—" if r["images_to_90"] is None else f"{r['images_to_90']:,}"
        lines.append(f"| `configs/cifar10_gpu.yaml` | {r['seed']} | {r['precision']} on {r['kernels']} | {r['epochs']} "
                     f"| **{100 * r['val_acc']:.2f}** | {first} | {images} | {r['train_seconds']:.0f} |")
    for r in result["earlier"]:
        lines.append(f"| the same at 10 epochs, as the recipe ablation's `epochs_10_airbench` | {r['seed']} | {r['precision']} on "
                     f"{r['kernels']} | {r['epochs']} | {100 * r['val_acc']:.2f} | (final only) | — | {r['train_seconds']:.0f} |")
    for r in result["reference"]:
        reached = r["val_acc"] >= TARGET
        first, images = (f"its last ({r['epochs']:g})", f"{r['images']:,}") if reached else ("not reached", "—")
        lines.append(f"| airbench94 (`bench/reference_airbench.py`) | {r['seed']} | {r['precision']} on {r['kernels']} | "
                     f"{r['epochs']:g} | {100 * r['val_acc']:.2f} | {first} | {images} | {r['train_seconds']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=describe(__doc__))
    ap.add_argument("run_dirs", nargs="*", type=Path)
    ap.add_argument("--results", type=Path, default=RESULTS, help=f"default: {RESULTS.relative_to(ROOT)}")
    ap.add_argument("--table", action="store_true", help="print the results file as a markdown table and exit")
    a = ap.parse_args()
    if a.table:
        if not a.results.is_file():
            sys.exit(f"error: {a.results} not found: record the runs first (python bench/gpu_recipe_cpu.py)")
        result = read_result(a.results)
        print(table(result) + "\n\n" + "\n".join(f"- {line}" for line in budgets(result)))
        return
    dirs = a.run_dirs or sorted(d for d in (ROOT / "runs" / "gpu_recipe_cpu").glob("*") if (d / "run_info.json").is_file())
    if not dirs:
        sys.exit("error: no run folders given and none under runs/gpu_recipe_cpu/")
    runs = [recorded_run(d) for d in dirs]
    fams = {r["kernels"] for r in runs}
    result = {"target": TARGET, "runs": runs, "earlier": earlier_runs(fams), "reference": reference_runs(fams)}
    write_atomic(a.results, json.dumps(result, indent=1) + "\n")
    for r in runs:
        print(f"{r['epochs']} epochs, seed {r['seed']}: {100 * r['val_acc']:.2f}%, 90% first at epoch {r['epoch_to_90']}")
    print("\n".join(budgets(result)))
    print(f"wrote {a.results}")


if __name__ == "__main__":
    from visattn.errors import run_main

    run_main(main, "gpu_recipe_cpu.py")
