"""An independent reference: airbench94's recipe written out here, trained on visattn's data and split.

    python -m bench.reference_airbench                  # 9.9 epochs, seed 0
    python -m bench.reference_airbench --epochs 16 --seeds 0 1
    python -m bench.reference_airbench --table

Why: on the CPU copy of CIFAR-10 (JPEG at quality 75, 45,000 training images, a 5,000-image validation split
held out from them) visattn's ``resnet_fast_none`` plateaus near 91% (90.4% at 10 epochs with airbench's levers,
91.0% at 16, 91.1% at 32), where airbench94 reports 94% after 9.9 epochs on CIFAR-10's clean test images. This
script asks whether the gap is visattn's training spine or the data: everything that trains here (the network,
the frozen whitening stem, dirac initialisation, frozen-scale BatchNorm, batch-wide translation and the
alternating flip, Nesterov SGD in airbench's decoupled form, the warmup-then-linear schedule ending at 0.07x,
lookahead averaging every 5 steps, the summed loss with label smoothing 0.2, 6-view test-time augmentation)
is written in this file from airbench94's description (Jordan 2024, arXiv 2404.00498) and shares no code with
``visattn.models``, ``visattn.trainer`` or ``visattn.data.augment``. Only the images and the validation split
come from visattn (``load_splits`` on ``configs/cifar10_cpu.yaml``'s data section: the same 45,000 and 5,000
images every table uses, so the figures compare). It runs under bf16 autocast with channels-last on CPUs with
native bf16, as the recipe does, else fp32 (``--precision`` overrides).

Each finished seed is appended to ``bench/results/reference_airbench.json`` with its command and git revision
(a seed already there at the same epochs and numerics is skipped); a run is about 10 minutes at 9.9 epochs on 2 cores with AVX512-BF16.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from bench.common import ROOT, kernels, parser, provenance
from visattn.errors import ConfigError, DataError, run_main
from visattn.options import check_at_least
from visattn.results import check_rows, read_json

RESULTS = ROOT / "bench" / "results" / "reference_airbench.json"
MEAN = (0.4914, 0.4822, 0.4465)  # CIFAR-10's channel statistics, as airbench normalises
STD = (0.2470, 0.2435, 0.2616)

# airbench94's hyperparameters, per 1024 examples and decoupled (its README's form)
HYP = dict(batch_size=1024, lr=11.5, momentum=0.85, weight_decay=0.0153, bias_scaler=64.0, label_smoothing=0.2,
           whiten_bias_epochs=3, translate=2, widths=(64, 256, 256), bn_momentum=0.6, scale=1 / 9,
           warmup=0.23, final_lr=0.07, lookahead_every=5)


class FrozenScaleBN(nn.BatchNorm2d):
    """BatchNorm with its scale fixed at 1 (only the bias trains), eps 1e-12, momentum 0.6 in airbench's sense."""

    def __init__(self, c: int):
        super().__init__(c, eps=1e-12, momentum=1 - HYP["bn_momentum"])
        self.weight.requires_grad_(False)


def dirac_conv(cin: int, cout: int, k: int = 3, padding="same", bias: bool = False) -> nn.Conv2d:
    """A conv whose first ``cin`` output channels start as the identity on the input (PyTorch's default init
    elsewhere)."""
    conv = nn.Conv2d(cin, cout, k, padding=padding, bias=bias)
    with torch.no_grad():
        nn.init.dirac_(conv.weight[: min(cin, cout)])
        if bias:
            conv.bias.zero_()
    return conv


class Group(nn.Sequential):
    def __init__(self, cin: int, cout: int):
        super().__init__(dirac_conv(cin, cout), nn.MaxPool2d(2), FrozenScaleBN(cout), nn.GELU(),
                         dirac_conv(cout, cout), FrozenScaleBN(cout), nn.GELU())


