"""What ``cpu_heap: keep`` gives a CPU training step: glibc keeping freed memory for reuse against glibc left alone
(``cpu_heap: system``), each in processes of its own.

    python -m bench.cpu_heap --threads 2 --out bench/results/cpu_heap.json   # none and non-local; adds a run to the file
    python -m bench.cpu_heap --doc                                            # the file's runs into docs/training.md
    python -m bench.cpu_heap --blocks none --pairs 1 --repeats 1 --steps 1 --batch 8   # a dry run

The allocator's settings belong to the whole process and its heap keeps what earlier allocations left (memory freed
under ``keep`` stays in glibc's bins after the setting is undone), so the two settings cannot be compared in one
process: each ``--pairs`` pair starts one process per setting (which goes first alternates from pair to pair), and
each process times whole training steps (``bench.speed``'s step: autocast forward, loss, backward, SGD step) of
``none`` and each block of ``--blocks`` (the network of ``configs/attention/resnet_fast_<block>.yaml``, the CPU
recipe's, at its precision: bf16 where the CPU runs it natively) on batches already in memory, the networks
interleaved over ``--repeats`` rounds after an untimed one, each network's median kept, with the minor page faults
the timed steps took (``getrusage``). ``speedup``: per network, the median over the pairs of ``system``'s median
seconds over ``keep``'s (above 1: ``keep`` is faster); ``ratio``: a block's images/s over ``none``'s in the same
process. glibc on Linux only (elsewhere the script says so and exits with status 2).
"""
from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from bench.common import ROOT, parser, provenance, splice
from visattn import cpu_heap
from visattn.errors import ConfigError, run_main
from visattn.options import check_at_least
from visattn.results import write_atomic

DEFAULT_BLOCKS = ["none", "nonlocal"]
SETTINGS = ("system", "keep")
DOC = ROOT / "docs" / "training.md"
MARKERS = ("<!-- cpu heap: python -m bench.cpu_heap --doc -->", "<!-- end of cpu heap -->")
RESULTS = ROOT / "bench" / "results" / "cpu_heap.json"


