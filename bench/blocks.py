"""What the attention blocks cost: each feature-map block against ``none`` in the CPU recipe's whole training step,
and against its own earlier implementation, in one process; or (``--vs-timm``) each block against timm's.

    python -m bench.blocks --threads 2 --out bench/results/block_speed.json   # the recipe step + each block alone
    python -m bench.blocks --device cuda --out DIR/block_speed.json          # the same on a GPU (bf16: the recipe's)
    python -m bench.blocks --quick                        # a dry run: one repeat of one step, eager (batch 16 on a CPU)
    python -m bench.blocks --vs-timm --repeats 7 --threads 2 [--precision bf16] [--no-compile]   # against timm's

**The recipe step** (the default). For ``none`` and every registered feature-map block (:data:`BLOCKS`, from
``visattn.list_attention("feature")``; ``--only`` picks some), the network of
``configs/attention/resnet_fast_<block>.yaml`` (the CPU recipe's: ``resnet_fast`` 64-256-256, the block in each
group at ``unit_bn``, ``init: identity``) runs whole training steps (autocast forward, label-smoothed loss,
backward, SGD step) at the recipe's batch of 512, channels-last, on batches already in memory: eager, and under
``torch.compile`` (Inductor). On a CPU glibc keeps freed memory for reuse, as ``train.py`` has it (config ``cpu_heap: keep``,
:mod:`visattn.cpu_heap`; the JSON's ``cpu_heap``). Every block runs as the working tree has it ("after") and, where revision
``--before`` registered it, as that revision had it ("before": that revision's ``visattn/attention`` block files
loaded into a throwaway package, the model's blocks swapped for them with the same weights; a block registered
since is measured "after" only, its "before" null in the JSON). The issue's :data:`TARGETS` cover the eight
blocks of issue 70; the others have none. Repeats are interleaved (every variant once per repeat,
the order reversed every other repeat) and each variant's median is taken; a block's ratio is its images/s over
``none``'s in the same kind of step, so every ratio, before and after, comes from this one process.
**FLOP ceiling**: each network's FLOP per step (``torch.utils.flop_counter``: convolutions and matmuls, the CPU
flash-attention kernel counted with the counter's formulas for the fused GPU kernels); ``none``'s over a block's
is the best ratio the block could reach, were its added FLOP free of every overhead. A target above it cannot be
met by making the block's code faster, only by giving it less to compute.
**Blocks alone**: forward + backward (train mode, eager, a dense upstream gradient) of each block, before and
after, on the three feature maps the recipe feeds it (recorded from ``none``'s network under the recipe's autocast:
their shapes, and their dtype, bf16 in bf16, so each block runs the path it takes inside the network), in the same
repeats.

``--precision auto`` is the recipe's own (bf16 where the device runs it natively, else fp32:
``visattn.evaluate.resolve_precision``). ``--out`` writes the rows, the ratios, the issue's targets and the
machine (CPU or GPU name, kernel family, whether bf16 is native, threads, precision, date, the command) as JSON;
``bench/results/block_speed.json`` is the attention summary's cost column (``bench/attention_report.py``). The
timing is :func:`bench.common.interleaved`'s, the flags :func:`bench.common.parser`'s. ``--table [JSON]`` prints a
measurement as the docs show it (:mod:`bench.block_table`): beside each FLOP ceiling, the memory-traffic ceiling that
``--profile`` (``bench/results/bf16_profile.json``) gives where it was measured on the same machine.

**Against timm** (``--vs-timm``): visattn's block and timm's equivalent with the same configuration (timm's
options set to the paper defaults visattn uses where they differ), the same input and upstream gradient,
forward + backward in train mode, four ways (each eager, each under ``torch.compile``); feature maps
``--batch x 64 x 32 x 32``, tokens ``--batch x 65 x 192`` with 3 heads; ``--precision bf16`` (also spelled
``--dtype``) runs them under CPU autocast. ratio = visattn ms / timm ms.
"""
from __future__ import annotations

import argparse
import atexit
import copy
import importlib
import importlib.util
import json
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import timm
import torch
from timm.layers import Attention, EcaModule, GlobalContext, NonLocalAttn, SEModule
from timm.layers.cbam import CbamModule, SpatialAttn
from torch import nn

