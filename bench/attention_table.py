"""The attention table's runner: trains each config for a fixed number of epochs, paired by seed against no attention, and appends each run to the results file (resumable).

    python -m bench.attention_table                          # every config below, seeds until the CIs are tight
    python -m bench.attention_table --configs configs/attention/resnet_fast_se.yaml --seeds 0 1
    python -m bench.attention_table --epochs 16 --tag wide --backbone --set 'model.widths=[128,384,384]'
                                    # a backbone variant: every config, none included, as CONFIG/wide

The tables, the README's summary, the plot and merging another machine's runs are
``bench/attention_report.py``'s (no training); the statistics (pairing, intervals, verdicts) live there too.

Budget: every config trains for its fixed number of epochs (``--epochs``, default the config's own: 4 for the
``resnet_fast`` configs, which are the CPU recipe ``configs/cifar10_cpu.yaml`` with one attention type each,
and the same 4 epochs for the transformers) on all 45,000 training images left after holding out the
stratified 5,000-image validation split (``data.split_seed=0``: the same images for every run), and is
scored once, at the end, on that split with the config's test-time augmentation. A busy machine changes only
the time a run takes, never its budget: each result records the mean 1-minute load average during the run, and
the times in the table and plot are medians over the runs timed with nothing else running (mean load at most
``QUIET_LOAD``; a training run alone keeps it near 2.3 on 2 cores).

Seeds: runs go seed-major (seed 0 of every config, then seed 1, ...), so a partial sweep still pairs every
config with ``resnet_fast_none`` on the same seeds. By default (no ``--seeds``) every config gets 3 seeds, and
after that only the configs whose 95% interval on the paired difference to ``none`` is still wider than
``--target`` (0.5) points on each side get more, with ``none`` alongside, up to ``--max-seeds`` (see
:func:`plan`). Results are appended to ``bench/results/attention_table.json`` after
every run (runs already there are skipped), so an interrupted sweep continues where it stopped.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import sys
import threading
from pathlib import Path
from typing import List, Mapping, Optional, Sequence, Tuple, Union

from bench.attention_report import (
    BASELINE,
    CNN_CONFIGS,
    MIN_PAIRS,
    RESULTS,
    TRANSFORMER_CONFIGS,
    canon,
    numerics,
    paired,
    planned_options,
    shipped,
    tables,
)
from bench.common import ROOT, cpu_name, kernels, parser
from visattn.errors import CheckpointError, ConfigError, run_main
from visattn.results import read_json, write_atomic
from visattn.rundir import complete_rows
from visattn.signals import Interrupted


class LoadSampler:
    """Samples the 1-minute load average every few seconds while a run trains (``with LoadSampler() as s``).

    A training run alone keeps it near the thread count (about 2.3 on 2 cores); another job on the machine
    pushes it higher and slows the run (time only: budgets are in epochs). :func:`quiet` uses the mean.
    """

    def __init__(self, every: float = 5.0):
        self.every, self.samples, self._stop = every, [], threading.Event()

    def __enter__(self) -> "LoadSampler":
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            self.samples.append(os.getloadavg()[0])

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def mean(self) -> Optional[float]:
        return round(statistics.mean(self.samples), 2) if self.samples else None


def run_name(config: str, tag: str = "") -> str:
    """A run's name in the table: the config's stem, then ``/tag`` for a variant (``resnet_fast_se/group_act``)."""
    return Path(config).stem + (f"/{tag}" if tag else "")


def run_one(config: str, seed: int, epochs: Optional[int], run_root: Path, data_root: Optional[str],
            tag: str = "", extra: Sequence[str] = (), precision_override: Optional[str] = None) -> dict:
    import torch

    from visattn.config import load_config

    name = run_name(config, tag)
    num = planned_numerics(config, precision_override).replace(" on ", "-")
    run_dir = run_root / f"{name.replace('/', '-')}-e{epochs or 'cfg'}-s{seed}-{num}"
    overrides = [f"seed={seed}", f"run_dir={run_dir}", "log.progress=false", "log.maps_every=0", *extra]
    if epochs:
        overrides.append(f"train.epochs={epochs}")
    if data_root:
        overrides.append(f"data.root={data_root}")
    if precision_override:
        overrides.append(f"precision={precision_override}")
    cfg = load_config(ROOT / config, overrides)
    overrides.append(f"eval.every={cfg.train.epochs}")  # score once, at the end
    with LoadSampler() as load:
        summary, resumed = run_resuming(ROOT / config, overrides, run_dir, log=lambda *a: None)
    rows, info = complete_rows(run_dir / "metrics.jsonl"), read_json(run_dir / "run_info.json")
    shown = [o for o in overrides if not o.startswith(("run_dir=", "log.progress=", "data.root="))]
    command = shlex.join(["python", "train.py", "--config", config, *shown])  # what reproduces the run
    return {"config": config, "name": name, "seed": seed, "epochs": cfg.train.epochs, "val_acc": rows[-1]["val_acc"],
            "command": command,
            "overrides": list(extra), "model": cfg.model.options(),
            "train_seconds": sum(r["epoch_seconds"] for r in rows),
            "images_per_s": statistics.mean(r["images_per_s"] for r in rows), "parameters": info["parameters"],
            "eval_split": summary["eval_split"], "git": info["git"], "load_mean": load.mean, "cpu": cpu_name(),
            "threads": torch.get_num_threads(), "precision": info["precision"], "kernels": kernels(cfg.device),
            **({"resumed": True} if resumed else {})}


def run_resuming(config: Path, overrides: Sequence[str], run_dir: Path, log=print) -> Tuple[dict, bool]:
    """Train ``config`` with ``overrides`` into ``run_dir``; a run killed part-way there goes on from its last
    checkpoint (the trainer resumes exactly) when the folder was trained with these settings (keys added to
    visattn's config since then count at their defaults), and otherwise (other settings, no checkpoint, a corrupt
    one) starts again from scratch: never a run of two settings. A folder that held training is moved aside,
    never deleted (it may hold hours), with a line on stderr. Returns the run's summary and whether it was
    resumed (its time then spans two sittings)."""
    from visattn.config import load_config, safe_yaml, with_defaults
    from visattn.rundir import config_diff, yaml_dump
    from visattn.trainer import run

    def settings(d: dict) -> dict:
        return {k: v for k, v in d.items() if k not in ("resume", "resume_allow_changes")}

    now = settings(safe_yaml(yaml_dump(load_config(config, list(overrides)).to_dict()), "the run's config"))  # as saved
    why = ""
    if (run_dir / "config.yaml").is_file():
        try:
            changed = config_diff(settings(with_defaults(safe_yaml((run_dir / "config.yaml").read_text(),
                                                                   str(run_dir / "config.yaml")))), now)
        except (OSError, ConfigError, AttributeError, TypeError):  # an unreadable or foreign config.yaml
            changed = ["config.yaml (unreadable)"]
        why = f"trained with other settings for {', '.join(changed)}" if changed else ""
    resumed = not why and (run_dir / "last.pt").is_file()
    if run_dir.exists() and not resumed:
        set_aside(run_dir, why or "no checkpoint to resume")
    try:
        return run(load_config(config, [*overrides, "resume=auto"] if resumed else list(overrides)), log=log), resumed
    except CheckpointError as e:
        if not resumed:
            raise
        set_aside(run_dir, str(e))
    return run(load_config(config, list(overrides)), log=log), False


def set_aside(run_dir: Path, why: str) -> Optional[Path]:
    """Make room for a fresh run at ``run_dir``: a folder that holds training (a checkpoint or metrics) is renamed
    to ``NAME.set-aside-N`` and said so on stderr; one that holds none (a run killed while starting) is removed.
    Returns where the old folder went, or None."""
    if not ((run_dir / "last.pt").exists() or (run_dir / "metrics.jsonl").exists()):
        shutil.rmtree(run_dir)
        return None
    n = 1
    while (aside := run_dir.with_name(f"{run_dir.name}.set-aside-{n}")).exists():
        n += 1
    run_dir.rename(aside)
    print(f"{run_dir}: {why}; its training moved to {aside.name}, starting again", file=sys.stderr, flush=True)
    return aside


def default_epochs(config: str) -> Optional[int]:
    """The transformers train for the CPU recipe's epochs (the same budget in images as the ResNets)."""
    if config in TRANSFORMER_CONFIGS:
        from visattn.config import load_config

        return load_config(ROOT / "configs" / "cifar10_cpu.yaml").train.epochs
    return None


