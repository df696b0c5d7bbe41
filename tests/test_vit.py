"""Transformer models (family "vit" and "hybrid"): forward/backward per variant, sizes, tap grids, options."""
from __future__ import annotations

import pytest
import torch
from conftest import ROOT, recording

import visattn
from visattn.models import create_model, list_models
from visattn.models.vit import ShiftedPatchTokenizer
from visattn.registry import attention_info

VIT = list_models("vit")
HYBRID = list_models("hybrid")
TRANSFORMERS = VIT + HYBRID


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# Variants run at depth 2 (the code paths do not depend on depth; the 2-core CI box is slow); the default
# configuration of every model runs at full size.
SHALLOW = {"depth": 2}
VARIANTS = [
    {"pool": "cls"},
    {"pool": "mean"},
    {"pool": "seq"},
    {"pool": "attn"},
    {"attn": "lsa"},
    {"attn": "xca"},
    {"attn_kwargs": {"score": "general"}},
]


def _cases():
    cases = [(m, {}) for m in TRANSFORMERS]
    cases += [(m, {**kw, **SHALLOW}) for m in TRANSFORMERS for kw in VARIANTS]
    spt = ({"spt": True}, {"spt": True, "attn": "lsa", "pool": "mean"})
    cases += [(m, {**kw, **SHALLOW}) for m in VIT for kw in spt]
    return [pytest.param(m, kw, id="-".join([m, *(f"{k}={v}" for k, v in kw.items())])) for m, kw in cases]


def test_both_families_are_registered():
    assert {"vit_tiny", "vit_small"} <= set(VIT)
    assert {"cct_2", "cct_7"} <= set(HYBRID)


@pytest.mark.parametrize("name,kw", _cases())
def test_forward_backward(name, kw):
    model = create_model(name, num_classes=7, **kw)
    x = torch.randn(2, 3, 32, 32)
    out = model(x)
    assert out.shape == (2, 7) and torch.isfinite(out).all()
    out.logsumexp(-1).sum().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, missing
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert model.pool == kw.get("pool", "seq" if name in HYBRID else "cls")


@pytest.mark.parametrize(
    "name,low,high",
    [("vit_tiny", 2.5e6, 2.9e6), ("vit_small", 5.5e6, 6.5e6), ("cct_2", 0.2e6, 0.4e6), ("cct_7", 3.5e6, 4.0e6)],
)
def test_parameter_counts(name, low, high):
    assert low <= n_params(create_model(name, num_classes=10)) <= high


def test_vit_tiny_is_the_small_dataset_configuration():
    model = create_model("vit_tiny")
    assert model.grid_size == (8, 8) and len(model.blocks) == 9 and model.embed_dim == 192
    assert model.blocks[0].attn.num_heads == 12 and model.blocks[0].mlp.fc1.out_features == 384


@pytest.mark.parametrize("name", TRANSFORMERS)
@pytest.mark.parametrize("pool", ["cls", "seq"])
def test_taps_report_grid_and_prefix_tokens(name, pool):
    model = create_model(name, num_classes=7, pool=pool, **SHALLOW).eval()
    h, w = model.grid_size
    n_prefix = model.num_prefix_tokens
    assert n_prefix == (1 if pool == "cls" else 0)
    with recording(model) as recs:
        model(torch.randn(2, 3, 32, 32))
    tokens = [r for r in recs if r.kind == "token"]
    pools = [r for r in recs if r.kind == "pool"]
    assert len(tokens) == len(model.blocks) and len(pools) == (1 if pool == "seq" else 0)
    for r in tokens:
        assert r.grid == (h, w) and r.num_prefix_tokens == n_prefix
        heads = r.weights.shape[1]
        assert r.weights.shape == (2, heads, h * w + n_prefix, h * w + n_prefix)
    for r in pools:
        assert r.name == "seq_pool" and r.grid == (h, w) and r.weights.shape == (2, h * w)


def test_expected_grids():
    assert create_model("vit_tiny", patch_size=8).grid_size == (4, 4)
    assert create_model("cct_2").grid_size == (8, 8)  # two conv+pool stages: 32 -> 16 -> 8
    assert create_model("cct_7").grid_size == (16, 16)  # one stage: 32 -> 16


