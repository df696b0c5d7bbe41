"""Gradient-weighted maps: attention x gradient per layer (Chefer et al. 2021's E_h[(grad * A)^+]), its rollout
(R = I + A_bar R) and gate x gradient for spatial gates, from one batched backward pass of a gradient recording.

Planted models decide from one known region while their raw attention points somewhere else: the gradient
maps must find the deciding region (on non-square grids, off the centre, behind a class token), and rank it
first for the faithfulness measure. Real blocks, timm and torchvision ViTs, torch.compile, bf16 and
channels-last record them too; the probe leaves the model as it found it.
"""
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import visattn
from visattn.attention.tap import AttentionTap
from visattn.maps import (
    GradientRecord,
    attention_rollout,
    gradient_heatmap,
    gradient_rollout,
    probe_pass,
    read_maps,
    record_attention,
)

GRID = (3, 5)  # 8x8-pixel patches of a 24x40 image
HOT, DISTRACTOR = (2, 1), (0, 3)  # the deciding patch, and the one the raw attention points at


def argmax2d(m: torch.Tensor):
    i = int(m.flatten().argmax())
    return divmod(i, m.shape[-1])


def images(n=6, seed=0, hw=(24, 40)):
    return torch.randn(n, 3, *hw, generator=torch.Generator().manual_seed(seed))


def patch_evidence(x: torch.Tensor) -> torch.Tensor:
    """(B, 3, 8h, 8w) -> (B, h*w): each 8x8 patch's mean red minus green, row-major."""
    f = F.avg_pool2d(x, 8)
    return (f[:, 0] - f[:, 1]).flatten(1)


class DecidingTokens(nn.Module):
    """One attention layer over the 15 patch tokens (and a class token when ``prefix``): its attention is
    planted on DISTRACTOR (learned logits, so it is in the graph), but only HOT's value is non-zero, so the
    class logit is ``A[query, HOT] * evidence[HOT]``. The class token reads out, or the mean over tokens."""

    def __init__(self, prefix=1, heads=2):
        super().__init__()
        self.prefix, self.heads = prefix, heads
        n = prefix + GRID[0] * GRID[1]
        logits = torch.zeros(heads, n, n)
        logits[:, :, prefix + DISTRACTOR[0] * GRID[1] + DISTRACTOR[1]] = 4.0
        self.logits = nn.Parameter(logits)
        mask = torch.zeros(n)
        mask[prefix + HOT[0] * GRID[1] + HOT[1]] = 1.0
        self.register_buffer("mask", mask)
        self.tap = AttentionTap("token")
        self.pool = "cls" if prefix else "mean"

    def forward(self, x):
        d = patch_evidence(x)
        v = torch.cat([d.new_zeros(d.shape[0], self.prefix), d], 1) * self.mask  # (B, N): only HOT carries a value
        attn = self.tap(self.logits.softmax(-1).expand(d.shape[0], -1, -1, -1), grid=GRID,
                        num_prefix_tokens=self.prefix)
        out = attn.mean(1) @ v[:, :, None]  # (B, N, 1)
        s = out[:, 0, 0] if self.prefix else out[:, self.prefix:, 0].mean(1)
        return torch.stack([20 * s, -20 * s], 1)


class DecidingGate(nn.Module):
    """A spatial gate (B, 1, h, w) on ``grid`` (8x8-pixel cells) multiplies the image; it is hottest at DISTRACTOR
    and coldest at HOT, yet the logit reads HOT's gated evidence only."""

    def __init__(self, grid=GRID, scale=400.0):
        super().__init__()
        self.scale = scale  # the gate at HOT is small: a large scale keeps the prediction confident
        g = torch.full((1, 1, *grid), -2.0)
        g[..., DISTRACTOR[0], DISTRACTOR[1]] = 3.0
        g[..., HOT[0], HOT[1]] = -2.5
        self.grid = grid
        self.gate_logits = nn.Parameter(g)
        self.tap = AttentionTap("spatial")

    def forward(self, x):
        gate = self.tap(torch.sigmoid(self.gate_logits).expand(x.shape[0], -1, -1, -1))
        y = x * F.interpolate(gate, size=x.shape[-2:], mode="nearest")
        s = self.scale * patch_evidence(y)[:, HOT[0] * self.grid[1] + HOT[1]]
        return torch.stack([s, -s], 1)


