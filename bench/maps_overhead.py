"""What attention-map logging costs a training epoch, and proof that recording off costs nothing.

    python bench/maps_overhead.py [--configs configs/attention/resnet_fast_cbam.yaml ...] [--steps 3] [--repeats 3]

1. Epoch time with map logging on against off, per config (default: the resnet_fast+cbam CPU recipe, the
   plain vit_tiny and the class-token vit_tiny_lsa_spt), for the real data's size: 45,000 training images
   per epoch. The script times ``--steps`` training steps (``trainer.train_one_epoch`` on the config's batch
   size, precision, augmentation and channels-last setting) and extrapolates to the epoch's steps; it times
   one map-logging call exactly as the trainer makes it (``visattn.maps.MapLogger.log``: log.probe_size validation
   images, log.map_scale, log.head_maps, with the config's defaults, then ``writer.flush()``) and adds it
   once per epoch (log.maps_every=1, the default). Step and logging repeats are interleaved; medians.
   A config whose model has class-token layers also gets a row with ``head_maps=all`` (one image per head
   of every layer, the logger's own default before log.head_maps existed), for comparison.
2. Recording off: a model that never saw a recorder against an identical copy that had one attached
   (a recorded forward pass) and detached again. Outputs (eval forward; train-mode forward and gradients
   with the same seed) must be bitwise equal, and the forward time ratio should be ~1.0 (interleaved
   repeats, medians). The recording pass itself is timed too (for information: fused attention blocks
   compute their weights explicitly on that pass only).

Real CIFAR-10 images are used when the config's data.root is there, random ones otherwise (said in the output).
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time
from typing import Any, Dict, List, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from visattn import evaluate, trainer
from visattn.config import Config, load_config
from visattn.data import ImageSet, Placement, TensorLoader, load_splits, normalize
from visattn.errors import DataError, run_main
from visattn.maps import MapLogger, read_maps, record_attention
from visattn.models import create_model
from visattn.options import describe

EPOCH_IMAGES = 45_000  # CIFAR-10's 50,000 training images less the 5,000 held out for validation
DEFAULT_CONFIGS = ("configs/attention/resnet_fast_cbam.yaml", "configs/vit_tiny.yaml", "configs/vit_tiny_lsa_spt.yaml")


def images_for(cfg: Config, n_train: int) -> Tuple[ImageSet, ImageSet, str]:
    try:
        splits = load_splits(cfg.data, cfg.seed)
        return (ImageSet(splits.train.x[:n_train], splits.train.y[:n_train], splits.train.classes), splits.eval,
                "real CIFAR-10")
    except DataError:
        rng = np.random.default_rng(0)
        s = cfg.data.image_size
        tr = ImageSet(rng.integers(0, 256, (n_train, s, s, 3), dtype=np.uint8), rng.integers(0, 10, n_train),
                      tuple(f"class{i}" for i in range(10)))
        ev = ImageSet(tr.x[:64], tr.y[:64], tr.classes)
        return tr, ev, "random images (data.root not found)"


def build(cfg: Config, train_images: ImageSet) -> torch.nn.Module:
    torch.manual_seed(cfg.seed)
    model = create_model(cfg.model.name, num_classes=10, **cfg.model.options())
    if getattr(model, "needs_data_init", False):
        model.data_init(torch.from_numpy(train_images.x).permute(0, 3, 1, 2), cfg.data.mean, cfg.data.std)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def has_class_token_layers(model: torch.nn.Module, probe: torch.Tensor) -> bool:
    with torch.no_grad(), record_attention(model) as rec:
        model.eval()(probe[:1])
    return any(m.kind == "head" for m in read_maps(rec.records, model, probe[:1].shape, head_maps="last"))


def epoch_overhead(cfg: Config, steps: int, repeats: int) -> Tuple[List[Dict[str, Any]], str]:
    dev = torch.device("cpu")
    precision = evaluate.resolve_precision(cfg.precision, dev)
    bs = cfg.train.batch_size
    train_images, eval_images, source = images_for(cfg, bs * (steps + 1))
    model = build(cfg, train_images)
    o = cfg.optim
    opt = trainer.build_optimizer(model, o.name, o.lr, o.weight_decay, o.momentum, o.nesterov, o.betas, o.no_decay_norm_bias)
    sched = trainer.StepScheduler(opt, "constant", o.lr, 10**9, 0)
    loader = TensorLoader(train_images, bs, cfg.data.mean, cfg.data.std, train=True, augment=cfg.data.augment,
                          seed=0, placement=Placement(channels_last=cfg.channels_last))
    k = min(cfg.log.probe_size, len(eval_images))
    px = torch.from_numpy(eval_images.x[:k]).permute(0, 3, 1, 2)
    probe = (normalize(px, cfg.data.mean, cfg.data.std), torch.from_numpy(eval_images.y[:k]))
    variants = [cfg.log.head_maps]
    if cfg.log.head_maps != "all" and has_class_token_layers(model, probe[0]):
        variants.append("all")

    def train_steps() -> float:  # seconds per step; the loader's first batch warms up and is not counted
        it = iter(loader)
        trainer.train_one_epoch(model, [next(it)], trainer.Optimization(opt, sched), trainer.StepPolicy(dev, precision))
        rest = list(it)
        t, c = time.perf_counter(), time.process_time()
        trainer.train_one_epoch(model, rest, trainer.Optimization(opt, sched), trainer.StepPolicy(dev, precision))
        wall = time.perf_counter() - t
        busy.append((time.process_time() - c) / wall / torch.get_num_threads())
        return wall / len(rest)

    def log_call(writer: Any, head_maps: str, step: int) -> float:
        c = cfg.model_copy(deep=True)
        c.log.head_maps = head_maps
        t = time.perf_counter()
        MapLogger(c, eval_images.classes).log(writer, model, probe, step)
        writer.flush()
        return time.perf_counter() - t

    from torch.utils.tensorboard import SummaryWriter

    step_s: List[float] = []
    busy: List[float] = []  # CPU time / (wall time x threads) of the timed steps: ~1.0 on a quiet machine
    log_s: Dict[str, List[float]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        writer = SummaryWriter(tmp)
        for v in variants:  # warm-up: fonts, colormap tables, the PNG encoder
            log_call(writer, v, 0)
        for r in range(repeats):
            step_s.append(train_steps())
            for v in variants:
                log_s[v].append(log_call(writer, v, r + 1))
        writer.close()
    epoch_steps = EPOCH_IMAGES // bs  # the training loader drops the last partial batch
    off = statistics.median(step_s) * epoch_steps
    rows = []
    for v in variants:
        # one logging call every log.maps_every epochs
        maps = statistics.median(log_s[v]) / cfg.log.maps_every if cfg.log.maps_every else 0.0
        rows.append({"name": cfg.name + ("" if v == cfg.log.head_maps else f" head_maps={v}"), "head_maps": v,
                     "step_s": statistics.median(step_s), "busy": statistics.median(busy), "epoch_off": off,
                     "maps": maps, "epoch_on": off + maps, "ratio": (off + maps) / off, "batch": bs,
                     "epoch_steps": epoch_steps, "precision": precision})
    return rows, source


def recording_off(cfg: Config, batch: int, repeats: int) -> Dict[str, Any]:
    dev = torch.device("cpu")
    precision = evaluate.resolve_precision(cfg.precision, dev)
    train_images, _, _ = images_for(cfg, max(batch, 64))
    never = build(cfg, train_images)
    after = copy.deepcopy(never)
    x = normalize(torch.from_numpy(train_images.x[:batch]).permute(0, 3, 1, 2), cfg.data.mean, cfg.data.std)
    y = torch.from_numpy(train_images.y[:batch])
    if cfg.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)

    def fwd(model: torch.nn.Module) -> torch.Tensor:
        with torch.no_grad(), evaluate.autocast(dev, precision):
            return model.eval()(x)

    def train_fwd_bwd(model: torch.nn.Module) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        model.train()
        model.zero_grad(set_to_none=True)
        torch.manual_seed(123)  # the same dropout / drop-path draws
        with evaluate.autocast(dev, precision):
            out = model(x)
        F.cross_entropy(out.float(), y).backward()
        return out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    before = fwd(after)
    with record_attention(after) as rec:  # attach, record one pass, detach
        fwd(after)
    n_records = len(rec)
    same_eval = torch.equal(fwd(never), fwd(after)) and torch.equal(before, fwd(after))
    out_a, grads_a = train_fwd_bwd(copy.deepcopy(never))
    out_b, grads_b = train_fwd_bwd(copy.deepcopy(after))
    same_train = torch.equal(out_a, out_b) and len(grads_a) == len(grads_b) and all(
        torch.equal(a, b) for a, b in zip(grads_a, grads_b))

    def timed(fn) -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    def recording() -> None:
        with record_attention(after):
            fwd(after)

    for _ in range(2):  # warm-up
        fwd(never), fwd(after), recording()
    times: Dict[str, List[float]] = {"never": [], "after": [], "recording": []}
    for _ in range(repeats):
        times["never"].append(timed(lambda: fwd(never)))
        times["after"].append(timed(lambda: fwd(after)))
        times["recording"].append(timed(recording))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"name": cfg.name, "records": n_records, "same_eval": same_eval, "same_train": same_train,
            "never_ms": 1e3 * med["never"], "after_ms": 1e3 * med["after"], "rec_ms": 1e3 * med["recording"],
            "after_ratio": med["after"] / med["never"], "rec_ratio": med["recording"] / med["never"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=describe(__doc__))
    ap.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS))
    ap.add_argument("--steps", type=int, default=3, help="timed training steps per repeat")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats (medians are reported)")
    ap.add_argument("--fwd-batch", type=int, default=128, help="batch of the recording-off forward timing")
    ap.add_argument("--fwd-repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfgs = [load_config(p, ["log.progress=false"]) for p in args.configs]

    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average at start "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"\n1) Epoch of {EPOCH_IMAGES:,} training images, map logging on vs off. Extrapolated: the median time of one "
          f"step over {args.steps} steps x {args.repeats} repeats, times the epoch's steps; plus one map-logging call "
          "(MapLogger.log + writer.flush(), median of the same interleaved repeats) per epoch (log.maps_every=1).")
    head = (f"{'config':<34}{'batch':>6}{'s/step':>8}{'busy':>6}{'epoch off s':>13}{'maps s':>8}{'epoch on s':>12}"
            f"{'on/off':>8}")
    print(head)
    print(f"{'':<34}(busy: CPU time / (wall time x threads) of the timed steps; well under 1 means the machine was shared)")
    for cfg in cfgs:
        rows, source = epoch_overhead(cfg, args.steps, args.repeats)
        for r in rows:
            print(f"{r['name']:<34}{r['batch']:>6}{r['step_s']:>8.3f}{r['busy']:>6.2f}{r['epoch_off']:>13.1f}{r['maps']:>8.2f}"
                  f"{r['epoch_on']:>12.1f}{r['ratio']:>8.3f}")
        print(f"{'':<34}({r['epoch_steps']} steps, {r['precision']}, probe {cfg.log.probe_size}, scale "
              f"{cfg.log.map_scale}, {source})")
    print("   target: on/off <= 1.050 with the defaults (log.head_maps=last)")

    print(f"\n2) Recording off: a never-recorded model vs an identical copy after record_attention was attached and "
          f"detached; eval forward of {args.fwd_batch} images, {args.fwd_repeats} interleaved repeats, medians.")
    print(f"{'config':<22}{'records':>8}{'eval bitwise':>13}{'train bitwise':>14}{'never ms':>10}{'after ms':>10}"
          f"{'after/never':>13}{'recording ms':>14}{'rec/never':>11}")
    for cfg in cfgs:
        r = recording_off(cfg, args.fwd_batch, args.fwd_repeats)
        print(f"{r['name']:<22}{r['records']:>8}{str(r['same_eval']):>13}{str(r['same_train']):>14}{r['never_ms']:>10.1f}"
              f"{r['after_ms']:>10.1f}{r['after_ratio']:>13.3f}{r['rec_ms']:>14.1f}{r['rec_ratio']:>11.3f}")
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    print(f"load average at end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


if __name__ == "__main__":
    run_main(main, "maps_overhead.py")