@pytest.mark.parametrize("name,grid", [("vit_tiny", (8, 12)), ("cct_2", (8, 12)), ("cct_7", (16, 24))])
def test_non_square_images(name, grid):
    model = create_model(name, num_classes=7, img_size=(32, 48), pool="cls", **SHALLOW)
    assert model.grid_size == grid
    with recording(model) as recs:
        out = model(torch.randn(2, 3, 32, 48))
    assert out.shape == (2, 7)
    assert all(r.grid == grid and r.weights.shape[-1] == grid[0] * grid[1] + 1 for r in recs)
    with pytest.raises(ValueError, match="expects"):
        model(torch.randn(2, 3, 32, 32))


def test_non_square_spt():
    model = create_model("vit_tiny", num_classes=7, img_size=(32, 48), spt=True, **SHALLOW)
    assert model(torch.randn(1, 3, 32, 48)).shape == (1, 7)


@pytest.mark.parametrize("name", TRANSFORMERS)
def test_recorded_class_token_row_sums_to_one(name):
    model = create_model(name, pool="cls", **SHALLOW).eval()
    with recording(model) as recs:
        model(torch.randn(2, 3, 32, 32))
    last = [r for r in recs if r.kind == "token"][-1]
    cls_row = last.weights[:, :, 0, :]  # (B, heads, N): what the class token reads from every token
    assert cls_row.shape[-1] == model.grid_size[0] * model.grid_size[1] + 1
    assert torch.allclose(cls_row.sum(-1), torch.ones(()), atol=1e-5)


@pytest.mark.parametrize("name", TRANSFORMERS)
def test_unknown_and_bad_options_are_rejected(name):
    with pytest.raises(ValueError, match="unknown option"):
        create_model(name, num_classes=7, pooling="cls")
    with pytest.raises(ValueError, match="pool"):
        create_model(name, pool="max")
    with pytest.raises(ValueError, match="attn"):
        create_model(name, attn="seqpool")
    with pytest.raises(ValueError, match="unknown attention block"):
        create_model(name, attn="nope")
    with pytest.raises(ValueError, match="score"):
        create_model(name, attn_kwargs={"score": "cosine"})
    with pytest.raises(ValueError, match="grid"):
        create_model(name, attn_kwargs={"grid": (2, 2)})


def test_every_token_mixer_builds_and_the_pooling_heads_are_pools():
    """Every registered token block that maps (B, N, D) to the same is a ViT's ``attn``; the pooling heads
    (kind "pool") are refused there with the ``pool`` that uses them; class attention needs the class token."""
    mixers = [a for a in visattn.list_attention("token") if attention_info(a)["kind"] != "pool"]
    assert {"mhsa", "lsa", "talking_heads", "class_attn", "window", "xca"} <= set(mixers)
    x = torch.randn(1, 3, 32, 32)
    for a in mixers:
        model = create_model("vit_tiny", num_classes=7, attn=a, depth=1)
        assert type(model.blocks[0].attn) is type(visattn.create_attention(a, 192, grid=(8, 8), num_prefix_tokens=1))
        assert model(x).shape == (1, 7)
    with pytest.raises(ValueError, match="attn='attn_pool' is a pooling head, not a token mixer: use pool='attn'"):
        create_model("vit_tiny", attn="attn_pool")
    with pytest.raises(ValueError, match="attn='seqpool' is a pooling head, not a token mixer: use pool='seq'"):
        create_model("cct_2", attn="seqpool")
    with pytest.raises(ValueError, match="attn must be a token block such as 'mhsa', 'lsa' or 'xca', got 'se'"):
        create_model("vit_tiny", attn="se")
    with pytest.raises(ValueError, match="attn='class_attn' updates the class token only: it needs pool='cls'"):
        create_model("vit_tiny", attn="class_attn", pool="attn")


def test_the_attention_pooling_head_is_attn_pool_on_the_normed_tokens():
    """``pool="attn"``: no class token; ``attn_pool`` built as timm's ViT builds its MAP head (the model's heads
    and MLP ratio, LayerNorm, one latent query) keeps its own initialisation and pools ``forward_features``."""
    model = create_model("vit_tiny", num_classes=7, pool="attn", depth=2).eval()
    pool = model.attn_pool
    assert model.num_prefix_tokens == 0 and model.cls_token is None and model.seq_pool is None
    assert type(pool) is type(visattn.create_attention("attn_pool", 192))
    assert pool.num_heads == 12 and pool.latent.shape == (1, 1, 192) and pool.mlp.fc1.out_features == 384
    assert isinstance(pool.norm, torch.nn.LayerNorm) and pool.pool == "token"
    assert 0.04 < pool.latent.std() < 0.09  # its own init (timm's latent: std dim ** -0.5 = 0.072, truncated)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        feats = model.forward_features(x)
        torch.testing.assert_close(model(x), model.head(pool(feats)), rtol=0, atol=0)
        assert feats.shape == (2, 64, 192)


