"""``bench/blocks.py``: the blocks of an earlier revision load beside today's and compute the same function, and one
quick run measures every variant in one process and writes the ratios the attention summary reads."""
from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

import visattn
from visattn.errors import DataError

blocks = importlib.import_module("bench.blocks")
block_table = importlib.import_module("bench.block_table")


def _in_git() -> bool:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode == 0


@pytest.mark.skipif(not _in_git(), reason="not a git checkout")
def test_every_registered_feature_block_is_measured_and_the_targets_are_the_issues_eight():
    feature = set(visattn.list_attention("feature")) - {"none"}
    assert set(blocks.BLOCKS) == feature and len(blocks.BLOCKS) == len(feature)
    assert list(blocks.BLOCKS[:8]) == list(blocks.TARGETS) == ["se", "eca", "gc", "spatial", "cbam", "coord",
                                                               "nonlocal", "mhsa2d"]
    assert all((ROOT / "configs" / "attention" / f"resnet_fast_{b}.yaml").is_file() for b in blocks.BLOCKS)


@pytest.mark.skipif(not _in_git(), reason="not a git checkout")
def test_the_before_revision_has_only_the_blocks_it_registered():
    """4470a3c (BEFORE) had the eight blocks of issue 70 in three files; the loader takes no block it lacked."""
    assert set(blocks.load_before(blocks.BEFORE)) == set(blocks.TARGETS)


@pytest.mark.parametrize("name", ["cbam", "mhsa2d", "sk", "sge"])
def test_before_blocks_are_the_revisions_own_and_swap_in_with_the_same_weights(name):
    before = blocks.load_before("HEAD")  # every block file, and the siblings they import (sge: excite.py)
    assert set(blocks.BLOCKS) <= set(before)
    assert before[name].__module__.startswith("visattn_before_") and before[name] is not type(
        visattn.create_attention(name, 16))
    torch.manual_seed(0)
    model = visattn.create_model("resnet_fast", widths=(16, 32, 32), attention=name, attn_kwargs={"init": "identity"})
    for p in model.parameters():  # every path live: the identity start would hide a wrong swap
        p.data.add_(torch.randn_like(p) * 0.1)
    x = torch.randn(4, 3, 32, 32, dtype=torch.float64)  # float64: a formula would differ, not the rounding
    old = blocks.swap_blocks(model.double().train(), name, before[name], {"init": "identity"}, x)
    kinds = {type(m) for m in old.modules()}
    assert before[name] in kinds and type(model.layers[0].units[0].attn) not in kinds
    torch.testing.assert_close(old(x), model(x), rtol=1e-9, atol=1e-10)
    gs = [torch.autograd.grad(m(x).square().sum(), list(m.parameters())) for m in (model, old)]
    for a, b in zip(*gs):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("argv, said", [(["--repeats", "0"], "--repeats must be at least 1, got 0"),
                                        (["--steps", "-1"], "--steps must be at least 1, got -1"),
                                        (["--warmup", "-1"], "--warmup must be at least 0, got -1"),
                                        (["--vs-timm", "--heads", "0"], "--heads must be at least 1, got 0")])
def test_counts_out_of_range_are_refused_before_anything_runs(argv, said):
    from visattn.errors import ConfigError

    with pytest.raises(ConfigError, match=said):
        blocks.main(argv)


def test_a_bad_count_is_one_line_and_exit_2_from_the_command_line():
    got = subprocess.run([sys.executable, "-m", "bench.blocks", "--repeats", "0"], capture_output=True,
                         text=True, cwd=ROOT)
    lines = [ln for ln in got.stderr.splitlines() if "Warning" not in ln and "warn(" not in ln and ln.strip()]
    assert got.returncode == 2 and lines == ["blocks.py: --repeats must be at least 1, got 0"], got.stderr


def test_an_unknown_revision_is_one_line():
    with pytest.raises(SystemExit, match="--before 'no-such-rev': not a revision"):
        blocks.load_before("no-such-rev")