def child(setting: str, blocks: Sequence[str], batch: int, steps: int, repeats: int, precision: str,
          threads: int) -> dict:
    """One process's measurement under ``setting`` (made before anything is built)."""
    applied = cpu_heap.apply(setting)
    import torch

    from bench.speed import build, make_step

    if threads:
        torch.set_num_threads(threads)
    setups = {b: build(str(ROOT / "configs" / "attention" / f"resnet_fast_{b}.yaml"), batch, steps, precision)
              for b in blocks}
    batches = setups[blocks[0]].batches
    step_fns = {}
    for b, s in setups.items():
        opt = torch.optim.SGD(s.model.parameters(), lr=1e-3, momentum=0.9, nesterov=True)
        step_fns[b] = make_step(s.model, opt, s.precision)
    seconds: Dict[str, List[float]] = {b: [] for b in blocks}
    faults: Dict[str, List[int]] = {b: [] for b in blocks}
    for r in range(repeats + 1):  # round 0 warms every network up, untimed
        for b in blocks if r % 2 == 0 else blocks[::-1]:
            f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
            for x, y in batches:
                step_fns[b](x, y)
            if r:
                seconds[b].append(time.perf_counter() - t0)
                faults[b].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    return {"setting": setting, "applied": applied, "precision": setups[blocks[0]].precision,
            "threads": torch.get_num_threads(), "seconds": seconds,
            "median_s": {b: statistics.median(v) for b, v in seconds.items()},
            "page_faults_per_step": {b: statistics.median(v) / steps for b, v in faults.items()},
            "max_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}


def spawn(setting: str, args) -> dict:
    cmd = [sys.executable, "-m", "bench.cpu_heap", "--child", setting, "--blocks", *args.blocks, "--batch",
           str(args.batch), "--steps", str(args.steps), "--repeats", str(args.repeats), "--precision", args.precision,
           *(["--threads", str(args.threads)] if args.threads else [])]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if done.returncode or not done.stdout.strip():
        raise ConfigError(f"the {setting} process failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(args) -> dict:
    procs = []
    for p in range(args.pairs):
        for setting in SETTINGS if p % 2 == 0 else SETTINGS[::-1]:
            procs.append(spawn(setting, args))
            if setting == "keep" and not procs[-1]["applied"]:  # else glibc alone against glibc alone
                raise ConfigError("cpu_heap: glibc refused the keep setting (mallopt) in its process: nothing to compare")
            print(f"  pair {p + 1} {setting:6s} " + "  ".join(f"{b} {args.batch * args.steps / s:.1f} images/s"
                                                            for b, s in procs[-1]["median_s"].items()), flush=True)
    by = {s: [pr for pr in procs if pr["setting"] == s] for s in SETTINGS}
    speedup = {b: statistics.median(s["median_s"][b] / k["median_s"][b] for s, k in zip(by["system"], by["keep"]))
               for b in args.blocks}
    rows = [{"block": b, "setting": s, "images_per_s": args.batch * args.steps / statistics.median(
                 pr["median_s"][b] for pr in by[s]),
             "ratio": statistics.median(pr["median_s"][args.blocks[0]] / pr["median_s"][b] for pr in by[s]),
             "page_faults_per_step": statistics.median(pr["page_faults_per_step"][b] for pr in by[s])}
            for b in args.blocks for s in SETTINGS]
    return {"rows": rows, "speedup": speedup, "processes": procs, "precision": procs[0]["precision"],
            "threads": procs[0]["threads"]}


def summary(runs: List[dict]) -> str:
    """The runs as docs/training.md tells them: each network's ``keep`` over ``system`` in every run."""
    kinds = {(r["command"], r["cpu"], r["kernels"], r["precision"], r["threads"], r["batch_size"]) for r in runs}
    if len(kinds) > 1:
        raise ConfigError(f"{RESULTS}: its runs differ in command or machine ({len(kinds)} kinds); keep one kind")
    first = runs[0]
    names = list(dict.fromkeys(b for r in runs for b in r["speedup"]))
    per = "; ".join(f"`{b}` " + ", ".join(f"{r['speedup'][b]:.2f}" for r in runs if b in r["speedup"]) for b in names)
    faults = "; ".join(f"`{row['block']}` {row['page_faults_per_step'] / 1000:.0f}k under `{row['setting']}`"
                       for row in runs[-1]["rows"])
    dates = sorted({r["date"][:10] for r in runs})
    return (f"Training steps per second with `keep` over `system`, each setting in processes of its own "
            f"(`{first['command']}`; {len(runs)} run(s) of {first['pairs']} pairs of processes, {', '.join(dates)}, "
            f"{first['cpu']} ({first['kernels']}), {first['precision']}, {first['threads']} threads, batch "
            f"{first['batch_size']}, {first['steps']} steps per timing, median of {first['repeats']}): {per}. "
            f"Minor page faults per step in the last run: {faults}.")


def read_runs(path: Path, flag: str = "--out") -> List[dict]:
    """The runs already in ``path`` (none where it does not exist); a file that is not this script's is refused,
    not overwritten."""
    if not path.exists():
        return []
    try:
        runs = json.loads(path.read_text())["runs"]
        assert isinstance(runs, list) and all(isinstance(r, dict) and "speedup" in r for r in runs)
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        raise ConfigError(f"{flag} {path}: not a results file of bench.cpu_heap (no list of runs); "
                          "name a new file") from None
    return runs


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = parser(__doc__, threads=True, precision="auto", precisions=("auto", "fp32", "bf16", "fp16"), batch=512,
                repeats=5, out=True)
    ap.add_argument("--blocks", nargs="+", default=DEFAULT_BLOCKS,
                    help="networks to time; none is always among them, the ratios' baseline (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=3, help="training steps per timed call (default: 3)")
    ap.add_argument("--pairs", type=int, default=3, help="pairs of processes, one per setting (default: 3)")
    ap.add_argument("--doc", action="store_true", help=f"write {RESULTS.name}'s runs into docs/training.md and exit")
    ap.add_argument("--child", choices=SETTINGS, help=argparse.SUPPRESS)  # internal: the process of one setting
    args = ap.parse_args(argv)
    args.blocks = ["none"] + [b for b in dict.fromkeys(args.blocks) if b != "none"]  # none first: the ratios' base
    if args.doc:
        runs = read_runs(RESULTS, "--doc")
        if not runs:
            raise ConfigError(f"--doc: {RESULTS} holds no runs; measure first (--out {RESULTS})")
        print(f"{DOC}: {'updated' if splice(DOC, *MARKERS, summary(runs)) else 'already current'}")
        return
    check_at_least("--steps", args.steps, 1)
    check_at_least("--pairs", args.pairs, 1)
    check_at_least("--repeats", args.repeats, 1)
    if args.child:
        print(json.dumps(child(args.child, args.blocks, args.batch, args.steps, args.repeats, args.precision,
                               args.threads)))
        return
    if cpu_heap._glibc() is None:
        raise ConfigError(f"cpu_heap: no glibc to set on this system ({platform.system()}, "
                          f"{platform.libc_ver()[0] or 'unknown C library'}): nothing to measure")
    runs = read_runs(Path(args.out)) if args.out else []  # a file not its own refused before the measurement
    data = measure(args)
    head = {**provenance(data["precision"]), "threads": data["threads"], "batch_size": args.batch,
            "steps": args.steps, "repeats": args.repeats, "pairs": args.pairs}
    print(f"{head['cpu']} ({head['kernels']}), {data['precision']}, {head['threads']} threads, batch {args.batch}, "
          f"{args.steps} steps per timing, median of {args.repeats}, {args.pairs} pairs of processes")
    for row in data["rows"]:
        print(f"  {row['block']:10s} {row['setting']:6s} {row['images_per_s']:7.1f} images/s  ratio "
              f"{row['ratio']:.3f}  {row['page_faults_per_step'] / 1000:7.1f}k page faults a step"
              + (f"  keep/system {data['speedup'][row['block']]:.3f}" if row["setting"] == "keep" else ""))
    if args.out:  # each run is added to the file's runs: the gain moves with the machine's state between runs
        write_atomic(Path(args.out), json.dumps({"runs": runs + [{**head, **data}]}, indent=1) + "\n")
        print(f"added run {len(runs) + 1} to {args.out}")


if __name__ == "__main__":
    run_main(main, "cpu_heap.py")
