"""What drives a gate's collapse: each inserted block's gates and gradients over the first training steps.

    python -m bench.gate_dynamics                       # MobileNetV3-Small + CBAM, three placements and none, 100 steps
    python -m bench.gate_dynamics --steps 40 --arms se-slot none --out /tmp/g.json

Trains ``configs/timm/mobilenetv3_small.yaml`` (the real images, the recipe's data, SGD and schedule, seed 0) for
``--steps`` optimizer steps per arm, through the trainer (its ``step_end`` hook), with CBAM at identity:

* ``earlier``: the earlier rule's 11 sites, after every inverted residual's projection norm (``model.attn_at``);
* ``earlier-skip``: the same sites in the 6 blocks with a skip only;
* ``se-slot``: today's rule (the 6 blocks with a skip, after the depthwise conv, at the SE slot);
* ``se-slot-lr0.1``: the same, the blocks at a tenth of the network's lr (the recipe's ``optim.attn_lr_scale``);
* ``none``: no block, the loss to compare with.

The block arms but the last train the blocks at the network's lr (``optim.attn_lr_scale=1``), as they were first
measured.

Every ``--every`` steps it records, per block, from the training batch itself (train mode): the spatial gate's
mean, spread (std over positions and images) and its minimum, the channel gate's mean, the block's parameter
gradient norm, and whether the block has a skip; and the training loss since the record before (over that interval's images) and the whole model's gradient norm.
Writes ``bench/results/gate_dynamics.json`` (with its command, revision and machine) and prints a summary.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from bench.common import ROOT, parser, provenance, splice
from visattn.errors import ConfigError, run_main
from visattn.results import write_atomic

RECIPE = "configs/timm/mobilenetv3_small.yaml"
RESULTS = ROOT / "bench" / "results" / "gate_dynamics.json"
DOC = ROOT / "docs" / "blocks.md"
BEGIN = "<!-- gate dynamics: python -m bench.gate_dynamics --summary --write -->"
END = "<!-- end of gate dynamics -->"
ARMS = ("earlier", "earlier-skip", "se-slot", "se-slot-lr0.1", "none")


def _sites(arm: str) -> List[str]:
    """The ``model.attn_at`` of an earlier-rule arm: each inverted residual's projection norm."""
    import visattn
    from visattn.attention.insert import earlier_sites

    model = visattn.create_model("timm/mobilenetv3_small_100", num_classes=10, cifar_stem=True)
    skip = {p for p, m in model.named_modules() if getattr(m, "has_skip", False)}
    return [s.rsplit(".", 1)[0] for s in earlier_sites(model)
            if arm == "earlier" or s.rsplit(".", 2)[0] in skip]


def _overrides(arm: str, steps: int, run_dir: Path, data_root: Optional[str], precision: Optional[str]) -> List[str]:
    out = [f"run_dir={run_dir}", "seed=0", f"train.max_steps={steps}", "log.progress=false", "log.maps_every=0",
           "log.tensorboard=false"]
    if arm != "none":
        out += ["model.attention=cbam", f"optim.attn_lr_scale={0.1 if arm == 'se-slot-lr0.1' else 1}"]
    if arm.startswith("earlier"):
        out.append("model.attn_at=[" + ",".join(_sites(arm)) + "]")
    if data_root:
        out.append(f"data.root={data_root}")
    if precision:
        out.append(f"precision={precision}")
    return out