def maps_of(model, x, **kw):
    rec, _ = probe_pass(model, x, **kw)
    return {m.name: m for m in read_maps(rec.records, model, x.shape)}, rec


# --------------------------------------------------------------------------------------------- planted


@pytest.mark.parametrize("prefix", [1, 0])
def test_attention_gradient_finds_the_deciding_token_not_the_attended_one(prefix):
    model = DecidingTokens(prefix)
    maps, rec = maps_of(model, images())
    assert isinstance(rec.records[0], GradientRecord) and rec.records[0].via == "weights"
    raw, grad, roll = maps["tap"], maps["tap/grad"], maps["rollout_grad"]
    assert grad.kind == "attention_gradient" and roll.kind == "gradient_rollout"
    assert grad.scale == roll.scale == "relative" and grad.keys == roll.keys == 15
    for i in range(raw.heat.shape[0]):
        assert argmax2d(raw.heat[i]) == DISTRACTOR  # what the layer attends to
        assert argmax2d(grad.heat[i]) == HOT  # what the decision depends on
        assert argmax2d(roll.heat[i]) == HOT
        assert argmax2d(maps["rollout"].heat[i]) == DISTRACTOR
    # the evidence is all in one cell: a share of 1 there, 0 elsewhere
    assert torch.allclose(grad.heat.flatten(1).sum(1), torch.ones(6))
    assert grad.heat[:, HOT[0], HOT[1]].min() > 0.999
    assert "Chefer" in grad.description and "target class" in grad.description


def test_gate_gradient_finds_the_deciding_region_and_ranks_it_first():
    maps, rec = maps_of(DecidingGate(), images(4))
    raw, grad = maps["tap"], maps["tap/grad"]
    assert rec.records[0].via == "weights" and raw.scale == "gate" and grad.scale == "relative"
    assert all(argmax2d(h) == DISTRACTOR for h in raw.heat) and all(argmax2d(h) == HOT for h in grad.heat)
    # on a square layout the faithfulness measure's 4x4 regions are the gate's cells
    model, x = DecidingGate(grid=(4, 4)), images(24, hw=(32, 32))
    report = visattn.faithfulness(model, x, steps=16, regions=4, draws=3, baselines=(), sanity=False)
    g, r = report.row("tap/grad"), report.row("tap")
    assert g.kind == "attention_gradient"
    # the gradient map removes the deciding region first: the prediction falls to chance at the first step
    assert g.deletion_curve[0] > 0.9 and g.deletion_curve[1] == pytest.approx(0.5, abs=0.05)
    assert g.deletion_score.lo > 0.1 and g.insertion_score.lo > 0.1, report.table()
    assert r.deletion_score.hi < 0, report.table()  # the raw gate ranks it last: worse than random


def test_maps_are_batch_independent_and_explain_the_given_class():
    model = DecidingTokens(1)
    x = images(5)
    batch, rec = maps_of(model, x)
    assert rec.target.tolist() == model.eval()(x).argmax(-1).tolist()  # default: the predicted classes
    for i in range(5):
        one, _ = maps_of(model, x[i : i + 1])
        for name in ("tap/grad", "rollout_grad"):
            assert torch.allclose(one[name].heat[0], batch[name].heat[i], atol=1e-6)
    # explaining the other class: the evidence is negative there, so the map has none to show
    other, rec = maps_of(model, x, target=1 - rec.target)
    assert torch.count_nonzero(other["tap/grad"].heat) == 0


def test_gradient_rollout_follows_chefers_rule():
    a1 = torch.rand(2, 3, 4, 4) - 0.3  # relevance of two layers, some negative
    a2 = torch.rand(2, 2, 4, 4) - 0.3
    r = torch.eye(4).expand(2, 4, 4)
    for a in (a1, a2):
        r = r + a.clamp_min(0).mean(1) @ r
    out = gradient_rollout([a1, a2], num_prefix_tokens=1, grid=(1, 3))
    assert torch.allclose(out, r[:, 0, 1:].reshape(2, 1, 3))
    mean = gradient_rollout([a1, a2], num_prefix_tokens=0, readout="mean", grid=(2, 2))
    assert torch.allclose(mean, (r - torch.eye(4))[:, :, :].mean(1).reshape(2, 2, 2), atol=1e-6)
    with pytest.raises(ValueError, match="relevance"):
        gradient_rollout([visattn.maps.record.AttentionRecord("x", "token", a1)])