def ran(results: List[dict], config: str, seed: int, epochs: Optional[int] = None, tag: str = "",
        prec: Optional[str] = None) -> bool:
    """Whether ``results`` hold the run (its name, seed and, where given, epochs and :func:`numerics`, e.g.
    ``"bf16 on amx"``)."""
    name = run_name(config, tag)
    return any(r["name"] == name and r["seed"] == seed and (epochs is None or r["epochs"] == epochs)
               and (prec is None or numerics(r) == prec) for r in results)


def current(results: List[dict], configs: Sequence[str], tag: str = "", sets: Sequence[str] = (),
            backbone: bool = False) -> List[dict]:
    """``results`` less the runs that bear the name of one of ``configs`` (as a sweep with ``tag``, ``sets`` and
    ``backbone`` names them) but recorded other model options than that config builds now: an earlier
    round's run of the same name (another block initialisation or position, or none recorded) is neither
    counted as done nor paired, so a sweep on that machine runs the config as it is. A sweep of the configs as
    they ship (no ``tag``) also counts their :func:`shipped` runs under another tag (a placement run with what
    the config now ships), as the README's summary does, rather than running them again."""
    want = {}
    for c in configs:
        t = variant(c, tag, backbone)
        want[run_name(c, t)] = canon(planned_options(c, sets if t else ()))
    kept = [r for r in results if r["name"] not in want or canon(r.get("model")) == want[r["name"]]]
    if tag:
        return kept
    key = lambda r: (r["name"], r["seed"], r["epochs"], numerics(r))  # noqa: E731
    have = {key(r) for r in kept}
    return kept + [r for c in configs for r in shipped(results, c) if key(r) not in have]


