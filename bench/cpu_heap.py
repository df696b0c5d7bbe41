"""What ``cpu_heap: keep`` gives a CPU training step: glibc keeping freed memory for reuse against its starting
settings, in one process.

    python -m bench.cpu_heap --threads 2 --out bench/results/cpu_heap.json            # none, non-local, MHSA-2D, CBAM
    python -m bench.cpu_heap --blocks none se --repeats 1 --steps 1 --batch 16        # a dry run

For ``none`` and each block asked for, the network of ``configs/attention/resnet_fast_<block>.yaml`` (the CPU
recipe's, at its precision: bf16 where the CPU runs it natively) runs whole training steps (``bench.speed``'s
step: autocast forward, loss, backward, SGD step) on batches already in memory, under each setting in turn:
``keep`` (:func:`visattn.cpu_heap.keep_freed_memory`, what ``train.py`` sets on a CPU) and ``system``
(:func:`visattn.cpu_heap.system_defaults`: glibc's starting values, the heap's free top given back). Before each
timed call the setting is made and one untimed call settles the heap under it; rounds interleave every
(network, setting) pair, the order reversed every other round, and each pair's median is taken. ``speedup`` is
``system``'s median seconds over ``keep``'s (above 1: ``keep`` is faster); ``ratio`` is a block's images/s over
``none``'s under the same setting. ``system`` here is glibc's start, whose ``mmap`` threshold stays at 128 KiB
(setting any value stops glibc raising it with use): a long process left alone may drift part way towards ``keep``.
glibc on Linux only (elsewhere the script says so and exits with status 2).
"""
from __future__ import annotations

import json
import platform
import resource
import statistics
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from bench.common import ROOT, parser, provenance
from bench.speed import build, make_step
from visattn import cpu_heap
from visattn.errors import ConfigError, run_main
from visattn.results import write_atomic

DEFAULT_BLOCKS = ["none", "nonlocal", "mhsa2d", "cbam"]
SETTINGS = {"system": cpu_heap.system_defaults, "keep": cpu_heap.keep_freed_memory}


def measure(blocks: Sequence[str], batch: int, steps: int, repeats: int, precision: str) -> Dict[str, object]:
    names = ["none"] + [b for b in blocks if b != "none"]
    setups = {b: build(str(ROOT / "configs" / "attention" / f"resnet_fast_{b}.yaml"), batch, steps, precision)
              for b in names}
    batches = setups["none"].batches
    step_fns = {}
    for b, s in setups.items():
        opt = torch.optim.SGD(s.model.parameters(), lr=1e-3, momentum=0.9, nesterov=True)
        step_fns[b] = make_step(s.model, opt, s.precision)

    order = [(b, setting) for b in names for setting in SETTINGS]
    seconds: Dict[tuple, List[float]] = {k: [] for k in order}
    for r in range(repeats + 1):  # round 0 warms every network up, untimed
        for b, setting in order if r % 2 == 0 else order[::-1]:
            SETTINGS[setting]()
            for x, y in batches:  # untimed: the heap settles under the setting
                step_fns[b](x, y)
            t0 = time.perf_counter()
            for x, y in batches:
                step_fns[b](x, y)
            if r:
                seconds[(b, setting)].append(time.perf_counter() - t0)
    cpu_heap.keep_freed_memory()
    med = {k: statistics.median(v) for k, v in seconds.items()}
    images = batch * len(batches)
    rows = []
    for b, setting in order:
        rows.append({"block": b, "setting": setting, "images_per_s": images / med[(b, setting)],
                     "ratio": med[("none", setting)] / med[(b, setting)],
                     "seconds": [round(t, 4) for t in seconds[(b, setting)]]})
    speedup = {b: med[(b, "system")] / med[(b, "keep")] for b in names}
    return {"rows": rows, "speedup": speedup, "precision": setups["none"].precision,
            "max_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = parser(__doc__, threads=True, precision="auto", batch=512, repeats=5, out=True)
    ap.add_argument("--blocks", nargs="+", default=DEFAULT_BLOCKS, help="networks to time (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=3, help="training steps per timed call (default: 3)")
    args = ap.parse_args(argv)
    if cpu_heap.keep_freed_memory() is False:
        raise ConfigError(f"cpu_heap: no glibc to set on this system ({platform.system()}, "
                          f"{platform.libc_ver()[0] or 'unknown C library'}): nothing to measure")
    if args.threads:
        torch.set_num_threads(args.threads)
    data = measure(args.blocks, args.batch, args.steps, args.repeats, args.precision)
    head = {**provenance(data["precision"]), "threads": torch.get_num_threads(), "batch_size": args.batch,
            "steps": args.steps, "repeats": args.repeats}
    print(f"{head['cpu']} ({head['kernels']}), {data['precision']}, {head['threads']} threads, batch {args.batch}, "
          f"{args.steps} steps per timing, median of {args.repeats}")
    for row in data["rows"]:
        print(f"  {row['block']:10s} {row['setting']:6s} {row['images_per_s']:7.1f} images/s  ratio to none "
              f"{row['ratio']:.3f}" + (f"  keep/system {data['speedup'][row['block']]:.3f}"
                                       if row["setting"] == "keep" else ""))
    if args.out:
        write_atomic(Path(args.out), json.dumps({**head, **data}, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    run_main(main, "cpu_heap.py")
