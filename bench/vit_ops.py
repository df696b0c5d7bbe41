"""Where one training step of a config's model spends its time, per op: a torch.profiler table.

    python bench/vit_ops.py --config configs/vit_tiny.yaml --threads 1 [--batch 256] [--compile] [--baseline]

One process: the config's model (as bench/throughput.py builds it), a training step as throughput.py times it
(autocast forward, label-smoothed cross-entropy, backward, SGD step), warmed up, then ``--steps`` steps under
``torch.profiler`` (CPU). Per op (``aten::...``, or an Inductor kernel ``cpp_fused_...`` with ``--compile``):
calls and self time per step, its share of the profiled ops' time, and its share of the step's FLOP
(``torch.utils.flop_counter``); then the same grouped into categories (matmul, attention, norm, activation,
casts and copies, other elementwise, optimizer, Inductor kernels). The unprofiled step time (median of
``--repeats`` steps) is printed too: the profiler adds some overhead per op.

``--baseline`` runs the model on the path as it was before the fast path (``TokenClassifier.set_fast_path``);
``--sdpa {fp32,native,matmul}`` picks the fast path's CPU attention kernel
(``visattn.attention.token.sdpa_cpu_mode``); ``--precision`` (``bf16``, ``fp32``) and ``--set``
(``model.num_heads=3``) override the config. The FLOP column counts linear layers and convolutions: the
counter has no formula for the CPU flash-attention kernel, and the FLOP are counted on the default kernel, so
every ``--sdpa`` mode shows the same count (the attention products are under 10% of ``vit_tiny``'s FLOP).
"""
from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import throughput  # noqa: E402  (bench/throughput.py: model building, step, FLOP count)

from visattn.errors import run_main  # noqa: E402
from visattn.options import describe  # noqa: E402

CATEGORIES: List[Tuple[str, Tuple[str, ...]]] = [
    ("matmul", ("aten::addmm", "aten::mm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::convolution",
                "aten::_convolution", "aten::mkldnn_convolution", "aten::convolution_backward", "aten::linear")),
    ("attention (SDPA)", ("aten::_scaled_dot_product_flash_attention_for_cpu",
                          "aten::_scaled_dot_product_flash_attention_for_cpu_backward", "aten::_softmax",
                          "aten::_softmax_backward_data")),
    ("norm", ("aten::native_layer_norm", "aten::native_layer_norm_backward")),
    ("activation", ("aten::gelu", "aten::gelu_backward", "aten::relu", "aten::threshold_backward")),
    ("casts and copies", ("aten::copy_", "aten::_to_copy", "aten::clone", "aten::contiguous", "aten::stack",
                          "aten::cat", "aten::_reshape_alias", "aten::empty_like", "aten::empty",
                          "aten::empty_strided", "aten::zeros", "aten::zero_", "aten::fill_")),
    ("optimizer", ("aten::_foreach_",)),
]


def category(name: str) -> str:
    if name.startswith("cpp_fused") or name.startswith("graph_") or "Inductor" in name:
        return "Inductor fused kernels"
    for cat, names in CATEGORIES:
        if any(name == n or (n.endswith("_") and name.startswith(n)) for n in names):
            return cat
    return "other elementwise / reductions" if name.startswith("aten::") else "other"


def flop_by_op(model, x, y, precision: str) -> Dict[str, int]:
    """FLOP of one training step per aten op (profiler spelling, ``aten::mm``)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as fc:
        with throughput.evaluate.autocast(x.device, precision):
            out = model(x)
        torch.nn.functional.cross_entropy(out.float(), y).backward()
    model.zero_grad(set_to_none=True)
    return {str(op).replace(".", "::", 1): n for op, n in fc.get_flop_counts().get("Global", {}).items()}


def profile(step, batches, steps: int) -> Dict[str, Tuple[int, float]]:
    """op -> (calls, self CPU seconds) summed over ``steps`` profiled steps."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    with prof(activities=[ProfilerActivity.CPU]) as p:
        for i in range(steps):
            step(*batches[i % len(batches)])
    out = {}
    for e in p.key_averages():
        if e.self_cpu_time_total > 0 and not e.key.startswith("ProfilerStep"):
            out[e.key] = (e.count, e.self_cpu_time_total / 1e6)
    return out