def test_a_summary_off_the_path_gets_its_gate_x_gradient_through_the_block_output():
    """Coordinate attention hands its tap the channel mean of a gate it does not use itself: the relevance
    comes from the block's output, out * d logit / d out summed over channels, which equals the gate's
    sum_c G_c * d logit / d G_c for a gate that multiplies its input."""

    class SummaryGate(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 3, padding=1)
            self.tap = AttentionTap("spatial")
            self.gate = None

        def forward(self, x):
            g = torch.sigmoid(self.conv(x))  # (B, C, H, W)
            self.tap(g.mean(1, keepdim=True))  # a summary, not used
            if self.gate is not None:
                self.gate.append(g)
                g.retain_grad()
            return x * g

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = SummaryGate()
            self.head = nn.Linear(3, 2)

        def forward(self, x):
            return self.head(self.block(x).mean((2, 3)) ** 2)

    torch.manual_seed(0)
    net = Net().eval()
    x = images(3, hw=(6, 10))
    rec, _ = probe_pass(net, x, target=torch.tensor([0, 1, 0]))
    (r,) = rec.records
    assert r.via == "output" and r.relevance.shape == (3, 1, 6, 10)
    net.block.gate = []
    out = net(x)
    out.gather(1, torch.tensor([[0], [1], [0]])).sum().backward()
    g = net.block.gate[0]
    assert torch.allclose(r.relevance, (g * g.grad).sum(1, keepdim=True).detach(), atol=1e-6)


@pytest.mark.parametrize("attention,via", [("cbam", "weights"), ("spatial", "weights"), ("gc", "view"),
                                           ("coord", "output"), ("nonlocal", "weights"), ("mhsa2d", "weights")])
def test_real_blocks_record_relevance(attention, via):
    torch.manual_seed(0)
    model = visattn.create_model("resnet_fast", num_classes=4, widths=(8, 16, 16), attention=attention)
    for p in model.parameters():  # the blocks start as the identity (zeroed output paths): no gradient reaches them
        if not p.any():
            nn.init.normal_(p, 0.5, 0.1)
    x = images(2, hw=(16, 16))
    maps, rec = maps_of(model, x)
    grads = [r for r in rec.records if isinstance(r, GradientRecord)]
    assert grads and all(r.via == via for r in grads) and all(r.kind != "channel" for r in grads)
    for r in grads:
        heat = gradient_heatmap(r, image_hw=(16, 16))
        assert torch.isfinite(heat).all() and (heat >= 0).all()
        assert torch.allclose(heat.flatten(1).sum(1), torch.ones(2), atol=1e-5)
    names = [n for n in maps if n.endswith("/grad")]
    assert len(names) == len(grads)


def test_cct_reads_its_gradient_rollout_out_by_the_sequence_pooling():
    torch.manual_seed(0)
    model = visattn.create_model("cct_2", num_classes=3, img_size=(16, 32), depth=2, dim=32, num_heads=2)
    x = images(2, hw=(16, 32))
    maps, rec = maps_of(model, x)
    assert {"blocks.0.attn/grad", "blocks.1.attn/grad", "seq_pool/grad", "rollout_grad"} <= set(maps)
    tokens = [r for r in rec.records if r.kind == "token"]
    pool = next(r for r in rec.records if r.kind == "pool")
    ref = gradient_rollout(tokens, num_prefix_tokens=0, readout=pool)
    assert torch.allclose(maps["rollout_grad"].heat, ref / ref.flatten(1).sum(1)[:, None, None], atol=1e-6)


# --------------------------------------------------------------------------------------------- foreign ViTs


timm = pytest.importorskip("timm")


def chefer_reference(m, x, target):
    """Chefer et al.'s maps computed by hand: timm's unfused path, the softmax's gradient kept."""
    kept = []
    hooks = []
    for b in m.blocks:
        b.attn.fused_attn = False

        def keep(mod, args):
            args[0].retain_grad()
            kept.append(args[0])

        hooks.append(b.attn.attn_drop.register_forward_pre_hook(keep))
    try:
        m.eval()
        out = m(x.clone().requires_grad_(True))
        out.gather(1, target[:, None]).sum().backward()
    finally:
        for b, h in zip(m.blocks, hooks):
            b.attn.fused_attn = True
            h.remove()
        m.zero_grad(set_to_none=True)
    rel = [(a * a.grad).detach() for a in kept]
    r = torch.eye(rel[0].shape[-1]).expand(x.shape[0], -1, -1)
    for a in rel:
        r = r + a.clamp_min(0).mean(1) @ r
    return rel, r[:, 0, 1:]


