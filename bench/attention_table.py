"""The README's attention tables: each config trained for a fixed number of epochs, paired by seed against no attention.

    python bench/attention_table.py                          # every config below, seeds until the CIs are tight
    python bench/attention_table.py --configs configs/attention/resnet_fast_se.yaml --seeds 0 1
    python bench/attention_table.py --report --plot assets/accuracy_vs_time.png     # table and plot, no training
    python bench/attention_table.py --summary    # the README's placement ablation and both budgets
    python bench/attention_table.py --merge OUT/results.json    # add another machine's runs (bench/gpu_table.sh)
    python bench/attention_table.py --epochs 16 --tag wide --backbone --set 'model.widths=[128,384,384]'
                                    # a backbone variant: every config, none included, as CONFIG/wide

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
import math
import os
import platform
import shutil
import statistics
import sys
import threading
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from visattn.errors import CheckpointError, ConfigError, VisattnError, run_main  # noqa: E402
from visattn.options import describe  # noqa: E402
from visattn.runtime import Interrupted, write_atomic  # noqa: E402

ATTENTION = ("none", "se", "eca", "gc", "spatial", "cbam", "coord", "nonlocal", "mhsa2d")
CNN_CONFIGS = [f"configs/attention/resnet_fast_{a}.yaml" for a in ATTENTION]
TRANSFORMER_CONFIGS = ["configs/vit_tiny.yaml", "configs/vit_tiny_lsa_spt.yaml", "configs/cct_2.yaml", "configs/vit_cpu.yaml"]
BASELINE = "resnet_fast_none"
QUIET_LOAD = 2.8  # mean 1-minute load average above which a run's time is not quoted (2 cores, 2 threads)
# runs seen sharing the machine before the load was recorded: (name, seed, git) -> what was seen
CONTENDED = {("resnet_fast_se", 0, "53cd2e228a6a1089310ef9ac33078045ac623bbd"):
             "test runs beside it in epochs 2-4: 583-644 images/s there against 899 in epoch 1",
             ("resnet_fast_eca", 0, "feaa354f522fdb76dc7fbcd1d97b38149e788c35-dirty"):
             "benchmarks beside it in epochs 2-4: 321-610 images/s there against 870 in epoch 1",
             ("resnet_fast_mhsa2d", 0, "8541bc54ca57037ce451fa928061a7f72d0e5dbd-dirty"):
             "tests beside it in epoch 1: 164 images/s there against 233-234 in epochs 2-3",
             ("cct_2", 3, "d2f3e67a0e704d16ede6b842651cb1e4f1c95322-dirty"):
             "a benchmark beside it in epoch 1: 362 images/s there against 990-1002 in epochs 2-4",
             ("resnet_fast_none", 0, "bf3819649118c815f40a2921d99402878a46adbb"):
             "a one-thread training run (the README screenshot) and tests beside it in epochs 2-4",
             ("resnet_fast_none", 3, "1bdac42065c4c9aac48181581a71c43b7599e497-dirty"):
             "tests beside it in epochs 1-2: 278-300 images/s there against 456-488 in epochs 3-4"}
RESULTS = ROOT / "bench" / "results" / "attention_table.json"
# the blocks' cost: one process's training steps of every config (python bench/throughput.py ... --out SPEED)
SPEED = ROOT / "bench" / "results" / "block_speed.json"
# two-sided 95% quantiles of Student's t for 1..30 degrees of freedom
T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
       2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


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


def quiet(r: dict) -> bool:
    """Whether a run's time was measured with nothing else on the machine (an unrecorded load counts as quiet,
    unless the run is in :data:`CONTENDED` or records a ``contended`` reason: another job ran beside it)."""
    load = r.get("load_mean")
    seen = (r["name"], r["seed"], r.get("git")) in CONTENDED or r.get("contended")
    if seen or (r.get("threads") or 2) < 2 or r.get("resumed"):
        return False  # seen sharing the machine, trained on one thread to share it, or timed in two sittings
    return load is None or load <= QUIET_LOAD


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
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    info = json.loads((run_dir / "run_info.json").read_text())
    return {"config": config, "name": name, "seed": seed, "epochs": cfg.train.epochs, "val_acc": rows[-1]["val_acc"],
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
    from visattn.runtime import config_diff, yaml_dump
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


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def default_epochs(config: str) -> Optional[int]:
    """The transformers train for the CPU recipe's epochs (the same budget in images as the ResNets)."""
    if config in TRANSFORMER_CONFIGS:
        from visattn.config import load_config

        return load_config(ROOT / "configs" / "cifar10_cpu.yaml").train.epochs
    return None