@pytest.mark.skipif(not _in_git(), reason="not a git checkout")
def test_a_quick_run_writes_every_ratio_from_one_process(tmp_path, capsys):
    """se has a "before" (BEFORE registered it) and a target; ge, registered since, is measured "after" only."""
    out = tmp_path / "speed.json"
    blocks.main(["--quick", "--only", "se", "ge", "--batch", "4", "--no-compile", "--out", str(out)])
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["quick"] is True and data["batch_size"] == 4 and data["precision"] in ("fp32", "bf16")
    assert data["before"] == blocks.BEFORE and {(r["block"], r["path"], r["step"]) for r in data["rows"]} == {
        ("none", "-", "eager"), ("se", "before", "eager"), ("se", "after", "eager"), ("ge", "after", "eager")}
    assert all(r["images_per_s"] > 0 for r in data["rows"])
    ratios = data["ratios"]["se"]["eager"]
    assert set(ratios) == {"before", "after"} and all(v > 0 for v in ratios.values())
    goal = 0.95 if data["precision"] == "bf16" else 0.97  # issue 94's bf16 targets, issue 70's otherwise
    assert data["met"] == {"se": {"eager": ratios["after"] >= goal}} and data["targets"] == {"se": goal}
    ge = dict(data["ratios"]["ge"]["eager"])
    assert ge["before"] is None and ge["after"] > 0
    assert list(data["alone_ms"]["ge"]) == list(data["alone_ms"]["se"])
    assert all(t["before"] is None and t["after"] > 0 for t in data["alone_ms"]["ge"].values())
    shapes = data["alone_ms"]["se"]  # the three feature maps the recipe's network feeds its blocks
    assert list(shapes) == ["4x64x15x15", "4x256x7x7", "4x256x3x3"]
    assert all(t["before"] > 0 and t["after"] > 0 for t in shapes.values())
    # every timed call is kept: 4 steps (none, se before and after, ge) and alone on 3 maps (se twice, ge once)
    assert len(data["seconds"]) == 4 + 3 * 3 and all(len(v) == 1 for v in data["seconds"].values())
    assert set(data["warmup_seconds"]) == set(data["seconds"])
    assert data["cpu"] and data["kernels"] and data["threads"] >= 1 and "--quick" in data["command"]
    assert isinstance(data["native_bf16"], bool) and data["precision"] in data["note"]
    assert blocks.tables(data) in printed and f"wrote {out}" in printed
    row = next(line for line in printed.splitlines() if line.startswith("| `se` |")).split(" | ")
    assert row[1:3] == [f"{ratios['before']:.3f}", f"{ratios['after']:.3f}"] and row[3] == f"{goal:.2f}"
    alone = [sum(t[i] for t in shapes.values()) for i in ("before", "after")]
    assert row[-1] == f"{alone[0]:.0f} -> {alone[1]:.0f} |"
    # se adds a few FLOP per image to a step of ~7e8 per image: its ceiling is 1 to 3 places; the table shows it
    assert set(data["gflop"]) == {"none", "se", "ge"} and 0.999 < data["flop_ceiling"]["se"] < 1.0
    assert row[4] == f"{data['flop_ceiling']['se']:.3f}"
    ge_alone = sum(t["after"] for t in data["alone_ms"]["ge"].values())
    # batch 4 is not the profile's 512: no memory ceiling, the share is of the FLOP ceiling alone
    share = ge["after"] / data["flop_ceiling"]["ge"]
    assert (f"| `ge` | — | {ge['after']:.3f} | — | {data['flop_ceiling']['ge']:.3f} | - | {share:.1%} | "
            f"{'yes' if share >= 0.9 else 'no'} | — | — -> {ge_alone:.0f} |") in printed
    # --table reads it back (a null "before" is allowed, a null "after" is a damaged file); so does the cost column
    assert blocks.read_table(out) == blocks.tables(data)
    data["ratios"]["ge"]["eager"]["after"] = None
    out.write_text(json.dumps(data))
    with pytest.raises(DataError, match=r"ratios\.ge\.eager\.after is null, not a finite number"):
        blocks.read_table(out)
    report = _report()
    assert report.speed_ratios(data) == {"none": 1.0, "se": pytest.approx(ratios["after"]),
                                         "ge": pytest.approx(ge["after"])}


