"""The block speed tables as the docs show them: a measurement of bench/blocks.py, each block beside its FLOP and
memory-traffic ceilings and its share of the lower.

    python -m bench.block_table bench/results/block_speed_bf16.json    # what python -m bench.blocks --table FILE prints
    python -m bench.block_table --profile OTHER.json                   # bench/results/block_speed.json, another profile

Each block's whole-step ratio to ``none`` (before and after, eager and compiled) stands beside its target and its
two ceilings: the **FLOP ceiling** (``none``'s FLOP per step over the block network's, in the measurement) and the
**memory-traffic ceiling** (the ratio the block would reach if it cost only the bytes it must move:
``bench/bf16_profile.py``'s, read from ``bench/results/bf16_profile.json`` or ``--profile``). A profile applies only
to a measurement made on the same machine in the same way (:data:`SAME_MACHINE`: CPU, kernel family, precision,
threads and batch); otherwise, or where there is no profile, the column shows "-" and the table's header line says
why. **Share of ceiling**: the "after" ratio over the lower of the block's ceilings, judged against
:data:`SHARE_GOAL` (issue 94: each block at 90% of its ceiling or more).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from bench.common import ROOT, parser, read_results
from visattn.errors import DataError, run_main
from visattn.results import check_rows, read_json

BASELINE = "none"
IMPLS = ("before", "after")
SPEED = ROOT / "bench" / "results" / "block_speed.json"  # python -m bench.blocks --out writes it
PROFILE = ROOT / "bench" / "results" / "bf16_profile.json"  # python -m bench.bf16_profile --out writes it
SHARE_GOAL = 0.90
# what a profile and a speed measurement must share for the profile's ceilings to apply to the measurement
SAME_MACHINE = ("cpu", "kernels", "precision", "threads", "batch_size")
# what the table reads of a profile (bench/bf16_profile.py's JSON)
PROFILE_FIELDS = {"cpu": "str", "kernels": "str", "precision": "str", "threads": "int", "batch_size": "int",
                  "git": "str", "date": "str", "blocks": "dict"}


def _shown(path: Path) -> str:
    """``path`` as the docs name it: relative to the repository where it lies inside it."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def read_profile(path: Optional[Path]) -> Optional[dict]:
    """The memory-traffic profile in ``path``; None where there is none (no path, no such file); a damaged or
    foreign file (not a JSON object, a key missing, a ceiling that is not a number in (0, 1]) is one
    :class:`DataError` line naming it."""
    if path is None or not Path(path).exists():
        return None
    data = read_results(Path(path), PROFILE_FIELDS, rows=None)
    for name, row in data["blocks"].items():
        if not isinstance(row, dict):
            raise DataError(f"{path}: blocks.{name} is a JSON {type(row).__name__}, not an object (a damaged or "
                            "foreign profile?)")
        c = row.get("ceiling")
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 < c <= 1):
            raise DataError(f"{path}: blocks.{name}.ceiling is {json.dumps(c)[:40]}, not a number in (0, 1] (a "
                            "damaged or foreign profile?)")
    return data


def memory_ceilings(data: dict, path: Optional[Path]) -> Tuple[Dict[str, float], str]:
    """Each block's memory-traffic ceiling from the profile in ``path`` where it applies to measurement ``data``, and
    the header line's sentence saying where the column comes from, or why it is empty."""
    profile, source = read_profile(path), _shown(path) if path else ""
    if path is None:
        said, found = ": - (no profile given)", {}
    elif profile is None:
        said, found = f": - (no profile at {source}: `python -m bench.bf16_profile --out {source}`)", {}
    elif differ := [f"{k} {profile[k]} there, {data.get(k)} here" for k in SAME_MACHINE if profile[k] != data.get(k)]:
        said, found = f": - ({source} was measured elsewhere: {'; '.join(differ)})", {}
    else:
        said = (f" from {source} (git {profile['git'][:7]}, {profile['date'][:10]}: the same CPU, kernels, precision, "
                "threads and batch)")
        found = {b: float(r["ceiling"]) for b, r in profile["blocks"].items() if r.get("ceiling") is not None}
    return found, (f"Memory-traffic ceiling{said}. Share of ceiling: the after ratio over the lower of the block's "
                   f"ceilings; at 90%: whether that share is {SHARE_GOAL:.0%} or more.")


