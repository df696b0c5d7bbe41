"""Reference tests of the catalogue's token mechanisms (issue 90, item 2): each block against timm's module
with the same weights (float64, outputs, input and parameter gradients to 1e-10 relative), on its fused and
its recording path, and the recorded maps against the written-out weights. Also the double-backward
references that tests/test_compose.py takes from here (``TOKEN_REFERENCES``)."""
from __future__ import annotations

import math
from functools import partial

import block_helpers
import pytest
import torch
from block_helpers import close
from conftest import recording
from torch import nn

from visattn.attention import create_attention
from visattn.attention.token import GATES

timm = pytest.importorskip("timm")
from timm.layers import Attention as TimmAttention  # noqa: E402
from timm.layers.attention_pool import AttentionPoolLatent as TimmAttentionPoolLatent  # noqa: E402
from timm.models.cait import ClassAttn, TalkingHeadAttn  # noqa: E402
from timm.models.swin_transformer import SwinTransformerBlock  # noqa: E402
from timm.models.xcit import XCA  # noqa: E402

D, HEADS = 32, 4


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


randomize_ = partial(block_helpers.randomize_, seed=3, spread=0.3)  # this file's weights: seed 3, spread 0.3


def no_fused(ref: nn.Module) -> nn.Module:
    for m in ref.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = False  # timm's explicit path: the written-out formula
    return ref


def assert_same_function(ours, ref, x, ours_out=lambda y: y, ref_out=lambda y: y):
    """Outputs, the input's and every parameter's gradient (parameters paired by order) agree in float64."""
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours_out(ours(xa)), ref_out(ref(xb))
    close(ya, yb, "output")
    g = torch.randn_like(yb)
    (ya * g).sum().backward()
    (yb * g).sum().backward()
    close(xa.grad, xb.grad, "input grad")
    pa, pb = list(ours.named_parameters()), list(ref.parameters())
    assert len(pa) == len(pb)
    for (name, p), q in zip(pa, pb):
        assert p.grad is not None and p.grad.abs().max() > 0, name
        close(p.grad, q.grad, f"grad of {name}")
    return ya.detach()


def pair(name: str, make_ref, **kwargs):
    """Our block with random weights and timm's with the same state dict (strict: the same names), float64."""
    ours = randomize_(create_attention(name, D, **kwargs)).double()
    ref = no_fused(make_ref()).double()
    ref.load_state_dict(ours.state_dict(), strict=True)
    return ours, ref


def both_paths(ours, ref, x, **kw):
    """The fused path, then the recording path, each equal to timm's; returns the records."""
    y = assert_same_function(ours, ref, x, **kw)
    ours.zero_grad(), ref.zero_grad()
    with recording(ours) as recs:
        y_tap = assert_same_function(ours, ref, x, **kw)
    close(y_tap, y, "recording changed the output")
    return recs


