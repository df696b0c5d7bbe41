"""visattn's GPU recipe against airbench94 on one device, in one process: the training time to 90% validation.

    python -m bench.gpu_race                                   # 3 runs each, alternating; bench/results/gpu_race.json
    python -m bench.gpu_race --runs 1 --subset 512 --batch-size 128 --epochs 1 --airbench-epochs 1 --out r.json
                                                               # a dry run (on a CPU: add --set compile=false)

The reference is ``bench/reference_airbench.py`` (airbench94 written out independently, eager, 9.9 epochs), the
contender ``configs/cifar10_gpu.yaml`` trained by visattn's own trainer (``trainer.build`` + ``trainer.fit``).
Both train on the same 45,000 images and are scored on the same 5,000 held out (the split of the configs' shared
data section), in the same precision, seeds 0, 1, 2, in the order A V, V A, A V. Every epoch is evaluated off the
clock; a run's time to the target is its training time (steps only) up to the end of the first epoch whose
validation accuracy reaches it. visattn's ``torch.compile`` is not on that clock: before each run the training
graphs (the whitening bias trainable, then frozen) are compiled on a throwaway batch with the weights restored
afterwards, and that time is reported as ``compile_seconds``; ``graphs_compiled_in_training`` says whether
training compiled again (it should be 0). The median time to the target of each, and their ratio visattn /
airbench, are printed and written with the device name, torch version and date; the file is rewritten after
every run (``complete`` false until the last), so a race stopped at a time limit leaves what it finished.
``bench/gpu_check.sh`` runs it first of the GPU check's rows.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch

import bench.reference_airbench as ref
from bench.common import ROOT, command, kernels, parser
from bench.time_to_accuracy import time_to
from visattn import evaluate, options, trainer
from visattn.errors import ConfigError
from visattn.options import check_at_least
from visattn.step import training_loss

CONFIG = ROOT / "configs" / "cifar10_gpu.yaml"
RESULTS = ROOT / "bench" / "results" / "gpu_race.json"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _graphs() -> int:
    """Graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _summary(curve: List[Dict[str, Any]], target: float) -> Dict[str, Any]:
    """Time and epoch to ``target`` from per-epoch rows ({epoch, epoch_seconds, val_acc})."""
    hit = time_to(curve, target)
    return {"seconds_to_target": None if hit is None else round(hit["train_seconds"], 3),
            "epoch_to_target": None if hit is None else hit["epoch"],
            "train_seconds": round(sum(r["epoch_seconds"] for r in curve), 3),
            "curve": [[r["epoch"], round(r["epoch_seconds"], 3), round(r["val_acc"], 4)] for r in curve]}


def airbench_run(seed: int, epochs: float, precision: str, data: tuple, target: float) -> Dict[str, Any]:
    """One airbench94 run (``reference_airbench.train``) with every epoch scored off its clock."""
    xva, yva = data[2], data[3]
    curve: List[Dict[str, Any]] = []

    def on_epoch(done: float, net: torch.nn.Module, train_s: float) -> None:
        before = sum(r["epoch_seconds"] for r in curve)
        curve.append({"epoch": done, "epoch_seconds": train_s - before,
                      "val_acc": ref.evaluate(net, xva, yva, precision == "bf16")})

    r = ref.train(seed, epochs, precision, log=lambda *_: None, device=xva.device, data=data, on_epoch=on_epoch)
    return {"recipe": "airbench94", "seed": seed, "epochs": epochs, "final_val_acc": round(r["val_acc"], 4),
            "compile_seconds": 0.0, **_summary(curve, target)}


def warm_compile(run: Any) -> float:
    """Compile ``run.model``'s training graphs on a throwaway batch of the training batches' shape, layout and
    autocast (one graph while the whitening bias trains, one after it is frozen), then put the weights and
    BatchNorm statistics back: ``trainer.fit``'s ``torch.compile`` of the same module then finds them cached.
    Returns the seconds it took."""
    model, device, cfg = run.model, run.device, run.cfg
    state = {k: v.clone() for k, v in model.state_dict().items()}
    compiled = torch.compile(model)
    g = torch.Generator().manual_seed(0)  # not the global RNG: the run's draws stay as they were
    size = cfg.data.image_size
    x = torch.randn(run.train_loader.batch_size, 3, size, size, generator=g).to(device)
    x = x.contiguous(memory_format=torch.channels_last) if cfg.channels_last else x
    y = torch.zeros(len(x), dtype=torch.long, device=device)
    model.train()
    t0 = time.perf_counter()
    for epoch in sorted({0, cfg.train.epochs - 1}):
        if hasattr(model, "set_epoch"):
            model.set_epoch(epoch)
        with evaluate.autocast(device, run.policy.precision):
            logits = compiled(x)
        training_loss(logits, x, y, run.policy).backward()
    _sync(device)
    seconds = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    model.load_state_dict(state)
    return seconds


