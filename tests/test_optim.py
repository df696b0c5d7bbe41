"""Which parameters get weight decay: optim.build_optimizer goes through timm's create_optimizer_v2, which
keeps norms, biases and the model's ``no_weight_decay()`` names (a ViT's pos_embed, cls_token) undecayed."""
from __future__ import annotations

import pytest
import torch

from visattn import create_model
from visattn.optim import StepScheduler, build_optimizer


def _decay_by_name(model, opt):
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: g["weight_decay"] for g in opt.param_groups for p in g["params"]}


@pytest.mark.parametrize("name,opt_name", [("vit_tiny", "adamw"), ("cct_2", "adamw"), ("resnet_fast", "sgd"),
                                           ("vit_tiny", "sgd")])
def test_decay_spares_norms_biases_and_position_embeddings(name, opt_name):
    kw = {"depth": 2} if name == "vit_tiny" else {}
    model = create_model(name, **kw)
    opt = build_optimizer(model, opt_name, 1e-3, 0.05)
    decay = _decay_by_name(model, opt)
    assert set(decay) == {n for n, p in model.named_parameters() if p.requires_grad}  # every parameter, once
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        spared = p.ndim <= 1 or n in {"pos_embed", "cls_token"}
        assert decay[n] == (0.0 if spared else 0.05), n
    if name == "vit_tiny":
        assert decay["pos_embed"] == decay["cls_token"] == 0.0
        assert decay["blocks.0.attn.qkv.weight"] == 0.05
    if name == "cct_2":
        assert decay["pos_embed"] == 0.0 and decay["tokenizer.layers.0.weight"] == 0.05


def test_norms_and_biases_decay_when_asked_but_declared_names_never():
    """optim.no_decay_norm_bias=false decays the 1-d parameters too; what the model declares in
    ``no_weight_decay()`` stays undecayed (timm's rule)."""
    model = create_model("vit_tiny", depth=1)
    decay = _decay_by_name(model, build_optimizer(model, "adamw", 1e-3, 0.05, no_decay_norm_bias=False))
    assert decay["blocks.0.norm1.weight"] == decay["head.bias"] == 0.05
    assert decay["pos_embed"] == decay["cls_token"] == 0.0


@pytest.mark.parametrize("momentum,nesterov,expect", [(0.9, True, True), (0.9, False, False), (0.0, True, False)])
def test_sgd_momentum_and_nesterov(momentum, nesterov, expect):
    model = torch.nn.Linear(3, 2)
    opt = build_optimizer(model, "sgd", 0.1, 5e-4, momentum=momentum, nesterov=nesterov)
    assert isinstance(opt, torch.optim.SGD)
    assert opt.defaults["nesterov"] is expect and opt.defaults["momentum"] == momentum


def test_adamw_betas_and_unknown_name():
    opt = build_optimizer(torch.nn.Linear(3, 2), "adamw", 1e-3, 0.05, betas=(0.8, 0.99))
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["betas"] == (0.8, 0.99)
    from visattn.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown optimizer 'lamb'"):
        build_optimizer(torch.nn.Linear(3, 2), "lamb", 1e-3, 0.0)


def _muon_routes(model, opt):
    names = {id(p): n for n, p in model.named_parameters()}
    fallback = {names[id(p)] for g in opt.param_groups for p in g["params"] if g.get("use_fallback") or p.ndim < 2}
    return fallback, {n for n in names.values() if n not in fallback}


def test_muon_orthogonalises_the_matrices_and_leaves_the_classifier_and_embeddings_to_adamw():
    model = create_model("cct_2", depth=1, dim=64, num_heads=2)
    opt = build_optimizer(model, "muon", 2e-3, 0.05, momentum=0.95, nesterov=True, betas=(0.9, 0.98))
    fallback, orthogonalised = _muon_routes(model, opt)
    assert {"head.weight", "head.bias", "pos_embed", "blocks.0.norm1.weight"} <= fallback
    assert {"tokenizer.layers.0.weight", "blocks.0.attn.qkv.weight", "blocks.0.mlp.fc2.weight"} <= orthogonalised
    decay = _decay_by_name(model, opt)
    assert decay["blocks.0.attn.qkv.weight"] == 0.05 and decay["pos_embed"] == decay["head.bias"] == 0.0
    g = opt.param_groups[0]
    assert (g["momentum"], g["nesterov"], tuple(g["betas"])) == (0.95, True, (0.9, 0.98))


@pytest.mark.parametrize("native", [False, True])
def test_muon_runs_newton_schulz_in_fp32_where_bf16_is_emulated_and_the_swap_is_undone(monkeypatch, native):
    import timm.optim.muon as muon

    seen = []
    original = muon.zeropower_via_newtonschulz

    def spy(G, *args, dtype=torch.bfloat16, **kw):
        seen.append(dtype)
        return original(G, *args, dtype=dtype, **kw)

    monkeypatch.setattr(muon, "zeropower_via_newtonschulz", spy)
    torch.manual_seed(0)
    model = create_model("cct_2", depth=1, dim=32, num_heads=2, num_classes=3)
    opt = build_optimizer(model, "muon", 1e-2, 0.0, momentum=0.95, native_bf16=native)
    sched = StepScheduler(opt, "onecycle", 1e-2, 10, 2)  # torch's schedulers wrap the optimizer's step
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 3, (8,))
    before = model.blocks[0].attn.qkv.weight.detach().clone()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    sched.step()
    assert seen and set(seen) == {torch.bfloat16 if native else torch.float32}
    assert muon.zeropower_via_newtonschulz is spy  # restored after the step
    assert not torch.equal(before, model.blocks[0].attn.qkv.weight)  # it learns


