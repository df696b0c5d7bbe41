"""Achieved training FLOP/s of a config's model against this machine's matmul ceiling, eager and compiled.

    python bench/throughput.py [--config configs/cifar10_cpu.yaml ...] [--steps 8] [--repeats 3] [--layers]
    python bench/throughput.py --config configs/vit_tiny.yaml configs/cifar10_cpu.yaml --baseline --threads 1
    python bench/throughput.py --config configs/attention/resnet_fast_*.yaml --no-compile --repeats 5 \
        --out /tmp/attention_steps.json          # every block's config: FLOP/s and the step against the first

In one process, for every ``--config``:
1. the ceiling: a large square matmul (``--matmul 4096``) in the config's precision (bf16 on a CPU with AMX),
   timed with its median over repeats: 2 * n^3 FLOP per call;
2. the FLOP of one training step of the config's model at its batch size, counted by
   ``torch.utils.flop_counter.FlopCounterMode`` over forward and backward (convolutions and matmuls);
3. training steps (autocast forward, loss, backward, SGD step) on batches already in memory, eager and then
   under ``torch.compile``; interleaved repeats, medians.
It prints images/s, achieved TFLOP/s, the fraction of the in-process matmul ceiling, and the speed relative to
the first row of the config and to the first config's row of the same path and step (``--out`` writes the rows
as JSON; the blocks' cost in the attention summary comes from ``bench/blocks.py``, which also measures the
blocks before and after a change, eager and compiled). ``--baseline adds, for a transformer (``TokenClassifier``), the same steps on a
copy of the model (same weights) running the path as it was before the fast path
(``TokenClassifier.set_fast_path(False)``): before and after, measured in one process. ``--sdpa`` picks the
fast path's CPU attention kernel (``visattn.attention.token.sdpa_cpu_mode``; several modes: one row each, on
copies of the model); ``--threads``, ``--batch`` (``--batch-size``), ``--precision`` and ``--set`` override the defaults and
the configs. The FLOP counter has no formula for the CPU flash-attention kernel, so a transformer's count leaves out the attention products themselves (q k^T and
weights x V, under 10% of ``vit_tiny``'s FLOP): the same count for every path and ``--sdpa`` mode.
A config with ``train.distill.teacher`` steps with its teacher's forward pass (and loss), which its FLOP count
leaves out: its images/s is the cost of distilling, its TFLOP/s the student's alone.
``--layers`` adds, per convolution of the model, the forward, input-gradient and weight-gradient kernel times
(``aten.convolution`` / ``aten.convolution_backward``, in the step's precision and memory format) next to
the time their FLOP would take at the matmul ceiling: where the step's time goes.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench.common import parser, provenance  # noqa: E402
from visattn import create_model, evaluate, trainer  # noqa: E402
from visattn.attention.token import SDPA_CPU_MODES, MultiHeadSelfAttention, sdpa_cpu_mode  # noqa: E402
from visattn.config import load_config  # noqa: E402
from visattn.errors import run_main  # noqa: E402
from visattn.rundir import write_atomic  # noqa: E402


def matmul_tflops(n: int, dtype: torch.dtype, repeats: int) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times) / 1e12


def step_flops(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, precision: str,
               cpu_attention: bool = False) -> int:
    """FLOP of one training step (forward and backward), convolutions and matmuls. ``cpu_attention`` also counts
    the CPU flash-attention kernel (for which the counter has no formula) with the counter's formulas for the
    GPU's fused kernels: ``4 N^2 d`` forward and ``10 N^2 d`` backward per head, as those count them."""
    from torch.utils import flop_counter

    def forward(q, k, v, *args, out_shape=None, **kwargs) -> int:  # shapes: the counter hands them over
        return flop_counter.sdpa_flop_count(q, k, v)

    def backward(grad_out, q, k, v, *args, out_shape=None, **kwargs) -> int:
        return flop_counter.sdpa_backward_flop_count(grad_out, q, k, v)

    aten = torch.ops.aten
    extra = {aten._scaled_dot_product_flash_attention_for_cpu: forward,
             aten._scaled_dot_product_flash_attention_for_cpu_backward: backward}
    with flop_counter.FlopCounterMode(display=False, custom_mapping=extra if cpu_attention else None) as fc:
        with evaluate.autocast(x.device, precision):
            out = model(x)
        F.cross_entropy(out.float(), y).backward()
    model.zero_grad(set_to_none=True)
    return fc.get_total_flops()