def test_timm_vit_gradient_maps_match_chefers_and_leave_fused_attention_on():
    torch.manual_seed(0)
    m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, num_classes=5, depth=3)
    x = images(3, hw=(32, 32))
    target = torch.tensor([0, 3, 1])
    rec, _ = probe_pass(m, x, target)
    rel, roll = chefer_reference(m, x, target)
    grads = [r for r in rec.records]
    assert [r.name for r in grads] == [f"blocks.{i}.attn" for i in range(3)]
    assert all(isinstance(r, GradientRecord) and r.via == "weights" for r in grads)
    for r, ref in zip(grads, rel):
        assert torch.allclose(r.relevance, ref, atol=1e-6, rtol=1e-4)
    maps = {lm.name: lm for lm in read_maps(rec.records, m, x.shape)}
    assert torch.allclose(maps["rollout_grad"].heat, (roll / roll.sum(1, keepdim=True)).reshape(3, 4, 4), atol=1e-5)
    assert all(b.attn.fused_attn for b in m.blocks)  # the unfused path was for the gradient pass only
    assert all(not b.attn.attn_drop._forward_pre_hooks for b in m.blocks)
    with torch.no_grad(), record_attention(m) as plain:
        m(x)
    for a, b in zip(plain.records, grads):  # a plain recording (fused path, recomputed weights) agrees
        assert torch.allclose(a.weights, b.weights, atol=1e-6)


def test_torchvision_vit_gradient_maps_obey_the_output_identity():
    """For attention out_i = sum_j A_ij v_j: sum_(heads, j) A_ij dy/dA_ij = <dy/dO_i, O_i>, where O is the heads'
    output before out_proj: <dy/dZ_i, Z_i - bias> with Z the module's output."""
    tv = pytest.importorskip("torchvision.models")
    torch.manual_seed(0)
    m = tv.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64,
                             num_classes=4).eval()
    x = images(2, hw=(32, 32))
    target = torch.tensor([1, 2])
    with torch.no_grad():
        plain = m(x)
    rec, logits = probe_pass(m, x, target)
    assert torch.allclose(logits, plain, atol=1e-5)  # the caller's output is what it was
    assert all(isinstance(r, GradientRecord) and r.via == "view" for r in rec.records) and len(rec.records) == 2
    outs = []
    layers = [layer.self_attention for layer in m.encoder.layers]

    def keep(mod, args, out):
        out[0].retain_grad()
        outs.append(out[0])

    hooks = [a.register_forward_hook(keep) for a in layers]
    try:
        m(x.clone().requires_grad_(True)).gather(1, target[:, None]).sum().backward()
    finally:
        for h in hooks:
            h.remove()
        m.zero_grad(set_to_none=True)
    for r, z, a in zip(rec.records, outs, layers):
        expect = ((z - a.out_proj.bias) * z.grad).sum(-1).detach()  # (B, N)
        assert torch.allclose(r.relevance.sum((1, 3)), expect, atol=1e-5)
    assert all(not a._forward_pre_hooks for a in layers)  # need_weights is the caller's again
    maps = {lm.name for lm in read_maps(rec.records, m, x.shape)}
    assert {"rollout_grad", "encoder.layers.encoder_layer_1.self_attention/grad"} <= maps


def test_a_timm_attention_that_never_reaches_attn_drop_is_still_recorded():
    """A subclass whose forward is always fused: the gradient pass cannot see its weights on the path, so it
    records the recomputed weights (as a plain recording does) and gives no relevance rather than nothing."""

    class AlwaysFused(timm.layers.Attention):
        def forward(self, x, attn_mask=None, is_causal=False):
            b, n, c = x.shape
            q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
            q, k = self.q_norm(q), self.k_norm(k)
            return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c))

    torch.manual_seed(0)
    m = AlwaysFused(16, num_heads=2).eval()
    x = torch.randn(2, 16, 16, requires_grad=True)
    with record_attention(m, gradients=True) as rec:
        rec.backward(m(x).mean(1))
    assert len(rec.records) == 1 and not isinstance(rec.records[0], GradientRecord)
    assert rec.records[0].weights.shape == (2, 2, 16, 16) and rec.records[0].grid == (4, 4)
    with torch.no_grad(), record_attention(m) as plain:
        m(x)
    assert torch.allclose(plain.records[0].weights, rec.records[0].weights, atol=1e-6)