def test_the_flop_count_includes_the_cpu_flash_attention_kernel():
    """The FLOP ceiling of nonlocal and mhsa2d counts their attention products, which run in a kernel the
    counter has no formula for: 4 N^2 d forward and 10 N^2 d backward per head."""
    from bench import speed as throughput

    torch.manual_seed(0)
    model = torch.nn.Sequential(visattn.create_attention("nonlocal", 16), torch.nn.AdaptiveAvgPool2d(1),
                                torch.nn.Flatten(), torch.nn.Linear(16, 10))
    x, y = torch.randn(2, 16, 5, 5), torch.tensor([1, 2])
    plain = throughput.step_flops(model, x, y, "fp32")
    full = throughput.step_flops(model, x, y, "fp32", cpu_attention=True)
    B, N, d = 2, 25, 8  # the block's inner width is C / 2 = 8, already a multiple of 8 (no padding)
    assert full - plain == 14 * B * N * N * d


def _report():
    return importlib.import_module("bench.attention_report")


def test_the_committed_measurement_is_a_whole_one():
    """The attention summary's cost column reads ``bench/results/block_speed.json``: every block, before and after,
    eager and compiled, at the recipe's batch, from one full run (not a ``--quick`` one)."""
    data = json.loads(blocks.SPEED.read_text())
    assert data["quick"] is False and data["batch_size"] == 512 and data["repeats"] >= 3
    # every block it holds is measured today, in BLOCKS' order, and the eight with targets are all there (the
    # blocks registered since wait for the next full run: bench/blocks.py measures them all by default)
    assert list(data["ratios"]) == [b for b in blocks.BLOCKS if b in data["ratios"]]
    assert set(blocks.TARGETS) <= set(data["ratios"]) and data["targets"] == blocks.TARGETS
    assert all(set(r) == {"eager", "compiled"} and all(set(k) == {"before", "after"} for k in r.values())
               for r in data["ratios"].values())
    assert {r["path"] for r in data["rows"]} == {"-", "before", "after"} and data["note"] and data["command"]


def test_the_results_pages_block_speed_is_the_one_the_file_gives():
    doc = (ROOT / "docs" / "results.md").read_text()
    block = doc.split("<!-- block speed: python -m bench.blocks --table -->\n")[1].split("<!-- end of block speed -->")[0]
    assert block.strip() == blocks.tables(json.loads(blocks.SPEED.read_text())), (
        "docs/results.md's block speed is stale: paste `python -m bench.blocks --table`")


SPEED_BF16 = ROOT / "bench" / "results" / "block_speed_bf16.json"
SPEED_BF16_TARGETS = ROOT / "bench" / "results" / "block_speed_bf16_targets.json"


def test_the_bf16_line_is_native_and_on_the_results_page():
    """The bf16 measurement (issue 94) ran where bf16 is native, eager (the path a user gets by default: the CPU
    recipe does not compile), at the recipe's batch; docs/blocks.md shows the table the file gives."""
    data = json.loads(SPEED_BF16.read_text())
    assert data["precision"] == "bf16" and data["native_bf16"] is True and data["quick"] is False
    assert data["batch_size"] == 512 and data["repeats"] >= 5
    assert set(blocks.TARGETS) <= set(data["ratios"]) and all(set(r) == {"eager"} for r in data["ratios"].values())
    assert data["targets"] == blocks.TARGETS_BF16  # judged by issue 94's bf16 targets
    assert set(data["ratios"]) == set(blocks.BLOCKS)  # every feature-map block of the catalogue
    doc = (ROOT / "docs" / "blocks.md").read_text()
    marker = "<!-- block speed bf16: python -m bench.blocks --table bench/results/block_speed_bf16.json -->\n"
    block = doc.split(marker)[1].split("<!-- end of block speed bf16 -->")[0]
    assert block.strip() == blocks.tables(data), "docs/blocks.md's bf16 block speed is stale: paste its --table"



# how the README and docs/results.md name the eight blocks of the targets
NAMED = {"SE": "se", "ECA": "eca", "GC": "gc", "spatial": "spatial", "CBAM": "cbam", "coordinate": "coord",
         "non-local": "nonlocal", "MHSA-2D": "mhsa2d"}
GATES = ["se", "eca", "gc", "spatial", "cbam", "coord"]


