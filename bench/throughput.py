"""Achieved training FLOP/s of a config's model against this machine's matmul ceiling, eager and compiled.

    python bench/throughput.py [--config configs/cifar10_cpu.yaml] [--steps 8] [--repeats 3]

In one process:
1. the ceiling: a large square matmul (``--matmul 4096``) in the config's precision (bf16 on a CPU with AMX),
   timed with its median over repeats: 2 * n^3 FLOP per call;
2. the FLOP of one training step of the config's model at its batch size, counted by
   ``torch.utils.flop_counter.FlopCounterMode`` over forward and backward (convolutions and matmuls);
3. training steps (autocast forward, loss, backward, SGD step) on batches already in memory, eager and then
   under ``torch.compile``; interleaved repeats, medians.
It prints images/s, achieved TFLOP/s, the fraction of the in-process matmul ceiling, and compiled / eager.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from visattn import create_model, engine  # noqa: E402
from visattn.config import load_config  # noqa: E402


def matmul_tflops(n: int, dtype: torch.dtype, repeats: int) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times) / 1e12


def step_flops(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, precision: str) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as fc:
        with engine.autocast(x.device, precision):
            out = model(x)
        F.cross_entropy(out.float(), y).backward()
    model.zero_grad(set_to_none=True)
    return fc.get_total_flops()


def make_step(model: torch.nn.Module, opt: torch.optim.Optimizer, precision: str):
    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        with engine.autocast(x.device, precision):
            out = model(x)
        loss = F.cross_entropy(out.float(), y, label_smoothing=0.2)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step


def time_steps(step, batches) -> float:
    t = time.perf_counter()
    for x, y in batches:
        step(x, y)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "cifar10_cpu.yaml"))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--matmul", type=int, default=4096)
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()
    cfg = load_config(args.config)
    device = torch.device("cpu")
    precision = engine.resolve_precision(cfg.precision, device)
    torch.manual_seed(0)
    model = create_model(cfg.model.name, num_classes=10, **cfg.model.options())
    if getattr(model, "needs_data_init", False):
        model.data_init(torch.randint(0, 255, (512, 3, 32, 32), dtype=torch.uint8), cfg.data.mean, cfg.data.std)
    model = model.to(memory_format=torch.channels_last) if cfg.channels_last else model
    bs = cfg.train.batch_size
    fmt = torch.channels_last if cfg.channels_last else torch.contiguous_format
    batches = [(torch.randn(bs, 3, 32, 32).contiguous(memory_format=fmt), torch.randint(0, 10, (bs,)))
               for _ in range(args.steps)]
    flop = step_flops(model, *batches[0], precision)
    dtype = engine.AMP_DTYPES[precision] or torch.float32
    ceiling = matmul_tflops(args.matmul, dtype, max(args.repeats, 3))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, nesterov=True)
    variants = {"eager": make_step(model, opt, precision)}
    if not args.no_compile:
        variants["compiled"] = make_step(torch.compile(model), opt, precision)
    for step in variants.values():  # warm-up (and compilation)
        time_steps(step, batches[:2])
    times = {k: [] for k in variants}
    for _ in range(args.repeats):
        for k, step in variants.items():
            times[k].append(time_steps(step, batches))
    print(f"config {args.config}: model {cfg.model.name}, batch {bs}, precision {precision}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"ceiling: {args.matmul}x{args.matmul} {dtype} matmul = {ceiling:.3f} TFLOP/s (median of {max(args.repeats, 3)})")
    print(f"one training step: {flop / 1e9:.1f} GFLOP = {flop / bs / 1e9:.3f} GFLOP per image (forward + backward)\n")
    print("| step | images/s | TFLOP/s | of matmul ceiling | ratio vs eager |")
    print("|---|---:|---:|---:|---:|")
    eager = statistics.median(times["eager"])
    for k, ts in times.items():
        t = statistics.median(ts)
        ips = bs * args.steps / t
        tf = flop * args.steps / t / 1e12
        print(f"| {k} | {ips:.0f} | {tf:.3f} | {tf / ceiling:.0%} | {eager / t:.2f} |")


if __name__ == "__main__":
    main()