import visattn
from bench.block_table import BASELINE, IMPLS, PROFILE, SPEED, read_table, tables  # SPEED: the attention summary's cost
from bench.common import ROOT, command, cpu_name, interleaved, kernels, parser, revision
from visattn import cpu_heap, evaluate
from visattn.attention.spatial import coord_mip
from visattn.config import load_config
from visattn.errors import ConfigError, run_main
from visattn.options import check_at_least, resolve_device
from visattn.results import write_atomic

try:  # coordinate attention arrived in timm 1.0.16 (timm/layers/coord_attn.py)
    from timm.layers.coord_attn import CoordAttn
except ImportError:  # pragma: no cover - older timm
    CoordAttn = None

BEFORE = "4470a3c"  # the blocks as they were before their speed work (issue 70): its first commit's parent
# the targets for the whole step's speed against none's, eager and compiled (set for bf16 on a CPU); the
# blocks registered since have none (the JSON's "targets" and "met" leave them out)
TARGETS = {"se": 0.97, "eca": 0.97, "gc": 0.97, "spatial": 0.95, "cbam": 0.95, "coord": 0.95, "nonlocal": 0.90,
           "mhsa2d": 0.75}
# issue 94's, for bf16 on a CPU that runs it natively (the eager step a user gets by default): the same eight blocks
TARGETS_BF16 = {"se": 0.95, "eca": 0.95, "gc": 0.95, "spatial": 0.90, "cbam": 0.90, "coord": 0.90, "nonlocal": 0.85,
                "mhsa2d": 0.60}


def targets_for(precision: str) -> Dict[str, float]:
    """The targets a measurement in ``precision`` is judged by: issue 94's in bf16, issue 70's otherwise."""
    return TARGETS_BF16 if precision == "bf16" else TARGETS


# every registered feature-map block (each has configs/attention/resnet_fast_<block>.yaml): the targets' eight
# first, in their order, then the others by name
BLOCKS = tuple([b for b in TARGETS if b in visattn.list_attention("feature")]
               + [b for b in visattn.list_attention("feature") if b not in TARGETS and b != BASELINE])
QUICK_CPU_BATCH = 16
PREPARED_REVISION = ROOT / "data" / "gpu_check" / "REVISION"  # bash bench/gpu_check.sh --prepare writes it


# ---- the blocks as an earlier revision had them ---------------------------------------------------------------

COLLECT = '''"""Stands in for visattn.registry: collects the block classes by name (the real one refuses a name twice)."""
BLOCKS = {}


def register_attention(name, **meta):
    def deco(cls):
        BLOCKS[name] = cls
        return cls

    return deco
'''
LOADED: List[str] = []  # the throwaway packages made so far (one per load_before call)


class BeforeError(ConfigError, SystemExit):
    """A ``--before`` that names neither a revision nor a folder of its files: one line and exit 2 through
    ``run_main`` (a ConfigError), and still a SystemExit for callers of :func:`load_before`."""


def before_source(rev: str, name: str) -> str:
    """The text of ``visattn/attention/<name>.py`` at ``rev``: a git revision, or a folder holding that revision's
    ``visattn/attention`` files (where the tree travels without its git history: the GPU check's
    ``data/gpu_check/before``, written by ``bash bench/gpu_check.sh --prepare``)."""
    folder = Path(rev)
    if folder.is_dir():
        path = folder / f"{name}.py"
        if not path.is_file():
            raise BeforeError(f"--before {rev}: the folder has no {name}.py")
        return path.read_text()
    got = subprocess.run(["git", "show", f"{before_commit(rev)}:visattn/attention/{name}.py"], cwd=ROOT, capture_output=True,
                         text=True)
    if got.returncode:
        said = got.stderr.strip().splitlines() or [f"git show exited {got.returncode}"]
        raise BeforeError(f"--before {rev}: not a revision of this repository, nor a folder of its visattn/attention "
                          f"files ({said[-1]})")
    return got.stdout


def before_commit(rev: str) -> str:
    """The commit ``--before`` names (:func:`bench.common.revision`: never an option-like string), or one line."""
    try:
        return revision("--before", rev)
    except ConfigError as e:
        raise BeforeError(f"{e}, nor a folder of its visattn/attention files") from None


