"""Every shipped config loads and trains a few steps on synthetic data (attention maps logged too)."""
from __future__ import annotations

from pathlib import Path

import pytest

from visattn.config import load_config, safe_yaml
from visattn.trainer import run

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted(ROOT.glob("configs/**/*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[str(p.relative_to(ROOT / "configs")) for p in CONFIGS])
def test_config_trains_a_few_steps(path, tmp_path):
    synthetic = "data.placed.source=synthetic" if "placed" in path.parts else "data.source=synthetic"  # keep the canvas
    shipped = load_config(path)  # a warmup or a lookahead interval longer than these 2 steps is refused: shortened
    shorter = ([f"sched.warmup_epochs={min(shipped.sched.warmup_epochs, 1)}"]
               + [f"train.lookahead_every={min(shipped.train.lookahead_every, 2)}"]
               + [f"log.maps_every={min(shipped.log.maps_every, 1)}"])  # maps every N > 1 epochs: refused in 1
    cfg = load_config(path, [
        f"run_dir={tmp_path / 'run'}", synthetic, "data.synthetic_size=120", "data.val_size=40",
        "train.batch_size=40", "train.epochs=1", "eval.batch_size=40", "log.progress=false", "log.probe_size=2",
        "compile=false", *shorter,  # torch.compile itself is covered by tests/test_train.py::test_compile_on_cpu
    ])
    summary = run(cfg, log=lambda *a: None)
    assert summary["epochs"] == 1 and summary["final"]["images_per_s"] > 0
    assert (tmp_path / "run" / "best.pt").is_file()


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _differ(a: Path, b: Path) -> tuple[dict, dict, set]:
    """Both configs resolved and flattened to dotted keys, and the keys whose values differ."""
    fa, fb = _flat(load_config(a).to_dict()), _flat(load_config(b).to_dict())
    return fa, fb, {k for k in fa.keys() | fb.keys() if fa.get(k) != fb.get(k)}


ATTENTION_CONFIGS = sorted(ROOT.glob("configs/attention/resnet_fast_*.yaml"))


@pytest.mark.parametrize("path", ATTENTION_CONFIGS, ids=[p.stem for p in ATTENTION_CONFIGS])
def test_attention_configs_are_the_cpu_recipe_with_one_block(path):
    """The attention table compares like with like: each config is configs/cifar10_cpu.yaml but for its block
    (and its name, run folder and map logging), so ``resnet_fast_none`` is the CPU recipe itself."""
    _, cfg, differ = _differ(ROOT / "configs" / "cifar10_cpu.yaml", path)
    allowed = {"name", "run_dir", "model.attention", "model.attn_kwargs.init", "model.attn_position"}
    allowed |= {k for k in differ if k.startswith("log.")}
    assert differ <= allowed, sorted(differ - allowed)
    block = path.stem.removeprefix("resnet_fast_")
    assert cfg["model.attention"] == block
    if block != "none":  # every block ships starting as the identity, at one position for all
        assert cfg["model.attn_kwargs.init"] == "identity" and cfg["model.attn_position"] == "unit_bn"


def test_the_wide_transformer_config_is_the_transformer_recipe_wider():
    """``vit_cpu_wide`` is ``vit_cpu`` with width 256 and MLP ratio 4 and nothing else, so its paired gain over
    ``vit_cpu`` (docs/results.md) is the gain of those two keys."""
    base, wide, differ = _differ(ROOT / "configs" / "vit_cpu.yaml", ROOT / "configs" / "vit_cpu_wide.yaml")
    assert differ == {"name", "run_dir", "model.dim", "model.mlp_ratio"}
    assert (base["model.dim"], base["model.mlp_ratio"]) == (192, 2.0)
    assert (wide["model.dim"], wide["model.mlp_ratio"]) == (256, 4.0)


@pytest.mark.parametrize("path", ATTENTION_CONFIGS, ids=[p.stem for p in ATTENTION_CONFIGS])
def test_attention_configs_are_a_few_lines_over_a_base(path):
    """Each block's config says only what differs (``base:`` gives the rest): at most 15 lines, a comment
    first; ``resnet_fast_none`` inherits the CPU recipe and repeats none of its keys."""
    text = path.read_text()
    own = safe_yaml(text, path.name)
    assert len(text.splitlines()) <= 15 and text.startswith("# ") and "base" in own
    if path.stem == "resnet_fast_none":
        assert own["base"] == "../cifar10_cpu.yaml" and set(own) == {"base", "name", "run_dir", "log"}
    else:
        assert own["base"] == "resnet_fast_none.yaml" and set(own) == {"base", "name", "run_dir", "model"}


def test_the_gpu_recipe_is_the_cpu_recipe_at_airbench94s_setting_for_11_epochs():
    """``configs/cifar10_gpu.yaml`` trains as the recipe ablation's ``epochs_10_airbench`` variant (the CPU recipe
    with batch 1024, lookahead, 23% warmup, whitening bias 3 epochs) with 11 epochs, so that variant's recorded
    10-epoch run is a run of this recipe at 10 epochs (docs/changelog.md, the GPU recipe's epochs to 90%); it differs in what does not
    change training (name, run folder, compiling, evaluation cadence and batch) and in the budget, and has no
    attention block and no EMA."""
    from test_bench import _load

    over = _load("recipe_ablation").CPU_VARIANTS["epochs_10_airbench"][1]
    cpu = _flat(load_config(ROOT / "configs" / "cifar10_cpu.yaml", over).to_dict())
    gpu = _flat(load_config(ROOT / "configs" / "cifar10_gpu.yaml").to_dict())
    differ = {k for k in cpu.keys() | gpu.keys() if cpu.get(k) != gpu.get(k)}
    assert differ == {"name", "run_dir", "compile", "eval.every", "eval.batch_size", "train.epochs"}
    assert cpu["train.epochs"] == 10 and gpu["train.epochs"] == 11
    assert gpu["compile"] and gpu["train.batch_size"] == 1024
    assert gpu["model.attention"] == "none" and gpu["train.ema_decay"] is None


def test_every_feature_block_has_its_attention_config():
    """A block registered is a row of the attention table and the speed table: its config must exist (a few
    lines over ``resnet_fast_none.yaml``, as the tests above check)."""
    from visattn import list_attention

    have = {p.stem.removeprefix("resnet_fast_") for p in ATTENTION_CONFIGS}
    missing = sorted(set(list_attention("feature")) - have)
    assert not missing, f"blocks without configs/attention/resnet_fast_<block>.yaml: {missing}"