def probe(arm: str, steps: int, every: int, work: Path, data_root: Optional[str] = None,
          precision: Optional[str] = None) -> Dict[str, Any]:
    """One arm's trace: ``{"arm", "blocks": [{name, skip}], "steps": [{step, loss, grad_norm, blocks: [...]}]}``."""
    import shutil

    import torch

    from visattn.config import load_config
    from visattn.hooks import FunctionHook
    from visattn.maps import record_attention
    from visattn.registry import is_attention_block
    from visattn.step import Stat
    from visattn.trainer import build, fit

    run_dir = work / arm
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a probe's own scratch folder: never a user's run
    cfg = load_config(ROOT / RECIPE, _overrides(arm, steps, run_dir, data_root, precision))
    run = build(cfg, log=lambda *a, **k: None)
    model = run.model
    hosts = {p: m for p, m in model.named_modules() if hasattr(m, "has_skip")}
    found = [(p, m) for p, m in model.named_modules() if p and is_attention_block(m)]
    blocks = [(p, m) for p, m in found if not any(p.startswith(q + ".") for q, _ in found)]  # outermost only

    def skip_of(path: str) -> bool:
        host = max((h for h in hosts if path.startswith(h + ".")), key=len, default=None)
        return bool(host is not None and hosts[host].has_skip)

    trace: List[Dict[str, Any]] = []
    seen = [0.0, 0.0]  # the epoch's loss sum and images at the last record: the loss since then is their difference
    with record_attention(model, max_passes=1) as rec:
        def on_step(r: Any, step: int) -> None:
            if step % every and step != 1:
                rec.records.clear()
                return
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            total = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))
            loss_sum, images = float(r.meter.totals[Stat.loss_sum]), float(r.meter.totals[Stat.finite_images])
            if images < seen[1]:  # a new epoch: its totals started again from zero
                seen[:] = [0.0, 0.0]
            loss = (loss_sum - seen[0]) / max(images - seen[1], 1.0)
            seen[:] = [loss_sum, images]
            row = []
            for path, block in blocks:
                g = [p.grad for p in block.parameters() if p.grad is not None]
                rec_of = {r.kind: r.weights for r in rec.records if r.name == path or r.name.startswith(path + ".")}
                entry = {"block": path, "skip": skip_of(path),
                         "grad_norm": float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x.float())
                                                                                   for x in g]))) if g else 0.0}
                if "spatial" in rec_of:
                    s = rec_of["spatial"]
                    entry.update(spatial_mean=float(s.mean()), spatial_std=float(s.std()), spatial_min=float(s.min()))
                if "channel" in rec_of:
                    entry["channel_mean"] = float(rec_of["channel"].mean())
                row.append(entry)
            trace.append({"step": step, "loss": loss, "grad_norm": total, "blocks": row})
            rec.records.clear()

        run.hooks.append(FunctionHook("step_end", on_step))
        t0 = time.perf_counter()
        fit(run)
    return {"arm": arm, "blocks": [{"name": p, "skip": skip_of(p)} for p, _ in blocks], "trace": trace,
            "seconds": round(time.perf_counter() - t0, 1), "precision": str(run.policy.precision)}