# ---- talking heads ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("train", [False, True])
def test_talking_heads_equals_timm(train):
    ours, ref = pair("talking_heads", lambda: TalkingHeadAttn(D, num_heads=HEADS, qkv_bias=True), num_heads=HEADS)
    ours.train(train), ref.train(train)
    x = torch.randn(3, 10, D, dtype=torch.float64)
    recs = both_paths(ours, ref, x)
    # the record is the softmax between the two head mixes (eq.: P = softmax(L P_l), then P P_w), rows sum to 1
    q, k, _ = ours.qkv(x).chunk(3, -1)
    q, k = (t.unflatten(-1, (HEADS, D // HEADS)).transpose(1, 2) for t in (q, k))
    logits = torch.einsum("bhnm,hg->bgnm", q @ k.transpose(-2, -1) / math.sqrt(D // HEADS), ours.proj_l.weight.T)
    want = (logits + ours.proj_l.bias.view(1, -1, 1, 1)).softmax(-1)
    close(recs[0].weights.double(), want, "recorded talking-heads weights", tol=1e-6)


def test_talking_heads_mixes_heads():
    """With ``proj_l`` and ``proj_w`` the identity (zero bias) it is plain multi-head attention (mhsa)."""
    th = create_attention("talking_heads", D, num_heads=HEADS)
    mh = create_attention("mhsa", D, num_heads=HEADS)
    with torch.no_grad():
        for lin in (th.proj_l, th.proj_w):
            lin.weight.copy_(torch.eye(HEADS))
            lin.bias.zero_()
    mh.load_state_dict({k: v for k, v in th.state_dict().items() if k.startswith(("qkv", "proj."))}, strict=True)
    x = 5 * torch.randn(2, 9, D)
    torch.testing.assert_close(th(x), mh(x), rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        th.proj_w.weight.copy_(torch.randn(HEADS, HEADS))
    assert (th(x) - mh(x)).abs().max() > 1e-3


# ---- class attention -------------------------------------------------------------------------------------
@pytest.mark.parametrize("train", [False, True])
def test_class_attn_equals_timm_and_leaves_the_patches(train):
    ours, ref = pair("class_attn", lambda: ClassAttn(D, num_heads=HEADS, qkv_bias=True), num_heads=HEADS,
                     grid=(3, 3), num_prefix_tokens=1)
    ours.train(train), ref.train(train)
    x = torch.randn(3, 10, D, dtype=torch.float64)
    recs = both_paths(ours, ref, x, ours_out=lambda y: y[:, :1])
    out = ours(x)
    assert (out[:, 1:] == 0).all()  # the patch rows: x + block(norm(x)) passes them through
    w = recs[0].weights
    assert w.shape == (3, HEADS, 1, 10) and recs[0].grid == (3, 3) and recs[0].num_prefix_tokens == 1
    q = ours.q(x[:, :1]).unflatten(-1, (HEADS, -1)).transpose(1, 2)
    k = ours.k(x).unflatten(-1, (HEADS, -1)).transpose(1, 2)
    close(w.double(), (q @ k.transpose(-2, -1) / math.sqrt(D // HEADS)).softmax(-1), "class weights", tol=1e-6)


# ---- XCA -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("train", [False, True])
def test_xca_equals_timm(train):
    ours, ref = pair("xca", lambda: XCA(D, num_heads=HEADS, qkv_bias=True), num_heads=HEADS, grid=(3, 3))
    ours.train(train), ref.train(train)
    x = torch.randn(3, 9, D, dtype=torch.float64)
    recs = both_paths(ours, ref, x)
    r = recs[0]
    assert r.kind == "covariance" and r.weights.shape == (3, HEADS, D // HEADS, D // HEADS) and r.grid == (3, 3)
    # eq. 4: softmax(tau * Q_hat^T K_hat) over the d channels, Q, K l2-normalised along the tokens
    q, k, _ = ours.qkv(x).chunk(3, -1)
    q, k = (t.unflatten(-1, (HEADS, -1)).permute(0, 2, 3, 1) for t in (q, k))  # (B, h, d, N)
    q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    want = (ours.temperature * q @ k.transpose(-2, -1)).softmax(-1)
    close(r.weights.double(), want, "covariance weights", tol=1e-6)


def test_xca_handles_one_token_and_large_inputs_in_fp16():
    block = create_attention("xca", D).eval()
    assert torch.isfinite(block(torch.randn(1, 1, D))).all()
    with torch.autocast("cpu", dtype=torch.float16):
        assert torch.isfinite(block(1e4 * torch.randn(2, 9, D))).all()


# ---- window attention ------------------------------------------------------------------------------------
WINDOWS = [((8, 8), 4, 0), ((8, 8), 4, 2), ((6, 9), 3, 1), ((4, 6), (2, 3), (1, 1)), ((3, 5), 7, 3)]


class SwinAttn(nn.Module):
    """timm's SwinTransformerBlock attention part (roll, partition, WindowAttention with the SW-MSA mask,
    reverse, roll back) on ``(B, N, C)`` tokens of ``grid``, with ``ours``' weights: copied (``share=False``,
    its own parameters in our order) or shared. Where timm shrinks the window to a smaller grid, its table is
    ours at the offsets that window uses."""

    def __init__(self, ours, grid, window, shift, share=False):
        super().__init__()
        self.grid = grid
        swin = no_fused(SwinTransformerBlock(ours.dim, input_resolution=grid, num_heads=ours.num_heads,
                                             window_size=window, shift_size=shift)).double()
        (wh, ww), (sh, sw) = ours.window_size, swin.window_size
        dy = torch.arange(2 * sh - 1) - (sh - 1) + (wh - 1)
        dx = torch.arange(2 * sw - 1) - (sw - 1) + (ww - 1)
        self.register_buffer("idx", (dy[:, None] * (2 * ww - 1) + dx[None, :]).flatten(), persistent=False)
        assert swin.attn.relative_position_bias_table.shape[0] == self.idx.numel()
        del swin.attn.relative_position_bias_table  # set from ours on each call
        copy = (lambda t: t) if share else (lambda t: nn.Parameter(t.detach().clone()))
        self.relative_position_bias_table = copy(ours.relative_position_bias_table)
        if share:
            swin.attn.qkv, swin.attn.proj = ours.qkv, ours.proj
        else:
            swin.attn.qkv.load_state_dict(ours.qkv.state_dict())
            swin.attn.proj.load_state_dict(ours.proj.state_dict())
        object.__setattr__(self, "swin", swin)  # not a submodule: only its attention's parameters count
        self.attn = swin.attn  # parameters: table, qkv, proj (our order)

    def forward(self, x):
        self.swin.attn.relative_position_bias_table = self.relative_position_bias_table[self.idx]
        b, n, c = x.shape
        return self.swin._attn(x.reshape(b, *self.grid, c)).reshape(b, n, c)


@pytest.mark.parametrize("grid,window,shift", WINDOWS)
def test_window_equals_timm_swin_block_attention(grid, window, shift):
    """(3, 5) with window 7: timm shrinks the window to the grid and drops the shift, as ours does."""
    ours = randomize_(create_attention("window", D, num_heads=HEADS, window_size=window, shift_size=shift,
                                       grid=grid)).double()
    ref = SwinAttn(ours, grid, window, shift)
    if grid == (8, 8):
        fresh = SwinTransformerBlock(D, input_resolution=grid, num_heads=HEADS, window_size=window, shift_size=shift)
        fresh.attn.load_state_dict(ours.state_dict(), strict=True)  # the same names where the table is not shrunk
    if shift and min(grid) > max(ours.window_size):
        assert ref.swin.attn_mask is not None  # the shifted-window mask is part of what is compared
    both_paths(ours, ref, torch.randn(2, grid[0] * grid[1], D, dtype=torch.float64))


def test_window_map_is_each_tokens_window_on_the_grid():
    """Shift 1 on a 4x4 grid with windows of 2: windows cut at rows/columns 1 and 3 (the shift undone), so
    token (0, 0) sees only itself, (1, 1) sees (1..2, 1..2), (3, 3) sees (3, 3) only."""
    block = create_attention("window", D, num_heads=HEADS, window_size=2, shift_size=1, grid=(4, 4)).eval()
    with recording(block) as recs:
        block(torch.randn(2, 16, D))
    w = recs[0].weights  # (B, h, 16, 16)
    assert w.shape == (2, HEADS, 16, 16) and recs[0].grid == (4, 4)
    support = (w > 0).all(dim=(0, 1))

    def cells(i):
        return {(j // 4, j % 4) for j in range(16) if support[i, j]}

    assert cells(0) == {(0, 0)}
    assert cells(1 * 4 + 1) == {(1, 1), (1, 2), (2, 1), (2, 2)}
    assert cells(3 * 4 + 3) == {(3, 3)}
    assert cells(0 * 4 + 2) == {(0, 1), (0, 2)}
    torch.testing.assert_close(w.sum(-1), torch.ones(2, HEADS, 16))


def test_window_partial_windows_and_prefix_tokens():
    """A 5x5 grid with windows of 2 (not divisible): the last windows are partial and attend to real tokens
    only; a class token attends to every token and no grid token attends to it."""
    block = create_attention("window", D, num_heads=HEADS, window_size=2, grid=(5, 5), num_prefix_tokens=1).eval()
    x = torch.randn(2, 26, D)
    with recording(block) as recs:
        out = block(x)
    torch.testing.assert_close(out, block(x), rtol=1e-5, atol=1e-6)
    w = recs[0].weights
    assert (w[:, :, 0] > 0).all() and (w[:, :, 1:, 0] == 0).all()
    last = 1 + 4 * 5 + 4  # grid token (4, 4): a 1x1 window
    assert (w[:, :, last, last] == 1).all()


@pytest.mark.parametrize("bad", [dict(window_size=0), dict(window_size=4, shift_size=4), dict(shift_size=-1),
                                 dict(window_size=(2, 2, 2)), dict(window_size=True)])
def test_window_bad_options_are_one_line(bad):
    with pytest.raises(ValueError, match="window_size|shift_size") as e:
        create_attention("window", D, **bad)
    assert "\n" not in str(e.value)


# ---- attention pooling -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [dict(), dict(qk_norm=True, latent_len=2, pool="avg", mlp_ratio=2.0)])
def test_attn_pool_equals_timm(kw):
    tkw = {"pool_type": kw.get("pool", "token"), **{k: v for k, v in kw.items() if k != "pool"}}
    ours, ref = pair("attn_pool", lambda: TimmAttentionPoolLatent(D, num_heads=HEADS, norm_layer=nn.LayerNorm, **tkw),
                     num_heads=HEADS, grid=(3, 3), **kw)
    x = torch.randn(3, 9, D, dtype=torch.float64)
    recs = both_paths(ours, ref, x)
    r = recs[0]
    assert r.kind == "pool" and r.weights.shape == (3, 9) and r.grid == (3, 3)
    # the record: the latents' per-head softmax weights over the tokens, averaged
    q = ours.q_norm(ours.q(ours.latent).unflatten(-1, (HEADS, -1)).transpose(1, 2))
    k = ours.k_norm(ours.kv(x).chunk(2, -1)[0].unflatten(-1, (HEADS, -1)).transpose(1, 2))
    want = (q @ k.transpose(-2, -1) / math.sqrt(D // HEADS)).softmax(-1).mean(dim=(1, 2))
    close(r.weights.double(), want, "pool weights", tol=1e-6)


def test_attn_pool_without_norm_equals_timm_default():
    ours, ref = pair("attn_pool", lambda: TimmAttentionPoolLatent(D, num_heads=HEADS), num_heads=HEADS, norm=False)
    assert_same_function(ours, ref, torch.randn(2, 7, D, dtype=torch.float64))


@pytest.mark.parametrize("bad", [dict(pool="max"), dict(latent_len=0), dict(mlp_ratio=0), dict(qk_norm=1)])
def test_attn_pool_bad_options(bad):
    with pytest.raises(ValueError):
        create_attention("attn_pool", D, **bad)


# ---- mhsa options ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("train", [False, True])
def test_mhsa_qk_norm_equals_timm(train):
    ours, ref = pair("mhsa", lambda: TimmAttention(D, num_heads=HEADS, qkv_bias=True, qk_norm=True, norm_layer=nn.LayerNorm),
                     num_heads=HEADS, qk_norm=True, grid=(3, 3))
    ours.train(train), ref.train(train)
    x = torch.randn(3, 9, D, dtype=torch.float64)
    both_paths(ours, ref, x)
    ours.fast_path = False  # the baseline split path too
    assert_same_function(ours, ref, x)


def test_mhsa_qk_norm_under_autocast_and_fp16_cast():
    block = create_attention("mhsa", D, qk_norm=True)
    x = torch.randn(2, 9, D)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = block(x)
        with recording(block) as recs:
            y_tap = block(x)
    assert torch.isfinite(y).all() and torch.isfinite(y_tap).all() and recs
    assert (y.float() - y_tap.float()).abs().max() < 0.05
    assert torch.isfinite(block.half()(x.half())).all()


@pytest.mark.parametrize("gate", [g for g in GATES if g != "none"])
def test_mhsa_gate_equals_written_out_formula(gate):
    """Qiu et al. 2025 (G1): ``Y' = Y * sigmoid(X W_g)``, after SDPA, before the output projection; one gate per
    head broadcast over its channels (``"head"``) or one per channel (``"element"``)."""
    block = randomize_(create_attention("mhsa", D, num_heads=HEADS, gate=gate)).double()
    x = torch.randn(2, 9, D, dtype=torch.float64)
    q, k, v = (t.unflatten(-1, (HEADS, -1)).transpose(1, 2) for t in block.qkv(x).chunk(3, -1))
    y = ((q @ k.transpose(-2, -1) / math.sqrt(D // HEADS)).softmax(-1) @ v).transpose(1, 2)  # (B, N, h, d)
    g = torch.sigmoid(x @ block.gate_proj.weight.T + block.gate_proj.bias)
    y = y * g.unsqueeze(-1) if gate == "head" else y * g.unflatten(-1, (HEADS, -1))
    want = block.proj(y.flatten(-2))
    close(block(x), want, "gated output")
    with recording(block):
        close(block(x), want, "gated output, recording")
    ungated = create_attention("mhsa", D, num_heads=HEADS).double()
    ungated.load_state_dict({k: v for k, v in block.state_dict().items() if not k.startswith("gate_proj")})
    assert (ungated(x) - want).abs().max() > 1e-3
    assert block.gate_proj.out_features == (HEADS if gate == "head" else D)


@pytest.mark.parametrize("bad", [dict(qk_norm=1), dict(qk_norm="yes"), dict(gate="channel"), dict(gate=True)])
def test_mhsa_bad_options_are_one_line(bad):
    with pytest.raises(ValueError, match="qk_norm|gate") as e:
        create_attention("mhsa", D, **bad)
    assert "\n" not in str(e.value)


# ---- in a ViT ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("attn,kw", [("talking_heads", {}), ("window", {"window_size": 4, "shift_size": 2}),
                                     ("mhsa", {"qk_norm": True, "gate": "head"})])
def test_drop_in_blocks_build_a_vit_and_record(attn, kw):
    from visattn import create_model
    from visattn.maps import record_attention

    model = create_model("vit_tiny", num_classes=10, depth=2, attn=attn, attn_kwargs=kw).eval()
    x = torch.randn(2, 3, 32, 32)
    with record_attention(model) as rec:
        y = model(x)
    assert y.shape == (2, 10) and torch.isfinite(y).all()
    assert len(rec) == 2 and all(r.kind == "token" and r.grid == model.grid_size for r in rec)


# ---- double-backward references for tests/test_compose.py (its D=16, two heads for mhsa/lsa, else defaults) --
def _by_state(make):
    def reference(block):
        ref = no_fused(make(block)).double().train()
        ref.load_state_dict(block.state_dict(), strict=True)
        return ref, list(ref.parameters())

    return reference


def _class_attn_ref(block):
    ref = no_fused(ClassAttn(block.dim, num_heads=block.num_heads, qkv_bias=True)).double().train()
    ref.load_state_dict(block.state_dict(), strict=True)

    def forward(x):
        cls = ref(x)
        return torch.cat([cls, cls.new_zeros(x.shape[0], x.shape[1] - 1, x.shape[2])], dim=1)

    return forward, list(ref.parameters())


def _window_ref(block):
    """Without a grid the tokens are one row: timm's block on a (1, N) grid, its window shrunk to (1, N)."""
    refs = {}

    def forward(x):
        n = x.shape[1]
        if n not in refs:
            refs[n] = SwinAttn(block, (1, n), block.window_size, block.shift_size, share=True)
        return refs[n](x)

    return forward, list(block.parameters())


TOKEN_REFERENCES = {
    "talking_heads": _by_state(lambda b: TalkingHeadAttn(b.dim, num_heads=b.num_heads, qkv_bias=True)),
    "class_attn": _class_attn_ref,
    "xca": _by_state(lambda b: XCA(b.dim, num_heads=b.num_heads, qkv_bias=True)),
    "attn_pool": _by_state(lambda b: TimmAttentionPoolLatent(b.dim, num_heads=b.num_heads, norm_layer=nn.LayerNorm)),
    "window": _window_ref,
}


# ---- options beyond the defaults the generic contract tests build ------------------------------------------
OPTION_VARIANTS = [
    ("window", dict(window_size=2, shift_size=1, grid=(4, 4))),
    ("window", dict(window_size=(2, 3), shift_size=(1, 1), grid=(2, 3), num_prefix_tokens=1)),
    ("mhsa", dict(qk_norm=True, gate="head")),
    ("mhsa", dict(gate="element")),
    ("attn_pool", dict(qk_norm=True, latent_len=2, pool="avg")),
]
VARIANT_IDS = ["-".join([n, *map(str, kw.values())]) for n, kw in OPTION_VARIANTS]
# compile, export and ONNX are the costly checks: the fast tier runs them on the windows with a prefix token and
# uneven sizes and on mhsa with qk_norm and a head gate (the other paths: slow)
FAST_VARIANTS = {"window-(2, 3)-(1, 1)-(2, 3)-1", "mhsa-True-head"}
VARIANTS = [pytest.param(name, kw, id=i, marks=() if i in FAST_VARIANTS else pytest.mark.slow)
            for (name, kw), i in zip(OPTION_VARIANTS, VARIANT_IDS)]


def _variant(name, kw, seed=0):
    torch.manual_seed(seed)
    block = randomize_(create_attention(name, 16, num_heads=2, **kw))
    grid = kw.get("grid")
    n = grid[0] * grid[1] + kw.get("num_prefix_tokens", 0) if grid else 6
    return block, n


@pytest.mark.parametrize("name,kw", VARIANTS)
def test_option_variants_compile_export_and_double_backward(name, kw):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch._dynamo.reset()
    block, n = _variant(name, kw)
    x = torch.randn(2, n, 16)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = compiled(xa), block(xb)
    torch.testing.assert_close(ya, yb, rtol=1e-5, atol=1e-5)
    ya.square().sum().backward()
    yb.square().sum().backward()
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
    program = torch.export.export(block.eval(), (x,))
    x2 = torch.randn(2, n, 16)
    torch.testing.assert_close(program.module()(x2), block(x2), rtol=1e-5, atol=1e-5)
    # double backward (a gradient penalty) exists and agrees with finite differences in float64
    block = block.double()
    xd = torch.randn(1, n, 16, dtype=torch.float64, requires_grad=True)
    with sdpa_kernel(SDPBackend.MATH):
        assert torch.autograd.gradgradcheck(lambda t: block(t), (xd,), atol=1e-6, rtol=1e-5)


@pytest.mark.skipif(any(__import__("importlib").util.find_spec(m) is None for m in ("onnx", "onnxruntime", "onnxscript")),
                    reason="onnx, onnxruntime and onnxscript not installed")
@pytest.mark.parametrize("name,kw", VARIANTS)
def test_option_variants_onnx(name, kw, tmp_path):
    import warnings

    import onnxruntime as ort

    block, n = _variant(name, kw)
    block.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(block, (torch.randn(2, n, 16),), dynamo=True, verbose=False)
    program.save(str(tmp_path / "m.onnx"))
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    x = torch.randn(2, n, 16)
    (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(out), block(x), rtol=1e-4, atol=1e-5)