def mean_ci(xs: List[float]) -> Tuple[float, float]:
    """Mean and the half-width of its 95% t interval (inf for a single value)."""
    m = statistics.mean(xs)
    if len(xs) < 2:
        return m, math.inf
    return m, T95[min(len(xs) - 1, len(T95)) - 1] * statistics.stdev(xs) / math.sqrt(len(xs))


def at_budget(results: List[dict], epochs: Optional[int]) -> List[dict]:
    """The runs trained for ``epochs`` (all runs for ``None``)."""
    return [r for r in results if epochs is None or r["epochs"] == epochs]


def precision(r: dict) -> str:
    """The run's resolved precision (runs recorded before it was stored were all bf16 autocast, on AMX CPUs)."""
    return r.get("precision", "bf16")


# the kernel family of runs recorded before it was stored: round 2's bf16 runs on AMX CPUs, this round's
# first fp32 runs on an AVX2 machine without native bf16
LEGACY_KERNELS = {"bf16": "amx", "fp32": "avx2"}


def kernels(device: str = "auto") -> str:
    """The family of kernels a run on this machine computes with: the CUDA device's name, else the CPU's best
    of ``amx`` (AMX tiles), ``avx512_bf16``, ``avx512``, ``avx2``, else ``cpu``, by the same ``torch.cpu``
    probes with which ``precision: auto`` decides whether bf16 is native (``visattn.engine``).

    The same seed gives a different result on another family (86.76% on AMX against 86.66% with AVX512-BF16
    for ``resnet_fast_none`` seed 0 in bf16), so runs are paired only within one family."""
    import torch

    from visattn import engine

    dev = engine.resolve_device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    for probe, name in (("amx_tile", "amx"), ("avx512_bf16", "avx512_bf16"), ("avx512", "avx512"), ("avx2", "avx2")):
        if getattr(torch.cpu, f"_is_{probe}_supported", lambda: False)():
            return name
    return "cpu"


def numerics(r: dict) -> str:
    """What a run is paired and tabled by besides its budget: its precision and kernel family, e.g.
    ``bf16 on avx512_bf16``."""
    p = precision(r)
    return f"{p} on {r.get('kernels') or LEGACY_KERNELS.get(p, 'cpu')}"


def baseline_of(results: List[dict], name: str) -> str:
    """The run name ``name`` pairs with: ``resnet_fast_none/TAG`` for a variant ``CONFIG/TAG`` whose tag also
    ran the baseline (a backbone variant, ``--backbone``: wider groups, say), else ``resnet_fast_none``, as
    for a block's own variant (a placement) that leaves the backbone as it is. ``resnet_fast_none/TAG`` itself
    pairs with ``resnet_fast_none``: what the backbone change alone does. A variant of a config outside the
    ``resnet_fast`` family (``vit_cpu/distill-hard``) pairs with that config itself: what the change does to it
    (the config's own runs are paired with ``resnet_fast_none``)."""
    stem, _, tag = name.partition("/")
    if tag and not stem.startswith("resnet_fast"):
        return stem
    if tag and stem != BASELINE and any(r["name"] == f"{BASELINE}/{tag}" for r in results):
        return f"{BASELINE}/{tag}"
    return BASELINE


def differences(results: List[dict], name: str, epochs: Optional[int] = None) -> List[float]:
    """``name``'s accuracy minus its baseline's (:func:`baseline_of`), in points, for each seed both have at
    the same epochs, precision and kernel family (:func:`numerics`; ``epochs``: only that budget)."""
    rs = at_budget(results, epochs)
    b = baseline_of(results, name)
    base = {(r["seed"], r["epochs"], numerics(r)): r["val_acc"] for r in rs if r["name"] == b}
    return [100 * (r["val_acc"] - base[r["seed"], r["epochs"], numerics(r)]) for r in rs
            if r["name"] == name and (r["seed"], r["epochs"], numerics(r)) in base]


