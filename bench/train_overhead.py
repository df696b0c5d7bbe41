"""Images/s of visattn's training loop against a bare PyTorch loop, and bf16 against fp32, in one process.

    python bench/train_overhead.py [--config configs/cifar10_cpu.yaml] [--batch 512] [--steps 12] [--repeats 3]

The model is the config's (default: the CPU recipe's network, with its options).

Baseline ("bare"): a plain loop over batches already in memory — autocast forward, cross-entropy,
zero_grad, backward, SGD step — on the same model, batch size and precision. "visattn" is
``trainer.train_one_epoch`` fed by the ``TensorLoader`` (batch gather, normalisation, and in the "+aug" row
the pad-crop and flip augmentation), with its schedule, statistics and non-finite checks. Repeats are
interleaved and the median is reported; the ratio is visattn / bare (1.0 = no overhead).
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import parser  # noqa: E402
from visattn import evaluate, trainer  # noqa: E402
from visattn.config import load_config  # noqa: E402
from visattn.data import ImageSet, Placement, TensorLoader  # noqa: E402
from visattn.errors import run_main  # noqa: E402
from visattn.models import create_model  # noqa: E402


def bare_loop(model, batches, opt, precision):
    model.train()
    t = time.perf_counter()
    for xb, yb in batches:
        with evaluate.autocast(torch.device("cpu"), precision):
            out = model(xb)
        loss = F.cross_entropy(out.float(), yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return time.perf_counter() - t


def visattn_loop(model, loader, opt, sched, precision):
    t = time.perf_counter()
    trainer.train_one_epoch(model, loader, trainer.Optimization(opt, sched), trainer.StepPolicy(torch.device("cpu"), precision))
    return time.perf_counter() - t


def main() -> None:
    ap = parser(__doc__, threads=True, batch=512, repeats=3)
    ap.add_argument("--config", default="configs/cifar10_cpu.yaml", help="the model (and its options) to time")
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    torch.manual_seed(0)
    n = args.batch * args.steps
    rng = np.random.default_rng(0)
    images = ImageSet(rng.integers(0, 255, (n, 32, 32, 3), dtype=np.uint8), rng.integers(0, 10, n), tuple("abcdefghij"))
    cfg = load_config(args.config, [])
    dcfg = cfg.data
    mean, std = dcfg.mean, dcfg.std

    def make(precision):
        model = create_model(cfg.model.name, num_classes=10, **cfg.model.options()).to(memory_format=torch.channels_last)
        opt = trainer.build_optimizer(model, "sgd", 0.05, 5e-4)
        return model, opt

    results = {}
    for precision in ("bf16", "fp32"):
        model, opt = make(precision)
        sched = trainer.StepScheduler(opt, "constant", 0.05, 10**6, 0)
        plain = TensorLoader(images, args.batch, mean, std, train=True, augment=None, seed=0, placement=Placement(channels_last=True))
        aug = TensorLoader(images, args.batch, mean, std, train=True, augment=dcfg.augment, seed=0, placement=Placement(channels_last=True))
        batches = [(xb.clone(), yb.clone()) for xb, yb in plain]  # the bare loop's data: ready in memory
        plain.set_epoch(0)
        # warm-up (allocator, oneDNN primitive caches)
        bare_loop(model, batches[:2], opt, precision)
        times = {"bare": [], "visattn": [], "visattn+aug": []}
        reps = args.repeats if precision == "bf16" else 1
        for _ in range(reps):
            times["bare"].append(bare_loop(model, batches, opt, precision))
            times["visattn"].append(visattn_loop(model, plain, opt, sched, precision))
            if precision == "bf16":
                times["visattn+aug"].append(visattn_loop(model, aug, opt, sched, precision))
        results[precision] = {k: n / statistics.median(v) for k, v in times.items() if v}

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


if __name__ == "__main__":
    run_main(main, "train_overhead.py")