def before_files(rev: str) -> List[str]:
    """The module names (``channel``, ...) of the ``visattn/attention`` files at ``rev`` (a git revision, or a
    folder of its files as :func:`before_source` takes)."""
    folder = Path(rev)
    if folder.is_dir():
        return sorted(f.stem for f in folder.glob("*.py"))
    got = subprocess.run(["git", "ls-tree", "--name-only", before_commit(rev), "visattn/attention/"], cwd=ROOT, capture_output=True,
                         text=True)
    if got.returncode:
        said = got.stderr.strip().splitlines() or [f"git ls-tree exited {got.returncode}"]
        raise BeforeError(f"--before {rev}: not a revision of this repository, nor a folder of its visattn/attention "
                          f"files ({said[-1]})")
    return sorted(Path(f).stem for f in got.stdout.split() if f.endswith(".py"))


REGISTERS = re.compile(r"""^@register_attention\(\s*["'](\w+)["']""", re.M)  # a block file's registrations


def before_label(rev: str) -> str:
    """What the JSON calls the "before" blocks: the revision, also for a folder of its files (its REVISION)."""
    stamp = Path(rev) / "REVISION"
    return stamp.read_text().strip() if Path(rev).is_dir() and stamp.is_file() else rev


def load_before(rev: str) -> Dict[str, type]:
    """The block classes of ``visattn/attention`` at ``rev`` (:func:`before_source`), by registered name:
    ``channel.py``, ``spatial.py``, ``self_attn2d.py`` (the blocks' first files: a revision or folder without
    them is refused), every other file of ``rev`` that registers one of :data:`BLOCKS`, and the sibling modules
    they import, written into a throwaway package whose ``registry`` only collects the classes; its other ``..``
    imports are today's modules. A block ``rev`` did not register is absent (measured "after" only)."""
    tmp = Path(tempfile.mkdtemp(prefix="visattn-before-"))
    atexit.register(shutil.rmtree, tmp, True)
    package = f"visattn_before_{len(LOADED)}_{tmp.name.rpartition('-')[2]}"  # unique even if this file loads twice
    LOADED.append(package)
    pkg = tmp / package
    (pkg / "attention").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "attention" / "__init__.py").write_text("")
    (pkg / "registry.py").write_text(COLLECT)
    todo, done = ["self_attn2d", "spatial", "channel"], []
    for name in before_files(rev):  # the files that registered a block measured here (they may have moved)
        if name not in todo and set(REGISTERS.findall(before_source(rev, name))) & set(BLOCKS):
            todo.insert(0, name)
    while todo:
        name = todo.pop()
        text = before_source(rev, name)
        (pkg / "attention" / f"{name}.py").write_text(text)
        done.append(name)
        todo += [m for m in re.findall(r"^from \.(\w+) import", text, re.M) if m not in done + todo]
        for up in re.findall(r"^from \.\.(\w+) import", text, re.M):
            if up != "registry":
                sys.modules.setdefault(f"{package}.{up}", importlib.import_module(f"visattn.{up}"))
    # the package from its folder (its modules found through its __path__, not sys.path)
    spec = importlib.util.spec_from_file_location(package, pkg / "__init__.py", submodule_search_locations=[str(pkg)])
    sys.modules[package] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules[package])
    for name in done:
        try:
            importlib.import_module(f"{package}.attention.{name}")
        except Exception as e:  # a damaged or foreign file in a --before folder: one line, not its traceback
            raise BeforeError(f"--before {rev}: {name}.py does not load ({type(e).__name__}: {e})") from None
    return importlib.import_module(f"{package}.registry").BLOCKS


def block_feeds(model: nn.Module, x: torch.Tensor, precision: str = "fp32") -> Dict[str, Tuple[torch.Size, torch.dtype]]:
    """The input shape and dtype of every attention slot (module path ending in ``attn``) in one forward pass of
    ``x`` under ``precision``'s autocast: in bf16 the maps reach the blocks in bf16, from the convolution and BN
    before them, and that is the path a block's own speed must be measured on."""
    seen: Dict[str, Tuple[torch.Size, torch.dtype]] = {}

    def record(name: str):
        return lambda module, inputs: seen.setdefault(name, (inputs[0].shape, inputs[0].dtype)) and None

    hooks = [m.register_forward_pre_hook(record(n)) for n, m in model.named_modules() if n.split(".")[-1] == "attn"]
    was = model.training
    with torch.no_grad(), evaluate.autocast(x.device, precision):
        model.eval()(x)
    model.train(was)
    for h in hooks:
        h.remove()
    return seen


def block_inputs(model: nn.Module, x: torch.Tensor) -> Dict[str, torch.Size]:
    """The input shape of every attention slot (module path ending in ``attn``) in one forward pass of ``x``."""
    return {name: shape for name, (shape, _) in block_feeds(model, x).items()}