def summarize(arms: Sequence[Dict[str, Any]]) -> str:
    """Per arm: at the last recorded step, the spatial gates' mean (and the lowest minimum) in blocks with and
    without a skip, their gradient norms, the model's, and the training loss since the record before; then the
    loss, the gates' gradient norms and the lowest gate at steps 15, 30 and 60."""
    lines = ["| arm | blocks (skip / no skip) | spatial gate mean, skip / no skip | lowest gate | block grad norm, "
             "skip / no skip | model grad norm | loss |", "|---|---|---|---|---|---|---|"]
    for a in arms:
        if not a["trace"]:
            continue
        last = a["trace"][-1]

        def mean(key: str, skip: bool) -> str:
            vals = [b[key] for b in last["blocks"] if b["skip"] == skip and key in b]
            return f"{statistics.mean(vals):.3f}" if vals else "—"

        low = min((b["spatial_min"] for b in last["blocks"] if "spatial_min" in b), default=None)
        n_skip = sum(b["skip"] for b in a["blocks"])
        lines.append(f"| {a['arm']} | {n_skip} / {len(a['blocks']) - n_skip} | {mean('spatial_mean', True)} / "
                     f"{mean('spatial_mean', False)} | {'—' if low is None else f'{low:.3f}'} | "
                     f"{mean('grad_norm', True)} / {mean('grad_norm', False)} | {last['grad_norm']:.3f} | "
                     f"{last['loss']:.3f} |")
    marks = [15, 30, 60]
    lines += ["", "| arm | " + " | ".join(f"step {m}: loss, gate grad norm (skip / no skip), gate min" for m in marks)
              + " |", "|---|" + "---|" * len(marks)]
    for a in arms:
        by_step = {t["step"]: t for t in a["trace"]}
        cells = []
        for m in marks:
            t = by_step.get(m)
            if t is None:
                cells.append("—")
                continue
            g = [f"{statistics.mean(v):.3f}" if v else "—" for v in
                 ([b["grad_norm"] for b in t["blocks"] if b["skip"] == k] for k in (True, False))]
            low = min((b["spatial_min"] for b in t["blocks"] if "spatial_min" in b), default=None)
            loss = "—" if t.get("loss") is None else f"{t['loss']:.3f}"
            cells.append(f"{loss}, {g[0]} / {g[1]}, {'—' if low is None else f'{low:.2f}'}")
        lines.append(f"| {a['arm']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def check_arms(data: Dict[str, Any], out: str) -> None:
    """A ConfigError line unless ``data`` holds arms whose every field :func:`summarize` reads is there."""
    if not isinstance(data.get("arms"), list):
        raise ConfigError(f"{out}: no 'arms' list (not a gate_dynamics.py results file)")
    if not data["arms"]:
        raise ConfigError(f"--summary: {out} holds no arms")
    number = (int, float)
    for i, arm in enumerate(data["arms"], 1):
        if not (isinstance(arm, dict) and isinstance(arm.get("trace"), list) and isinstance(arm.get("blocks"), list)
                and all(isinstance(t, dict) and isinstance(t.get("blocks"), list) for t in arm["trace"])):
            raise ConfigError(f"{out}: arm {i} has no trace and blocks lists (damaged, or not this script's file)")
        rows = [("arm", arm, "arm", str)] + [("blocks", b, "skip", bool) for b in arm["blocks"]] + \
            [(f"trace step {j}", t, k, kind) for j, t in enumerate(arm["trace"], 1)
             for k, kind in (("step", int), ("grad_norm", number))] + \
            [(f"trace step {j} block", b, k, kind) for j, t in enumerate(arm["trace"], 1) for b in t["blocks"]
             for k, kind in (("skip", bool), ("grad_norm", number))]
        for where, row, key, kind in rows:
            if not isinstance(row, dict) or not isinstance(row.get(key), kind):
                raise ConfigError(f"{out}: arm {i}: a {where} entry has no {key!r} of the right type (damaged, or "
                                  "not this script's file)")


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = parser(__doc__, threads=True, precision=True, out=str(RESULTS))
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--every", type=int, default=5, help="record every N steps (and step 1)")
    ap.add_argument("--arms", nargs="*", default=list(ARMS), choices=ARMS)
    ap.add_argument("--data-root", default=None)
    ap.add_argument("--work", default=str(ROOT / "runs" / "gate_dynamics"))
    ap.add_argument("--summary", action="store_true", help="print the summary of --out; no training")
    ap.add_argument("--write", action="store_true", help="with --summary: write it into docs/blocks.md")
    args = ap.parse_args(argv)
    if args.summary:
        from visattn.results import read_json

        data = read_json(Path(args.out), dict)
        check_arms(data, args.out)
        text = summarize(data["arms"]) + (f"\n\n{data.get('steps')} steps of `{data.get('recipe')}` (seed 0, "
                                          f"{data['arms'][0].get('precision')} on {data.get('kernels')}), at the last "
                                          f"recorded step; `{data.get('command')}` at {str(data.get('git'))[:7]}.")
        print(text)
        if args.write:
            splice(DOC, BEGIN, END, text)
        return
    if args.steps < 1 or args.every < 1 or not args.arms:
        raise ConfigError("--steps and --every must be at least 1, and --arms not empty")
    arms = [probe(a, args.steps, args.every, Path(args.work), args.data_root, args.precision) for a in args.arms]
    out = {**provenance(args.precision), "recipe": RECIPE, "steps": args.steps, "every": args.every, "arms": arms}
    write_atomic(Path(args.out), json.dumps(out, indent=1))
    print(summarize(arms))


if __name__ == "__main__":
    run_main(main, "gate_dynamics.py")
