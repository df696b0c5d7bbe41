"""A worked example of the user's path: a torchvision network trained here, then a block inserted and fine-tuned.

    python examples/finetune_torchvision.py              # the base, then each arm; arms already in the results are skipped
    python examples/finetune_torchvision.py --report     # the table, and docs/blocks.md's section rewritten from it

The network is torchvision's ``mobilenet_v3_small(num_classes=10)``, which has squeeze-and-excitation modules of
its own, with a stride-1 stem (at 32x32 the stock stride-2 stem leaves 1x1 maps). It is trained in plain PyTorch,
as a user's own loop would be: AdamW, a one-cycle schedule, pad-crop and flip, bf16 autocast where the CPU has
native bf16. The base trains ``--base-epochs`` (4) on the 45,000 training images of the stratified, seeded
hold-out (``data.split_seed`` 0 of ``configs/cifar10_cpu.yaml``) and is scored on the 5,000 held-out ones.
Each arm copies the base, inserts its block with ``visattn.insert_attention`` (``none``: nothing), checks that
the eval-mode output is bit-identical, scores it once before any step (it must equal the base), then fine-tunes
``--epochs`` (2) with a fresh one-cycle schedule at a tenth of the base's peak, the same data order for every arm
(``none``, ``cbam``). One seed: this shows the path, it is not evidence for a block (``bench/finetune.py`` is).

Results go to ``bench/results/finetune_torchvision.json`` after the base and after every arm, each with the
command and git revision that made it. It needs visattn importable (``pip install -e .`` from the repository root)
and torchvision.
"""
from __future__ import annotations

import argparse
import copy
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

from visattn.errors import DataError
from visattn.results import cpu_name

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "finetune_torchvision.json"
DOC = ROOT / "docs" / "blocks.md"
BASE_CKPT = ROOT / "runs" / "ft_torchvision" / "base.pt"
ARMS = ("none", "cbam")
BATCH = 256
BASE_LR = 4e-3
BEGIN = "<!-- torchvision finetune table: python examples/finetune_torchvision.py --report -->"
END = "<!-- end of torchvision finetune table -->"


def stamp(argv: List[str]) -> Dict[str, str]:
    """What made a row: the command (from the repository root) and the git revision (``-dirty``: with changes)."""
    from visattn.results import git_revision

    return {"command": shlex.join(["python", "examples/finetune_torchvision.py", *argv]), "git": git_revision()}


def build_net() -> torch.nn.Module:
    import torchvision

    net = torchvision.models.mobilenet_v3_small(num_classes=10)
    net.features[0][0].stride = (1, 1)  # a CIFAR-sized stem: 32x32 -> 2x2 at the last stage instead of 1x1
    return net


def data(seed: int):
    from visattn.config import load_config
    from visattn.data import load_splits

    cfg = load_config(ROOT / "configs" / "cifar10_cpu.yaml")
    s = load_splits(cfg.data, seed)
    to_t = lambda im: (torch.from_numpy(im.x).permute(0, 3, 1, 2).contiguous(), torch.from_numpy(im.y))  # noqa: E731
    return to_t(s.train), to_t(s.eval), cfg.data.mean, cfg.data.std, s.eval_split


def prep(x: torch.Tensor, mean, std, gen: Optional[torch.Generator] = None) -> torch.Tensor:
    x = x.float()
    if gen is not None:  # pad 4 and crop back at a random offset (one gather), then a random horizontal flip
        b = x.shape[0]
        xp = F.pad(x, (4, 4, 4, 4), mode="reflect")
        i, j = torch.randint(0, 9, (2, b), generator=gen)
        r = torch.arange(32)
        x = xp[torch.arange(b)[:, None, None, None], torch.arange(3)[None, :, None, None],
               (i[:, None] + r)[:, None, :, None], (j[:, None] + r)[:, None, None, :]]
        flip = torch.rand(b, generator=gen) < 0.5
        x = torch.where(flip[:, None, None, None], x.flip(3), x)
    m = torch.tensor(mean).view(1, 3, 1, 1) * 255
    s = torch.tensor(std).view(1, 3, 1, 1) * 255
    return ((x - m) / s).contiguous(memory_format=torch.channels_last)


def autocast():
    from visattn.evaluate import cpu_has_native_bf16

    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=cpu_has_native_bf16())


@torch.no_grad()
def accuracy(net: torch.nn.Module, val, mean, std) -> float:
    net.eval()
    hits = 0
    for k in range(0, len(val[1]), 1000):
        with autocast():
            hits += (net(prep(val[0][k:k + 1000], mean, std)).argmax(1) == val[1][k:k + 1000]).sum().item()
    return hits / len(val[1])