def plan(results: List[dict], configs: List[str], seed: int, target: float,
         epochs: Union[None, int, Mapping[str, int]] = None, tag: str = "", prec: Optional[str] = None,
         backbone: bool = False) -> List[str]:
    """The configs of ``configs`` still to run at ``seed`` in an adaptive sweep.

    Every config gets the first :data:`MIN_PAIRS` seeds. From then on a config gets another seed only while its
    paired difference to the baseline is wider than ``target`` (or has fewer than :data:`MIN_PAIRS` pairs), and
    the baseline runs at a seed only when some other config does, so the hours go to the undecided configs.
    Runs already in ``results`` are never repeated. ``epochs``: the budget, one for all or one per config
    (runs and pairs count only at it: a sweep at 4 epochs is not done because the config ran at 16);
    ``prec``: the :func:`numerics` the sweep runs in (runs and pairs count only in it); ``tag``: the variant
    of the non-baseline configs (the baseline runs untagged unless ``backbone``).
    """
    budget = (lambda c: epochs.get(c)) if isinstance(epochs, Mapping) else (lambda c: epochs)  # noqa: E731
    here = [r for r in results if prec is None or numerics(r) == prec]

    def open_(config: str) -> bool:
        d = paired(here, run_name(config, tag), budget(config))
        return d is None or d[2] < MIN_PAIRS or d[1] > target

    others = [c for c in configs if Path(c).stem != BASELINE]
    wanted = others if seed < MIN_PAIRS else [c for c in others if open_(c)]
    if wanted:
        wanted = [c for c in configs if Path(c).stem == BASELINE] + wanted
    return [c for c in wanted if not ran(here, c, seed, budget(c), variant(c, tag, backbone))]