# --------------------------------------------------------------------------------------------- runtime


def counting_backend():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return backend, graphs


def test_compiled_model_records_gradient_maps_without_recompiling():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = visattn.create_model("vit_tiny", num_classes=4, img_size=(16, 32), depth=2, dim=32, num_heads=2).eval()
    x = images(2, hw=(16, 32))
    eager, _ = maps_of(model, x)
    backend, graphs = counting_backend()
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        compiled(x)
    warm = len(graphs)
    for _ in range(2):
        maps, _ = maps_of(compiled, x)
        with torch.no_grad():
            compiled(x)
    assert len(graphs) == warm
    for name in ("blocks.0.attn/grad", "blocks.1.attn/grad", "rollout_grad"):
        assert torch.allclose(maps[name].heat, eager[name].heat, atol=1e-6)
    with record_attention(compiled, gradients=True) as rec:  # the recorder used directly on the wrapper
        out = compiled(x.clone().requires_grad_(True))
        rec.backward(out)
    assert len(rec.records) == 2 and all(isinstance(r, GradientRecord) for r in rec.records)


def pearson(a, b):
    return float(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1])


@pytest.mark.parametrize("name,kwargs", [
    ("vit_tiny", dict(img_size=(16, 32), depth=2, dim=32, num_heads=2)),
    ("resnet_fast", dict(attention="cbam", widths=(8, 16, 16))),
])
def test_bf16_autocast_and_channels_last(name, kwargs):
    torch.manual_seed(0)
    model = visattn.create_model(name, num_classes=4, **kwargs).eval()
    for p in model.parameters():
        if not p.any():
            nn.init.normal_(p, 0.5, 0.1)
    x = images(2, hw=(16, 32))
    fp32, _ = maps_of(model, x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16, _ = maps_of(model, x)
    cl_model = copy.deepcopy(model).to(memory_format=torch.channels_last)
    cl, _ = maps_of(cl_model, x.contiguous(memory_format=torch.channels_last))
    grads = [n for n in fp32 if n.endswith("/grad") or n == "rollout_grad"]
    assert grads
    for n in grads:
        assert torch.isfinite(bf16[n].heat).all()
        assert torch.allclose(bf16[n].heat.flatten(1).sum(1), torch.ones(2), atol=1e-4)
        assert all(pearson(a, b) > 0.8 for a, b in zip(bf16[n].heat, fp32[n].heat)), n  # bf16 rounding only
        assert torch.allclose(cl[n].heat, fp32[n].heat, atol=1e-5), n


def test_probe_pass_leaves_the_model_as_it_was():
    torch.manual_seed(0)
    model = visattn.create_model("vit_tiny", num_classes=4, img_size=(16, 32), depth=2, dim=32, num_heads=2)
    x = images(2, hw=(16, 32))
    model.train()
    model(x).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    state = copy.deepcopy(model.state_dict())
    rng = torch.get_rng_state()
    maps_of(model, x)
    assert model.training and all(torch.equal(grads[n], p.grad) for n, p in model.named_parameters())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert torch.equal(rng, torch.get_rng_state())
    taps = [t for t in model.modules() if isinstance(t, AttentionTap)]
    assert all(t.sink is None and not t._forward_hooks for t in taps)


def test_no_gradient_maps_when_asked_or_when_nothing_depends_on_the_input():
    model = DecidingTokens(1)
    maps, rec = maps_of(model, images(2), gradients=False)
    assert "tap/grad" not in maps and "rollout_grad" not in maps and "rollout" in maps
    assert not any(isinstance(r, GradientRecord) for r in rec.records)
    model.logits.requires_grad_(False)  # constant attention: nothing to differentiate, and no error
    frozen, _ = maps_of(model, images(2))
    assert "tap" in frozen and "rollout" in frozen
    assert not math.isnan(float(frozen["tap"].heat.sum()))
    ro = attention_rollout([r for r in rec.records if r.kind == "token"])
    assert ro.shape == (2, 3, 5)


# --------------------------------------------------------------------------------- layers_grad: the stages joined


def _grad_map(name, heat, geometry):
    from visattn.maps import LayerMap

    return LayerMap(f"{name}/grad", "attention_gradient", heat, "relative", heat.shape[-1] * heat.shape[-2],
                    geometry, "test map")


def test_layers_grad_averages_each_layers_share_on_the_pixels_with_equal_weight():
    from visattn.maps import GridGeometry, fuse_layers

    hw = (4, 4)
    fine = torch.zeros(2, 4, 4)
    fine[0, 1, 2], fine[1, 3, 0] = 5.0, 0.25  # one hot pixel per image, at any magnitude
    coarse = torch.full((2, 2, 2), 7.0)  # uniform on a 2x2 grid: 1/16 of the evidence on every pixel once placed
    stretched = GridGeometry.stretched((2, 2), hw)
    fused = fuse_layers([_grad_map("a", fine, GridGeometry.image(hw)), _grad_map("b", coarse, stretched)], hw)
    expected = torch.full((2, 4, 4), 0.5 / 16)
    expected[0, 1, 2] += 0.5
    expected[1, 3, 0] += 0.5
    assert fused.name == "layers_grad" and fused.kind == "layers_gradient" and fused.scale == "relative"
    assert fused.keys == 16 and fused.geometry == GridGeometry.image(hw)
    assert torch.allclose(fused.heat, expected, atol=1e-6)
    assert torch.allclose(fused.heat.flatten(1).sum(1), torch.ones(2))
    assert "2 layers" in fused.description and "a, b" in fused.description
    # a layer's own magnitude never changes its say: scaling it gives the same map
    louder = fuse_layers([_grad_map("a", fine * 1000, GridGeometry.image(hw)), _grad_map("b", coarse, stretched)], hw)
    assert torch.allclose(louder.heat, fused.heat)
    # raw (non-gradient) maps are not joined, and maps on one grid are a transformer trunk's: no layers_grad
    from visattn.maps import LayerMap

    raw = LayerMap("b", "spatial", coarse, "gate", 0, stretched, "gate")
    assert fuse_layers([_grad_map("a", fine, GridGeometry.image(hw)), raw], hw) is None
    assert fuse_layers([_grad_map("a", fine, GridGeometry.image(hw)), _grad_map("c", fine, GridGeometry.image(hw))],
                       hw) is None
    # a NaN layer makes the joined map NaN (the logger then skips it with a warning), never a silent zero
    bad = fine.clone()
    bad[0, 0, 0] = float("nan")
    assert not fuse_layers([_grad_map("a", bad, GridGeometry.image(hw)), _grad_map("b", coarse, stretched)], hw).finite()


@pytest.mark.parametrize("attention", ["cbam", "mhsa2d"])
def test_a_cnn_with_a_block_in_each_stage_gets_layers_grad_and_a_vit_does_not(attention):
    torch.manual_seed(0)
    cnn = visattn.create_model("resnet_fast", num_classes=10, widths=(8, 16, 16), attention=attention).eval()
    for p in cnn.parameters():  # zeroed classifier and identity blocks: no gradient would reach the blocks
        if not p.any():
            nn.init.normal_(p, 0.5, 0.1)
    x, y = images(3, hw=(32, 32)), torch.tensor([1, 2, 3])
    rec, _ = probe_pass(cnn, x, y, gradients=True)
    maps = {m.name: m for m in read_maps(rec.records, cnn, x.shape)}
    grads = [m for n, m in maps.items() if n.endswith("/grad")]
    assert len({tuple(m.heat.shape[-2:]) for m in grads}) == 3  # 16x16, 8x8, 4x4
    fused = maps["layers_grad"]
    assert fused.heat.shape == (3, 32, 32) and (fused.heat >= 0).all()
    assert torch.allclose(fused.heat.flatten(1).sum(1), torch.ones(3), atol=1e-5)
    assert list(maps)[-1] == "layers_grad"  # after every layer's maps and the rollouts
    # the gradient maps off: neither the /grad maps nor their join
    plain = {m.name for m in read_maps(rec.records, cnn, x.shape, gradients=False)}
    assert "layers_grad" not in plain and not any(n.endswith("/grad") for n in plain)

    vit = visattn.create_model("vit_tiny", num_classes=10, img_size=32, depth=2, dim=32, num_heads=2).eval()
    rec, _ = probe_pass(vit, x, y, gradients=True)
    names = {m.name for m in read_maps(rec.records, vit, x.shape)}
    assert "rollout_grad" in names and "layers_grad" not in names