@pytest.mark.parametrize("attn,pool", [("xca", "cls"), ("mhsa", "attn"), ("xca", "attn")])
def test_xca_and_the_attention_pool_train_a_step_and_record_their_maps(attn, pool):
    model = create_model("vit_tiny", num_classes=7, attn=attn, pool=pool, depth=2)
    x, y = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)
    unchanged = [n for n, p in model.named_parameters() if torch.equal(p, before[n])]
    assert not unchanged, unchanged  # every parameter, the head's latent query and the temperatures included
    model.eval()
    with visattn.record_attention(model) as rec:
        model(x)
    kinds = [r.kind for r in rec.records]
    mixer = "covariance" if attn == "xca" else "token"
    assert kinds == [mixer] * 2 + (["pool"] if pool == "attn" else [])
    maps = {m.name: m for m in visattn.read_maps(rec.records, model, x.shape, matrices=True)}
    for i in range(2):
        lm = maps[f"blocks.{i}.attn"]
        if attn == "xca":  # channel x channel, 16 channels per head, rows summing to 1 (mean of the heads)
            assert lm.kind == "covariance" and not lm.placed and lm.heat.shape == (4, 16, 16)
            torch.testing.assert_close(lm.heat.sum(-1), torch.ones(4, 16))
        else:
            assert lm.kind == "token" and lm.placed and lm.heat.shape == (4, 8, 8)
    if pool == "attn":
        weights = rec.records[-1].weights
        assert rec.records[-1].name == "attn_pool" and weights.shape == (4, 64)
        torch.testing.assert_close(weights.sum(-1), torch.ones(4))
        assert maps["attn_pool"].kind == "pool" and maps["attn_pool"].heat.shape == (4, 8, 8)
    if attn == "mhsa":  # the rollout is read out through the pooling head's weights, as the model pools
        assert maps["rollout"].info["readout"] == "seq"


