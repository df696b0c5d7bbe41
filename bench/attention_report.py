"""The attention table's report: merges results files, prints the tables and the plot, and writes the summary into docs/results.md, from the results file alone (no training).

    python -m bench.attention_report                  # every run: one table per budget and kernel family
    python -m bench.attention_report --plot assets/accuracy_vs_time.png     # and the accuracy-vs-time plot
    python -m bench.attention_report --summary        # the README's summary: placement ablation and budgets
    python -m bench.attention_report --summary --write    # the same, written into docs/results.md
    python -m bench.attention_report --merge OUT/results.json    # add another machine's runs (bench/gpu_table.sh)

``bench/attention_table.py`` trains the runs and appends them to the results file. Runs are paired by seed
against ``resnet_fast_none`` within one budget (epochs) and one kernel family (:func:`numerics`: the same seed
gives another result on other hardware); each difference gets a 95% t interval and a verdict
(:func:`verdict`). Times are medians over the runs timed with nothing else on the machine (:func:`quiet`).
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from bench.common import ROOT, parser, splice
from visattn.errors import ConfigError, DataError, VisattnError, run_main
from visattn.results import check_rows, read_json, write_atomic

ATTENTION = ("none", "se", "eca", "gc", "spatial", "cbam", "coord", "nonlocal", "mhsa2d")
# the summary's blocks (above) first, then the rest of the catalogue's feature-map blocks (their rows: docs/blocks.md's
# catalogue, bench/catalogue.py): the runner's default sweep trains them all
CNN_CONFIGS = [f"configs/attention/resnet_fast_{a}.yaml" for a in ATTENTION] + sorted(
    p.relative_to(ROOT).as_posix() for p in (ROOT / "configs" / "attention").glob("resnet_fast_*.yaml")
    if p.stem.removeprefix("resnet_fast_") not in ATTENTION)
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
# the blocks' cost: one process's training steps of every config (python -m bench.blocks --out SPEED)
SPEED = ROOT / "bench" / "results" / "block_speed.json"
# two-sided 95% quantiles of Student's t for 1..30 degrees of freedom
T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
       2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def quiet(r: dict) -> bool:
    """Whether a run's time was measured with nothing else on the machine (an unrecorded load counts as quiet,
    unless the run is in :data:`CONTENDED` or records a ``contended`` reason: another job ran beside it)."""
    load = r.get("load_mean")
    seen = (r["name"], r["seed"], r.get("git")) in CONTENDED or r.get("contended")
    if seen or (r.get("threads") or 2) < 2 or r.get("resumed"):
        return False  # seen sharing the machine, trained on one thread to share it, or timed in two sittings
    return load is None or load <= QUIET_LOAD


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


# the kernel family of runs recorded before it was stored: the earliest bf16 runs ran on AMX CPUs, the
# earliest fp32 runs on an AVX2 machine without native bf16
LEGACY_KERNELS = {"bf16": "amx", "fp32": "avx2"}


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
    keys = [(r["name"], canon(r.get("model"))) for r in results]  # (name, model options as canonical text)
    sets: Dict[str, List[str]] = {}  # name -> its model options, in the order the file holds them
    for name, mine in keys:
        if mine not in sets.setdefault(name, []):
            sets[name].append(mine)
    label: Dict[Tuple[str, str], str] = {}  # (name, options) -> the row's name, for the names to split
    for name, opts in sets.items():
        if len(opts) > 1:
            r = next(r for r in results if r["name"] == name)
            try:
                now = canon(planned_options(r["config"], r.get("overrides", [])))
            except VisattnError:  # the config is gone or no longer loads: the newest runs keep the name
                now = None
            keep = now if now in opts else canon(next(r for r in reversed(results) if r["name"] == name).get("model"))
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


# the README's summary: the sweeps on one kernel family (see :func:`numerics`)
SUMMARY_NUMERICS = "bf16 on avx512_bf16"
PLACED = ("se", "eca", "cbam")  # the blocks of the placement ablation (docs/changelog.md: placement_sweep)
BUDGETS = (4, 16)  # the recipe's epochs and the longer budget (the recipe as shipped for 16 epochs: see docs/results.md)
# budgets the summary adds from another kernel family: (epochs, numerics, column label); the CPU cannot run
# the table at 32 epochs, an H100 did (bench/gpu_table.sh); paired only within that family, like every column
OTHER_BUDGETS = ((16, "bf16 on NVIDIA H100 80GB HBM3", "16 epochs, H100"),
                 (32, "bf16 on NVIDIA H100 80GB HBM3", "32 epochs, H100"))
README_BEGIN = "<!-- attention summary: python -m bench.attention_report --summary --write -->"
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
    (the runs are deterministic for a seed, precision and kernel family); an earlier sweep's runs of the
    same name, with other block options, do not. ``options``: the model options to match (default: the config's).
    A seed run under two names (the config's own and a placement tag) counts once, as the config's own run, per
    budget and kernel family."""
    want, name = canon(planned_options(config) if options is None else options), Path(config).stem
    mine = sorted((r for r in results if r["config"] == config and canon(r.get("model")) == want
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
    return read_json(path, dict, missing={})


def speed_ratios(speed: Mapping, step: str = "eager") -> Dict[str, float]:
    """Each ``resnet_fast`` config's training-step images/s over ``none``'s, ``step`` ``"eager"`` or
    ``"compiled"``, from one ``bench/blocks.py --out`` measurement (every ratio from one process, so a busy or
    slower machine changes both sides alike); keyed by block. The blocks as they are now: rows of path ``"-"``
    (one implementation) or ``"after"`` (not the earlier implementation measured beside them, ``"before"``)."""
    ips = {Path(r["config"]).stem: r["images_per_s"] for r in speed.get("rows", ())
           if r["step"] == step and r["path"] in ("-", "after")}
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
    ratios, compiled = speed_ratios(speed), speed_ratios(speed, "compiled")
    both = any(a != "none" for a in compiled)  # a second figure per cell: the compiled step's
    emulated = (" (no native bf16 on that CPU: fp32 is the recipe's precision there)"
                if speed.get("native_bf16") is False else "")
    cost = (f" Cost: the {'eager / compiled' if both else 'eager'} training step's images/s against `none`'s, "
            f"measured in one process on {speed['cpu']} ({speed['rows'][0]['precision']} on {speed['kernels']}, "
            f"{speed['threads']} threads, {speed['date']}; `bench/results/block_speed.json`){emulated}."
            if ratios else "")

    def cost_cell(a: str) -> str:
        if a not in ratios:
            return "—"
        return f"{ratios[a]:.2f}" + (f" / {compiled[a]:.2f}" if both and a in compiled else "")
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
    out += ["", f"| block (`configs/attention`, as shipped) | {head} | cost: images/s vs `none`"
                + (", eager / compiled |" if both else " |"),
            "|---|" + "---:|---|" * len(columns) + "---:|"]

    for a in ATTENTION:
        if a == "none":
            accs = [" ".join(filter(None, _acc(runs_of(a, e, n)))) for e, n, _ in columns]
            out.append("| `none` (accuracy ± std) | " + " | ".join(f"{x} | —" for x in accs) + f" | {cost_cell(a)} |")
            continue
        ds = [paired(runs_of("none", e, n) + runs_of(a, e, n), f"resnet_fast_{a}", e) for e, n, _ in columns]
        out.append(f"| `{a}` | " + " | ".join(f"{cell(d)} | {verdict(d) if d else '—'}" for d in ds) + f" | {cost_cell(a)} |")
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


def canon(options) -> str:
    """Model options as comparable text (tuples and lists alike, key order ignored)."""
    return json.dumps(options, sort_keys=True)


def planned_options(config: str, sets: Sequence[str] = ()) -> dict:
    """The model options a run of ``config`` with the ``--set`` overrides ``sets`` records."""
    from visattn.config import load_config

    return json.loads(json.dumps(load_config(ROOT / config, list(sets)).model.options()))


def merge(results: List[dict], others: List[dict]) -> List[dict]:
    """The runs of ``others`` (another machine's results file, e.g. ``bench/gpu_table.sh``'s) that ``results``
    lack, by name, seed, epochs, :func:`numerics` and model options; a run already there is kept, never
    replaced."""
    key = lambda r: (r["name"], r["seed"], r["epochs"], numerics(r), canon(r.get("model")))  # noqa: E731
    have, new = {key(r) for r in results}, []
    for r in others:
        if key(r) not in have:
            have.add(key(r))
            new.append(r)
    return new


# the pages that carry the summary between README_BEGIN and README_END (``--summary --write``)
SUMMARY_PAGES = (ROOT / "docs" / "results.md",)


def write_summary(text: str, pages: Sequence[Path] = SUMMARY_PAGES) -> List[Path]:
    """Put ``text`` (the :func:`summary`) between the markers of each page that has them; returns the pages
    changed. A page whose block is already ``text`` is left as it is."""
    inner = text.removeprefix(README_BEGIN + "\n").removesuffix("\n" + README_END)  # the markers are the page's
    return [page for page in pages if README_BEGIN in page.read_text() and splice(page, README_BEGIN, README_END, inner)]


# what the tables, the summary, the plot and the merge read of every run (results.check_rows)
ROW = {"name": "str", "config": "str", "seed": "int", "epochs": "int", "val_acc": "number", "parameters": "number",
       "train_seconds": "number", "images_per_s": "number", "precision": "str?", "kernels": "str?", "git": "str?",
       "load_mean": "number?", "threads": "int?", "model": "dict?", "overrides": "list?"}


def read_results(path: Path, missing: Optional[list] = None) -> List[dict]:
    """The runs of a results file (``missing`` where there is no file and it is given); a damaged file or row is
    one line naming it (:func:`visattn.results.check_rows`)."""
    return check_rows(path, read_json(path, list) if missing is None else read_json(path, list, missing=missing), ROW)


def tables(results: List[dict]) -> str:
    """Every run's table, one per budget and kernel family."""
    return "\n".join(f"\n{epochs} epochs, {num}\n" + table([r for r in at_budget(results, epochs) if numerics(r) == num])
                     for epochs, num in sorted({(r["epochs"], numerics(r)) for r in results}))


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--results", default=str(RESULTS), help="the results file (--merge: read and appended to)")
    ap.add_argument("--merge", nargs="+", default=None, metavar="FILE",
                    help="add the runs of these results files (another machine's) that the results file lacks")
    ap.add_argument("--summary", action="store_true", help="print the README's summary (placement ablation, "
                    "every budget) instead of every run's table")
    ap.add_argument("--write", action="store_true", help="with --summary: write it into docs/results.md "
                    "between its markers")
    ap.add_argument("--numerics", default=None, help="the kernel family the plot shows, e.g. 'bf16 on amx' "
                    "(default: the one with the most runs)")
    ap.add_argument("--plot-epochs", type=int, default=4, help="the budget the plot shows")
    ap.add_argument("--plot", default=None, help="write the accuracy-vs-time plot here (PNG)")
    args = ap.parse_args()
    if args.write and not args.summary:
        ap.error("--write writes the summary: give --summary too")
    out = Path(args.results)
    results = read_results(out, missing=[])
    if args.merge:
        new = merge(results, [r for f in args.merge for r in read_results(Path(f))])
        write_atomic(out, json.dumps(results + new, indent=1))
        print(f"added {len(new)} runs to {out}: " + ", ".join(f"{r['name']} seed {r['seed']} ({r['epochs']} "
                                                             f"epochs, {numerics(r)})" for r in new))
        return
    if not results:
        raise ConfigError(f"{'--summary: ' if args.summary else ''}{out} holds no results")
    families = [SUMMARY_NUMERICS, *(n for _, n, _ in OTHER_BUDGETS)]
    if args.summary and not any(numerics(r) in families for r in results):
        raise DataError(f"--summary: {out} holds no runs of the summary's kernel families ({', '.join(families)})")
    shown = [r for r in at_budget(results, args.plot_epochs) if args.numerics in (None, numerics(r))]
    if args.plot and not shown:
        raise ConfigError(f"--plot: {out} holds no runs of --plot-epochs {args.plot_epochs}"
                          + (f" in --numerics {args.numerics!r}" if args.numerics else ""))
    if args.summary:
        text = summary(results)
        if args.write:
            changed = write_summary(text)
            print("wrote " + (", ".join(str(p.relative_to(ROOT)) for p in changed) or "nothing (already current)"))
        else:
            print(text)
        return
    print(tables(results))
    if args.plot:
        plot(results, Path(args.plot), args.numerics, args.plot_epochs)


if __name__ == "__main__":
    run_main(main, "attention_report.py")  # a bad results file or page: one line
