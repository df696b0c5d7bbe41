"""Training throughput of each model config, against ``resnet_fast`` without attention, in one process.

    python bench/model_speed.py [--steps 6] [--repeats 3] [--batch 256]

For the README's attention comparison: the table's wall times come from the sweep itself; this script
measures the cost of each config on its own, with no other job on the machine, as images/s of a bf16
training step (forward, backward, optimizer step) on random data, interleaving the configs over repeats
and taking medians. The ratio is images/s relative to ``configs/attention/resnet_fast_none.yaml``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from attention_table import DEFAULT_CONFIGS  # noqa: E402

from visattn import engine  # noqa: E402
from visattn.config import load_config  # noqa: E402
from visattn.models import create_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="*", default=DEFAULT_CONFIGS)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=256)
    args = ap.parse_args()
    torch.manual_seed(0)
    setups = []
    for path in args.configs:
        cfg = load_config(ROOT / path)
        model = create_model(cfg.model.name, num_classes=10, **cfg.model.options())
        if cfg.channels_last:
            model = model.to(memory_format=torch.channels_last)
        o = cfg.optim
        opt = engine.build_optimizer(model, o.name, o.lr, o.weight_decay, o.momentum, o.nesterov, o.betas)
        setups.append((Path(path).stem, model, opt, cfg.channels_last))
    x = torch.randn(args.batch, 3, 32, 32)
    y = torch.randint(0, 10, (args.batch,))

    def run(model, opt, cl, steps):
        xb = x.contiguous(memory_format=torch.channels_last) if cl else x
        t = time.perf_counter()
        for _ in range(steps):
            with engine.autocast(torch.device("cpu"), "bf16"):
                out = model(xb)
            loss = F.cross_entropy(out.float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        return time.perf_counter() - t

    for name, model, opt, cl in setups:  # warm-up
        run(model, opt, cl, 1)
    times = {name: [] for name, *_ in setups}
    for _ in range(args.repeats):
        for name, model, opt, cl in setups:
            times[name].append(run(model, opt, cl, args.steps))
    ips = {n: args.steps * args.batch / statistics.median(t) for n, t in times.items()}
    base = ips[setups[0][0]]
    print(f"bf16 training step, batch {args.batch}, {args.steps} steps x {args.repeats} interleaved repeats, "
          f"{torch.get_num_threads()} threads")
    print(f"{'config':<26}{'images/s':>10}{'vs ' + setups[0][0]:>28}")
    for n, v in ips.items():
        print(f"{n:<26}{v:>10.0f}{v / base:>28.2f}")


if __name__ == "__main__":
    main()