@pytest.mark.parametrize("scale", [1.0, 64.0])
def test_muon_leaves_the_classifier_to_adamw_whatever_the_norm_bias_lr_scale(scale):
    """optim.norm_bias_lr_scale != 1 builds the parameter groups in visattn, not in timm: they must carry Muon's
    fallback marks too, or the classifier (``fc.*``) is orthogonalised. Read from Muon's own state after a step."""
    torch.manual_seed(0)
    model = create_model("resnet_fast", widths=[8, 16, 16], stem_width=8, num_classes=10)  # (10, 16): Muon-shaped
    opt = build_optimizer(model, "muon", 1e-3, 5e-4, momentum=0.9, norm_bias_lr_scale=scale)
    torch.nn.functional.cross_entropy(model(torch.randn(4, 3, 32, 32)), torch.randint(0, 10, (4,))).backward()
    opt.step()
    routes = {n: opt.state[p]["use_muon"] for n, p in model.named_parameters() if p in opt.state}
    assert routes["fc.weight"] is False
    assert any(routes[n] for n, p in model.named_parameters() if p.ndim == 4)  # the convolutions are Muon's
    scaled = [g for g in opt.param_groups if g.get("lr_scale", 1.0) != 1.0]
    assert bool(scaled) == (scale != 1.0)  # the backbone's norm biases keep their own rate


def _small_attn_model():
    torch.manual_seed(0)
    return create_model("resnet_fast", widths=[8, 16, 16], stem_width=8, attention="cbam")


@pytest.mark.parametrize("sched", ["onecycle", "cosine", "constant"])
@pytest.mark.parametrize("attn,norm_bias", [(0.1, 1.0), (0.1, 64.0), (4.0, 1.0)])
def test_attn_lr_scale_moves_every_block_parameter_and_nothing_else(sched, attn, norm_bias):
    """optim.attn_lr_scale: each parameter of an attention block (its own norms too) trains at lr times the
    scale under every schedule, the backbone's norm biases at norm_bias_lr_scale, everything else at lr; weight
    decay is what it is at scale 1."""
    from visattn.registry import backbone_modules, is_attention_block

    model = _small_attn_model()
    in_blocks = {id(p) for m in model.modules() if is_attention_block(m) for p in m.parameters()}
    norm_biases = {id(m.bias) for m in backbone_modules(model) if isinstance(m, torch.nn.BatchNorm2d)}
    assert in_blocks and norm_biases and not in_blocks & norm_biases
    want = {id(p): attn if id(p) in in_blocks else norm_bias if id(p) in norm_biases else 1.0
            for p in model.parameters() if p.requires_grad}
    opt = build_optimizer(model, "sgd", 0.1, 5e-4, norm_bias_lr_scale=norm_bias, attn_lr_scale=attn)
    plain = build_optimizer(model, "sgd", 0.1, 5e-4)
    assert _decay_by_name(model, opt) == _decay_by_name(model, plain)
    sched_ = StepScheduler(opt, sched, 0.1, total_steps=40, warmup_steps=8)
    for step in range(30):
        rest = [g["lr"] for g in opt.param_groups if all(want[id(p)] == 1.0 for p in g["params"])]
        assert rest and len(set(rest)) == 1 and rest[0] > 0
        for g in opt.param_groups:
            for p in g["params"]:
                assert g["lr"] == pytest.approx(rest[0] * want[id(p)], rel=1e-9), (sched, step)
        opt.step()
        sched_.step()


@pytest.mark.parametrize("norm_bias", [1.0, 64.0])
def test_attn_lr_scale_one_keeps_the_groups_a_checkpoint_was_saved_with(norm_bias):
    """At attn_lr_scale=1 the parameter groups, and so a saved optimizer state, are those built before the option
    existed: timm's groups, split only by the backbone's norm biases where norm_bias_lr_scale is not 1."""
    from timm.optim import create_optimizer_v2, param_groups_weight_decay

    from visattn.registry import backbone_modules

    model = _small_attn_model()
    opt = build_optimizer(model, "sgd", 0.1, 5e-4, norm_bias_lr_scale=norm_bias, attn_lr_scale=1.0)
    got = [[id(p) for p in g["params"]] for g in opt.param_groups]
    if norm_bias == 1.0:
        ref = create_optimizer_v2(model, opt="sgd", lr=0.1, weight_decay=5e-4, momentum=0.9)
        assert got == [[id(p) for p in g["params"]] for g in ref.param_groups]
    else:
        nb = {id(m.bias) for m in backbone_modules(model) if isinstance(m, torch.nn.BatchNorm2d)}
        want = []
        for g in param_groups_weight_decay(model, 5e-4):
            ids = [id(p) for p in g["params"]]
            want += [part for part in ([i for i in ids if i not in nb], [i for i in ids if i in nb]) if part]
        assert got == want


@pytest.mark.parametrize("value,says", [(".nan", "finite number"), (".inf", "finite number"), ("true", "not true or false"),
                                        ("[1]", "valid number"), ("0", "greater than 0"), ("1001", "less than or equal")])
def test_a_bad_attn_lr_scale_is_one_line_before_anything_is_written(tmp_path, value, says):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "train.py", "--config", "configs/smoke.yaml", f"optim.attn_lr_scale={value}",
                           f"run_dir={run_dir}"], cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "optim.attn_lr_scale" in proc.stderr and says in proc.stderr
    assert not run_dir.exists()