def make_step(model: torch.nn.Module, opt: torch.optim.Optimizer, precision: str,
              distill: Optional[trainer.Distill] = None):
    """One training step; with ``distill`` (a config's ``train.distill``) the teacher's forward pass too."""
    policy = trainer.StepPolicy(torch.device("cpu"), precision, 0.2, distill=distill)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        with evaluate.autocast(x.device, precision):
            out = model(x)
        loss = trainer.training_loss(out, x, y, policy)
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
    with torch.no_grad(), evaluate.autocast(x.device, precision):
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


@dataclass
class Setup:
    """A config's model, batches in memory and precision, built as the trainer builds them."""

    config: str
    name: str
    model: torch.nn.Module
    batches: List[Tuple[torch.Tensor, torch.Tensor]]
    precision: str
    dtype: torch.dtype
    distill: Optional[trainer.Distill] = None  # the config's teacher: its forward pass is part of the step


def build(config: str, batch: int = 0, steps: int = 8, precision: str = "", overrides: Sequence[str] = ()) -> Setup:
    """The model of ``config`` (seed 0; ``overrides`` as ``train.py --set``) and ``steps`` random batches of
    ``batch`` (default: the config's) images."""
    cfg = load_config(config, overrides)
    precision = evaluate.resolve_precision(precision or cfg.precision, torch.device("cpu"))
    torch.manual_seed(0)
    model = create_model(cfg.model.name, num_classes=10, **cfg.model.options())
    if getattr(model, "needs_data_init", False):
        model.data_init(torch.randint(0, 255, (512, 3, 32, 32), dtype=torch.uint8), cfg.data.mean, cfg.data.std)
    model = model.to(memory_format=torch.channels_last) if cfg.channels_last else model
    bs = batch or cfg.train.batch_size
    fmt = torch.channels_last if cfg.channels_last else torch.contiguous_format
    batches = [(torch.randn(bs, 3, 32, 32).contiguous(memory_format=fmt), torch.randint(0, 10, (bs,)))
               for _ in range(steps)]
    distill = None
    if cfg.train.distill.teacher:
        from visattn.trainer import load_teacher

        distill = load_teacher(cfg.train.distill, torch.device("cpu"), cfg.channels_last)[0]
    return Setup(config, cfg.model.name, model, batches, precision, evaluate.AMP_DTYPES[precision] or torch.float32,
                 distill)


SDPA_MODES = SDPA_CPU_MODES


def sdpa_mode(mode: Optional[str]):
    """Context: the fast path's CPU attention kernel (``None``: the library's default)."""
    return sdpa_cpu_mode(mode) if mode else contextlib.nullcontext()


def set_fast_path(model: torch.nn.Module, enabled: bool) -> bool:
    """Switch a transformer's fast path (``TokenClassifier.set_fast_path``); False for models without one."""
    if not hasattr(model, "set_fast_path"):
        return False
    model.set_fast_path(enabled)
    return True


def set_sdpa_cpu(model: torch.nn.Module, mode: str) -> bool:
    """Give every attention block of ``model`` the CPU attention kernel ``mode``; False if it has none."""
    blocks = [m for m in model.modules() if hasattr(m, "sdpa_cpu")]
    for m in blocks:
        m.sdpa_cpu = mode
    return bool(blocks)


def variants(setup: Setup, compile_: bool, baseline: bool, sdpa: Sequence[str] = ()) -> List[Tuple[str, str, object]]:
    """(path, step kind, step function) to time for one config: eager and compiled, on the fast path (one copy
    of the model per ``sdpa`` mode, same weights) and, with ``baseline``, on a copy running the path as it was
    before the fast path."""
    models = [("fast", setup.model)]
    if len(sdpa) > 1 or (sdpa and sdpa[0] != MultiHeadSelfAttention.sdpa_cpu):
        copies = [(f"fast, sdpa {mode}", copy.deepcopy(setup.model)) for mode in sdpa]
        if all(set_sdpa_cpu(m, mode) for (_, m), mode in zip(copies, sdpa)):
            models = copies
    if baseline:
        base = copy.deepcopy(setup.model)
        if set_fast_path(base, False):
            models = [("baseline", base)] + models
    out = []
    for path, model in models:
        label = path if len(models) > 1 else "-"
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, nesterov=True)
        out.append((label, "eager", make_step(model, opt, setup.precision, setup.distill)))
        if compile_:
            out.append((label, "compiled", make_step(torch.compile(model), opt, setup.precision, setup.distill)))
    return out


