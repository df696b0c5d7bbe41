"""``mhsa`` with ``pos_bias="local"``: a learned relative-position bias that starts every head as a local kernel
on the token grid, is part of the weights the tap records, and learns."""
from __future__ import annotations

import math

import pytest
import torch
from conftest import recording
from torch import nn

from visattn.attention import create_attention
from visattn.attention.token import SDPA_CPU_MODES, sdpa_cpu_mode
from visattn.models import create_model

D, HEADS, GRID = 32, 4, (5, 6)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def local_block(prefix: int = 0, **kw) -> nn.Module:
    return create_attention("mhsa", D, num_heads=HEADS, grid=GRID, num_prefix_tokens=prefix, pos_bias="local", **kw)


def test_heads_start_as_local_kernels_around_their_own_centres():
    block = local_block()
    with torch.no_grad():
        block.qkv.weight.zero_()  # no content: the weights are the bias's softmax alone
    n = GRID[0] * GRID[1]
    with recording(block) as recs:
        block(torch.randn(2, n, D))
    w = recs[0].weights  # (B, heads, N, N)
    query = 2 * GRID[1] + 3  # token (2, 3)
    for h, (cy, cx) in enumerate(block.pos_center.tolist()):
        row = w[0, h, query].view(GRID)
        # the four tokens around (2 + cy, 3 + cx) hold the most weight, equally (centres are half-way between)
        y0, x0 = 2 + math.floor(cy), 3 + math.floor(cx)
        near = row[y0:y0 + 2, x0:x0 + 2]
        assert torch.allclose(near, near.flatten()[0].expand_as(near))
        assert near.sum() > 0.6 and row.max() == near.max()
        assert torch.allclose(w[1, h, query], w[0, h, query])  # no content: the same for every image
    assert torch.allclose(w.sum(-1), torch.ones(()))


@pytest.mark.parametrize("prefix", [0, 1])
def test_recorded_weights_are_the_applied_ones_and_prefix_tokens_get_no_bias(prefix):
    block = local_block(prefix).eval()
    x = torch.randn(3, prefix + GRID[0] * GRID[1], D)
    fused = block(x)
    with recording(block) as recs:
        explicit = block(x)
    torch.testing.assert_close(explicit, fused, atol=1e-5, rtol=1e-5)
    bias = block.position_bias()
    assert bias.shape == (HEADS, x.shape[1], x.shape[1])
    if prefix:
        assert bias[:, 0].abs().sum() == 0 and bias[:, :, 0].abs().sum() == 0
    q, k, _ = block.qkv(x).reshape(3, x.shape[1], 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
    expected = ((q @ k.transpose(-2, -1)) * (D // HEADS) ** -0.5 + bias).softmax(-1)
    torch.testing.assert_close(recs[0].weights, expected, atol=1e-5, rtol=1e-5)


def test_bool_mask_and_bf16_autocast():
    block = local_block().eval()
    n = GRID[0] * GRID[1]
    x = torch.randn(2, n, D)
    keep = torch.ones(n, n, dtype=torch.bool)
    keep[:, 0] = False
    with recording(block) as recs:
        block(x, attn_mask=keep)
    assert recs[0].weights[..., 0].abs().max() == 0
    per_image = keep.expand(2, 1, n, n).clone()  # (B, 1, N, N): broadcast over the heads
    per_image[1, 0, :, 1] = False
    with recording(block) as recs:
        fused = block(x, attn_mask=per_image)
    assert recs[0].weights[..., 0].abs().max() == 0 and recs[0].weights[1, :, :, 1].abs().max() == 0
    torch.testing.assert_close(fused, block(x, attn_mask=per_image), atol=1e-5, rtol=1e-5)
    for mode in SDPA_CPU_MODES:  # every CPU kernel of the fast path takes the float bias under bf16 autocast
        with sdpa_cpu_mode(mode), torch.autocast("cpu", dtype=torch.bfloat16):
            low = block(x)
        torch.testing.assert_close(low.float(), block(x), atol=0.05, rtol=0.05)


def test_bias_learns_in_a_model_and_is_not_decayed():
    model = create_model("cct_2", depth=2, attn_kwargs={"pos_bias": "local"})
    model(torch.randn(2, 3, 32, 32)).logsumexp(-1).sum().backward()
    for block in model.blocks:
        assert block.attn.pos_center.grad.abs().sum() > 0 and block.attn.pos_log_strength.grad.abs().sum() > 0
    assert {"blocks.0.attn.pos_center", "blocks.1.attn.pos_center"} <= model.no_weight_decay()
    plain = create_attention("mhsa", D, num_heads=HEADS, grid=GRID)
    assert not any("pos_" in k for k in plain.state_dict())  # off by default: old checkpoints load


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="unknown pos_bias"):
        create_attention("mhsa", D, num_heads=HEADS, grid=GRID, pos_bias="global")
    with pytest.raises(ValueError, match="needs the token grid"):
        create_attention("mhsa", D, num_heads=HEADS, pos_bias="local")
    with pytest.raises(ValueError, match="tokens"):
        local_block()(torch.randn(1, 7, D))
    with pytest.raises(ValueError, match="is_causal"):
        local_block()(torch.randn(1, 30, D), is_causal=True)


def test_nine_heads_start_on_a_three_by_three_convolutions_taps():
    block = create_attention("mhsa", 36, num_heads=9, grid=GRID, pos_bias="local")
    taps = sorted(tuple(c) for c in block.pos_center.tolist())
    assert taps == [(dy, dx) for dy in (-1.0, 0.0, 1.0) for dx in (-1.0, 0.0, 1.0)]
