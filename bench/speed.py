"""The training step's speed, measured in one process: a config's achieved FLOP/s against this machine's matmul
ceiling, eager and compiled (``flops``), or visattn's training loop against a bare PyTorch loop and bf16 against
fp32 (``overhead``).

    python -m bench.speed flops [--config configs/cifar10_cpu.yaml ...] [--steps 8] [--repeats 3] [--layers]
    python -m bench.speed flops --config configs/vit_tiny.yaml configs/cifar10_cpu.yaml --baseline --threads 1
    python -m bench.speed flops --config configs/attention/resnet_fast_*.yaml --no-compile --repeats 5 \
        --out /tmp/attention_steps.json          # every block's config: FLOP/s and the step against the first
    python -m bench.speed overhead [--config configs/cifar10_cpu.yaml] [--batch 512] [--steps 12] [--repeats 3]

Both time with :func:`bench.common.interleaved` (interleaved repeats, medians) and take the common flags
(:func:`bench.common.parser`); ``python -m bench.speed MODE --help`` lists each mode's.

**flops**. In one process, for every ``--config``:
1. the ceiling: a large square matmul (``--matmul 4096``) in the config's precision (bf16 on a CPU with AMX),
   timed with its median over repeats: 2 * n^3 FLOP per call;
2. the FLOP of one training step of the config's model at its batch size, counted by
   ``torch.utils.flop_counter.FlopCounterMode`` over forward and backward (convolutions and matmuls);
3. training steps (autocast forward, loss, backward, SGD step) on batches already in memory, eager and then
   under ``torch.compile``; interleaved repeats, medians.
It prints images/s, achieved TFLOP/s, the fraction of the in-process matmul ceiling, and the speed relative to
the first row of the config and to the first config's row of the same path and step (``--out`` writes the rows
as JSON; the blocks' cost in the attention summary comes from ``bench/blocks.py``, which also measures the
blocks before and after a change, eager and compiled). ``--baseline`` adds, for a transformer
(``TokenClassifier``), the same steps on a copy of the model (same weights) running the path as it was before the
fast path (``TokenClassifier.set_fast_path(False)``): before and after, measured in one process. ``--sdpa`` picks
the fast path's CPU attention kernel (``visattn.attention.token.sdpa_cpu_mode``; several modes: one row each, on
copies of the model); ``--threads``, ``--batch`` (``--batch-size``), ``--precision`` and ``--set`` override the
defaults and the configs. The FLOP counter has no formula for the CPU flash-attention kernel, so a transformer's
count leaves out the attention products themselves (q k^T and weights x V, under 10% of ``vit_tiny``'s FLOP): the
same count for every path and ``--sdpa`` mode. A config with ``train.distill.teacher`` steps with its teacher's
forward pass (and loss), which its FLOP count leaves out: its images/s is the cost of distilling, its TFLOP/s the
student's alone. ``--layers`` adds, per convolution of the model, the forward, input-gradient and weight-gradient
kernel times (``aten.convolution`` / ``aten.convolution_backward``, in the step's precision and memory format)
next to the time their FLOP would take at the matmul ceiling: where the step's time goes.

**overhead**. Images/s of visattn's training loop against a bare PyTorch loop, and bf16 against fp32, in one
process. The model is the config's (default: the CPU recipe's network, with its options). Baseline ("bare"): a
plain loop over batches already in memory (autocast forward, cross-entropy, zero_grad, backward, SGD step) on the
same model, batch size and precision. "visattn" is ``trainer.train_one_epoch`` fed by the ``TensorLoader`` (batch
gather, normalisation, and in the "+aug" row the pad-crop and flip augmentation), with its schedule, statistics
and non-finite checks. Repeats are interleaved and the median is reported (fp32: one repeat); the ratio is
visattn / bare (1.0 = no overhead).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from bench.common import ROOT, interleaved, mode, parser, provenance
from visattn import evaluate, trainer
from visattn.attention.token import SDPA_CPU_MODES, MultiHeadSelfAttention, sdpa_cpu_mode
from visattn.config import load_config
from visattn.data import ImageSet, Placement, TensorLoader
from visattn.distill import Distill
from visattn.errors import run_main
from visattn.models import from_config
from visattn.models.layout import to_channels_last
from visattn.optim import Optimization, StepScheduler, build_optimizer
from visattn.results import write_atomic
from visattn.step import StepPolicy, training_loss

FLOPS = "A config's achieved training FLOP/s against this machine's matmul ceiling, eager and compiled."
OVERHEAD = "Images/s of visattn's training loop against a bare PyTorch loop, and bf16 against fp32, in one process."


# ---- flops: a config's training FLOP/s against the matmul ceiling ----------------------------------------------


def matmul_tflops(n: int, dtype: torch.dtype, repeats: int) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    timed = interleaved({"matmul": lambda: a @ b}, repeats)  # one warm-up call, then the timed ones
    return 2 * n**3 / statistics.median(timed.seconds["matmul"]) / 1e12


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
              distill: Optional[Distill] = None):
    """One training step; with ``distill`` (a config's ``train.distill``) the teacher's forward pass too."""
    policy = StepPolicy(torch.device("cpu"), precision, 0.2, distill=distill)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        with evaluate.autocast(x.device, precision):
            out = model(x)
        loss = training_loss(out, x, y, policy)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step


def run_steps(step, batches) -> None:
    for x, y in batches:
        step(x, y)


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

        timed = interleaved({"forward": fwd, "input grad": grad([True, False, False]),
                             "weight grad": grad([False, True, False])}, max(repeats, 3))
        ms = [1e3 * statistics.median(ts) for ts in timed.seconds.values()]
        flop = 2 * out.numel() * w[0].numel()  # one of the three: forward, input grad and weight grad are equal
        ideal = 1e3 * flop / (ceiling * 1e12)
        what = "x".join(map(str, shape[1:]))
        print(f"| `{name}` {w.shape[1]}->{w.shape[0]} | {what} | {ms[0]:.1f} | {ms[1]:.1f} | {ms[2]:.1f} | "
              f"{ms[2] / ms[0]:.1f}x | {ideal:.1f} |")


@dataclass
class Setup:
    """A config's model, batches in memory and precision, built as the trainer builds them."""

    config: str
    name: str
    model: torch.nn.Module
    batches: List[Tuple[torch.Tensor, torch.Tensor]]
    precision: str
    dtype: torch.dtype
    distill: Optional[Distill] = None  # the config's teacher: its forward pass is part of the step


def build(config: str, batch: int = 0, steps: int = 8, precision: str = "", overrides: Sequence[str] = ()) -> Setup:
    """The model of ``config`` (seed 0; ``overrides`` as ``train.py --set``) and ``steps`` random batches of
    ``batch`` (default: the config's) images."""
    cfg = load_config(config, overrides)
    precision = evaluate.resolve_precision(precision or cfg.precision, torch.device("cpu"))
    torch.manual_seed(0)
    model = from_config(cfg, train_images=torch.randint(0, 255, (512, 3, 32, 32), dtype=torch.uint8))
    if cfg.channels_last:
        to_channels_last(model, torch.device("cpu"))  # in place (oneDNN's defective shapes kept contiguous)
    bs = batch or cfg.train.batch_size
    fmt = torch.channels_last if cfg.channels_last else torch.contiguous_format
    batches = [(torch.randn(bs, 3, 32, 32).contiguous(memory_format=fmt), torch.randint(0, 10, (bs,)))
               for _ in range(steps)]
    distill = None
    if cfg.train.distill.teacher:
        from visattn.distill import load_teacher

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


def flops_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--config", nargs="+", default=[str(ROOT / "configs" / "cifar10_cpu.yaml")],
                    help="one or more configs, measured in one process against one ceiling")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--matmul", type=int, default=4096)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="config overrides applied to every config, e.g. model.num_heads=3")
    ap.add_argument("--baseline", action="store_true",
                    help="also time each transformer on the path as it was before the fast path (same weights)")
    ap.add_argument("--sdpa", nargs="+", choices=SDPA_MODES, default=[],
                    help="the fast path's CPU attention kernel(s): several give one row each (default: the library's)")
    ap.add_argument("--layers", action="store_true",
                    help="also time every convolution's forward, input gradient and weight gradient")