def visattn_run(seed: int, overrides: List[str], workdir: Path, target: float) -> Dict[str, Any]:
    """One run of the GPU recipe through ``trainer.build`` and ``trainer.fit``, every epoch evaluated."""
    from visattn.config import load_config

    torch._dynamo.reset()  # each run compiles its own model (no recompile limit reached over the runs)
    run_dir = workdir / f"visattn_seed{seed}_{time.monotonic_ns()}"
    cfg = load_config(CONFIG, [*overrides, f"seed={seed}", f"run_dir={run_dir}", "eval.every=1", "log.progress=false",
                               "log.tensorboard=false", "log.maps_every=0"])
    run = trainer.build(cfg, log=lambda *a, **k: None)
    compile_s = warm_compile(run) if cfg.compile else 0.0
    graphs = _graphs()
    trainer.fit(run)
    return {"recipe": "visattn", "seed": seed, "epochs": cfg.train.epochs,
            "final_val_acc": round(run.history[-1]["val_acc"], 4), "compile_seconds": round(compile_s, 3),
            "graphs_compiled_in_training": _graphs() - graphs, **_summary(run.history, target)}


def _median(times: List[Optional[float]]) -> Optional[float]:
    """Median time to the target over runs, a run that never reached it counting as infinitely slow (None: no
    run yet, or the median never reached it)."""
    if not times:
        return None
    m = statistics.median([float("inf") if t is None else t for t in times])
    return None if m == float("inf") else m


def race(args: argparse.Namespace, save: Callable[[Dict[str, Any]], None] = lambda result: None) -> Dict[str, Any]:
    """The race; ``save(result)`` is called after every run with the result so far (``complete`` false until the
    last), so a race stopped at a time limit leaves the runs it finished."""
    from visattn.config import load_config

    device = options.resolve_device(args.device)
    precision = args.precision
    if precision == "auto":
        precision = "bf16" if evaluate.resolve_precision("auto", device) == "bf16" else "fp32"
    over = [f"device={device}", f"precision={precision}", *args.set]
    if args.subset is not None:
        over.append(f"data.subset={args.subset}")
    if args.data_root:
        over.append(f"data.root={args.data_root}")
    if args.epochs is not None:  # a shorter run keeps the warmup's share of the steps (2.3 of 11 epochs: 21%)
        planned = load_config(CONFIG, list(args.set))
        over.append(f"train.epochs={args.epochs}")
        if planned.sched.warmup_epochs > args.epochs:
            over.append(f"sched.warmup_epochs={planned.sched.warmup_epochs * args.epochs / planned.train.epochs:.4g}")
    if args.batch_size:  # both recipes' (a dry run's small batches); the reference's lr and decay are per 1024 images
        over.append(f"train.batch_size={args.batch_size}")
        ref.HYP["batch_size"] = args.batch_size
    ours = load_config(CONFIG, over)
    theirs = load_config(ROOT / "configs" / "cifar10_cpu.yaml", [o for o in over if o.startswith("data.")])
    if ours.data != theirs.data:
        raise ConfigError("configs/cifar10_gpu.yaml and configs/cifar10_cpu.yaml (the reference's data) differ in "
                          "their data sections; the race needs the same images and split")
    data = ref.load_data([o for o in over if o.startswith("data.")])
    data = (*(t.to(device) for t in data[:4]), data[4])
    steps = len(data[0]) // ours.train.batch_size * ours.train.epochs
    if 0 < steps < ours.train.lookahead_every:  # a dry run shorter than one lookahead interval: one average, at its end
        over.append(f"train.lookahead_every={steps}")
    name = kernels(str(device))
    print(f"{name}, torch {torch.__version__}, {precision}: airbench94 ({args.airbench_epochs:g} epochs) against "
          f"{CONFIG.relative_to(ROOT)} ({ours.train.epochs} epochs), {args.runs} runs each, target "
          f"{100 * args.target:g}%, on the {data[4]} ({len(data[0])} training images)", flush=True)
    ref.train(0, min(args.airbench_epochs, 0.1), precision, log=lambda *_: None, device=device, data=data)  # warm-up
    runs: List[Dict[str, Any]] = []
    head = {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda, "precision": precision,
            "target": args.target, "eval_split": data[4], "train_images": len(data[0]), "overrides": over}
    with tempfile.TemporaryDirectory(prefix="gpu_race_") as tmp:
        for i in range(args.runs):
            order = ("airbench94", "visattn") if i % 2 == 0 else ("visattn", "airbench94")
            for recipe in order:
                if recipe == "airbench94":
                    r = airbench_run(i, args.airbench_epochs, precision, data, args.target)
                else:
                    r = visattn_run(i, over, Path(tmp), args.target)
                runs.append(r)
                t = r["seconds_to_target"]
                print(f"{recipe} seed {i}: {100 * r['final_val_acc']:.2f}% after {r['train_seconds']:.2f} s of training; "
                      f"{100 * args.target:g}% " + ("not reached" if t is None else f"at epoch {r['epoch_to_target']:g}, "
                                                    f"{t:.2f} s") + f"; compile {r['compile_seconds']:.1f} s", flush=True)
                save(result(head, runs, complete=len(runs) == 2 * args.runs))
    out = result(head, runs, complete=True)
    said = {k: "not reached" if v is None else f"{v:.2f} s" for k, v in out["median_seconds_to_target"].items()}
    ratio = out["ratio_visattn_over_airbench94"]
    print(f"median time to {100 * args.target:g}%: visattn {said['visattn']}, airbench94 {said['airbench94']}; "
          f"visattn / airbench94 = {'n/a' if ratio is None else f'{ratio:.2f}'}")
    return out