def test_the_readme_and_the_results_page_quote_both_precisions_as_the_files_give_them():
    """The README's "what a block costs" row and docs/results.md's speed section quote the fp32 line (AVX2) and the
    bf16 line (AVX512-BF16, the eight blocks with targets at 3 steps per timing) as the two measurements give them, and the gates' memory-traffic ceiling and each
    block's share of its lower ceiling as bench/results/bf16_profile.json gives them."""
    # the bf16 figures quoted are the eight blocks' measurement with 3 steps per timing (the all-blocks line's single
    # steps move by up to 6 points)
    fp32, bf16 = json.loads(blocks.SPEED.read_text()), json.loads(SPEED_BF16_TARGETS.read_text())
    assert (fp32["precision"], fp32["kernels"], bf16["precision"], bf16["kernels"]) == ("fp32", "avx2", "bf16",
                                                                                      "avx512_bf16")
    assert bf16.get("cpu_heap") == "keep"  # measured with glibc keeping freed memory, as train.py runs on a CPU
    profile = block_table.read_profile(block_table.PROFILE)
    assert profile is not None and all(profile[k] == bf16[k] for k in ("cpu", "kernels", "precision", "threads",
                                                                        "batch_size"))
    memory = {b: profile["blocks"][b]["ceiling"] for b in GATES}
    after = {b: bf16["ratios"][b]["eager"]["after"] for b in NAMED.values()}
    share = {b: after[b] / min(c for c in (bf16["flop_ceiling"][b], memory.get(b)) if c) for b in after}
    readme = next(ln for ln in (ROOT / "README.md").read_text().splitlines() if ln.startswith("| what a block costs"))
    results = next(ln for ln in (ROOT / "docs" / "results.md").read_text().splitlines() if "**In native bf16**" in ln)
    gates = [share[b] for b in GATES]
    for text in (readme, results):
        quoted = text[text.index("AVX512-BF16"):]
        assert all(f"{word} {after[b]:.2f}" in quoted for word, b in NAMED.items()), text
        assert f"{100 * min(gates):.0f}-{100 * max(gates):.0f}% of its memory-traffic ceiling" in quoted
        assert f"memory-traffic ceiling ({min(memory.values()):.2f}" in quoted
        assert f"{100 * share['nonlocal']:.0f}% and {100 * share['mhsa2d']:.0f}% of their FLOP ceilings" in quoted
    fp32_part = readme[readme.index("**fp32 on AVX2**"):readme.index("**bf16")]
    eager, compiled = ([fp32["ratios"][b][k]["after"] for b in GATES] for k in ("eager", "compiled"))
    assert (f"{min(eager):.2f}-{max(eager):.2f} / {min(compiled):.2f}-{max(compiled):.2f}; non-local "
            f"{fp32['ratios']['nonlocal']['eager']['after']:.2f}, MHSA-2D {fp32['ratios']['mhsa2d']['eager']['after']:.2f}"
            ) in fp32_part

# ---- the table's ceilings: the FLOP ceiling beside the memory-traffic ceiling of bench/bf16_profile.py -------------


def _speed(**machine) -> dict:
    """A synthetic bf16 measurement (eager only): se and cbam with memory-traffic ceilings in :func:`_profile`,
    coord whose FLOP ceiling is the lower one, nonlocal (arithmetic: a FLOP ceiling only), ge registered since the
    "before" revision and without a target."""
    after = {"se": 0.97, "cbam": 0.86, "coord": 0.85, "nonlocal": 0.80, "ge": 0.93}
    flop = {"se": 0.999, "cbam": 0.998, "coord": 0.90, "nonlocal": 0.89, "ge": 0.9995}
    targets = {b: t for b, t in blocks.TARGETS_BF16.items() if b in after}
    data = {"cpu": "Test CPU", "device": "cpu", "kernels": "amx", "precision": "bf16", "threads": 2,
            "torch": torch.__version__, "date": "2026-01-01", "batch_size": 512, "steps": 1, "repeats": 5,
            "quick": False, "before": "abc1234", "after": "def5678", "note": "Measured in bf16 on amx.",
            "targets": targets, "ratios": {b: {"eager": {"before": None if b == "ge" else a - 0.01, "after": a}}
                                           for b, a in after.items()},
            "met": {b: {"eager": after[b] >= t} for b, t in targets.items()},
            "flop_ceiling": {"none": 1.0, **flop},
            "alone_ms": {b: {"512x64x15x15": {"before": None if b == "ge" else 10.0, "after": 9.0}} for b in after},
            "rows": [{"block": "none", "path": "-", "step": "eager", "images_per_s": 1000.0}]}
    data.update(machine)
    return data


