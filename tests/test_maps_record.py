"""Recording any model's attention: timm and torchvision ViTs (fused attention on), a warning for models with
nothing to record, a memory bound on long recordings, and no recompilation of compiled models."""
import warnings

import pytest
import torch
from torch import nn

import visattn
from visattn.attention.tap import AttentionTap
from visattn.maps import attention_rollout, read_maps, record_attention, remove_taps

timm = pytest.importorskip("timm")
tv_models = pytest.importorskip("torchvision.models")


def timm_vit():
    torch.manual_seed(0)
    m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=4, num_classes=10)
    assert all(b.attn.fused_attn for b in m.blocks)  # the fused path is what runs, recorded or not
    return m


def torchvision_vit():
    torch.manual_seed(0)
    return tv_models.VisionTransformer(image_size=32, patch_size=4, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64)


def explicit_timm_attention(m, x):
    """Reference weights: timm's own unfused path, read at the softmax's output (before dropout)."""
    ref, handles = [], []
    for b in m.blocks:
        b.attn.fused_attn = False
        handles.append(b.attn.attn_drop.register_forward_hook(lambda mod, a, o: ref.append(a[0].detach().clone())))
    try:
        with torch.no_grad():
            m.eval()(x)
    finally:
        for b, h in zip(m.blocks, handles):
            b.attn.fused_attn = True
            h.remove()
    return ref


def explicit_torchvision_attention(m, x):
    """Reference weights: each nn.MultiheadAttention asked for its per-head weights."""
    ref = []
    for layer in m.encoder.layers:
        orig = layer.self_attention.forward

        def asking(*args, _orig=orig, **kwargs):
            kwargs.update(need_weights=True, average_attn_weights=False)
            out, w = _orig(*args, **kwargs)
            ref.append(w.detach().clone())
            return out, w

        layer.self_attention.forward = asking
    try:
        with torch.no_grad():
            m.eval()(x)
    finally:
        for layer in m.encoder.layers:
            del layer.self_attention.forward
    return ref


def test_timm_vit_with_fused_attention_records_every_block_in_training():
    m = timm_vit().train()
    x = torch.randn(3, 3, 32, 32)
    with record_attention(m) as rec:
        out = m(x)
    assert out.shape == (3, 10)
    assert [r.name for r in rec] == [f"blocks.{i}.attn" for i in range(len(m.blocks))]
    assert all(r.kind == "token" and r.weights.shape == (3, 3, 65, 65) for r in rec)
    assert all(r.grid == (8, 8) and r.num_prefix_tokens == 1 for r in rec)
    ref = explicit_timm_attention(m, x)
    assert len(ref) == len(rec)
    for r, q in zip(rec, ref):
        assert torch.allclose(r.weights, q, atol=1e-6)
    heat = attention_rollout(rec.records)
    assert heat.shape == (3, 8, 8)
    assert torch.allclose(heat, attention_rollout(ref, num_prefix_tokens=1, grid=(8, 8)), atol=1e-6)
    maps = {lm.name: lm for lm in read_maps(rec.records, m, x.shape)}
    share = heat / heat.flatten(1).sum(1)[:, None, None]  # the readout shows the grid tokens' share of the flow
    assert torch.allclose(maps["rollout"].heat, share)  # read out by the class token, as the model pools
    assert maps["rollout"].geometry.exact and maps["rollout"].geometry.stride == (4, 4)


def test_torchvision_vit_records_every_layer():
    m = torchvision_vit()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        plain = m.eval()(x)
    with torch.no_grad(), record_attention(m) as rec:
        out = m.eval()(x)
    assert torch.equal(out, plain)  # its forward is untouched (fast path included)
    assert [r.name for r in rec] == ["encoder.layers.encoder_layer_0.self_attention",
                                     "encoder.layers.encoder_layer_1.self_attention"]
    assert all(r.weights.shape == (2, 2, 65, 65) and r.grid == (8, 8) and r.num_prefix_tokens == 1 for r in rec)
    ref = explicit_torchvision_attention(m, x)
    for r, q in zip(rec, ref):
        assert torch.allclose(r.weights, q, atol=1e-5)
    heat = attention_rollout(rec.records)
    assert heat.shape == (2, 8, 8)
    assert torch.allclose(heat, attention_rollout(ref, num_prefix_tokens=1, grid=(8, 8)), atol=1e-5)
    assert "rollout" in {lm.name for lm in read_maps(rec.records, m, x.shape)}