def result(head: Dict[str, Any], runs: List[Dict[str, Any]], complete: bool) -> Dict[str, Any]:
    """The race's JSON from the runs so far: the median time to the target of each recipe and their ratio."""
    from visattn.results import git_revision

    med = {k: _median([r["seconds_to_target"] for r in runs if r["recipe"] == k]) for k in ("visattn", "airbench94")}
    ratio = med["visattn"] / med["airbench94"] if med["visattn"] is not None and med["airbench94"] else None
    return {**head, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git": git_revision(), "config": str(CONFIG.relative_to(ROOT)),
            "command": command(), "complete": complete,
            "median_seconds_to_target": med, "ratio_visattn_over_airbench94": ratio, "runs": runs}


def main() -> None:
    from visattn.results import write_atomic

    ap = parser(__doc__, precision="auto", precisions=("auto", "bf16", "fp32"), device="auto", out=RESULTS,
                help={"out": f"default: {RESULTS.relative_to(ROOT)}"})
    ap.add_argument("--runs", type=int, default=3, help="runs of each recipe (seeds 0..runs-1)")
    ap.add_argument("--target", type=float, default=0.90)
    ap.add_argument("--epochs", type=int, default=None, help="visattn's epochs (default: the config's)")
    ap.add_argument("--airbench-epochs", type=float, default=9.9)
    ap.add_argument("--subset", type=int, default=None, help="train on this many images only (a dry run)")
    ap.add_argument("--batch-size", type=int, default=None, help="both recipes' batch size (default: their own, 1024)")
    ap.add_argument("--data-root", default=None)
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides for visattn's run "
                    "(data.* ones for the reference's images too)")
    a = ap.parse_args()
    for flag, low in (("--runs", 1), ("--epochs", 1), ("--batch-size", 1), ("--subset", 10)):  # (data.subset's least)
        check_at_least(flag, getattr(a, flag[2:].replace("-", "_")), low)
    check_at_least("--airbench-epochs", a.airbench_epochs, 0, strict=True)
    if not 0 < a.target <= 1:
        raise ConfigError(f"--target is an accuracy in (0, 1], got {a.target:g}")
    if not a.out.parent.is_dir():
        raise ConfigError(f"--out: folder {a.out.parent} does not exist")
    result = race(a, save=lambda r: write_atomic(a.out, json.dumps(r, indent=1) + "\n"))
    write_atomic(a.out, json.dumps(result, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    from visattn.errors import run_main

    run_main(main, "gpu_race.py")
