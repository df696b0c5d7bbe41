"""Token attention blocks: generic contract tests over ``list_attention("token")``, then per-block formulas."""
from __future__ import annotations

import math

import pytest
import torch
from conftest import recording

from visattn.attention import AttentionTap, attention_info, create_attention, list_attention
from visattn.attention.token import SCORES

TOKEN_BLOCKS = list_attention("token")
D = 32  # token dim: divisible by the default 8 heads


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def is_pool(name: str) -> bool:
    return attention_info(name)["kind"] == "pool"


def expected_shape(name: str, b: int, n: int):
    return (b, D) if is_pool(name) else (b, n, D)


def qkv_of(block, x):
    """Written-out q, k, v, each ``(B, heads, N, d)``, from the block's own projection weights."""
    B, N, _ = x.shape
    h, d = block.num_heads, block.head_dim
    qkv = x @ block.qkv.weight.T + block.qkv.bias
    q, k, v = qkv.split(D, dim=-1)
    return [t.reshape(B, N, h, d).transpose(1, 2) for t in (q, k, v)]


def finish(block, attn, v):
    """``softmax(...) V``, heads merged, output projection."""
    B, h, N, d = v.shape
    out = (attn @ v).transpose(1, 2).reshape(B, N, h * d)
    return out @ block.proj.weight.T + block.proj.bias


# ---- generic contract ----------------------------------------------------------------------------------
def test_token_blocks_are_registered():
    assert {"mhsa", "lsa", "seqpool"} <= set(TOKEN_BLOCKS)
    assert attention_info("seqpool")["kind"] == "pool"
    assert attention_info("mhsa")["kind"] == attention_info("lsa")["kind"] == "token"


@pytest.mark.parametrize("name", TOKEN_BLOCKS)
@pytest.mark.parametrize("b,n", [(2, 7), (1, 9), (3, 16)])  # odd N, batch 1
def test_shape_and_grads(name, b, n):
    block = create_attention(name, D)
    x = torch.randn(b, n, D, requires_grad=True)
    out = block(x)
    assert out.shape == expected_shape(name, b, n)
    out.square().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    for pname, p in block.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname


@pytest.mark.parametrize("name", TOKEN_BLOCKS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_module_cast(name, dtype):
    block = create_attention(name, D).to(dtype)
    x = torch.randn(2, 7, D, dtype=dtype)
    out = block(x)
    assert out.dtype == dtype and torch.isfinite(out).all()
    with recording(block) as recs:
        out_tap = block(x)
    assert out_tap.dtype == dtype and torch.isfinite(out_tap).all()
    assert recs and all(r.weights.dtype == torch.float32 for r in recs)
    assert torch.allclose(recs[0].weights.sum(-1), torch.ones(()), atol=1e-5)


@pytest.mark.parametrize("name", TOKEN_BLOCKS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast(name, dtype):
    block = create_attention(name, D)
    x = torch.randn(2, 7, D, requires_grad=True)
    with torch.autocast("cpu", dtype=dtype):
        out = block(x)
        with recording(block) as recs:
            out_tap = block(x)
    assert out.dtype == dtype and torch.isfinite(out).all() and torch.isfinite(out_tap).all()
    assert recs[0].weights.dtype == torch.float32
    out.float().sum().backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("name", TOKEN_BLOCKS)
def test_tap_records_shape_grid_and_rows_sum_to_one(name):
    # N = 1 prefix token + a 2x3 grid = 7 tokens
    block = create_attention(name, D, grid=(2, 3), num_prefix_tokens=1)
    x = torch.randn(2, 7, D)
    with recording(block) as recs:
        block(x)
    assert len(recs) == 1
    rec = recs[0]
    assert rec.kind == attention_info(name)["kind"]
    assert rec.grid == (2, 3) and rec.num_prefix_tokens == 1
    if rec.kind == "pool":
        assert rec.weights.shape == (2, 7)
    elif rec.kind == "covariance":  # channel x channel per head (XCA)
        assert rec.weights.shape == (2, block.num_heads, block.head_dim, block.head_dim)
    else:  # queries x keys; class attention has one query
        assert rec.weights.shape == (2, block.num_heads, getattr(block, "num_queries", 7), 7)
    assert (rec.weights >= 0).all()
    assert torch.allclose(rec.weights.sum(-1), torch.ones(()), atol=1e-5)
    # a grid that does not fit the sequence is reported, not silently recorded
    with recording(block), pytest.raises(ValueError, match="grid"):
        block(torch.randn(2, 8, D))


@pytest.mark.parametrize("name", TOKEN_BLOCKS)
def test_forward_alone_works_and_tap_is_off_by_default(name):
    block = create_attention(name, D)
    assert isinstance(block.tap, AttentionTap) and not block.tap.active
    assert block(torch.randn(2, 5, D)).shape == expected_shape(name, 2, 5)


@pytest.mark.parametrize("name", TOKEN_BLOCKS)
def test_tap_does_not_change_output(name):
    # recording switches fused blocks to the explicit fp32 path: both must compute the same thing
    block = create_attention(name, D).eval()
    x = torch.randn(2, 9, D)
    out = block(x)
    with recording(block):
        out_tap = block(x)
    assert (out - out_tap).abs().max() <= 1e-5


def _large_input_cases():
    cases = [(name, {}) for name in TOKEN_BLOCKS]
    cases += [("mhsa", {"score": s}) for s in SCORES if s != "scaled_dot"]
    cases += [("mhsa", {"hard": 2}), ("lsa", {"hard": "argmax"})]
    return [pytest.param(n, kw, id="-".join([n, *(f"{k}={v}" for k, v in kw.items())])) for n, kw in cases]


@pytest.mark.parametrize("name,kw", _large_input_cases())
def test_fp16_autocast_large_inputs_stay_finite(name, kw):
    block = create_attention(name, D, **kw).eval()
    x = 1000.0 * torch.randn(2, 9, D)
    with torch.autocast("cpu", dtype=torch.float16):
        if hasattr(block, "qkv"):
            # the premise: fp16 logits of these inputs overflow, so a naive fp16 softmax would give NaN
            q, k, _ = block.qkv(x).split(D, dim=-1)
            assert torch.isinf(q[:, :, :4].half() @ k[:, :, :4].half().transpose(1, 2)).any()
        out = block(x)
        with recording(block) as recs:
            out_tap = block(x)
    assert torch.isfinite(out).all() and torch.isfinite(out_tap).all()
    assert torch.isfinite(recs[0].weights).all()
    assert torch.allclose(recs[0].weights.sum(-1), torch.ones(()), atol=1e-4)


def test_unknown_option_and_bad_dims_are_rejected():
    with pytest.raises(ValueError, match="unknown option"):
        create_attention("mhsa", D, heads=4)
    with pytest.raises(ValueError, match="divisible"):
        create_attention("mhsa", 30, num_heads=8)
    with pytest.raises(ValueError, match="expects"):
        create_attention("mhsa", D)(torch.randn(2, 5, D + 1))


# ---- mhsa -----------------------------------------------------------------------------------------------
def test_mhsa_equals_written_out_attention_fused_and_recorded():
    block = create_attention("mhsa", D, num_heads=4).eval()
    x = torch.randn(2, 9, D)
    q, k, v = qkv_of(block, x)
    attn = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(D // 4), dim=-1)  # (B, h, N, N)
    ref = finish(block, attn, v)
    assert not block.tap.active
    assert (block(x) - ref).abs().max() <= 1e-5  # fused path
    with recording(block) as recs:
        out = block(x)  # explicit path
    assert (out - ref).abs().max() <= 1e-5
    assert (recs[0].weights - attn).abs().max() <= 1e-6


def _score_reference(block, q, k):
    """The textbook formula of each score, written out per head (``(B, h, N, N)`` logits)."""
    d = block.head_dim
    if block.score == "scaled_dot":
        return q @ k.transpose(-2, -1) / math.sqrt(d)
    if block.score == "dot":
        return q @ k.transpose(-2, -1)
    if block.score == "general":
        W = block.general_weight  # (h, d, d)
        return torch.stack([q[:, h] @ W[h] @ k[:, h].transpose(-2, -1) for h in range(block.num_heads)], 1)
    # additive: s_ij = v^T tanh(q_i + k_j), one pair at a time
    B, H, N, _ = q.shape
    out = torch.empty(B, H, N, N)
    for h in range(H):
        for i in range(N):
            for j in range(N):
                out[:, h, i, j] = torch.tanh(q[:, h, i] + k[:, h, j]) @ block.additive_v[h]
    return out


@pytest.mark.parametrize("score", SCORES)
def test_each_score_equals_its_formula(score):
    block = create_attention("mhsa", D, num_heads=4, score=score).eval()
    if score == "general":
        with torch.no_grad():  # move W away from its I/sqrt(d) init so the test sees a real bilinear form
            block.general_weight.add_(0.3 * torch.randn_like(block.general_weight))
    x = torch.randn(2, 5, D)
    q, k, v = qkv_of(block, x)
    attn = torch.softmax(_score_reference(block, q, k), dim=-1)
    ref = finish(block, attn, v)
    assert (block(x) - ref).abs().max() <= 1e-5
    with recording(block) as recs:
        assert (block(x) - ref).abs().max() <= 1e-5
    assert (recs[0].weights - attn).abs().max() <= 1e-6


def test_dot_and_scaled_dot_differ_and_general_starts_as_scaled_dot():
    x = torch.randn(2, 5, D) * 30  # ViT-initialised projections (std 0.02): large tokens give non-flat logits
    torch.manual_seed(1)
    scaled = create_attention("mhsa", D, score="scaled_dot")
    torch.manual_seed(1)
    dot = create_attention("mhsa", D, score="dot")
    torch.manual_seed(1)
    general = create_attention("mhsa", D, score="general")
    out = scaled(x)
    assert (out - dot(x)).abs().max() > 0.05 * out.abs().max()
    assert (out - general(x)).abs().max() <= 1e-5 * out.abs().max()


def test_unknown_score_lists_valid_ones():
    with pytest.raises(ValueError, match="scaled_dot.*dot.*general.*additive"):
        create_attention("mhsa", D, score="cosine")


@pytest.mark.parametrize("hard,k", [("argmax", 1), (1, 1), (3, 3)])
def test_hard_attention_keeps_top_k_per_row_in_eval(hard, k):
    block = create_attention("mhsa", D, num_heads=4, hard=hard).eval()
    x = torch.randn(2, 9, D)
    q, k_, v = qkv_of(block, x)
    soft = torch.softmax(q @ k_.transpose(-2, -1) / math.sqrt(block.head_dim), dim=-1)
    out = block(x)
    with recording(block) as recs:
        out_tap = block(x)
    w = recs[0].weights
    assert ((w > 0).sum(-1) == k).all()
    assert torch.allclose(w.sum(-1), torch.ones(()), atol=1e-6)
    # the kept entries are the k largest soft weights, renormalised
    kept = torch.zeros_like(soft).scatter(-1, soft.topk(k, dim=-1).indices, 1.0).bool()
    assert torch.equal(w > 0, kept)
    renorm = soft * kept / (soft * kept).sum(-1, keepdim=True)
    assert (w - renorm).abs().max() <= 1e-6
    # those weights are what the block applied, with and without the tap
    ref = finish(block, w, v)
    assert (out_tap - ref).abs().max() <= 1e-5 and (out - ref).abs().max() <= 1e-5


def test_hard_attention_is_ignored_in_training():
    torch.manual_seed(3)
    soft = create_attention("mhsa", D, hard=None)
    torch.manual_seed(3)
    hard = create_attention("mhsa", D, hard="argmax")
    x = torch.randn(2, 9, D)
    assert (soft.train()(x) - hard.train()(x)).abs().max() <= 1e-6
    assert (soft.eval()(x) - hard.eval()(x)).abs().max() > 1e-3


@pytest.mark.parametrize("bad", [0, -1, True, "max", 2.0])
def test_bad_hard_option_is_rejected(bad):
    with pytest.raises(ValueError, match="hard"):
        create_attention("mhsa", D, hard=bad)
    block = create_attention("mhsa", D)
    with pytest.raises(ValueError, match="hard"):
        block.hard = bad  # also when set on a built block


def test_hard_can_be_switched_on_a_built_block():
    block = create_attention("lsa", D).eval()
    block.hard = 2
    with recording(block) as recs:
        block(torch.randn(2, 9, D))
    assert ((recs[0].weights > 0).sum(-1) == 2).all()
    assert (torch.diagonal(recs[0].weights, dim1=-2, dim2=-1) == 0).all()


# ---- lsa ------------------------------------------------------------------------------------------------
def test_lsa_masks_the_diagonal_and_learns_its_temperature():
    block = create_attention("lsa", D, num_heads=4)
    assert isinstance(block.temperature, torch.nn.Parameter) and block.temperature.requires_grad
    assert torch.allclose(block.temperature, torch.full((4,), math.sqrt(D // 4)))  # paper init: sqrt(d)
    x = torch.randn(2, 7, D)
    with recording(block) as recs:
        block(x)
    w = recs[0].weights
    assert (torch.diagonal(w, dim1=-2, dim2=-1) == 0).all()
    assert torch.allclose(w.sum(-1), torch.ones(()), atol=1e-6)

    block(x).square().sum().backward()  # the fused training path reaches the temperature
    assert block.temperature.grad is not None and block.temperature.grad.abs().sum() > 0


def test_lsa_equals_written_out_formula():
    block = create_attention("lsa", D, num_heads=4)
    with torch.no_grad():
        block.temperature.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))  # distinct per head
    x = torch.randn(2, 7, D)
    q, k, v = qkv_of(block, x)
    logits = q @ k.transpose(-2, -1) / block.temperature.view(1, -1, 1, 1)
    logits = logits.masked_fill(torch.eye(7, dtype=torch.bool), float("-inf"))
    attn = torch.softmax(logits, dim=-1)
    ref = finish(block, attn, v)
    assert (block(x) - ref).abs().max() <= 1e-5  # fused
    with recording(block) as recs:
        assert (block(x) - ref).abs().max() <= 1e-5  # explicit
    assert (recs[0].weights - attn).abs().max() <= 1e-6


def test_lsa_needs_two_tokens():
    with pytest.raises(ValueError, match="at least 2 tokens"):
        create_attention("lsa", D)(torch.randn(2, 1, D))


# ---- seqpool --------------------------------------------------------------------------------------------
def test_seqpool_is_a_softmax_weighted_sum():
    block = create_attention("seqpool", D, grid=(3, 3))
    x = torch.randn(2, 9, D)
    w = torch.softmax((x @ block.attention_pool.weight.T + block.attention_pool.bias).squeeze(-1), dim=1)
    ref = (w.unsqueeze(-1) * x).sum(1)
    with recording(block) as recs:
        out = block(x)
    assert out.shape == (2, D) and (out - ref).abs().max() <= 1e-5
    assert (recs[0].weights - w).abs().max() <= 1e-6
    assert recs[0].grid == (3, 3)


# ---- errors and masks -----------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [2.0, "2", True, 0, 3])
def test_num_heads_must_be_an_int_dividing_dim(bad):
    for name in ("mhsa", "lsa"):
        with pytest.raises(ValueError, match="num_heads"):
            create_attention(name, D, num_heads=bad)


@pytest.mark.parametrize("name", TOKEN_BLOCKS)
def test_wrong_rank_or_dim_is_one_line_naming_the_block(name):
    block = create_attention(name, D)
    cls = type(block).__name__
    for bad in (torch.randn(2, 5, D + 1), torch.randn(5, D), torch.randn(2, 3, 5, D)):
        with pytest.raises(ValueError) as e:
            block(bad)
        msg = str(e.value)
        assert "\n" not in msg and cls in msg and f"(B, N, {D})" in msg and str(tuple(bad.shape)) in msg


def _masks(n):
    g = torch.Generator().manual_seed(5)
    keep = torch.rand(2, 1, n, n, generator=g) > 0.4
    keep |= torch.eye(n, dtype=torch.bool)  # every row keeps its own token (so no row is empty)
    keep[..., 1] = True  # and token 1 (lsa masks the diagonal: its rows need another one)
    additive = torch.randn(1, 4, n, n, generator=g)  # per-head float bias, broadcast over the batch
    return {"bool": keep, "float": additive}


@pytest.mark.parametrize("kind", ["bool", "float", "causal"])
@pytest.mark.parametrize("score", ["scaled_dot", "general"])
def test_mhsa_attn_mask_equals_written_out_formula(kind, score):
    block = create_attention("mhsa", D, num_heads=4, score=score).eval()
    x = torch.randn(2, 7, D)
    q, k, v = qkv_of(block, x)
    logits = _score_reference(block, q, k)
    if kind == "causal":
        kwargs = {"is_causal": True}
        logits = logits.masked_fill(~torch.ones(7, 7, dtype=torch.bool).tril(), float("-inf"))
    else:
        mask = _masks(7)[kind]
        kwargs = {"attn_mask": mask}
        logits = logits.masked_fill(~mask, float("-inf")) if kind == "bool" else logits + mask
    attn = torch.softmax(logits, dim=-1)
    ref = finish(block, attn, v)
    assert (block(x, **kwargs) - ref).abs().max() <= 1e-5  # fused
    with recording(block) as recs:
        assert (block(x, **kwargs) - ref).abs().max() <= 1e-5  # explicit path, same mask semantics
    assert (recs[0].weights - attn).abs().max() <= 1e-6
    assert (block(x) - ref).abs().max() > 1e-4  # the mask mattered


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_lsa_combines_attn_mask_with_its_diagonal_mask(kind):
    block = create_attention("lsa", D, num_heads=4)
    x = torch.randn(2, 7, D)
    q, k, v = qkv_of(block, x)
    mask = _masks(7)[kind]
    logits = q @ k.transpose(-2, -1) / block.temperature.view(1, -1, 1, 1)
    logits = logits.masked_fill(~mask, float("-inf")) if kind == "bool" else logits + mask
    logits = logits.masked_fill(torch.eye(7, dtype=torch.bool), float("-inf"))
    ref = finish(block, torch.softmax(logits, dim=-1), v)
    assert (block(x, attn_mask=mask) - ref).abs().max() <= 1e-5
    with recording(block):
        assert (block(x, attn_mask=mask) - ref).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="is_causal"):
        block(x, is_causal=True)


def test_mask_and_causal_together_are_refused():
    block = create_attention("mhsa", D)
    with pytest.raises(ValueError, match="not both"):
        block(torch.randn(2, 5, D), attn_mask=torch.ones(5, 5, dtype=torch.bool), is_causal=True)


# ---- mhsa as a drop-in for timm's ViT Attention --------------------------------------------------------
def _timm_vit():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=4, num_classes=10)


def test_mhsa_swaps_into_a_timm_vit_and_loads_its_weights_strictly():
    from timm.layers import Attention

    model = _timm_vit().eval()
    with torch.no_grad():  # move the biases away from zero so every parameter matters
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    original = [b.attn for b in model.blocks]
    assert all(type(a) is Attention for a in original)
    x = torch.randn(2, 3, 32, 32)
    keep = torch.rand(2, 1, 65, 65) > 0.3
    keep |= torch.eye(65, dtype=torch.bool)
    with torch.no_grad():
        ref, ref_masked, ref_causal = model(x), model(x, attn_mask=keep), model(x, is_causal=True)

    for block, attn in zip(model.blocks, original):
        block.attn = create_attention("mhsa", attn.qkv.in_features, num_heads=attn.num_heads,
                                      qkv_bias=attn.qkv.bias is not None, proj_bias=attn.proj.bias is not None)
    for key in (k for k in state if k.startswith("blocks.0.attn.")):
        assert key in model.state_dict()  # the same names
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model(x, attn_mask=keep), ref_masked, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model(x, is_causal=True), ref_causal, rtol=1e-5, atol=1e-5)
    assert (ref_masked - ref).abs().max() > 1e-4  # the mask reached the attention
    # and back: visattn's weights load strictly into timm's module
    original[0].load_state_dict(model.blocks[0].attn.state_dict(), strict=True)


def test_mhsa_without_projection_bias_matches_timm():
    from timm.layers import Attention

    torch.manual_seed(0)
    ref = Attention(D, num_heads=4, qkv_bias=False, proj_bias=False).eval()
    ours = create_attention("mhsa", D, num_heads=4, qkv_bias=False, proj_bias=False).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(2, 9, D)
    mask = torch.randn(2, 4, 9, 9)
    torch.testing.assert_close(ours(x, mask), ref(x, mask), rtol=1e-5, atol=1e-6)