class Net(nn.Module):
    def __init__(self, widths=HYP["widths"]):
        super().__init__()
        self.whiten = nn.Conv2d(3, 24, 2, padding=0, bias=True)  # 12 eigen-patches and their negatives
        self.whiten.weight.requires_grad_(False)
        w = (24, *widths)
        self.groups = nn.Sequential(*[Group(w[i], w[i + 1]) for i in range(3)])
        self.head = nn.Linear(w[-1], 10, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.groups(F.gelu(self.whiten(x)))
        x = F.adaptive_max_pool2d(x, 1).flatten(1)  # 3x3 maps after three pools of a 31x31 map
        return self.head(x) * HYP["scale"]

    @torch.no_grad()
    def init_whitening(self, images: torch.Tensor, eps: float = 5e-4) -> None:
        """Set the stem to the eigenvectors of the 2x2 patch covariance scaled by 1/sqrt(eigenvalue + eps)."""
        p = images.unfold(2, 2, 1).unfold(3, 2, 1)  # N, C, H', W', 2, 2
        p = p.permute(0, 2, 3, 1, 4, 5).reshape(-1, 12).double()
        cov = p.T @ p / len(p)
        val, vec = torch.linalg.eigh(cov)
        val, vec = val.flip(0), vec.T.flip(0)  # largest first, one eigenvector per row
        filt = (vec / torch.sqrt(val + eps)[:, None]).reshape(12, 3, 2, 2).float()
        self.whiten.weight.copy_(torch.cat([filt, -filt]))
        self.whiten.bias.zero_()


def translate(x: torch.Tensor, r: int, gen: torch.Generator) -> torch.Tensor:
    """Each image shifted by (dy, dx) in [-r, r]^2 with reflect padding (a random crop of the padded image)."""
    n, c, h, w = x.shape
    padded = F.pad(x, (r,) * 4, mode="reflect")
    dy, dx = torch.randint(0, 2 * r + 1, (2, n), generator=gen).to(x.device)
    out = torch.empty_like(x)
    for sy in range(2 * r + 1):
        for sx in range(2 * r + 1):
            m = (dy == sy) & (dx == sx)
            if m.any():
                out[m] = padded[m, :, sy:sy + h, sx:sx + w]
    return out


def tta_logits(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """airbench's 6 views: (identity + mirror) weighted 1/2, and the mirrored pair at 1-pixel shifts up-left and
    down-right, each 1/4."""
    def mirror(v):
        return 0.5 * (net(v) + net(v.flip(-1)))
    p = F.pad(x, (1,) * 4, mode="reflect")
    h, w = x.shape[-2:]
    return 0.5 * mirror(x) + 0.25 * (mirror(p[..., :h, :w]) + mirror(p[..., 2:, 2:]))


def lr_factor(step: int, total: int) -> float:
    """The learning rate at optimizer step ``step`` of ``total``, as a multiple of the peak: linear from 0.2x to
    1x over the first 23% of the steps, then linear down to 0.07x at the last step."""
    warm = max(int(total * HYP["warmup"]), 1)
    if step < warm:
        return 0.2 + 0.8 * step / warm
    return 1.0 + (HYP["final_lr"] - 1.0) * (step - warm) / max(total - warm, 1)


def reencode(x_uint8, quality: int):
    """Each image (``(N, H, W, 3)`` uint8) encoded as JPEG at ``quality`` (PIL's default 4:2:0 chroma subsampling, as
    the stored copy) and decoded again: a second, stronger loss on top of the copy's quality 75."""
    import io

    import numpy as np
    from PIL import Image

    out = np.empty_like(x_uint8)
    for i, im in enumerate(x_uint8):
        buf = io.BytesIO()
        Image.fromarray(im).save(buf, "JPEG", quality=quality)
        out[i] = np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB"))
    return out


def load_data(overrides=(), quality: int | None = None):
    """The recipe's 45,000 training and 5,000 validation images (visattn's reader and split), normalised
    channels-last float tensors, optionally re-encoded first: ``(xtr, ytr, xva, yva, eval_split)``."""
    from visattn.config import load_config
    from visattn.data import load_splits

    cfg = load_config(ROOT / "configs" / "cifar10_cpu.yaml", list(overrides))
    splits = load_splits(cfg.data, 0)
    mean, std = torch.tensor(MEAN).view(1, 3, 1, 1), torch.tensor(STD).view(1, 3, 1, 1)

    def to_tensor(x_uint8) -> torch.Tensor:
        x = torch.from_numpy(x_uint8).permute(0, 3, 1, 2).float().div_(255)
        return ((x - mean) / std).contiguous(memory_format=torch.channels_last)

    if quality is not None:  # training and validation images alike, as the stored copy is
        splits.train.x, splits.eval.x = reencode(splits.train.x, quality), reencode(splits.eval.x, quality)
    return (to_tensor(splits.train.x), torch.from_numpy(splits.train.y).long(), to_tensor(splits.eval.x),
            torch.from_numpy(splits.eval.y).long(), splits.eval_split)


def make_optimizer(net: Net) -> torch.optim.SGD:
    """Nesterov SGD with airbench's decoupled hyperparameters converted to PyTorch's form; BatchNorm biases at
    64x the learning rate with the same absolute decay."""
    kilo = 1024 * (1 + 1 / (1 - HYP["momentum"]))
    lr, wd = HYP["lr"] / kilo, HYP["weight_decay"] * HYP["batch_size"] / kilo
    biases = [m.bias for m in net.modules() if isinstance(m, FrozenScaleBN)]
    others = [p for p in net.parameters() if p.requires_grad and all(p is not b for b in biases)]
    return torch.optim.SGD([dict(params=biases, lr=lr * HYP["bias_scaler"], weight_decay=wd / (lr * HYP["bias_scaler"])),
                            dict(params=others, lr=lr, weight_decay=wd / lr)], momentum=HYP["momentum"], nesterov=True)


@torch.no_grad()
def evaluate(net: nn.Module, xva: torch.Tensor, yva: torch.Tensor, bf16: bool) -> float:
    """Validation accuracy with the 6 test-time views (:func:`tta_logits`), in batches of 1000."""
    net.eval()
    with torch.autocast(xva.device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = torch.cat([tta_logits(net, xb).float() for xb in xva.split(1000)])
    return (logits.argmax(1) == yva).float().mean().item()


def train(seed: int, epochs: float, precision: str, overrides=(), quality: int | None = None, log=print,
          device: str | torch.device = "cpu", data=None, on_epoch=None) -> dict:
    """One run. ``data``: :func:`load_data`'s tuple, for a caller that trains several times on it; ``device``:
    where it trains (``bench/gpu_race.py`` runs it on a GPU); ``on_epoch(epochs_done, net, train_seconds)`` is
    called after each epoch off the training clock (``train_seconds`` counts training steps only)."""
    device = torch.device(device)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    xtr, ytr, xva, yva, eval_split = data if data is not None else load_data(overrides, quality)
    xtr, ytr, xva, yva = (t.to(device) for t in (xtr, ytr, xva, yva))
    bs = HYP["batch_size"]
    steps_per_epoch = len(xtr) // bs  # the last partial batch is dropped, as airbench does
    if steps_per_epoch == 0:
        raise SystemExit(f"error: {len(xtr)} training images are fewer than one batch of {bs}")
    total = math.ceil(steps_per_epoch * epochs)

    net = Net().to(device, memory_format=torch.channels_last)
    net.init_whitening(xtr[:5000])
    opt = make_optimizer(net)
    base = [g["lr"] for g in opt.param_groups]
    ema = {k: v.detach().clone() for k, v in net.state_dict().items()}

    def lookahead(decay: float) -> None:
        with torch.no_grad():
            for k, v in net.state_dict().items():
                if v.is_floating_point():
                    ema[k].lerp_(v, 1 - decay)
                    v.copy_(ema[k])

    bf16 = precision == "bf16"
    loss_fn = nn.CrossEntropyLoss(label_smoothing=HYP["label_smoothing"], reduction="sum")
    flipped = (torch.rand(len(xtr), generator=gen) < 0.5).to(device)  # epoch 1 mirrors a random half; then all switch
    step, train_s = 0, 0.0
    for epoch in range(math.ceil(epochs)):
        t0 = time.perf_counter()
        net.whiten.bias.requires_grad_(epoch < HYP["whiten_bias_epochs"])
        net.train()
        mirror = flipped ^ bool(epoch % 2)
        x = torch.where(mirror.view(-1, 1, 1, 1), xtr.flip(-1), xtr)
        x = translate(x, HYP["translate"], gen)
        order = torch.randperm(len(xtr), generator=gen).to(device)
        correct = torch.zeros((), dtype=torch.long, device=device)  # summed on the tensor side: no host sync per step
        for i in range(steps_per_epoch):
            idx = order[i * bs:(i + 1) * bs]
            for g, b in zip(opt.param_groups, base):
                g["lr"] = b * lr_factor(step, total)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                out = net(x[idx])
                loss = loss_fn(out.float(), ytr[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            correct += (out.detach().argmax(1) == ytr[idx]).sum()
            if step % HYP["lookahead_every"] == 0:
                lookahead(0.95 ** 5 * (step / total) ** 3)
            if step >= total:
                lookahead(1.0)  # end on the averaged weights
                break
        train_acc = correct.item() / ((i + 1) * bs)  # the host read waits for the epoch's queued GPU work
        train_s += time.perf_counter() - t0
        log(f"seed {seed} epoch {epoch + 1}: train acc {train_acc:.4f}, {train_s:.0f} s")
        if on_epoch is not None:
            on_epoch(min(epoch + 1, epochs), net, train_s)
    acc = evaluate(net, xva, yva, bf16)
    return {"seed": seed, "epochs": epochs, "precision": precision, "val_acc": acc, "train_seconds": round(train_s, 1),
            "images_per_s": round(step * bs / train_s, 1), "eval_split": eval_split,
            "reencoded_quality": quality}


# what the table and the skip of runs already made read of every row (results.check_rows)
ROW = {"seed": "int", "epochs": "number", "precision": "str", "kernels": "str", "val_acc": "number",
       "train_seconds": "number", "images_per_s": "number", "reencoded_quality": "int?"}


def main() -> None:
    from visattn import evaluate
    from visattn.results import write_atomic

    ap = parser(__doc__, precision="auto", precisions=("auto", "bf16", "fp32"))
    ap.add_argument("--epochs", type=float, default=9.9)
    ap.add_argument("--seeds", type=int, nargs="*", default=[0])
    ap.add_argument("--data-root", default=None, help="default: configs/cifar10_cpu.yaml's data.root")
    ap.add_argument("--results", type=Path, default=RESULTS, help=f"default: {RESULTS.relative_to(ROOT)}")
    ap.add_argument("--reencode", type=int, default=None, metavar="Q",
                    help="re-encode training and validation images as JPEG at quality Q (1-95) first: how much "
                         "does accuracy depend on the images' compression")
    ap.add_argument("--table", action="store_true", help="print the results file as a markdown table and exit")
    a = ap.parse_args()
    results = check_rows(a.results, read_json(a.results, list, missing=[]), ROW)
    if a.table:
        if not results:
            raise DataError(f"--table: {a.results} holds no results")
        print("| images | epochs | seed | numerics | val acc % | train time s | images/s |\n"
              "|---|---:|---:|---|---:|---:|---:|")
        for r in sorted(results, key=lambda r: (-(r.get("reencoded_quality") or 100), r["epochs"], r["seed"])):
            q = r.get("reencoded_quality")
            images = "as stored (JPEG q75)" if q is None else f"re-encoded at q{q}"
            print(f"| {images} | {r['epochs']:g} | {r['seed']} | {r['precision']} on {r['kernels']} | {100 * r['val_acc']:.2f} "
                  f"| {r['train_seconds']:.0f} | {r['images_per_s']:.0f} |")
        return
    check_at_least("--epochs", a.epochs, 0, strict=True)  # NaN and inf too
    for seed in a.seeds:
        check_at_least("--seeds", seed, 0)
    if a.reencode is not None and not 1 <= a.reencode <= 95:
        raise ConfigError(f"--reencode must be a JPEG quality from 1 to 95, got {a.reencode}")
    precision = a.precision
    if precision == "auto":
        precision = "bf16" if evaluate.resolve_precision("auto", torch.device("cpu")) == "bf16" else "fp32"
    fam = kernels("cpu")
    made = {k: v for k, v in provenance(precision, "cpu").items() if k in ("command", "git")}
    for seed in a.seeds:
        if any(r["seed"] == seed and r["epochs"] == a.epochs and r["precision"] == precision and r["kernels"] == fam
               and r.get("reencoded_quality") == a.reencode for r in results):
            print(f"seed {seed} at {a.epochs:g} epochs ({precision} on {fam}) is already in {a.results}; skipped")
            continue
        r = dict(train(seed, a.epochs, precision, [f"data.root={a.data_root}"] if a.data_root else [], a.reencode),
                 kernels=fam, torch=torch.__version__, **made)
        what = "" if a.reencode is None else f", images re-encoded at JPEG quality {a.reencode}"
        print(f"seed {seed}, {a.epochs:g} epochs{what}, {precision} on {fam}: {100 * r['val_acc']:.2f}% on the "
              f"{r['eval_split']} ({r['train_seconds']:.0f} s, {r['images_per_s']:.0f} images/s)")
        results.append(r)
        write_atomic(a.results, json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    run_main(main, "reference_airbench.py")