def tables(data: dict, profile: Optional[Path] = PROFILE) -> str:
    """The measurement as markdown: a line on the machine, the note and where the memory-traffic ceilings come from,
    then one row per block: its whole-step ratios to ``none`` (before and after, eager and compiled) against its
    target, its FLOP ceiling (the ratio with no overhead at all: ``none``'s FLOP per step over the block network's)
    and its memory-traffic ceiling (the profile's, where it applies), the after ratio's share of the lower ceiling
    and whether it reaches :data:`SHARE_GOAL`, and the block alone (forward + backward ms summed over the three
    feature maps, before -> after; each map's figure is in the JSON). A block measured "after" only (registered since
    the "before" revision) shows "—" for before, and one without a target "—" for its target and whether it is
    met; a block without a ceiling "-" for it."""
    none = {r["step"]: r["images_per_s"] for r in data["rows"] if r["block"] == BASELINE}
    kinds = [k for k in ("eager", "compiled") if k in none]
    where = data["cpu"] if data["device"] == "cpu" else data["kernels"]
    memory, said = memory_ceilings(data, profile)
    flop = data.get("flop_ceiling") or {}
    lines = [f"{where} ({data['kernels']}), {data['precision']}, {data['threads']} threads, torch {data['torch']}, "
             f"{data['date']}; batch {data['batch_size']}, {data['steps']} step(s) per timing, median of "
             f"{data['repeats']} interleaved repeats; before = {data['before']}, after = {data['after']}; `none`: "
             + ", ".join(f"{none[k]:.1f} images/s {k}" for k in kinds) + (" (a quick run: no claim)" if data["quick"] else "")
             + ". " + data["note"] + " " + said, "",
             "| block | " + " | ".join(f"{k} {i}" for k in kinds for i in IMPLS)
             + " | target | FLOP ceiling | memory ceiling | share of ceiling | at 90% | met (after) | alone, ms (3 maps) |",
             "|---|" + "---:|" * (2 * len(kinds)) + "---:|---:|---:|---:|---|---|---:|"]

    def num(x: Optional[float], form: str) -> str:  # "before": null, a block without a target: a dash
        return "—" if x is None else format(x, form)

    def total(times: Sequence[Optional[float]]) -> Optional[float]:
        return None if any(t is None for t in times) else sum(times)

    for b, r in data["ratios"].items():
        met = " / ".join("yes" if data["met"][b][k] else "no" for k in kinds) if b in data["met"] else "—"
        alone = [num(total([t[i] for t in data["alone_ms"].get(b, {}).values()]), ".0f") for i in IMPLS]
        ceilings = [c for c in (flop.get(b), memory.get(b)) if c is not None]
        shares: List[Optional[float]] = [r[k]["after"] / min(ceilings) if ceilings else None for k in kinds]
        share = " / ".join(num(s, ".1%") for s in shares) if ceilings else "-"
        judged = " / ".join("yes" if s >= SHARE_GOAL else "no" for s in shares) if ceilings else "-"
        lines.append(f"| `{b}` | " + " | ".join(num(r[k][i], ".3f") for k in kinds for i in IMPLS)
                     + f" | {num(data['targets'].get(b), '.2f')} | {num(flop.get(b), '.3f') if b in flop else '-'} | "
                     + f"{format(memory[b], '.3f') if b in memory else '-'} | {share} | {judged} | {met} | "
                     + f"{alone[0]} -> {alone[1]} |")
    return "\n".join(lines)


# what tables() reads of a measurement: the top-level keys (results.check_rows kinds), and numbers in its mappings
TABLE_FIELDS = {"cpu": "str", "device": "str", "kernels": "str", "precision": "str", "threads": "int", "torch": "str",
                "date": "str", "batch_size": "int", "steps": "int", "repeats": "int", "quick": "bool", "before": "str",
                "after": "str", "note": "str", "targets": "dict", "ratios": "dict", "met": "dict", "alone_ms": "dict",
                "rows": "list", "flop_ceiling": "dict?"}


def read_table(path: Path, profile: Optional[Path] = PROFILE) -> str:
    """``--table``: the tables of the measurement in ``path``, the memory-traffic ceilings from ``profile``; a
    missing, damaged or foreign file (not a JSON object, a key missing, a bool or text where a number belongs) is
    one :class:`DataError` line naming it; so is a damaged profile (a missing one leaves its column "-")."""
    data = read_json(path, dict)
    try:
        check_rows(path, [data], TABLE_FIELDS)
    except DataError as e:  # the file is one measurement, not a list of rows
        raise DataError(str(e).replace(": row 1 has", ": it has", 1)) from None
    check_rows(path, data["rows"], {"block": "str", "step": "str", "images_per_s": "number"})

    def numbers(x: object, key: str) -> None:  # every leaf of the ratios, targets, ceilings and times
        if isinstance(x, dict):
            for k, v in x.items():
                numbers(v, f"{key}.{k}")
        elif x is None and key.endswith(".before") and key.split(".")[0] in ("ratios", "alone_ms"):
            return  # a block registered since the "before" revision
        elif isinstance(x, bool) or not isinstance(x, (int, float)) or x != x or x in (float("inf"), float("-inf")):
            raise DataError(f"{path}: {key} is {json.dumps(x)[:40]}, not a finite number (a damaged or foreign "
                            "measurement?)")

    for key in ("targets", "ratios", "alone_ms", "flop_ceiling"):
        numbers(data.get(key) or {}, key)
    try:
        return tables(data, profile)
    except DataError:  # the profile's own line (a DataError is a ValueError too)
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        raise DataError(f"{path}: not a block speed measurement ({e.__class__.__name__}: "
                        f"{str(e).splitlines()[0][:80] if str(e) else ''})") from None


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = parser(__doc__, prog="python -m bench.block_table")
    ap.add_argument("speed", type=Path, nargs="?", default=SPEED, metavar="JSON",
                    help="a block speed measurement (python -m bench.blocks --out's; default: %(default)s)")
    ap.add_argument("--profile", type=Path, default=PROFILE, metavar="JSON",
                    help="the memory-traffic ceilings shown where measured on the same machine "
                         "(python -m bench.bf16_profile --out's; default: %(default)s)")
    args = ap.parse_args(argv)
    print(read_table(args.speed, args.profile))


if __name__ == "__main__":
    run_main(main, "block_table.py")