def swap_blocks(model: nn.Module, name: str, cls: type, kwargs: dict, example: torch.Tensor) -> nn.Module:
    """A copy of ``model`` whose ``name`` blocks are ``cls`` instances (built for the same channels and options)
    carrying the same weights, on the same device and in the same memory format."""
    now = type(visattn.create_attention(name, 64, **kwargs))
    shapes = block_inputs(model, example)
    out = copy.deepcopy(model)
    swapped = 0
    for path, shape in shapes.items():
        block = out.get_submodule(path)
        if type(block) is not now:
            continue
        old = cls(shape[1], **kwargs)
        old.load_state_dict(block.state_dict())
        p = next(block.parameters())
        old.to(device=p.device, dtype=p.dtype).to(memory_format=torch.channels_last).train(block.training)
        parent, _, child = path.rpartition(".")
        setattr(out.get_submodule(parent) if parent else out, child, old)
        swapped += 1
    if not swapped:
        raise SystemExit(f"blocks.py: no {name!r} block found in the model to swap")
    return out


# ---- the recipe's training step and the blocks alone, before and after ----------------------------------------

Key = Tuple[str, ...]  # ("step", block, impl, "eager" | "compiled") or ("alone", block, impl, shape)


def build_recipe(args: argparse.Namespace, before: Dict[str, type]):
    """The models of every config (``after``; ``before`` with the old blocks swapped in, for the blocks that
    ``before`` has), the batches, the precision, each block's options and the three feature maps the blocks see
    (shape and dtype)."""
    from bench.speed import build

    device = torch.device(args.device)
    precision = evaluate.resolve_precision(args.precision, device)
    models: Dict[Tuple[str, str], nn.Module] = {}
    kwargs: Dict[str, dict] = {}
    for block in (BASELINE, *args.only):
        config = ROOT / "configs" / "attention" / f"resnet_fast_{block}.yaml"
        setup = build(str(config), args.batch, args.steps, precision)
        model = setup.model.to(device)
        if block == BASELINE:
            batches = [(x.to(device), y.to(device)) for x, y in setup.batches]
            # (shape, dtype) of each map the blocks see, as autocast hands them over (bf16 under bf16)
            shapes = list(dict.fromkeys(block_feeds(model, batches[0][0], precision).values()))
            models[block, "-"] = model
            continue
        kwargs[block] = load_config(config).model.options()["attn_kwargs"]
        models[block, "after"] = model
        if block in before:  # a block registered since that revision has no "before"
            models[block, "before"] = swap_blocks(model, block, before[block], kwargs[block], batches[0][0])
    return models, batches, precision, kwargs, shapes


def step_flop(models, batch, precision: str) -> Dict[str, int]:
    """FLOP of one recipe step of each config's network (``none`` and every block as it is now) on ``batch``:
    convolutions and matmuls, the CPU flash-attention kernel included (``bench.speed.step_flops``)."""
    from bench.speed import step_flops

    return {block: step_flops(model, *batch, precision, cpu_attention=True)
            for (block, impl), model in models.items() if impl != "before"}


def step_variants(models, batches, precision: str, compile_: bool) -> List[Tuple[Key, Callable[[], None]]]:
    """One callable per (block, implementation, eager or compiled): the recipe's training steps on ``batches``."""
    from bench.speed import make_step

    out = []
    if compile_:  # one network per variant, all through the same forward code: past dynamo's default of 8
        # compilations per code object the later ones would quietly run eager
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(models))
    for (block, impl), model in models.items():
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, nesterov=True)
        kinds = [("eager", model)] + ([("compiled", torch.compile(model, dynamic=False))] if compile_ else [])
        for kind, m in kinds:
            step = make_step(m, opt, precision)
            out.append((("step", block, impl, kind), lambda step=step: [step(x, y) for x, y in batches]))
    return out