def ordered(names) -> List[str]:
    """Config names in the table's fixed order (blocks, then transformers, then anything else), each
    config's variants (``name/tag``) after it."""
    canon = [Path(c).stem for c in CNN_CONFIGS + TRANSFORMER_CONFIGS]

    def key(n: str):
        stem, _, tag = n.partition("/")
        return (canon.index(stem) if stem in canon else len(canon), stem, tag)

    return sorted(dict.fromkeys(names), key=key)


def paired(results: List[dict], name: str, epochs: Optional[int] = None) -> Optional[Tuple[float, float, int]]:
    """(mean difference to the baseline in points, 95% half-width, pairs) over the seeds both have."""
    diffs = differences(results, name, epochs)
    if not diffs:
        return None
    m, h = mean_ci(diffs)
    return m, h, len(diffs)


MIN_PAIRS = 3  # two pairs give a t interval on a spread estimated from two numbers: no verdict from that


def verdict(d: Optional[Tuple[float, float, int]]) -> str:
    """better / worse (the 95% interval excludes 0), no difference resolved (it holds 0 and is at most ±0.5
    wide), undecided (wider), or too few seeds (under :data:`MIN_PAIRS` pairs)."""
    if d is None or d[2] < MIN_PAIRS:
        return "too few seeds"
    m, h, _ = d
    if m - h > 0:
        return "better"
    if m + h < 0:
        return "worse"
    return "no difference resolved" if h <= 0.5 else "undecided (interval too wide)"


def timing(rs: List[dict], key: str) -> float:
    """Median of ``key`` over the runs timed on a quiet machine (all runs if none was)."""
    return statistics.median(r[key] for r in ([r for r in rs if quiet(r)] or rs))


def pairs_needed(results: List[dict], name: str, target: float = 0.5) -> Optional[int]:
    """Pairs at which the 95% half-width would reach ``target`` if the differences' spread stays as measured
    (None below 2 pairs; capped at 31, past the t table)."""
    diffs = differences(results, name)
    if len(diffs) < 2:
        return None
    sd = statistics.stdev(diffs)
    return next((n for n in range(2, 31) if T95[n - 2] * sd / math.sqrt(n) <= target), 31)


def split_by_options(results: List[dict]) -> List[dict]:
    """``results`` with every name that ran with more than one set of model options split into one name per
    set, so that no row averages or pairs runs of different models: the runs built as their config builds now
    (with their own overrides, :func:`planned_options`; the newest set where the config is gone) keep the
    name, the others become ``NAME/earlier-K`` (K = 1, 2, ... in the order the file first holds them). Like any
    variant these pair with ``resnet_fast_none/earlier-K`` where the baseline was split too, else with
    ``resnet_fast_none``."""
    keys = [(r["name"], _canon(r.get("model"))) for r in results]  # (name, model options as canonical text)
    sets: Dict[str, List[str]] = {}  # name -> its model options, in the order the file holds them
    for name, mine in keys:
        if mine not in sets.setdefault(name, []):
            sets[name].append(mine)
    label: Dict[Tuple[str, str], str] = {}  # (name, options) -> the row's name, for the names to split
    for name, opts in sets.items():
        if len(opts) > 1:
            r = next(r for r in results if r["name"] == name)
            try:
                now = _canon(planned_options(r["config"], r.get("overrides", [])))
            except VisattnError:  # the config is gone or no longer loads: the newest runs keep the name
                now = None
            keep = now if now in opts else _canon(next(r for r in reversed(results) if r["name"] == name).get("model"))
            earlier = [o for o in opts if o != keep]
            label.update({(name, o): f"{name}/earlier-{k}" for k, o in enumerate(earlier, start=1)})
    return [dict(r, name=label[k]) if k in label else r for r, k in zip(results, keys)]


