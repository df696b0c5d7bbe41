"""Forward + backward time of visattn's attention blocks against timm's equivalents, eager and compiled, on
CPU, in one process.

Each row builds visattn's block and timm's module with the same configuration (timm's options are set to
the paper defaults visattn uses where they differ), feeds both the same input and the same upstream
gradient (a dense random tensor, as in a real network), and times ``forward + backward`` in train mode,
four ways: visattn eager, timm eager, visattn under ``torch.compile`` (Inductor, ``fullgraph=True``) and
timm under ``torch.compile`` (Inductor, default options). Compilation happens in the warm-up calls. Repeats
are interleaved (each repeat runs every row and every variant, alternating who goes first) so drift in
machine load hits all sides, and the table reports medians. Shapes are CIFAR's: feature maps
``--batch x 64 x 32 x 32``, tokens ``--batch x 65 x 192`` with 3 heads (a ViT-Tiny-width model on 4x4
patches plus a class token).

    python bench/blocks.py --repeats 7 --threads 2                 # fp32, eager and compiled
    python bench/blocks.py --repeats 7 --threads 2 --dtype bf16    # under torch.autocast("cpu", bfloat16)
    python bench/blocks.py --no-compile                            # eager only

ratio = visattn ms / timm ms (below 1.0: visattn is faster). Prints a markdown table.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List, Tuple

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import timm  # noqa: E402
from timm.layers import Attention, EcaModule, GlobalContext, NonLocalAttn, SEModule  # noqa: E402
from timm.layers.cbam import CbamModule, SpatialAttn  # noqa: E402

import visattn  # noqa: E402
from visattn.attention.spatial import coord_mip  # noqa: E402
from visattn.options import describe  # noqa: E402

try:  # coordinate attention arrived in timm 1.0.16 (timm/layers/coord_attn.py)
    from timm.layers.coord_attn import CoordAttn
except ImportError:  # pragma: no cover - older timm
    CoordAttn = None


class ReferenceCoordAttn(nn.Module):
    """Plain coordinate attention (Hou et al., 2021), as in the paper's code; used only when timm has none."""

    def __init__(self, channels: int):
        super().__init__()
        mip = coord_mip(channels)
        self.conv1 = nn.Conv2d(channels, mip, 1)
        self.bn1 = nn.BatchNorm2d(mip)
        self.act = nn.Hardswish()
        self.conv_h = nn.Conv2d(mip, channels, 1)
        self.conv_w = nn.Conv2d(mip, channels, 1)

    def forward(self, x):
        B, C, H, W = x.shape
        y = torch.cat([x.mean(3, keepdim=True), x.mean(2, keepdim=True).transpose(2, 3)], dim=2)
        y = self.act(self.bn1(self.conv1(y)))
        y_h, y_w = y.split([H, W], dim=2)
        return x * self.conv_h(y_h).sigmoid() * self.conv_w(y_w).transpose(2, 3).sigmoid()


Row = Tuple[str, str, Callable[[], nn.Module], Callable[[], nn.Module], str]


def rows(channels: int, dim: int, heads: int) -> List[Row]:
    """(row name, baseline name, build visattn's block, build the baseline, input kind)."""
    C = channels

    def ours(name: str, **kwargs) -> Callable[[], nn.Module]:
        return lambda: visattn.create_attention(name, C, **kwargs)

    if CoordAttn is not None:  # same configuration as the paper's: mip = max(8, C // 32), conv biases
        coord = ("timm CoordAttn", lambda: CoordAttn(C, rd_channels=coord_mip(C), bias=True))
    else:
        coord = ("reference (timm has no coordinate attention)", lambda: ReferenceCoordAttn(C))
    return [
        ("se", "timm SEModule", ours("se"), lambda: SEModule(C, rd_divisor=1), "map"),
        ("eca", "timm EcaModule", ours("eca"), lambda: EcaModule(C), "map"),
        ("cbam", "timm CbamModule", ours("cbam"), lambda: CbamModule(C), "map"),
        ("spatial", "timm cbam.SpatialAttn", ours("spatial"), lambda: SpatialAttn(7), "map"),
        (
            "gc",
            "timm GlobalContext (add fusion, 1/16)",
            ours("gc"),
            lambda: GlobalContext(C, fuse_add=True, fuse_scale=False, rd_ratio=1 / 16),
            "map",
        ),
        ("coord", coord[0], ours("coord"), coord[1], "map"),
        (
            "nonlocal",
            "timm NonLocalAttn (C/2 inner)",
            ours("nonlocal"),
            lambda: NonLocalAttn(C, rd_channels=C // 2),
            "map",
        ),
        (
            "mhsa",
            "timm layers.Attention (ViT)",
            lambda: visattn.create_attention("mhsa", dim, num_heads=heads, qkv_bias=True),
            lambda: Attention(dim, num_heads=heads, qkv_bias=True),
            "tokens",
        ),
    ]


def step(module: nn.Module, x: torch.Tensor, grad: torch.Tensor, autocast_dtype) -> float:
    """One forward + backward; returns seconds."""
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast_dtype is not None):
        out = module(x)
    out.backward(grad.to(out.dtype))
    dt = time.perf_counter() - t0
    x.grad = None
    module.zero_grad(set_to_none=True)
    return dt