def parse_args() -> argparse.Namespace:
    ap = parser(__doc__, threads=True, precision=True, repeats=3)
    ap.add_argument("--config", nargs="+", default=[str(ROOT / "configs" / "cifar10_cpu.yaml")],
                    help="one or more configs, measured in one process against one ceiling")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--matmul", type=int, default=4096)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--batch", "--batch-size", dest="batch_size", type=int, default=0,
                    help="override every config's batch size")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="config overrides applied to every config, e.g. model.num_heads=3")
    ap.add_argument("--baseline", action="store_true",
                    help="also time each transformer on the path as it was before the fast path (same weights)")
    ap.add_argument("--sdpa", nargs="+", choices=SDPA_MODES, default=[],
                    help="the fast path's CPU attention kernel(s): several give one row each (default: the library's)")
    ap.add_argument("--layers", action="store_true",
                    help="also time every convolution's forward, input gradient and weight gradient")
    ap.add_argument("--out", type=Path, default=None,
                    help="also write the rows as JSON here")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    setups = [build(c, args.batch_size, args.steps, args.precision, args.set) for c in args.config]
    flops = [step_flops(s.model, *s.batches[0], s.precision) for s in setups]
    ceilings = {s.dtype: None for s in setups}
    for dtype in ceilings:
        ceilings[dtype] = matmul_tflops(args.matmul, dtype, max(args.repeats, 3))
    runs = [(i, *v) for i, s in enumerate(setups) for v in variants(s, not args.no_compile, args.baseline, args.sdpa)]
    times: List[List[float]] = [[] for _ in runs]
    for i, _, _, step in runs:  # warm-up (and compilation)
        time_steps(step, setups[i].batches[:2])
    for _ in range(args.repeats):  # interleaved repeats
        for j, (i, _, _, step) in enumerate(runs):
            times[j].append(time_steps(step, setups[i].batches))
    print(f"{torch.get_num_threads()} threads, torch {torch.__version__}, sdpa {' '.join(args.sdpa) or 'default'}, "
          f"{args.steps} steps x {args.repeats} interleaved repeats (medians)"
          + (f", overrides {' '.join(args.set)}" if args.set else ""))
    for dtype, c in ceilings.items():
        print(f"ceiling: {args.matmul}x{args.matmul} {dtype} matmul = {c:.3f} TFLOP/s (median of {max(args.repeats, 3)})")
    for s, flop in zip(setups, flops):
        bs = s.batches[0][0].shape[0]
        print(f"config {s.config}: model {s.name}, batch {bs}, precision {s.precision}; one training step "
              f"{flop / 1e9:.1f} GFLOP = {flop / bs / 1e9:.3f} GFLOP per image (forward + backward)")
    print("\n| config | path | step | images/s | TFLOP/s | of matmul ceiling | ratio vs first row of its config | "
          "images/s vs first config |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    first, first_config, rows = {}, {}, []
    for (i, path, kind, _), ts in zip(runs, times):
        s, t = setups[i], statistics.median(ts)
        bs = s.batches[0][0].shape[0]
        first.setdefault(i, t)
        ips, tf = bs * args.steps / t, flops[i] * args.steps / t / 1e12
        first_config.setdefault((path, kind), ips)
        print(f"| {Path(s.config).stem} | {path} | {kind} | {ips:.0f} | {tf:.3f} | {tf / ceilings[s.dtype]:.0%} | "
              f"{first[i] / t:.2f} | {ips / first_config[path, kind]:.2f} |")
        rows.append({"config": _relative(s.config), "path": path, "step": kind, "images_per_s": ips, "tflops": tf,
                     "of_ceiling": tf / ceilings[s.dtype], "gflop_per_image": flops[i] / bs / 1e9,
                     "precision": s.precision, "batch_size": bs})
    if args.out:
        write_results(args.out, rows, args)
    if args.layers:
        for s in setups:
            layer_table(s.model, s.batches[0][0], s.precision, s.dtype, args.repeats, ceilings[s.dtype])


def _relative(config: str) -> str:
    """A config's path relative to the repository when it lies inside it (as the attention table names configs)."""
    path = Path(config).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else config


def write_results(path: Path, rows: List[dict], args: argparse.Namespace) -> None:
    """The rows of one process's measurement, with the machine and the command, as JSON (replacing ``path``
    atomically: one measurement per file, its ratios all from one process)."""
    meta = {**provenance(), "threads": torch.get_num_threads(), "steps": args.steps, "repeats": args.repeats}
    write_atomic(path, json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    run_main(main, "throughput.py")