def alone_variants(blocks: Sequence[str], before: Dict[str, type], kwargs: Dict[str, dict], shapes, device: str,
                   precision: str) -> List[Tuple[Key, Callable[[], None]]]:
    """One callable per (block, implementation, feature map): forward + backward of the block alone ("before"
    only for the blocks ``before`` has); ``kwargs``: each block's options; ``shapes``: the ``(shape, dtype)`` of
    each map the recipe's network hands its blocks. The map and its upstream gradient are made in that dtype (bf16
    under bf16 autocast, as the convolution and BN before the block write it), channels-last, so the block runs
    the path it runs inside the network: an fp32 map would send it down autocast's casts instead."""
    out = []
    for block in blocks:
        for shape, dtype in shapes:
            torch.manual_seed(0)
            after = visattn.create_attention(block, shape[1], **kwargs[block])
            impls = [("after", after)]
            if block in before:
                old = before[block](shape[1], **kwargs[block])
                old.load_state_dict(after.state_dict())
                impls.insert(0, ("before", old))
            x = torch.randn(shape, device=device).to(dtype).contiguous(memory_format=torch.channels_last)
            x.requires_grad_()
            g = torch.randn_like(x)
            for impl, m in impls:
                m = m.to(device).to(memory_format=torch.channels_last).train()
                out.append((("alone", block, impl, "x".join(map(str, shape))), _fwd_bwd(m, x, g, precision)))
    return out


def _fwd_bwd(block: nn.Module, x: torch.Tensor, g: torch.Tensor, precision: str) -> Callable[[], None]:
    def run() -> None:
        with evaluate.autocast(x.device, precision):
            y = block(x)
        y.backward(g.to(y.dtype))
        x.grad = None
        block.zero_grad(set_to_none=True)
    return run


def results(times: Dict[Key, List[float]], warm: Dict[Key, float], blocks: Sequence[str], images: int,
            meta: dict, flop: Optional[Dict[str, int]] = None) -> dict:
    """The measurement as the JSON holds it: ``rows`` (one per config, implementation ``path`` and step kind, the
    form ``bench/attention_report.py`` reads), each block's ratios to ``none`` (same step kind, medians), the
    blocks alone in ms, the issue's targets and whether the "after" ratio meets each, the machine, and every
    timed call's seconds with each variant's warm-up (compilation) seconds. With ``flop`` (each config's FLOP per
    step), ``gflop`` and each block's ``flop_ceiling``: ``none``'s FLOP over the block network's, the whole-step
    ratio the block would reach if its added FLOP ran as fast as the rest of the step (no overhead at all).
    A block without an earlier implementation has ``"before": null`` in its ratios and times; one without a
    target (:data:`TARGETS`) is absent from ``targets`` and ``met``."""
    med = {k: statistics.median(v) for k, v in times.items()}
    ips = {k[1:]: images / t for k, t in med.items() if k[0] == "step"}
    kinds = [k for k in ("eager", "compiled") if (BASELINE, "-", k) in ips]
    rows = [{"config": f"configs/attention/resnet_fast_{b}.yaml", "block": b, "path": impl, "step": kind,
             "images_per_s": v, "ratio": v / ips[BASELINE, "-", kind], "precision": meta["precision"],
             "batch_size": meta["batch_size"]} for (b, impl, kind), v in ips.items()]
    ratios = {b: {k: {i: ips[b, i, k] / ips[BASELINE, "-", k] if (b, i, k) in ips else None for i in IMPLS}
                  for k in kinds} for b in blocks}
    alone: Dict[str, Dict[str, Dict[str, Optional[float]]]] = {}
    for (what, b, impl, shape), t in med.items():
        if what == "alone":
            alone.setdefault(b, {}).setdefault(shape, dict.fromkeys(IMPLS))[impl] = 1e3 * t
    aimed, goal = [b for b in blocks if b in TARGETS], targets_for(meta["precision"])
    return {**meta, "note": note(meta), "targets": {b: goal[b] for b in aimed}, "ratios": ratios,
            "met": {b: {k: ratios[b][k]["after"] >= goal[b] for k in kinds} for b in aimed},
            **({"gflop": {b: round(f / 1e9, 2) for b, f in flop.items()},
                "flop_ceiling": {b: flop[BASELINE] / flop[b] for b in blocks}} if flop else {}),
            "alone_ms": alone, "rows": rows, "seconds": {"/".join(k): [round(t, 4) for t in v] for k, v in times.items()},
            "warmup_seconds": {"/".join(k): round(t, 2) for k, t in warm.items()}}