def flops(args: argparse.Namespace) -> None:
    setups = [build(c, args.batch, args.steps, args.precision, args.set) for c in args.config]
    flop = [step_flops(s.model, *s.batches[0], s.precision) for s in setups]
    ceilings = {s.dtype: None for s in setups}
    for dtype in ceilings:
        ceilings[dtype] = matmul_tflops(args.matmul, dtype, max(args.repeats, 3))
    runs = [(i, *v) for i, s in enumerate(setups) for v in variants(s, not args.no_compile, args.baseline, args.sdpa)]
    steps = {j: (lambda step=step, i=i: run_steps(step, setups[i].batches)) for j, (i, _, _, step) in enumerate(runs)}
    warm = {j: (lambda step=step, i=i: run_steps(step, setups[i].batches[:2])) for j, (i, _, _, step) in enumerate(runs)}
    timed = interleaved(steps, args.repeats, warm=warm, alternate=False)  # the warm-up compiles the compiled steps
    print(f"{torch.get_num_threads()} threads, torch {torch.__version__}, sdpa {' '.join(args.sdpa) or 'default'}, "
          f"{args.steps} steps x {args.repeats} interleaved repeats (medians)"
          + (f", overrides {' '.join(args.set)}" if args.set else ""))
    for dtype, c in ceilings.items():
        print(f"ceiling: {args.matmul}x{args.matmul} {dtype} matmul = {c:.3f} TFLOP/s (median of {max(args.repeats, 3)})")
    for s, f in zip(setups, flop):
        bs = s.batches[0][0].shape[0]
        print(f"config {s.config}: model {s.name}, batch {bs}, precision {s.precision}; one training step "
              f"{f / 1e9:.1f} GFLOP = {f / bs / 1e9:.3f} GFLOP per image (forward + backward)")
    print("\n| config | path | step | images/s | TFLOP/s | of matmul ceiling | ratio vs first row of its config | "
          "images/s vs first config |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    first, first_config, rows = {}, {}, []
    for j, (i, path, kind, _) in enumerate(runs):
        s, t = setups[i], statistics.median(timed.seconds[j])
        bs = s.batches[0][0].shape[0]
        first.setdefault(i, t)
        ips, tf = bs * args.steps / t, flop[i] * args.steps / t / 1e12
        first_config.setdefault((path, kind), ips)
        print(f"| {Path(s.config).stem} | {path} | {kind} | {ips:.0f} | {tf:.3f} | {tf / ceilings[s.dtype]:.0%} | "
              f"{first[i] / t:.2f} | {ips / first_config[path, kind]:.2f} |")
        rows.append({"config": _relative(s.config), "path": path, "step": kind, "images_per_s": ips, "tflops": tf,
                     "of_ceiling": tf / ceilings[s.dtype], "gflop_per_image": flop[i] / bs / 1e9,
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


# ---- overhead: visattn's training loop against a bare one ------------------------------------------------------


def bare_loop(model, batches, opt, precision) -> None:
    model.train()
    for xb, yb in batches:
        with evaluate.autocast(torch.device("cpu"), precision):
            out = model(xb)
        loss = F.cross_entropy(out.float(), yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


def visattn_loop(model, loader, opt, sched, precision) -> None:
    trainer.train_one_epoch(model, loader, Optimization(opt, sched), StepPolicy(torch.device("cpu"), precision))


def overhead_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--config", default="configs/cifar10_cpu.yaml", help="the model (and its options) to time")
    ap.add_argument("--steps", type=int, default=12)


def overhead(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    n = args.batch * args.steps
    rng = np.random.default_rng(0)
    images = ImageSet(rng.integers(0, 255, (n, 32, 32, 3), dtype=np.uint8), rng.integers(0, 10, n), tuple("abcdefghij"))
    cfg = load_config(args.config, [])
    dcfg = cfg.data
    mean, std = dcfg.mean, dcfg.std
    results = {}
    for precision in ("bf16", "fp32"):
        model = from_config(cfg, train_images=torch.from_numpy(images.x[:512]).permute(0, 3, 1, 2))
        to_channels_last(model, torch.device("cpu"))
        opt = build_optimizer(model, "sgd", 0.05, 5e-4)
        sched = StepScheduler(opt, "constant", 0.05, 10**6, 0)
        plain = TensorLoader(images, args.batch, mean, std, train=True, augment=None, seed=0, placement=Placement(channels_last=True))
        aug = TensorLoader(images, args.batch, mean, std, train=True, augment=dcfg.augment, seed=0, placement=Placement(channels_last=True))
        batches = [(xb.clone(), yb.clone()) for xb, yb in plain]  # the bare loop's data: ready in memory
        plain.set_epoch(0)
        loops = {"bare": lambda: bare_loop(model, batches, opt, precision),
                 "visattn": lambda: visattn_loop(model, plain, opt, sched, precision)}
        if precision == "bf16":
            loops["visattn+aug"] = lambda: visattn_loop(model, aug, opt, sched, precision)
        # warm-up (allocator, oneDNN primitive caches): the bare loop on two batches
        warm = {"bare": lambda: bare_loop(model, batches[:2], opt, precision)}
        timed = interleaved(loops, args.repeats if precision == "bf16" else 1, warm=warm, alternate=False)
        results[precision] = {k: n / statistics.median(v) for k, v in timed.seconds.items()}

    b = results["bf16"]
    print(f"model {cfg.model.name} ({args.config}), batch {args.batch}, {args.steps} steps x {args.repeats} interleaved repeats, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"{'loop':<26}{'images/s':>10}{'ratio vs bare':>16}")
    for k in ("bare", "visattn", "visattn+aug"):
        print(f"{'bf16 ' + k:<26}{b[k]:>10.0f}{b[k] / b['bare']:>16.3f}")
    f = results["fp32"]
    for k in ("bare", "visattn"):
        print(f"{'fp32 ' + k:<26}{f[k]:>10.0f}{f[k] / f['bare']:>16.3f}")
    print(f"bf16 autocast vs fp32 (bare loop): {b['bare'] / f['bare']:.2f}x images/s")


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = parser(__doc__)
    modes = ap.add_subparsers(dest="mode", required=True, metavar="{flops,overhead}")
    flops_flags(mode(modes, "flops", FLOPS, threads=True, precision=True, batch=True, repeats=3, out=True,
                     help={"batch": "override every config's batch size", "out": "also write the rows as JSON here"}))
    overhead_flags(mode(modes, "overhead", OVERHEAD, threads=True, batch=512, repeats=3))
    args = ap.parse_args(argv)
    (flops if args.mode == "flops" else overhead)(args)


if __name__ == "__main__":
    run_main(main, "speed.py")