def train(net: torch.nn.Module, tr, mean, std, epochs: int, lr: float, seed: int) -> float:
    gen = torch.Generator().manual_seed(seed)
    steps = epochs * (len(tr[1]) // BATCH)
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.2)
    t0 = time.perf_counter()
    net.train()
    for _ in range(epochs):
        order = torch.randperm(len(tr[1]), generator=gen)
        for k in range(len(tr[1]) // BATCH):
            idx = order[k * BATCH:(k + 1) * BATCH]
            with autocast():
                loss = F.cross_entropy(net(prep(tr[0][idx], mean, std, gen)), tr[1][idx], label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    return time.perf_counter() - t0


def read() -> Dict[str, object]:
    """The results file ({} where there is none); a base or arm row without what the table reads is one line."""
    from visattn.results import check_rows, read_json

    res = read_json(RESULTS, missing={})
    if "base" in res:
        check_rows(RESULTS, [res["base"]], {"epochs": "int", "val_acc": "number"})
    check_rows(RESULTS, res.get("arms", []), {"block": "str", "inserted": "int", "params_added": "int",
                                              "step0_val_acc": "number", "val_acc": "number", "epochs": "int"})
    return res


def write(res: Dict[str, object]) -> None:
    from visattn.results import write_atomic

    write_atomic(RESULTS, json.dumps(res, indent=1) + "\n")


def base(res: Dict[str, object], tr, val, mean, std, epochs: int, seed: int, made: Dict[str, str]) -> torch.nn.Module:
    torch.manual_seed(seed)
    net = build_net().to(memory_format=torch.channels_last)
    from visattn.rundir import load_checkpoint, save_checkpoint

    if BASE_CKPT.is_file() and res.get("base", {}).get("epochs") == epochs:  # digest and finite check, as every loader
        net.load_state_dict(load_checkpoint(BASE_CKPT)["model"])
        return net
    secs = train(net, tr, mean, std, epochs, BASE_LR, seed)
    save_checkpoint({"model": net.state_dict(), "config": {}, "epoch": epochs, "step": 0}, BASE_CKPT)
    res.update(base={"epochs": epochs, "lr": BASE_LR, "val_acc": accuracy(net, val, mean, std),
                     "train_seconds": round(secs, 1), **made}, arms=[])
    write(res)
    return net


def arm(name: str, net0: torch.nn.Module, tr, val, mean, std, epochs: int, seed: int) -> dict:
    import visattn

    net = copy.deepcopy(net0)
    probe = prep(val[0][:64], mean, std)
    before = net.eval()(probe)
    n = 0 if name == "none" else visattn.insert_attention(net, name)
    if not torch.equal(net.eval()(probe), before):
        raise SystemExit(f"{name}: inserting the block changed the eval output")
    added = sum(p.numel() for p in net.parameters()) - sum(p.numel() for p in net0.parameters())
    step0 = accuracy(net, val, mean, std)
    secs = train(net, tr, mean, std, epochs, BASE_LR / 10, seed + 1)
    return {"block": name, "inserted": n, "params_added": added, "step0_val_acc": step0,
            "val_acc": accuracy(net, val, mean, std), "epochs": epochs, "train_seconds": round(secs, 1)}


def table(res: Dict[str, object]) -> str:
    b = res["base"]
    rows = ["| | blocks inserted | parameters added | before any step | after the fine-tune |", "|---|---:|---:|---:|---:|",
            f"| base ({b['epochs']} epochs) | | | | {b['val_acc']:.2%} |"]
    for a in res["arms"]:
        rows.append(f"| + {a['block']} ({a['epochs']} epochs) | {a['inserted']} | {a['params_added']:,} | "
                    f"{a['step0_val_acc']:.2%} | {a['val_acc']:.2%} |")
    return "\n".join(rows)


def write_doc(text: str) -> None:
    doc = DOC.read_text()
    head, rest = doc.split(BEGIN, 1)
    DOC.write_text(head + BEGIN + "\n" + text + "\n" + END + rest.split(END, 1)[1])


def positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def main(argv: Optional[List[str]] = None) -> None:
    from visattn.options import describe

    ap = argparse.ArgumentParser(description=describe(__doc__))
    ap.add_argument("--base-epochs", type=positive, default=4)
    ap.add_argument("--epochs", type=positive, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--report", action="store_true")
    argv = sys.argv[1:] if argv is None else list(argv)
    a = ap.parse_args(argv)
    if a.report:
        if "base" not in read():
            raise DataError(f"{RESULTS} holds no run: run python examples/finetune_torchvision.py first")
        text = table(read())
        print(text)
        write_doc(text)
        return
    tr, val, mean, std, split = data(a.seed)
    res = read()
    res.update(model="torchvision mobilenet_v3_small, stride-1 stem", eval_split=split, seed=a.seed,
               cpu=cpu_name(), torch=torch.__version__)
    made = stamp(argv)
    net0 = base(res, tr, val, mean, std, a.base_epochs, a.seed, made)
    print(f"base: {res['base']['val_acc']:.2%} after {a.base_epochs} epochs", flush=True)
    done = {r["block"] for r in res.get("arms", [])}
    for name in ARMS:
        if name in done:
            continue
        row = {**arm(name, net0, tr, val, mean, std, a.epochs, a.seed), **made}
        res.setdefault("arms", []).append(row)
        write(res)
        print(f"{name}: step 0 {row['step0_val_acc']:.2%} -> {row['val_acc']:.2%}", flush=True)


if __name__ == "__main__":
    from visattn.errors import run_main

    run_main(main, "finetune_torchvision.py")