def make_parser() -> argparse.ArgumentParser:
    """The runner's flags (``bench/gpu_table.sh`` reads a job's ``--tag``, ``--set``, ``--backbone`` and
    ``--precision`` with it)."""
    ap = parser(__doc__, threads=True, precision=True, precisions=("auto", "bf16", "fp16", "fp32"), help={
        "precision": "override every config's precision (the runs keep their names: the table keys them by precision "
                     "and kernel family)",
        "threads": "torch threads (default: torch's own); 1 lets a run share the 2 cores with other work without the "
                   "2-thread slowdown; its time is then left out of the table's medians"})
    ap.add_argument("--configs", nargs="*", default=CNN_CONFIGS + TRANSFORMER_CONFIGS)
    ap.add_argument("--seeds", nargs="*", type=int, default=None, help="exactly these seeds (default: adaptive)")
    ap.add_argument("--max-seeds", type=int, default=10)
    ap.add_argument("--target", type=float, default=0.5, help="95%% half-width to reach on every difference")
    ap.add_argument("--epochs", type=int, default=None, help="default: each config's own train.epochs")
    ap.add_argument("--tag", default="", help="a variant's name: its runs are named CONFIG/TAG (the baseline keeps "
                    "its own name and runs without --set, unless --backbone)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="config overrides of the variant, e.g. model.attn_position=group_act (needs --tag)")
    ap.add_argument("--backbone", action="store_true",
                    help="the --set overrides change the backbone (e.g. model.widths=[128,384,384]), not the "
                         "block: resnet_fast_none runs them too, as resnet_fast_none/TAG, and every CONFIG/TAG "
                         "pairs with it")
    ap.add_argument("--data-root", default=None)
    ap.add_argument("--runs", default=str(ROOT / "runs" / "attention_table"))
    ap.add_argument("--results", default=str(RESULTS), help="the results file, read and appended to")
    return ap


def main() -> None:
    ap = make_parser()
    args = ap.parse_args()
    if args.set and not args.tag:
        ap.error("--set changes the runs: name the variant with --tag")
    if args.backbone and not args.set:
        ap.error("--backbone: give the backbone's overrides with --set")
    out = Path(args.results)
    results = read_json(out, list, missing=[])
    seeds = args.seeds if args.seeds is not None else list(range(args.max_seeds))
    # the runs a sweep plans and pairs with: a same-named run with other model options is not this config's
    live = current(results, args.configs, args.tag, args.set, args.backbone)
    for seed in seeds:  # seed-major: a partial sweep still pairs every config
        epochs_of = {c: args.epochs or default_epochs(c) or config_epochs(c) for c in args.configs}
        prec = planned_numerics(args.configs[0], args.precision)
        if args.seeds is not None:  # exactly these seeds, every config
            todo = [c for c in args.configs
                    if not ran(live, c, seed, epochs_of[c], variant(c, args.tag, args.backbone), prec)]
        else:
            todo = plan(live, args.configs, seed, args.target, epochs_of, args.tag, prec, args.backbone)
        for config in todo:
            tag = variant(config, args.tag, args.backbone)
            r = run_one(config, seed, epochs_of[config], Path(args.runs), args.data_root, tag,
                        args.set if tag else (), args.precision)
            results.append(r)
            live.append(r)
            write_atomic(out, json.dumps(results, indent=1))  # a kill mid-write keeps the old file
            print(f"{r['name']} seed {seed}: val {100 * r['val_acc']:.2f}% in {r['train_seconds']:.0f}s", flush=True)
    print(tables(results))  # every run's table (python -m bench.attention_report prints it without training)


def variant(config: str, tag: str, backbone: bool = False) -> str:
    """The tag a config runs under: none for the baseline, which has no block to vary, unless the variant
    changes the backbone (``backbone``), which the baseline must share to pair with."""
    return "" if Path(config).stem == BASELINE and not backbone else tag


def planned_numerics(config: str, precision_override: Optional[str] = None) -> str:
    """The :func:`numerics` a run of ``config`` has on this machine (``auto``: bf16 only with native bf16)."""
    from visattn import evaluate, options
    from visattn.config import load_config

    cfg = load_config(ROOT / config)
    prec = evaluate.resolve_precision(precision_override or cfg.precision, options.resolve_device(cfg.device))
    return numerics({"precision": prec, "kernels": kernels(cfg.device)})


def config_epochs(config: str) -> int:
    from visattn.config import load_config

    return load_config(ROOT / config).train.epochs


if __name__ == "__main__":
    try:  # a missing or bad config, data or checkpoint: one line (run_main); the finished runs are kept
        run_main(main, "attention_table.py")
    except Interrupted as e:  # SIGTERM or SIGINT mid-run: one line; the finished runs are in the results file
        print(str(e), file=sys.stderr)
        sys.exit(e.exit_code)