def _profile(**machine) -> dict:
    data = {"command": "python -m bench.bf16_profile", "git": "0123456789abcdef", "date": "2026-01-02T00:00:00Z",
            "torch": torch.__version__, "cpu": "Test CPU", "kernels": "amx", "precision": "bf16", "threads": 2,
            "batch_size": 512, "bandwidth_gb_s": 30.0, "none_step_ms": 500.0,
            "blocks": {"se": {"alone_ms": 9.0, "passes": 8, "least_ms": 10.0, "ceiling": 0.95, "ops": []},
                       "cbam": {"alone_ms": 30.0, "passes": 10, "least_ms": 12.0, "ceiling": 0.96, "ops": []},
                       "coord": {"alone_ms": 20.0, "passes": 8, "least_ms": 4.0, "ceiling": 0.99, "ops": []},
                       "nonlocal": {"alone_ms": 100.0, "ops": []}}}  # arithmetic: no memory-traffic ceiling
    data.update(machine)
    return data


def _write(tmp_path, speed: dict, profile) -> tuple:
    paths = tmp_path / "speed.json", tmp_path / "profile.json"
    paths[0].write_text(json.dumps(speed))
    if profile is not None:
        paths[1].write_text(profile if isinstance(profile, str) else json.dumps(profile))
    return paths


