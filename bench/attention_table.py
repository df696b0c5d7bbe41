"""Reruns the README's attention comparison: each config x seed under one fixed CPU budget, on the real images.

    python bench/attention_table.py --plot assets/accuracy_vs_time.png   # all configs below, seeds 0 1 2
    python bench/attention_table.py --seeds 0 --configs configs/attention/resnet_fast_se.yaml

The fixed CPU budget: every run trains for ``--epochs`` (2) epochs on a stratified ``--subset`` (10,000) of the
45,000 training images left after holding out the stratified 5,000-image validation split
(``data.split_seed=0``: the same images for every seed and config) and is scored once, at the end, on that
whole validation split with flip test-time augmentation. The table gives each run's training wall time
beside its accuracy, so the cost of each attention type shows. Results go to ``bench/results/attention_table.json`` (runs already
there are skipped, so an interrupted sweep continues); ``--plot`` draws validation accuracy against wall time.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_CONFIGS = [f"configs/attention/resnet_fast_{a}.yaml" for a in ("none", "se", "eca", "cbam", "coord", "nonlocal")] + [
    "configs/vit_tiny.yaml", "configs/vit_tiny_lsa_spt.yaml", "configs/cct_2.yaml"]


def run_one(config: str, seed: int, epochs: int, subset: int, run_root: Path, data_root: str | None) -> dict:
    from visattn.config import load_config
    from visattn.trainer import run

    name = Path(config).stem
    run_dir = run_root / f"{name}-s{seed}"
    overrides = [f"seed={seed}", f"run_dir={run_dir}", f"train.epochs={epochs}", "log.progress=false",
                 "log.maps_every=0", "resume=null", f"data.subset={subset}", f"eval.every={epochs}", "eval.tta=flip"]
    if data_root:
        overrides.append(f"data.root={data_root}")
    if (run_dir / "last.pt").exists():
        import shutil

        shutil.rmtree(run_dir)
    cfg = load_config(ROOT / config, overrides)
    t0 = time.perf_counter()
    summary = run(cfg, log=lambda *a: None)
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    info = json.loads((run_dir / "run_info.json").read_text())
    return {"config": config, "name": name, "seed": seed, "epochs": epochs, "subset": subset, "best_val_acc": summary["best_val_acc"],
            "final_val_acc": rows[-1]["val_acc"], "train_seconds": sum(r["epoch_seconds"] for r in rows),
            "wall_seconds": time.perf_counter() - t0, "images_per_s": statistics.mean(r["images_per_s"] for r in rows),
            "parameters": info["parameters"], "eval_split": summary["eval_split"],
            "curve": [(r["wall_seconds"], r.get("val_acc")) for r in rows]}


def table(results: list[dict]) -> str:
    by: dict[str, list[dict]] = {}
    for r in results:
        by.setdefault(r["name"], []).append(r)
    lines = ["| config | params | val acc % (mean ± std) | seeds | train time s (median) | images/s (median) |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, rs in by.items():
        accs = [100 * r["final_val_acc"] for r in rs]
        sd = statistics.stdev(accs) if len(accs) > 1 else 0.0
        lines.append(f"| `{name}` | {rs[0]['parameters'] / 1e6:.2f}M | {statistics.mean(accs):.2f} ± {sd:.2f} | {len(rs)} "
                     f"| {statistics.median(r['train_seconds'] for r in rs):.0f} | {statistics.median(r['images_per_s'] for r in rs):.0f} |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    names = list(dict.fromkeys(r["name"] for r in results))
    cmap = plt.get_cmap("tab10")
    for i, name in enumerate(names):
        rs = [x for x in results if x["name"] == name]
        ts = [r["train_seconds"] for r in rs]
        accs = [100 * r["final_val_acc"] for r in rs]
        ax.scatter(ts, accs, color=cmap(i % 10), s=14, alpha=0.6)
        sd = statistics.stdev(accs) if len(accs) > 1 else 0.0
        ax.errorbar([statistics.mean(ts)], [statistics.mean(accs)], yerr=[sd], fmt="o", ms=7, capsize=3,
                    color=cmap(i % 10), label=name)
    ax.set_xlabel("training wall time (s) on 2 CPU cores")
    ax.set_ylabel("validation accuracy (%)")
    ax.set_title(f"CIFAR-10 held-out validation (5,000 images): {results[0]['epochs']} epochs on "
                 f"{results[0]['subset']:,} training images;\nsmall dots: seeds, large: mean \u00b1 std", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="*", default=DEFAULT_CONFIGS)
    ap.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2])
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--subset", type=int, default=10000)
    ap.add_argument("--data-root", default=None)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "attention_table.json"))
    ap.add_argument("--run-root", default=str(ROOT / "runs" / "table"))
    ap.add_argument("--plot", default=None, help="write the accuracy-vs-wall-time plot here (PNG)")
    ap.add_argument("--plot-only", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else []
    if not args.plot_only:
        for seed in args.seeds:  # seed-major: a partial sweep still covers every config
            for config in args.configs:
                if any(r["config"] == config and r["seed"] == seed and r["epochs"] == args.epochs
                       and r.get("subset") == args.subset for r in results):
                    continue
                r = run_one(config, seed, args.epochs, args.subset, Path(args.run_root), args.data_root)
                results.append(r)
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(results, indent=1))
                print(f"{r['name']} seed {seed}: val {100 * r['final_val_acc']:.2f}% in {r['train_seconds']:.0f}s", flush=True)
    print(table([r for r in results if r["epochs"] == args.epochs]))
    if args.plot:
        plot([r for r in results if r["epochs"] == args.epochs], Path(args.plot))


if __name__ == "__main__":
    main()