VARIANTS = ("visattn eager", "timm eager", "visattn compiled", "timm compiled")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=describe(__doc__))
    p.add_argument("--repeats", type=int, default=7, help="timed forward+backward calls per block and side")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--channels", type=int, default=64)
    p.add_argument("--size", type=int, default=32, help="feature-map height and width")
    p.add_argument("--dim", type=int, default=192)
    p.add_argument("--heads", type=int, default=3)
    p.add_argument("--tokens", type=int, default=65)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="bf16: run under CPU autocast")
    p.add_argument("--only", nargs="*", default=None, help="row names to run (default: all)")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="eager only (no torch.compile)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    autocast_dtype = torch.bfloat16 if args.dtype == "bf16" else None

    table = rows(args.channels, args.dim, args.heads)
    if args.only:
        table = [r for r in table if r[0] in args.only]

    inputs = {
        "map": torch.randn(args.batch, args.channels, args.size, args.size),
        "tokens": torch.randn(args.batch, args.tokens, args.dim),
    }
    grads = {k: torch.randn_like(v) for k, v in inputs.items()}
    variants = VARIANTS if args.compile else VARIANTS[:2]
    built: Dict[str, Dict[str, nn.Module]] = {}
    for name, _, ours, ref, _ in table:
        o, r = ours().train(), ref().train()
        built[name] = {"visattn eager": o, "timm eager": r}
        if args.compile:  # the compiled modules share the eager ones' parameters
            built[name]["visattn compiled"] = torch.compile(o, fullgraph=True, dynamic=False)
            built[name]["timm compiled"] = torch.compile(r, dynamic=False)

    t_start = time.perf_counter()
    times: Dict[Tuple[str, str], List[float]] = {}
    for name, _, _, _, kind in table:  # warm-up; compiles the compiled variants
        x = inputs[kind].clone().requires_grad_()
        for v in variants:
            for _ in range(args.warmup):
                step(built[name][v], x, grads[kind], autocast_dtype)
    t_warm = time.perf_counter() - t_start
    for r in range(args.repeats):
        for name, _, _, _, kind in table:
            x = inputs[kind].clone().requires_grad_()
            order = variants if r % 2 == 0 else variants[::-1]  # alternate who goes first
            for v in order:
                times.setdefault((name, v), []).append(step(built[name][v], x, grads[kind], autocast_dtype))

    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(
        f"visattn blocks vs timm, forward+backward, train mode, {args.dtype}"
        f"{' (CPU autocast)' if autocast_dtype else ''}; torch {torch.__version__}, timm {timm.__version__}, "
        f"{args.threads} thread(s), {platform.processor() or platform.machine()}"
    )
    print(
        f"feature maps {args.batch}x{args.channels}x{args.size}x{args.size}; "
        f"tokens {args.batch}x{args.tokens}x{args.dim}, {args.heads} heads; "
        f"median of {args.repeats} interleaved repeats; warm-up (incl. compilation) {t_warm:.0f} s"
    )
    if CoordAttn is None:
        print("timm has no coordinate attention: 'coord' is compared with a plain reference in this file")
    print()
    head = "| block | timm baseline | visattn eager ms | timm eager ms | eager ratio |"
    rule = "|---|---|---:|---:|---:|"
    if args.compile:
        head += " visattn compiled ms | timm compiled ms | compiled ratio |"
        rule += "---:|---:|---:|"
    print(head)
    print(rule)
    for name, base, _, _, _ in table:
        row = f"| `{name}` | {base} | {med[(name, VARIANTS[0])]:.2f} | {med[(name, VARIANTS[1])]:.2f} | "
        row += f"{med[(name, VARIANTS[0])] / med[(name, VARIANTS[1])]:.2f} |"
        if args.compile:
            row += f" {med[(name, VARIANTS[2])]:.2f} | {med[(name, VARIANTS[3])]:.2f} | "
            row += f"{med[(name, VARIANTS[2])] / med[(name, VARIANTS[3])]:.2f} |"
        print(row)


if __name__ == "__main__":
    main()
