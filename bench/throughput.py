"""Achieved training FLOP/s of a config's model against this machine's matmul ceiling, eager and compiled.

    python bench/throughput.py [--config configs/cifar10_cpu.yaml] [--steps 8] [--repeats 3] [--layers]

In one process:
1. the ceiling: a large square matmul (``--matmul 4096``) in the config's precision (bf16 on a CPU with AMX),
   timed with its median over repeats: 2 * n^3 FLOP per call;
2. the FLOP of one training step of the config's model at its batch size, counted by
   ``torch.utils.flop_counter.FlopCounterMode`` over forward and backward (convolutions and matmuls);
3. training steps (autocast forward, loss, backward, SGD step) on batches already in memory, eager and then
   under ``torch.compile``; interleaved repeats, medians.
It prints images/s, achieved TFLOP/s, the fraction of the in-process matmul ceiling, and compiled / eager.
``--layers`` adds, per convolution of the model, the forward, input-gradient and weight-gradient kernel times
(``aten.convolution`` / ``aten.convolution_backward``, in the step's precision and memory format) next to
the time their FLOP would take at the matmul ceiling: where the step's time goes.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import List, Tuple

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


def conv_layers(model: torch.nn.Module, x: torch.Tensor, precision: str) -> List[Tuple[str, torch.nn.Conv2d, tuple]]:
    """(name, conv, input shape) of every ``Conv2d`` one forward pass of ``x`` runs, in order."""
    seen: List[Tuple[str, torch.nn.Conv2d, tuple]] = []
    hooks = [m.register_forward_hook(lambda m, i, o, n=n: seen.append((n, m, tuple(i[0].shape))))
             for n, m in model.named_modules() if isinstance(m, torch.nn.Conv2d)]
    with torch.no_grad(), engine.autocast(x.device, precision):
        model(x)
    for h in hooks:
        h.remove()
    return seen


def layer_table(model: torch.nn.Module, x: torch.Tensor, precision: str, dtype: torch.dtype, repeats: int,
                ceiling: float) -> None:
    """Per convolution: forward, input-gradient and weight-gradient times (the kernels autograd calls), each
    against the time the same FLOP would take at the in-process matmul ceiling."""
    fmt = torch.channels_last if x.is_contiguous(memory_format=torch.channels_last) else torch.contiguous_format
    print("\n| conv | input | forward ms | input grad ms | weight grad ms | weight grad / forward | "
          "FLOP-equal matmul ms |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, conv, shape in conv_layers(model, x, precision):
        inp = torch.randn(shape, dtype=dtype).contiguous(memory_format=fmt)
        w = conv.weight.detach().to(dtype).contiguous(memory_format=fmt)
        args = (conv.stride, conv.padding, conv.dilation, False, [0, 0], conv.groups)
        out = torch.ops.aten.convolution(inp, w, None, *args)
        g = torch.randn_like(out)
        def fwd():
            torch.ops.aten.convolution(inp, w, None, *args)

        def grad(mask):
            return lambda: torch.ops.aten.convolution_backward(g, inp, w, None, *args, mask)

        ms = [1e3 * statistics.median(_times(f, repeats)) for f in (fwd, grad([True, False, False]),
                                                                   grad([False, True, False]))]
        flop = 2 * out.numel() * w[0].numel()  # one of the three: forward, input grad and weight grad are equal
        ideal = 1e3 * flop / (ceiling * 1e12)
        what = "x".join(map(str, shape[1:]))
        print(f"| `{name}` {w.shape[1]}->{w.shape[0]} | {what} | {ms[0]:.1f} | {ms[1]:.1f} | {ms[2]:.1f} | "
              f"{ms[2] / ms[0]:.1f}x | {ideal:.1f} |")


def _times(f, repeats: int) -> List[float]:
    f()
    out = []
    for _ in range(max(repeats, 3)):
        t = time.perf_counter()
        f()
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "cifar10_cpu.yaml"))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--matmul", type=int, default=4096)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--layers", action="store_true",
                    help="also time every convolution's forward, input gradient and weight gradient")
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
    if args.layers:
        layer_table(model, batches[0][0], precision, dtype, args.repeats, ceiling)


if __name__ == "__main__":
    main()