def _columns(table: str) -> dict:
    """block -> {column: cell} from the markdown table (the header row names the columns)."""
    lines = [ln for ln in table.splitlines() if ln.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    return {cells[0].strip("`"): dict(zip(head, cells))
            for cells in ([c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:])}


def test_the_table_shows_the_memory_ceiling_beside_the_flop_ceiling_and_the_share_of_the_lower(tmp_path):
    speed, profile = _speed(), _profile()
    cols = _columns(blocks.read_table(*_write(tmp_path, speed, profile)))
    assert list(cols) == list(speed["ratios"])
    for b, row in cols.items():
        memory = profile["blocks"].get(b, {}).get("ceiling")
        assert row["FLOP ceiling"] == f"{speed['flop_ceiling'][b]:.3f}"
        assert row["memory ceiling"] == (f"{memory:.3f}" if memory else "-")
        share = speed["ratios"][b]["eager"]["after"] / min(c for c in (speed["flop_ceiling"][b], memory) if c)
        assert row["share of ceiling"] == f"{share:.1%}" and row["at 90%"] == ("yes" if share >= 0.9 else "no")
    # the lower ceiling counts: se's memory ceiling (0.95 under a FLOP ceiling of 0.999) lifts its share above
    # 100%; coord's FLOP ceiling (0.90) is the lower of its two
    assert cols["se"]["share of ceiling"] == f"{0.97 / 0.95:.1%}" and cols["coord"]["share of ceiling"] == f"{0.85 / 0.90:.1%}"
    # the judgement: cbam at 0.86 of a 0.96 ceiling is short of 90%; nonlocal at 0.80 of 0.89, just short
    assert [cols[b]["at 90%"] for b in ("se", "cbam", "coord", "nonlocal", "ge")] == ["yes", "no", "yes", "no", "yes"]
    assert cols["ge"]["target"] == "—" and cols["ge"]["met (after)"] == "—" and cols["se"]["met (after)"] == "yes"
    header = blocks.read_table(*_write(tmp_path, speed, profile)).splitlines()[0]
    assert "Memory-traffic ceiling from" in header and "profile.json (git 0123456, 2026-01-02" in header


@pytest.mark.parametrize("field, value", [("cpu", "Other CPU"), ("kernels", "avx512_bf16"), ("precision", "fp32"),
                                          ("threads", 4), ("batch_size", 256)])
def test_a_profile_from_another_machine_gives_no_memory_ceiling_and_says_why(tmp_path, field, value):
    speed = _speed()
    table = blocks.read_table(*_write(tmp_path, speed, _profile(**{field: value})))
    cols = _columns(table)
    assert all(row["memory ceiling"] == "-" for row in cols.values())
    assert f"was measured elsewhere: {field} {value} there, {speed[field]} here" in table.splitlines()[0]
    # the share falls back on the FLOP ceiling alone: se's 0.97 of 0.999
    assert cols["se"]["share of ceiling"] == f"{0.97 / 0.999:.1%}" and cols["se"]["at 90%"] == "yes"


def test_no_profile_leaves_the_column_empty_and_names_the_command(tmp_path):
    speed_path, missing = _write(tmp_path, _speed(), None)
    table = blocks.read_table(speed_path, missing)
    assert all(row["memory ceiling"] == "-" for row in _columns(table).values())
    assert f"no profile at {missing}: `python -m bench.bf16_profile --out {missing}`" in table.splitlines()[0]
    # a measurement made before the FLOP ceiling was counted: no ceiling, no share
    old = _speed()
    del old["flop_ceiling"]
    cols = _columns(blocks.read_table(_write(tmp_path, old, None)[0], missing))
    assert all(row["FLOP ceiling"] == row["share of ceiling"] == row["at 90%"] == "-" for row in cols.values())


@pytest.mark.parametrize("profile, says", [
    ("{", "not a readable JSON file"),
    ("[]", "holds a JSON list, not a dict"),
    (json.dumps({k: v for k, v in _profile().items() if k != "kernels"}), "has no 'kernels'"),
    (json.dumps(_profile(blocks=[])), "'blocks', which must be"),
    (json.dumps(_profile(blocks={"se": 0.9})), "blocks.se is a JSON float, not an object"),
    (json.dumps(_profile(blocks={"se": {"ceiling": True}})), "blocks.se.ceiling is true, not a number in"),
    (json.dumps(_profile(blocks={"se": {"ceiling": 1.5}})), "blocks.se.ceiling is 1.5, not a number in"),
    (json.dumps(_profile(blocks={"se": {"ceiling": "0.9"}})), 'blocks.se.ceiling is "0.9", not a number in')])
def test_a_damaged_profile_is_one_line(tmp_path, profile, says):
    with pytest.raises(DataError, match=re.escape(says)):
        blocks.read_table(*_write(tmp_path, _speed(), profile))


def test_a_damaged_profile_exits_2_in_one_line_from_the_command_line(tmp_path, monkeypatch, capsys):
    from visattn.errors import run_main

    speed, profile = _write(tmp_path, _speed(), '{"cpu": ')
    monkeypatch.setattr(sys, "argv", ["blocks.py", "--table", str(speed), "--profile", str(profile)])
    with pytest.raises(SystemExit) as stop:
        run_main(blocks.main, "blocks.py")
    err = capsys.readouterr()
    assert stop.value.code == 2 and not err.out and len(err.err.strip().splitlines()) == 1
    assert err.err.startswith(f"blocks.py: {profile}: not a readable JSON file")


def test_both_commands_print_the_same_tables(tmp_path, capsys):
    """python -m bench.block_table FILE --profile P prints what python -m bench.blocks --table FILE --profile P does."""
    speed, profile = _write(tmp_path, _speed(), _profile())
    block_table.main([str(speed), "--profile", str(profile)])
    alone = capsys.readouterr().out
    blocks.main(["--table", str(speed), "--profile", str(profile)])
    assert capsys.readouterr().out == alone == blocks.read_table(speed, profile) + "\n"
    assert "| memory ceiling |" in alone.splitlines()[2]


@pytest.mark.parametrize("name, precision", [("block_speed_bf16_targets.json", "bf16"),
                                             ("block_speed_fp32_avx512.json", "fp32")])
def test_the_same_machines_other_lines_are_on_the_blocks_page(name, precision):
    """Beside the bf16 line, on the same AVX512-BF16 machine: the eight blocks with targets measured again with more
    steps per timing, and fp32 before and after the bf16 work (whether any block got slower in fp32); each is a
    full measurement of the eight, eager, at the recipe's batch, and docs/blocks.md shows the table its file gives."""
    data = json.loads((ROOT / "bench" / "results" / name).read_text())
    bf16 = json.loads(SPEED_BF16.read_text())
    assert data["precision"] == precision and data["quick"] is False and data["batch_size"] == 512
    assert (data["cpu"], data["kernels"]) == (bf16["cpu"], bf16["kernels"]) and data["repeats"] >= 5
    assert set(data["ratios"]) == set(blocks.TARGETS) and data["before"] == bf16["before"]
    doc = (ROOT / "docs" / "blocks.md").read_text()
    marker = f"<!-- block speed: python -m bench.blocks --table bench/results/{name} -->\n"
    block = doc.split(marker)[1].split("<!-- end of block speed -->")[0]
    assert block.strip() == blocks.tables(data), f"docs/blocks.md's table of {name} is stale: paste its --table"
