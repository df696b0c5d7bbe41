"""Where a block's time goes in bf16, op by op, and the least time its memory traffic allows.

    python -m bench.bf16_profile --threads 2 --out bench/results/bf16_profile.json     # every feature-map block
    python -m bench.bf16_profile --only cbam coord --top 12                           # two blocks, 12 ops each

For every feature-map block, in one process, on the three feature maps the CPU recipe's network feeds its blocks
(``configs/attention/resnet_fast_<block>.yaml``: 64 x 15 x 15, 256 x 7 x 7 and 256 x 3 x 3 at the recipe's batch
of 512, channels-last, recorded from the network itself with their dtype: bf16 under bf16 autocast, as the
convolution and BN before a block write them), under the recipe's autocast (``--precision``, default bf16):

1. **the op table**: ``torch.profiler`` over the block's forward and backward (train mode, an upstream gradient
   of the map's shape and dtype), each aten op's share of the block's self CPU time, largest first (``--top``);
   what a cast (``aten::_to_copy`` / ``copy_``) or a layout round trip costs shows here.
2. **the memory-traffic ceiling**: the least bytes the block must move per step, ``passes x`` the maps' bytes
   (a gate reads the map to pool it and reads it again to write its product: 3 passes forward; backward reads
   the upstream gradient and the map for the gate's gradient, then both again to write the input's gradient:
   5 passes; :data:`PASSES`), at the bandwidth this machine reaches copying the same maps (measured in the same
   process: a copy reads and writes each byte once). ``ceiling = t_none / (t_none + bytes / bandwidth)``, with
   ``t_none`` the recipe's training step without blocks, measured here too: the whole-step ratio against
   ``none`` the block would reach if it cost only its compulsory traffic. ``bench/blocks.py`` measures the
   step ratio itself; a block stands at ``ratio / ceiling`` of its ceiling. Blocks whose cost is arithmetic
   (self-attention: ``nonlocal``, ``mhsa2d``) have a FLOP ceiling there instead, and no entry here.

``--out`` writes the tables, the bandwidth, ``t_none`` and each ceiling as JSON with the machine and command.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Dict, List, Optional, Sequence

import torch
from torch.profiler import ProfilerActivity, profile

import visattn
from bench.common import ROOT, command, interleaved, parser, provenance
from visattn import evaluate
from visattn.errors import run_main

# least passes over the full feature map per training step (forward + backward), by block
GATE = 3 + 5
PASSES = {"se": GATE, "eca": GATE, "gc": GATE, "spatial": GATE, "coord": GATE,
          # CBAM: the spatial gate pools the channel-gated map, which is formed on the fly while pooling; the
          # backward needs the channel gate's gradient too: one more read of the gradient and the map
          "cbam": GATE + 2}
RECIPE = ROOT / "configs" / "attention" / "resnet_fast_none.yaml"


def recipe(batch: int, precision: str):
    """The recipe's network without blocks (``bench.speed.build``) and the ``(shape, dtype)`` of each distinct map
    its attention slots receive under ``precision``'s autocast (``bench.blocks.block_feeds``)."""
    from bench.blocks import block_feeds
    from bench.speed import build

    setup = build(str(RECIPE), batch, 1, precision)
    return setup, list(dict.fromkeys(block_feeds(setup.model, setup.batches[0][0], precision).values()))


def maps(feeds) -> List[torch.Tensor]:
    """A random map of each ``(shape, dtype)``, channels-last, as the network hands it to its blocks."""
    torch.manual_seed(0)
    return [torch.randn(shape).to(dtype).contiguous(memory_format=torch.channels_last) for shape, dtype in feeds]


def fwd_bwd(block_name: str, xs: Sequence[torch.Tensor], precision: str):
    """Forward + backward of ``block_name`` on each map (blocks built for the map's channels, ``init="identity"``
    as the recipe's configs build them)."""
    blocks = [visattn.create_attention(block_name, x.shape[1], init="identity").to(memory_format=torch.channels_last)
              .train() for x in xs]
    # the maps in the dtype the network's convolutions hand the blocks under autocast (bf16), as leaves
    leaves = [x.detach().clone().requires_grad_() for x in xs]
    grads = [torch.randn_like(x) for x in xs]

    def run() -> None:
        for b, x, g in zip(blocks, leaves, grads):
            with evaluate.autocast(x.device, precision):
                y = b(x)
            y.backward(g.to(y.dtype))
            x.grad = None
            b.zero_grad(set_to_none=True)
    return run


