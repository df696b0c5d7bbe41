"""What the faithfulness scalars (and the gradient maps) cost a training epoch, as a ratio to that epoch's
training time measured in the same process.

    python bench/faithfulness_cost.py [--configs configs/attention/resnet_fast_cbam.yaml ...] [--steps 3] [--repeats 3]
    python bench/faithfulness_cost.py --steps 1 --repeats 1 --epoch-images 2000     # a quick look

Per config: ``--steps`` training steps are timed (``trainer.train_one_epoch`` on the config's batch size,
precision, augmentation and channels-last setting, as ``bench/maps_overhead.py`` does) and extrapolated to an
epoch of ``--epoch-images`` images (45,000: CIFAR-10's training images less the held-out 5,000). One map-logging
call is timed as the trainer makes it (``log_attention_maps`` with the config's ``log.probe_size`` probe
images, ``log.map_scale``, ``log.head_maps``, ``log.map_norm``, then ``writer.flush()``) in three variants,
interleaved with the training steps, medians over ``--repeats``:

* ``plain``: no gradient maps, no faithfulness (the logger before gradient maps);
* ``grad``: the default: gradient maps (one backward pass over the probe), no faithfulness;
* ``faithful``: gradient maps and the faithfulness scalars (``log.faithfulness=true``: deletion and insertion
  curves of every map on the probe, :data:`visattn.maps.tensorboard.FAITHFULNESS_PROBE`).

Each cost is a difference of medians (``grad - plain``, ``faithful - grad``) per logging call, divided by
``log.maps_every`` and by the epoch's training time. The last column says whether the faithfulness scalars fit
the budget of ``--budget`` (5%) of an epoch: where they do, ``log.faithfulness`` should be on by default.
``--out FILE`` also writes the rows as JSON. Real CIFAR-10 images are used when the config's data.root is
there, random ones otherwise (said in the output).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from visattn import evaluate, trainer  # noqa: E402
from visattn.config import Config, load_config  # noqa: E402
from visattn.data import Placement, TensorLoader, normalize  # noqa: E402
from visattn.maps import MapSettings, log_attention_maps  # noqa: E402
from visattn.options import describe  # noqa: E402

DEFAULT_CONFIGS = ("configs/attention/resnet_fast_cbam.yaml", "configs/attention/resnet_fast_gc.yaml",
                   "configs/attention/resnet_fast_coord.yaml", "configs/cct_2.yaml", "configs/vit_tiny.yaml")
VARIANTS = {"plain": dict(gradient_maps=False, faithfulness=False), "grad": dict(gradient_maps=True, faithfulness=False),
            "faithful": dict(gradient_maps=True, faithfulness=True)}
EPOCH_IMAGES = 45_000


def _overhead_module():
    spec = importlib.util.spec_from_file_location("maps_overhead", ROOT / "bench" / "maps_overhead.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure(cfg: Config, steps: int, repeats: int, epoch_images: int, budget: float) -> Dict[str, Any]:
    """One config's row: seconds per training step and epoch, and each logging variant's median seconds."""
    mo = _overhead_module()
    dev = torch.device("cpu")
    precision = evaluate.resolve_precision(cfg.precision, dev)
    bs = cfg.train.batch_size
    train_images, eval_images, source = mo.images_for(cfg, bs * (steps + 1))
    model = mo.build(cfg, train_images)
    o = cfg.optim
    opt = trainer.build_optimizer(model, o.name, o.lr, o.weight_decay, o.momentum, o.nesterov, o.betas,
                                 o.no_decay_norm_bias)
    sched = trainer.StepScheduler(opt, "constant", o.lr, 10**9, 0)
    loader = TensorLoader(train_images, bs, cfg.data.mean, cfg.data.std, train=True, augment=cfg.data.augment,
                          seed=0, placement=Placement(channels_last=cfg.channels_last))
    k = min(cfg.log.probe_size, len(eval_images))
    probe = normalize(torch.from_numpy(eval_images.x[:k]).permute(0, 3, 1, 2), cfg.data.mean, cfg.data.std)
    labels = torch.from_numpy(eval_images.y[:k]).long()

    def train_steps() -> float:
        it = iter(loader)
        trainer.train_one_epoch(model, [next(it)], trainer.Optimization(opt, sched), trainer.StepPolicy(dev, precision))
        rest = list(it)
        t = time.perf_counter()
        trainer.train_one_epoch(model, rest, trainer.Optimization(opt, sched), trainer.StepPolicy(dev, precision))
        return (time.perf_counter() - t) / len(rest)

    def log_call(writer: Any, variant: str, step: int) -> float:
        t = time.perf_counter()
        settings = MapSettings(cfg.data.mean, cfg.data.std, eval_images.classes, scale=cfg.log.map_scale,
                               head_maps=cfg.log.head_maps, norm=cfg.log.map_norm, **VARIANTS[variant])
        log_attention_maps(writer, model, probe, labels, step, settings)
        writer.flush()
        return time.perf_counter() - t

    from torch.utils.tensorboard import SummaryWriter

    step_s: List[float] = []
    log_s: Dict[str, List[float]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        writer = SummaryWriter(tmp)
        for v in VARIANTS:  # warm-up: fonts, colormaps, the PNG encoder
            log_call(writer, v, 0)
        for r in range(repeats):
            step_s.append(train_steps())
            for v in VARIANTS:
                log_s[v].append(log_call(writer, v, r + 1))
        writer.close()
    epoch = statistics.median(step_s) * (epoch_images // bs)
    med = {v: statistics.median(t) for v, t in log_s.items()}
    every = max(cfg.log.maps_every, 1)
    grad, faithful = (med["grad"] - med["plain"]) / every, (med["faithful"] - med["grad"]) / every
    return {"config": cfg.name, "model": cfg.model.name, "batch": bs, "precision": precision, "probe": k,
            "step_s": statistics.median(step_s), "epoch_s": epoch, "epoch_images": epoch_images,
            "log_s": med, "grad_s": grad, "faithfulness_s": faithful, "grad_ratio": grad / epoch,
            "faithfulness_ratio": faithful / epoch, "faithfulness_on_by_default": faithful / epoch <= budget,
            "data": "synthetic images" if cfg.data.source == "synthetic" else source}


def main(argv: List[str] = None) -> int:
    ap = argparse.ArgumentParser(description=describe(__doc__))
    ap.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS))
    ap.add_argument("--steps", type=int, default=3, help="timed training steps per repeat")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats (medians are reported)")
    ap.add_argument("--epoch-images", type=int, default=EPOCH_IMAGES, help="training images per epoch")
    ap.add_argument("--budget", type=float, default=0.05, help="the share of an epoch the scalars may cost")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides for every config")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default=None, help="also write the rows as JSON to this file")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average at start {load[0]:.2f}")
    print(f"{'config':<28}{'s/step':>8}{'epoch s':>9}{'plain s':>9}{'grad s':>8}{'faithful s':>12}"
          f"{'grad/epoch':>12}{'faith./epoch':>14}  on by default (<= {args.budget:.0%})")
    rows = []
    for path in args.configs:
        cfg = load_config(path, ["log.progress=false", *args.set])
        r = measure(cfg, args.steps, args.repeats, args.epoch_images, args.budget)
        rows.append(r)
        lg = r["log_s"]
        print(f"{r['config']:<28}{r['step_s']:>8.3f}{r['epoch_s']:>9.1f}{lg['plain']:>9.2f}{lg['grad']:>8.2f}"
              f"{lg['faithful']:>12.2f}{r['grad_ratio']:>12.2%}{r['faithfulness_ratio']:>14.2%}  "
              f"{'yes' if r['faithfulness_on_by_default'] else 'no'}")
        print(f"{'':<28}({r['epoch_images'] // r['batch']} steps of {r['batch']}, {r['precision']}, probe {r['probe']}, "
              f"{r['data']})")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