def table(results: List[dict]) -> str:
    results = split_by_options(results)
    lines = ["| config | params | epochs | seeds | val acc % (mean ± std) | difference to none, points (95% CI) | "
             "verdict | pairs for ±0.5 (est.) | train time s (median) | images/s (median) |",
             "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    by: Dict[str, List[dict]] = {}
    for r in results:
        by.setdefault(r["name"], []).append(r)
    for name in ordered(by):
        rs = by[name]
        accs = [100 * r["val_acc"] for r in rs]
        busy = "" if any(quiet(r) for r in rs) else " (busy)"  # no run of this config was timed on a quiet machine
        acc = f"{statistics.mean(accs):.2f} ± {statistics.stdev(accs):.2f}" if len(accs) > 1 else f"{accs[0]:.2f}"
        d = paired(results, name) if name != BASELINE else None
        if d is None:
            diff = "—"
        else:
            diff = f"{d[0]:+.2f} ± {d[1]:.2f} ({d[2]} pairs)" if d[2] > 1 else f"{d[0]:+.2f} (1 pair, no interval)"
        lines.append(f"| `{name}` | {rs[0]['parameters'] / 1e6:.2f}M | {rs[0]['epochs']} | {len(rs)} | "
                     f"{acc} | {diff} | "
                     f"{verdict(d) if name != BASELINE else '—'} | {(pairs_needed(results, name) if name != BASELINE else None) or '—'} | "
                     f"{timing(rs, 'train_seconds'):.0f}{busy} | {timing(rs, 'images_per_s'):.0f}{busy} |")
    return "\n".join(lines)


# the README's summary: this round's sweeps, all on one kernel family (see :func:`numerics`)
SUMMARY_NUMERICS = "bf16 on avx512_bf16"
PLACED = ("se", "eca", "cbam")  # the blocks of the placement ablation (bench/placement_sweep.sh)
BUDGETS = (4, 16)  # the recipe's epochs and the longer budget (the recipe as shipped for 16 epochs: see docs/results.md)
# budgets the summary adds from another kernel family: (epochs, numerics, column label); the CPU cannot run
# the table at 32 epochs, an H100 did (bench/gpu_table.sh); paired only within that family, like every column
OTHER_BUDGETS = ((16, "bf16 on NVIDIA H100 80GB HBM3", "16 epochs, H100"),
                 (32, "bf16 on NVIDIA H100 80GB HBM3", "32 epochs, H100"))
README_BEGIN = "<!-- attention summary: python bench/attention_table.py --summary -->"
README_END = "<!-- end of attention summary -->"


def cell(d: Optional[Tuple[float, float, int]]) -> str:
    """A paired difference as a table cell: ``+0.60 ± 0.32 (3)``, ``+0.60 (1, no interval)`` or ``—``."""
    if d is None:
        return "—"
    m, h, n = d
    return f"{m:+.2f} ± {h:.2f} ({n})" if n > 1 else f"{m:+.2f} (1, no interval)"


def shipped(results: List[dict], config: str, options: Optional[dict] = None) -> List[dict]:
    """The runs of ``config`` as it ships now, under the config's own name whatever tag they ran under: those
    whose model options (recorded per run) equal the config's and whose ``--set`` overrides touched only the
    model. A placement variant whose overrides are what the config now ships is the same run, so it counts
    (the runs are deterministic for a seed, precision and kernel family); round 2's runs of the same name,
    with other block options, do not. ``options``: the model options to match (default: the config's).
    A seed run under two names (the config's own and a placement tag) counts once, as the config's own run, per
    budget and kernel family."""
    want, name = _canon(planned_options(config) if options is None else options), Path(config).stem
    mine = sorted((r for r in results if r["config"] == config and _canon(r.get("model")) == want
                   and all(o.startswith("model.") for o in r.get("overrides", []))),
                  key=lambda r: r["name"] != name)  # stable: the config's own runs first
    out, seen = [], set()
    for r in mine:
        if (r["seed"], r["epochs"], numerics(r)) not in seen:
            seen.add((r["seed"], r["epochs"], numerics(r)))
            out.append(dict(r, name=name))
    return out


def load_speed(path: Path = SPEED) -> dict:
    """The committed one-process measurement of the configs' training steps (``{}`` where there is none)."""
    return json.loads(path.read_text()) if path.is_file() else {}


def speed_ratios(speed: Mapping) -> Dict[str, float]:
    """Each ``resnet_fast`` config's eager training-step images/s over ``none``'s, from one
    ``bench/throughput.py --out`` measurement (every ratio from one process, so a busy or slower machine
    changes both sides alike); keyed by block."""
    ips = {Path(r["config"]).stem: r["images_per_s"] for r in speed.get("rows", ())
           if r["step"] == "eager" and r["path"] == "-"}
    base = ips.get(BASELINE)
    return {n.removeprefix("resnet_fast_"): v / base for n, v in ips.items()
            if base and n.startswith("resnet_fast_")}


def summary(results: List[dict], num: str = SUMMARY_NUMERICS, options: Optional[Dict[str, dict]] = None,
            others: Sequence[Tuple[int, str, str]] = OTHER_BUDGETS, speed: Optional[Mapping] = None) -> str:
    """The README's attention results, from the runs on one kernel family (``num``): the placement ablation
    (identity-initialised ``se``, ``eca``, ``cbam`` in each position, the recipe's epochs: every run of the
    config's model at that position, tagged or not, so the shipped position's cell and the block's row count the
    same runs) and every block's
    paired difference to ``none`` at each budget of :data:`BUDGETS` with its verdict, then at each budget of
    ``others`` (``(epochs, numerics, label)``: runs of another kernel family, paired among themselves), plus
    its training step's images/s against ``none``'s, measured in one process (``speed``, default the
    committed :data:`SPEED`; the training runs' own images/s come from different sittings and machine loads,
    so their ratios mix the machine's speed into the block's cost). The blocks' rows are the shipped
    ``configs/attention`` (:func:`shipped`; ``options`` maps a block to the model options to match instead,
    for tests)."""
    from visattn.models.resnet import POSITIONS

    rs = [r for r in results if numerics(r) == num]
    columns = [(e, num, f"{e} epochs") for e in BUDGETS] + list(others)
    by_family: Dict[str, List[str]] = {}
    for _, n, label in others:
        by_family.setdefault(n, []).append(f'"{label}"')
    also = "".join(f", the {' and '.join(ls)} column{'s' if len(ls) > 1 else ''} in {n}" for n, ls in by_family.items())
    speed = load_speed() if speed is None else speed
    ratios = speed_ratios(speed)
    cost = (f" Cost: the eager training step's images/s against `none`'s, measured in one process on {speed['cpu']} "
            f"({speed['rows'][0]['precision']} on {speed['kernels']}, {speed['threads']} threads, {speed['date']}; `bench/results/block_speed.json`)."
            if ratios else "")
    out = [README_BEGIN, f"Runs in {num}{also}; difference to `none` in points, 95% interval, (pairs).{cost}", "",
           "| placement (4 epochs, `init: identity`) | " + " | ".join(f"`{p}`" for p in POSITIONS) + " |",
           "|---|" + "---:|" * len(POSITIONS)]
    fams = {n: [r for r in results if numerics(r) == n] for _, n, _ in columns}
    as_shipped = {(a, n): shipped(fam, f"configs/attention/resnet_fast_{a}.yaml", (options or {}).get(a))
                  for n, fam in fams.items() for a in ATTENTION}  # each config read once per family

    def runs_of(a: str, e: int, n: str) -> List[dict]:
        return at_budget(as_shipped[a, n], e)

    base = runs_of("none", BUDGETS[0], num)
    for b in PLACED:  # each position's runs as shipped() finds them: the shipped position's cell is the block row's
        cfg = f"configs/attention/resnet_fast_{b}.yaml"
        at = {p: (dict(options[b], attn_position=p) if options and b in options
                  else planned_options(cfg, [f"model.attn_position={p}"])) for p in POSITIONS}
        out.append(f"| `{b}` | " + " | ".join(cell(paired(base + shipped(rs, cfg, at[p]), f"resnet_fast_{b}", BUDGETS[0]))
                                           for p in POSITIONS) + " |")
    head = " | ".join(f"{label} | verdict" for _, _, label in columns)
    out += ["", f"| block (`configs/attention`, as shipped) | {head} | cost: images/s vs `none` |",
            "|---|" + "---:|---|" * len(columns) + "---:|"]

    for a in ATTENTION:
        if a == "none":
            accs = [" ".join(filter(None, _acc(runs_of(a, e, n)))) for e, n, _ in columns]
            out.append("| `none` (accuracy ± std) | " + " | ".join(f"{x} | —" for x in accs)
                       + f" | {'1.00' if ratios else '—'} |")
            continue
        ds = [paired(runs_of("none", e, n) + runs_of(a, e, n), f"resnet_fast_{a}", e) for e, n, _ in columns]
        ratio = f"{ratios[a]:.2f}" if a in ratios else "—"
        out.append(f"| `{a}` | " + " | ".join(f"{cell(d)} | {verdict(d) if d else '—'}" for d in ds) + f" | {ratio} |")
    return "\n".join(out + [README_END])


def _acc(rs: List[dict]) -> Tuple[str, ...]:
    """Mean accuracy with its spread and count, as cell text."""
    if not rs:
        return ("—",)
    accs = [100 * r["val_acc"] for r in rs]
    return (f"{statistics.mean(accs):.2f}%", f"± {statistics.stdev(accs):.2f}" if len(accs) > 1 else "",
            f"({len(accs)})")


def plot(results: List[dict], path: Path, num: Optional[str] = None, epochs: int = 4) -> Dict[str, int]:
    """Two panels: the ``resnet_fast`` configs on their own accuracy scale, then every config; only the runs
    at ``epochs`` on one kernel family (``num``, :func:`numerics`; default: the family with the most runs at
    that budget), since times and accuracies from different budgets or machines do not share axes. Returns
    the runs drawn per config."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = at_budget(results, epochs)
    if num is None:
        num = statistics.mode(numerics(r) for r in results)
    results = split_by_options([r for r in results if numerics(r) == num])  # one marker per model
    names = ordered(r["name"] for r in results)
    colour = {n: plt.get_cmap("tab20")(i % 20) for i, n in enumerate(names)}
    fig, axes = plt.subplots(1, 2, figsize=(12, 5.2), dpi=100)
    for ax, shown in zip(axes, ([n for n in names if n.startswith("resnet_fast")], names)):
        for name in shown:
            rs = [x for x in results if x["name"] == name]
            ts, accs = [r["train_seconds"] for r in rs], [100 * r["val_acc"] for r in rs]
            ax.scatter(ts, accs, color=colour[name], s=12, alpha=0.5)
            m, h = mean_ci(accs)
            ax.errorbar([timing(rs, "train_seconds")], [m], yerr=[0 if math.isinf(h) else h], fmt="o", ms=6,
                        capsize=3, color=colour[name], label=f"{name} (n={len(rs)})")
        ax.set_xlabel("training time (s) on 2 CPU cores")
        ax.set_ylabel("validation accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2 if len(shown) > 9 else 1)
    axes[0].set_title("resnet_fast + each block (the CPU recipe's network)", fontsize=9)
    axes[1].set_title(f"every config, transformers included (same {epochs} epochs)", fontsize=9)
    fig.suptitle(f"CIFAR-10, 5,000-image validation split held out from train; 45,000 training images, {epochs} "
                 f"epochs; {num}, 2 CPU cores.\n"
                 "Dots: seeds; markers: mean with the 95% interval of that mean (unpaired; none for n=1) at the median "
                 "time of the runs timed with nothing else on the machine", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return {n: sum(r["name"] == n for r in results) for n in names}


def ran(results: List[dict], config: str, seed: int, epochs: Optional[int] = None, tag: str = "",
        prec: Optional[str] = None) -> bool:
    """Whether ``results`` hold the run (its name, seed and, where given, epochs and :func:`numerics`, e.g.
    ``"bf16 on amx"``)."""
    name = run_name(config, tag)
    return any(r["name"] == name and r["seed"] == seed and (epochs is None or r["epochs"] == epochs)
               and (prec is None or numerics(r) == prec) for r in results)


def _canon(options) -> str:
    """Model options as comparable text (tuples and lists alike, key order ignored)."""
    return json.dumps(options, sort_keys=True)


def planned_options(config: str, sets: Sequence[str] = ()) -> dict:
    """The model options a run of ``config`` with the ``--set`` overrides ``sets`` records."""
    from visattn.config import load_config

    return json.loads(json.dumps(load_config(ROOT / config, list(sets)).model.options()))


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
        want[run_name(c, t)] = _canon(planned_options(c, sets if t else ()))
    kept = [r for r in results if r["name"] not in want or _canon(r.get("model")) == want[r["name"]]]
    if tag:
        return kept
    key = lambda r: (r["name"], r["seed"], r["epochs"], numerics(r))  # noqa: E731
    have = {key(r) for r in kept}
    return kept + [r for c in configs for r in shipped(results, c) if key(r) not in have]


def merge(results: List[dict], others: List[dict]) -> List[dict]:
    """The runs of ``others`` (another machine's results file, e.g. ``bench/gpu_table.sh``'s) that ``results``
    lack, by name, seed, epochs, :func:`numerics` and model options; a run already there is kept, never
    replaced."""
    key = lambda r: (r["name"], r["seed"], r["epochs"], numerics(r), _canon(r.get("model")))  # noqa: E731
    have, new = {key(r) for r in results}, []
    for r in others:
        if key(r) not in have:
            have.add(key(r))
            new.append(r)
    return new


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


def main() -> None:
    ap = argparse.ArgumentParser(description=describe(__doc__))
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
    ap.add_argument("--precision", choices=["auto", "bf16", "fp16", "fp32"], default=None,
                    help="override every config's precision (the runs keep their names: the table keys them by "
                         "precision and kernel family)")
    ap.add_argument("--data-root", default=None)
    ap.add_argument("--runs", default=str(ROOT / "runs" / "attention_table"))
    ap.add_argument("--results", default=str(RESULTS), help="the results file, read and appended to")
    ap.add_argument("--merge", nargs="+", default=None, metavar="FILE",
                    help="add the runs of these results files (another machine's) that the results file lacks")
    ap.add_argument("--report", action="store_true", help="print the table (and plot) from the results file only")
    ap.add_argument("--summary", action="store_true", help="print the README's summary (placement ablation, "
                    "both budgets) from the results file only")
    ap.add_argument("--numerics", default=None, help="the kernel family the plot shows, e.g. 'bf16 on amx' "
                    "(default: the one with the most runs)")
    ap.add_argument("--plot-epochs", type=int, default=4, help="the budget the plot shows")
    ap.add_argument("--plot", default=None, help="write the accuracy-vs-time plot here (PNG)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's own); 1 lets a run share the 2 cores with other work "
                         "without the 2-thread slowdown; its time is then left out of the table's medians")
    args = ap.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.set and not args.tag:
        ap.error("--set changes the runs: name the variant with --tag")
    if args.backbone and not args.set:
        ap.error("--backbone: give the backbone's overrides with --set")
    out = Path(args.results)
    results = json.loads(out.read_text()) if out.is_file() else []
    if args.summary:
        print(summary(results))
        return
    if args.merge:
        try:
            new = merge(results, [r for f in args.merge for r in json.loads(Path(f).read_text())])
        except (OSError, ValueError, KeyError, TypeError) as e:
            sys.exit(f"--merge: not a results file ({type(e).__name__}: {e})")
        write_atomic(out, json.dumps(results + new, indent=1))
        print(f"added {len(new)} runs to {out}: " + ", ".join(f"{r['name']} seed {r['seed']} ({r['epochs']} "
                                                             f"epochs, {numerics(r)})" for r in new))
        return
    seeds = args.seeds if args.seeds is not None else list(range(args.max_seeds))
    # the runs a sweep plans and pairs with: a same-named run with other model options is not this config's
    live = [] if args.report else current(results, args.configs, args.tag, args.set, args.backbone)
    for seed in [] if args.report else seeds:  # seed-major: a partial sweep still pairs every config
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
    for epochs, num in sorted({(r["epochs"], numerics(r)) for r in results}):
        print(f"\n{epochs} epochs, {num}\n" + table([r for r in at_budget(results, epochs) if numerics(r) == num]))
    if args.plot and results:
        plot(results, Path(args.plot), args.numerics, args.plot_epochs)


def variant(config: str, tag: str, backbone: bool = False) -> str:
    """The tag a config runs under: none for the baseline, which has no block to vary, unless the variant
    changes the backbone (``backbone``), which the baseline must share to pair with."""
    return "" if Path(config).stem == BASELINE and not backbone else tag


def planned_numerics(config: str, precision_override: Optional[str] = None) -> str:
    """The :func:`numerics` a run of ``config`` has on this machine (``auto``: bf16 only with native bf16)."""
    from visattn import engine
    from visattn.config import load_config

    cfg = load_config(ROOT / config)
    prec = engine.resolve_precision(precision_override or cfg.precision, engine.resolve_device(cfg.device))
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