def test_xcas_maps_are_drawn_as_matrices_in_tensorboard(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    from visattn.maps.tensorboard import log_attention_maps

    model = create_model("vit_tiny", num_classes=4, attn="xca", pool="attn", depth=1)
    with SummaryWriter(str(tmp_path)) as writer:
        summary = log_attention_maps(writer, model, torch.randn(4, 3, 32, 32), torch.arange(4), step=0)
    # the covariance record as a channel x channel matrix, the pooling head's weights placed on the image
    assert {"matrix/blocks.0.attn", "maps/attn_pool"} <= set(summary["images"]), summary["images"]


def test_vit_rejects_indivisible_image_size():
    with pytest.raises(ValueError, match="divisible"):
        create_model("vit_tiny", img_size=30)


def test_attn_kwargs_reach_every_block():
    model = create_model("vit_tiny", attn_kwargs={"score": "dot", "hard": 2})
    assert all(b.attn.score == "dot" and b.attn.hard == 2 for b in model.blocks)
    lsa = create_model("cct_2", attn="lsa")
    assert all(type(b.attn).__name__ == "LocalitySelfAttention" for b in lsa.blocks)


def test_shifted_patch_tokenizer_shifts_by_half_a_patch_diagonally():
    tok = ShiftedPatchTokenizer((8, 8), patch_size=4, in_chans=1, dim=8)
    tok.norm, tok.proj = torch.nn.Identity(), torch.nn.Identity()  # look at the raw patch vectors
    img = torch.zeros(1, 1, 8, 8)
    img[0, 0, 3, 3] = 1.0
    patches = tok(img)  # (1, 4 tokens, 4*4*5)
    assert patches.shape == (1, 4, 80)
    found = set()
    for token, feat in (patches[0] == 1).nonzero().tolist():
        y = (token // 2) * 4 + (feat // 5) // 4  # patch row, then row within the patch
        x = (token % 2) * 4 + (feat // 5) % 4
        found.add((feat % 5, y, x))  # (channel, pixel)
    # channel 0 is the image itself; the four shifted copies move the pixel by (+-2, +-2)
    assert {c for c, _, _ in found} == {0, 1, 2, 3, 4} and len(found) == 5
    assert {(y, x) for _, y, x in found} == {(3, 3), (1, 1), (1, 5), (5, 1), (5, 5)}


@pytest.mark.parametrize("pool_kernel,grids", [(3, {32: (8, 8), 30: (8, 8), 33: (9, 9)}),
                                               (2, {32: (8, 8), 30: (7, 7), 33: (8, 8)})])
def test_conv_tokenizer_grid_matches_its_output(pool_kernel, grids):
    for size, grid in grids.items():
        model = create_model("cct_2", img_size=size, pool_kernel=pool_kernel, tokenizer_norm="bn", **SHALLOW)
        assert model.grid_size == grid
        assert model.tokenizer(torch.randn(1, 3, size, size)).shape == (1, grid[0] * grid[1], model.embed_dim)


def test_conv_tokenizer_norm_and_activation_options():
    paper = create_model("cct_2", **SHALLOW).tokenizer
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in paper.modules())
    assert sum(isinstance(m, torch.nn.ReLU) for m in paper.modules()) == 2
    bn = create_model("cct_2", tokenizer_norm="bn", tokenizer_act="gelu", **SHALLOW).tokenizer
    kinds = [type(m).__name__ for m in bn.layers]
    assert kinds == ["Conv2d", "BatchNorm2d", "GELU", "MaxPool2d"] * 2
    for what, kw in (("norm", {"tokenizer_norm": "ln"}), ("act", {"tokenizer_act": "silu"}),
                     ("pool_kernel", {"pool_kernel": 4}), ("pools", {"pools": 3})):
        with pytest.raises(ValueError, match=f"unknown tokenizer {what}"):
            create_model("cct_2", **kw)


def test_layer_scale_starts_each_branch_at_its_value_and_learns():
    model = create_model("cct_2", layer_scale=1e-4, **SHALLOW)
    for block in model.blocks:
        assert torch.equal(block.ls1.gamma, torch.full((model.embed_dim,), 1e-4))
        assert torch.equal(block.ls2.gamma, block.ls1.gamma)
    model(torch.randn(2, 3, 32, 32)).logsumexp(-1).sum().backward()
    assert all(b.ls1.gamma.grad.abs().sum() > 0 and b.ls2.gamma.grad.abs().sum() > 0 for b in model.blocks)
    plain = create_model("cct_2", **SHALLOW)
    assert not any("gamma" in n for n, _ in plain.named_parameters())  # off by default: old checkpoints load
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="layer_scale"):
            create_model("cct_2", layer_scale=bad)


@pytest.mark.parametrize("pools,grid", [(0, (32, 32)), (1, (16, 16)), (2, (8, 8))])
def test_conv_tokenizer_pools_after_its_first_layers_only(pools, grid):
    model = create_model("cct_2", pools=pools, pool_kernel=2, **SHALLOW)
    assert model.grid_size == grid and model.pos_embed.shape[1] == grid[0] * grid[1]
    assert sum(isinstance(m, torch.nn.MaxPool2d) for m in model.tokenizer.modules()) == pools
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 10)