def test_foreign_taps_leave_the_model_as_it_was():
    m = timm_vit().eval()
    keys = list(m.state_dict())
    names = [n for n, _ in m.named_modules()]
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        before = m(x)
        with record_attention(m):
            m(x)
        after = m(x)
    assert torch.equal(before, after) and list(m.state_dict()) == keys and [n for n, _ in m.named_modules()] == names
    assert remove_taps(m) == len(m.blocks) and remove_taps(m) == 0


def test_attention_free_model_warns_naming_what_was_searched():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    with pytest.warns(RuntimeWarning, match=r"nothing to record.*AttentionTap.*timm Attention.*MultiheadAttention"):
        with record_attention(model) as rec:
            model(torch.randn(1, 3, 8, 8))
    assert len(rec) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with record_attention(visattn.create_model("vit_tiny", depth=1, dim=16, num_heads=2)):
            pass  # a model with taps: no warning


class Tiny(nn.Module):
    """One 4x4 spatial gate: 16 floats per image recorded per pass."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 1, 3, padding=1)
        self.tap = AttentionTap("spatial")

    def forward(self, x):
        return x * self.tap(torch.sigmoid(self.conv(x)))


def test_thousand_passes_stay_under_the_memory_bound():
    model = Tiny()
    x = torch.randn(2, 3, 4, 4)
    per_pass = 2 * 1 * 4 * 4 * 4  # B x 1 x H x W fp32 bytes
    with pytest.warns(RuntimeWarning, match="max_passes") as caught, torch.no_grad():
        with record_attention(model, max_passes=50) as rec:
            for _ in range(1000):
                model(x)
    assert sum("max_passes" in str(w.message) for w in caught) == 1  # one warning, not one per pass
    assert rec.passes() == list(range(950, 1000)) and rec.dropped_passes == 950
    assert rec.bytes_per_pass == per_pass
    assert rec.nbytes <= 50 * per_pass  # the stated bound: max_passes x one pass's weights
    assert all(r.weights.device.type == "cpu" for r in rec)
    with record_attention(model, max_passes=None) as everything, torch.no_grad():
        for _ in range(3):
            model(x)
    assert everything.passes() == [0, 1, 2] and len(everything.by_pass(1)) == 1


def test_records_are_independent_copies():
    model = Tiny()
    with torch.no_grad(), record_attention(model) as rec:
        model(torch.randn(1, 3, 4, 4))
    w = rec.records[0].weights
    assert w.untyped_storage().nbytes() == w.numel() * 4  # no larger storage kept alive behind a view


def counting_backend():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return backend, graphs


def cache_entries(fn) -> int:
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return len(_debug_get_cache_entry_list(fn.__code__))


@pytest.mark.parametrize("which", ["visattn", "timm"])
def test_compiled_model_compiles_at_most_twice(which):
    torch._dynamo.reset()
    if which == "visattn":
        model = visattn.create_model("vit_tiny", num_classes=10, depth=2, dim=32, num_heads=2).eval()
    else:
        model = timm_vit().eval()  # its taps' hooks are added by the first recording, after compiling
    backend, graphs = counting_backend()
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        eager = {}
        with record_attention(model) as rec:
            model(x)
        eager = [r.weights for r in rec]
        compiled(x)
        with record_attention(compiled) as rec:
            compiled(x)
        warm = len(graphs)
        for _ in range(3):  # fresh recorders and plain calls alternate: nothing new to compile
            with record_attention(compiled) as rec:
                compiled(x)
            compiled(x)
    assert len(graphs) == warm
    # visattn: one version (recording runs eagerly); timm: a second one once its attention got its tap hooks
    assert cache_entries(type(model).forward) <= 2
    assert len(rec) == len(eager) and all(torch.allclose(a.weights, b, atol=1e-5) for a, b in zip(rec, eager))