def machine(args: argparse.Namespace, precision: str) -> dict:
    """Where and how the figures were measured."""
    cuda = args.device.startswith("cuda")
    native = torch.cuda.is_bf16_supported() if cuda else evaluate.cpu_has_native_bf16()
    def git(*argv: str) -> str:  # "" where the tree has no git history, or the machine no git
        try:
            return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        except OSError:
            return ""

    head = git("rev-parse", "--short", "HEAD")
    if head:
        head += " with uncommitted block edits" if git("status", "--porcelain", "--", "visattn/attention") else ""
    elif PREPARED_REVISION.is_file():  # a tree sent to the GPU without its history: what --prepare recorded
        head = PREPARED_REVISION.read_text().strip()
    rev = git("rev-parse", "HEAD")  # the whole tree's revision (every results file records one), -dirty with changes
    rev += "-dirty" if rev and git("status", "--porcelain", "--untracked-files=no") else ""
    return {"command": command(args.argv, __file__), "git": rev or head or "unknown",
            "device": args.device,
            "cpu": cpu_name(), "kernels": kernels(args.device), "native_bf16": bool(native), "precision": precision,
            "threads": torch.get_num_threads(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
            "batch_size": args.batch_or_recipe, "steps": args.steps, "repeats": args.repeats, "quick": args.quick,
            "before": before_label(args.before), "after": head or "?",
            **({"cpu_heap": args.cpu_heap} if getattr(args, "cpu_heap", None) else {})}


def note(meta: dict) -> str:
    """What the figures are, in a line for the JSON and the docs."""
    if meta["precision"] != "bf16" and not meta["native_bf16"] and meta["device"] == "cpu":
        return (f"Measured in {meta['precision']}, the precision the recipe runs at on this CPU ({meta['kernels']}, no "
                "native bf16: bf16 autocast is emulated there and many times slower than fp32, so a bf16 ratio would "
                "say nothing). The issue's targets, set for bf16, are checked against these figures; the bf16 line "
                "awaits a CPU with native bf16.")
    if meta["precision"] == "bf16" and not meta["native_bf16"]:
        return f"Measured in bf16, emulated on this {meta['kernels']} CPU (no native bf16): no guide to a CPU that has it."
    return f"Measured in {meta['precision']} on {meta['kernels']}."


def recipe_args(argv: Sequence[str]) -> argparse.Namespace:
    p = parser(__doc__, threads=True, precision="auto", precisions=("auto", "fp32", "bf16", "fp16"), batch=True,
               repeats=5, warmup=1, device="cpu", out=True,
               help={"precision": "autocast precision (auto: the recipe's, bf16 where native, else fp32)",
                     "batch": "images per step (default: the recipe's, 512)",
                     "out": "write the JSON here (bench/results/block_speed.json)"})
    p.add_argument("--steps", type=int, default=1, help="training steps per timed call")
    p.add_argument("--before", default=BEFORE, help="git revision whose blocks are 'before', or a folder of its "
                   "visattn/attention files (gpu_check.sh --prepare writes data/gpu_check/before; default: %(default)s)")
    p.add_argument("--only", nargs="+", choices=BLOCKS, default=list(BLOCKS), help="blocks to measure (none always)")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="eager steps only")
    p.add_argument("--quick", action="store_true",
                   help=f"a dry run: one repeat of one step, eager only, batch {QUICK_CPU_BATCH} on a CPU "
                        "(unless --batch); its times are no claim")
    p.add_argument("--table", type=Path, nargs="?", const=SPEED, default=None, metavar="JSON",
                   help="print the tables of a measurement's JSON (default: %(const)s) and stop: the docs' block")
    p.add_argument("--profile", type=Path, default=PROFILE, metavar="JSON",
                   help="the memory-traffic ceilings the tables show, where measured on the same machine "
                        "(python -m bench.bf16_profile's; default: %(default)s)")
    p.add_argument("--vs-timm", action="store_true",
                   help="instead: each block against timm's (its own options: python -m bench.blocks --vs-timm --help)")
    args = p.parse_args(argv)
    args.argv = list(argv)
    check_at_least("--steps", args.steps, 1)
    if args.quick:
        args.repeats, args.steps, args.compile = 1, 1, False
        if not args.batch and not args.device.startswith("cuda"):
            args.batch = QUICK_CPU_BATCH
    return args