def op_table(run, top: int) -> List[Dict[str, object]]:
    run()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    rows = sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]
    return [{"op": e.key, "share": round(e.self_cpu_time_total / total, 4), "calls": e.count,
             "ms": round(e.self_cpu_time_total / 1e3, 3)} for e in rows]


def bandwidth(xs: Sequence[torch.Tensor], repeats: int) -> float:
    """Bytes per second this machine moves copying the maps (each byte read once and written once)."""
    outs = [torch.empty_like(x) for x in xs]
    nbytes = sum(2 * x.numel() * x.element_size() for x in xs)

    def copy() -> None:
        for o, x in zip(outs, xs):
            o.copy_(x)
    copy()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        copy()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times)


def none_step_seconds(setup, precision: str, repeats: int) -> float:
    from bench.speed import make_step

    opt = torch.optim.SGD(setup.model.parameters(), lr=1e-3, momentum=0.9, nesterov=True)
    step = make_step(setup.model, opt, precision)
    x, y = setup.batches[0]
    timed = interleaved({"none": lambda: step(x, y)}, repeats)
    return statistics.median(timed.seconds["none"])


def profile_blocks(args: argparse.Namespace) -> dict:
    precision = evaluate.resolve_precision(args.precision, torch.device("cpu"))
    setup, feeds = recipe(args.batch, precision)
    xs = maps(feeds)
    bw = bandwidth(xs, args.repeats)
    t_none = none_step_seconds(setup, precision, args.repeats)
    map_bytes = sum(x.numel() * x.element_size() for x in xs)
    out: Dict[str, dict] = {}
    for name in args.only:
        run = fwd_bwd(name, xs, precision)
        timed = interleaved({name: run}, args.repeats)
        row = {"alone_ms": round(1e3 * statistics.median(timed.seconds[name]), 2), "ops": op_table(run, args.top)}
        if name in PASSES:
            least = PASSES[name] * map_bytes / bw
            row.update(passes=PASSES[name], least_ms=round(1e3 * least, 2), ceiling=round(t_none / (t_none + least), 4))
        out[name] = row
        print(f"{name:10s} alone {row['alone_ms']:8.2f} ms" + (f"  least {row['least_ms']:6.2f} ms  ceiling "
              f"{row['ceiling']:.3f}" if "ceiling" in row else "  (arithmetic: FLOP ceiling in bench/blocks.py)"))
        for op in row["ops"]:
            print(f"    {op['share']:6.1%}  {op['op']}  ({op['calls']} calls)")
    return {**provenance(precision), "command": command(args.argv, __file__),
            "threads": torch.get_num_threads(), "batch_size": args.batch, "shapes": [list(s) for s, _ in feeds],
            "map_dtype": str(xs[0].dtype).replace("torch.", ""),
            "bandwidth_gb_s": round(bw / 1e9, 2), "none_step_ms": round(1e3 * t_none, 2), "blocks": out}


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = parser(__doc__, prog="python -m bench.bf16_profile", threads=True, precision="bf16", repeats=5, out=True)
    feature = [n for n in visattn.list_attention("feature") if n != "none"]
    ap.add_argument("--only", nargs="+", default=feature, choices=feature, metavar="BLOCK", help="blocks to profile")
    ap.add_argument("--batch", type=int, default=512, help="images per map (the recipe's batch)")
    ap.add_argument("--top", type=int, default=8, help="ops per block in the table")
    args = ap.parse_args(argv)
    args.argv = argv
    if args.batch < 1 or args.top < 1 or args.repeats < 1:
        ap.error("--batch, --top and --repeats must be at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    result = profile_blocks(args)
    if args.out:
        from visattn.results import write_atomic

        write_atomic(args.out, json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    run_main(main, "bf16_profile.py")