def test_whitened_tokenizer_whitens_the_patches_of_its_images():
    model = create_model("cct_2", tokenizer_init="whiten", tokenizer_norm="bn", **SHALLOW)
    assert model.needs_data_init
    kaiming = model.tokenizer.layers[0].weight.detach().clone()
    noise = torch.rand(64, 3, 36, 36)
    smooth = torch.nn.functional.avg_pool2d(noise, 5, stride=1)  # neighbouring pixels correlate
    images = (smooth * 255 / smooth.max()).to(torch.uint8)
    mean, std = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)
    model.data_init(images, mean, std)
    conv = model.tokenizer.layers[0]
    x = (images.float() / 255 - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    with torch.no_grad():
        out = torch.nn.functional.conv2d(x, conv.weight[:27])  # the whitening filters, no padding: whole patches
    flat = out.permute(1, 0, 2, 3).reshape(27, -1).double()
    cov = torch.cov(flat)
    off = cov - torch.diag(cov.diag())
    assert off.abs().max() < 1e-3  # decorrelated
    # unit variance but for eps (5e-4): the patch covariance's eigen-direction of variance v comes out at v / (v + eps)
    patches = x.unfold(2, 3, 1).unfold(3, 3, 1).permute(0, 2, 3, 1, 4, 5).reshape(-1, 27).double()
    v = torch.linalg.eigvalsh(torch.cov(patches.T))  # ascending, the filters' order
    torch.testing.assert_close(cov.diag(), v / (v + 5e-4), rtol=1e-3, atol=1e-4)
    assert torch.equal(conv.weight[27:54], -conv.weight[:27])
    assert torch.equal(conv.weight[54:], kaiming[54:])  # the other filters keep their initialisation
    with pytest.raises(ValueError, match="needs 54 filters"):
        create_model("cct_2", tokenizer_init="whiten", conv_channels=32)


def test_frozen_whitened_tokenizer_keeps_its_whitening_filters_and_trains_the_rest():
    from visattn.models.cct import PartlyFrozenConv2d
    from visattn.optim import build_optimizer

    torch.manual_seed(0)
    model = create_model("cct_2", tokenizer_init="whiten_frozen", tokenizer_norm="bn", **SHALLOW)
    conv = model.tokenizer.layers[0]
    assert model.needs_data_init and isinstance(conv, PartlyFrozenConv2d)
    assert conv.frozen.shape == (54, 3, 3, 3) and conv.weight.shape == (10, 3, 3, 3) and not conv.frozen.requires_grad
    images = torch.randint(0, 256, (32, 3, 32, 32), dtype=torch.uint8)
    mean, std = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)
    model.data_init(images, mean, std)
    from visattn.models.resnet import patch_whitening_filters

    x = (images.float() / 255 - 0.5) / 0.25
    torch.testing.assert_close(conv.frozen, patch_whitening_filters(x, 3))
    # one convolution with all 64 filters, the frozen ones first
    torch.testing.assert_close(conv(x), torch.nn.functional.conv2d(x, torch.cat([conv.frozen, conv.weight]), padding=1))
    frozen, trained = conv.frozen.detach().clone(), conv.weight.detach().clone()
    for name in ("muon", "adamw", "sgd"):
        opt = build_optimizer(model, name, lr=0.1, weight_decay=0.5)
        for _ in range(2):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), torch.arange(32) % 10).backward()
            opt.step()
        assert conv.frozen.grad is None and torch.equal(conv.frozen, frozen), name  # no step, no weight decay
    assert not torch.equal(conv.weight, trained)  # the other filters learn
    state = model.state_dict()
    assert "tokenizer.layers.0.frozen" in state  # saved and restored with the checkpoint
    clone = create_model("cct_2", tokenizer_init="whiten_frozen", tokenizer_norm="bn", **SHALLOW)
    clone.load_state_dict(state)
    model.eval(), clone.eval()
    torch.testing.assert_close(clone(x), model(x))
    with pytest.raises(ValueError, match="'whiten_frozen' needs 54 filters"):
        create_model("cct_2", tokenizer_init="whiten_frozen", conv_channels=32)
    whole = create_model("cct_2", tokenizer_init="whiten_frozen", conv_channels=54, **SHALLOW)
    assert not any(p.requires_grad for p in whole.tokenizer.layers[0].parameters())  # all 54 filters whitening


def test_the_trainer_whitens_the_tokenizer_from_its_training_images(tmp_path):
    from visattn.config import build_config, read_yaml
    from visattn.models.resnet import patch_whitening_filters
    from visattn.trainer import build

    tree = read_yaml(ROOT / "configs" / "smoke.yaml")
    tree.update(run_dir=str(tmp_path / "run"), precision="fp32")
    tree["model"] = {"name": "cct_2", "depth": 1, "dim": 64, "tokenizer_init": "whiten", "tokenizer_norm": "bn"}
    tree["data"].update(synthetic_size=120, val_size=20)
    run = build(build_config(tree), log=lambda *a, **k: None)
    train = torch.from_numpy(run.splits.train.x[:5000]).permute(0, 3, 1, 2).float() / 255
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in (run.cfg.data.mean, run.cfg.data.std))
    expected = patch_whitening_filters((train - mean) / std, 3)
    torch.testing.assert_close(run.model.tokenizer.layers[0].weight[:54].detach().float(), expected)