def recipe_main(argv: Sequence[str]) -> None:
    args = recipe_args(argv)
    if args.table:
        print(read_table(args.table, args.profile))
        return
    if resolve_device(args.device).type == "cpu":
        args.cpu_heap = "keep" if cpu_heap.keep_freed_memory() else "system"  # as train.py sets it on a CPU
    before = load_before(args.before)
    models, batches, precision, kwargs, shapes = build_recipe(args, before)
    args.batch_or_recipe = batches[0][0].shape[0]
    flop = step_flop(models, batches[0], precision)
    variants = step_variants(models, batches, precision, args.compile)
    variants += alone_variants(args.only, before, kwargs, shapes, args.device, precision)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    timed = interleaved(dict(variants), args.repeats, args.warmup, sync)  # the order reversed every other repeat
    total = sum(timed.warmup.values()) + sum(t for ts in timed.seconds.values() for t in ts)
    meta = dict(machine(args, precision), total_seconds=round(total))
    data = results(timed.seconds, timed.warmup, args.only, args.batch_or_recipe * args.steps, meta, flop)
    if args.out:  # before the tables: a damaged profile must not cost the measurement
        write_atomic(args.out, json.dumps(data, indent=1) + "\n")
    print(tables(data, args.profile))
    if args.out:
        print(f"\nwrote {args.out}")


# ---- against timm's blocks (--vs-timm) -----------------------------------------------------------------------


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


VARIANTS = ("visattn eager", "timm eager", "visattn compiled", "timm compiled")
TIMM_DOC = """Each block against timm's equivalent: forward + backward in train mode, eager and compiled."""


def timm_args(argv: Sequence[str]) -> argparse.Namespace:
    p = parser(TIMM_DOC, prog="blocks.py --vs-timm", threads=True, precision="fp32", precisions=("fp32", "bf16"),
               batch=128, repeats=7, warmup=2, aliases={"precision": ("--dtype",)},
               help={"precision": "bf16: run under CPU autocast (also spelled --dtype; default: %(default)s)",
                     "batch": "the inputs' batch (default: %(default)s)",
                     "repeats": "timed forward+backward calls per block and side (default: %(default)s)"})
    p.add_argument("--channels", type=int, default=64)
    p.add_argument("--size", type=int, default=32, help="feature-map height and width")
    p.add_argument("--dim", type=int, default=192)
    p.add_argument("--heads", type=int, default=3)
    p.add_argument("--tokens", type=int, default=65)
    p.add_argument("--only", nargs="*", default=None, help="row names to run (default: all)")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="eager only (no torch.compile)")
    args = p.parse_args(list(argv))
    for flag in ("channels", "size", "dim", "heads", "tokens"):
        check_at_least(f"--{flag}", getattr(args, flag), 1)
    return args


def vs_timm_main(argv: Sequence[str]) -> None:
    args = timm_args(argv)
    torch.manual_seed(0)
    table = rows(args.channels, args.dim, args.heads)
    if args.only:
        table = [r for r in table if r[0] in args.only]
    inputs = {
        "map": torch.randn(args.batch, args.channels, args.size, args.size),
        "tokens": torch.randn(args.batch, args.tokens, args.dim),
    }
    grads = {k: torch.randn_like(v) for k, v in inputs.items()}
    names = VARIANTS if args.compile else VARIANTS[:2]
    variants: Dict[Tuple[str, str], Callable[[], None]] = {}
    for name, _, ours, ref, kind in table:
        o, r = ours().train(), ref().train()
        built = {"visattn eager": o, "timm eager": r}
        if args.compile:  # the compiled modules share the eager ones' parameters
            built["visattn compiled"] = torch.compile(o, fullgraph=True, dynamic=False)
            built["timm compiled"] = torch.compile(r, dynamic=False)
        x = inputs[kind].clone().requires_grad_()  # one input per block, both sides
        for v in names:
            variants[name, v] = _fwd_bwd(built[v], x, grads[kind], args.precision)
    timed = interleaved(variants, args.repeats, args.warmup)  # the warm-up compiles the compiled variants
    med = {k: statistics.median(v) * 1e3 for k, v in timed.seconds.items()}
    timm_table(med, table, args, sum(timed.warmup.values()))


def timm_table(med: Dict[Tuple[str, str], float], table: List[Row], args: argparse.Namespace, t_warm: float) -> None:
    print(
        f"visattn blocks vs timm, forward+backward, train mode, {args.precision}"
        f"{' (CPU autocast)' if args.precision == 'bf16' else ''}; torch {torch.__version__}, timm {timm.__version__}, "
        f"{torch.get_num_threads()} thread(s), {platform.processor() or platform.machine()}"
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


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--vs-timm" in argv:
        vs_timm_main([a for a in argv if a != "--vs-timm"])
    else:
        recipe_main(argv)


if __name__ == "__main__":
    run_main(main, "blocks.py")