def print_tables(ops: Dict[str, Tuple[int, float]], flop: Dict[str, int], steps: int, top: int) -> None:
    total = sum(t for _, t in ops.values())
    all_flop = sum(flop.values()) or 1
    print("| op | calls/step | ms/step | share of op time | FLOP share |")
    print("|---|---:|---:|---:|---:|")
    for name, (n, t) in sorted(ops.items(), key=lambda kv: -kv[1][1])[:top]:
        fshare = flop.get(name, 0) / all_flop
        print(f"| `{name}` | {n / steps:g} | {1e3 * t / steps:.1f} | {t / total:.1%} | {fshare:.0%} |")
    cats: Dict[str, List[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for name, (_, t) in ops.items():
        cats[category(name)][0] += t
    for name, f in flop.items():
        cats[category(name)][1] += f
    print("\n| category | ms/step | share of op time | FLOP share |")
    print("|---|---:|---:|---:|")
    for cat, (t, f) in sorted(cats.items(), key=lambda kv: -kv[1][0]):
        print(f"| {cat} | {1e3 * t / steps:.1f} | {t / total:.1%} | {f / all_flop:.0%} |")
    print(f"| all profiled ops | {1e3 * total / steps:.1f} | 100% | 100% |")


def main() -> None:
    ap = argparse.ArgumentParser(description=describe(__doc__))
    ap.add_argument("--config", default=str(throughput.ROOT / "configs" / "vit_tiny.yaml"))
    ap.add_argument("--batch", type=int, default=0, help="batch size (default: the config's)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: PyTorch's)")
    ap.add_argument("--precision", default="", help="override the config's precision (bf16, fp32)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides (model.num_heads=3)")
    ap.add_argument("--steps", type=int, default=2, help="profiled steps")
    ap.add_argument("--repeats", type=int, default=3, help="unprofiled steps timed for the step time")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--compile", action="store_true", help="profile the torch.compile'd model")
    ap.add_argument("--baseline", action="store_true", help="the path as it was before the fast path")
    ap.add_argument("--sdpa", choices=throughput.SDPA_MODES, default=None,
                    help="CPU attention kernel precision under autocast (default: the library's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.compile:
        import torch._inductor.config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True  # name the generated kernels in the profile
    setup = throughput.build(args.config, args.batch, max(args.steps, 2), args.precision, args.set)
    model, batches, precision = setup.model, setup.batches, setup.precision
    if args.baseline:
        throughput.set_fast_path(model, False)
    flop = flop_by_op(model, *batches[0], precision)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, nesterov=True)
    step = throughput.make_step(torch.compile(model) if args.compile else model, opt, precision)
    with throughput.sdpa_mode(args.sdpa):
        for x, y in batches[:2]:  # warm-up (and compilation)
            step(x, y)
        times = [throughput.time_steps(step, batches[:1]) for _ in range(args.repeats)]
        ops = profile(step, batches, args.steps)
    bs = batches[0][0].shape[0]
    t = statistics.median(times)
    path = "baseline" if args.baseline else "fast"
    print(f"config {args.config} {' '.join(args.set)}: model {setup.name}, batch {bs}, precision {precision}, {path} path, "
          f"{'compiled' if args.compile else 'eager'}, sdpa {args.sdpa or 'default'}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"step (unprofiled, median of {args.repeats}): {1e3 * t:.0f} ms = {bs / t:.0f} images/s, "
          f"{sum(flop.values()) / 1e9:.1f} GFLOP = {sum(flop.values()) / t / 1e12:.3f} TFLOP/s\n")
    print_tables(ops, flop, args.steps, args.top)


if __name__ == "__main__":
    t0 = time.perf_counter()
    run_main(main, "vit_ops.py")
    print(f"\n({time.perf_counter() - t0:.0f} s in all)")
