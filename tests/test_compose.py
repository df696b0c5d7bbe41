"""Every registered block composes with PyTorch's program transforms.

One test per capability, parametrised over ``list_attention()``: ``torch.compile(fullgraph=True)`` (forward
and backward, AOTAutograd; Inductor in a slow test), ``torch.export.export``, ONNX export with the default
dynamo exporter checked by onnxruntime, ``torch.jit.trace`` with gradients enabled, double backward (a
gradient penalty) against an explicit-ops reference (timm's block where timm has one) in float64, and
``torch.func.vmap(torch.func.grad(...))`` per-sample gradients against a loop. Then whole models:
``torch._dynamo.explain`` finds no graph break in torchvision / timm ResNet-18 with each feature-map block
inserted, visattn's ``resnet_fast`` with each block, ``vit_tiny`` and ``cct_2``.

SDPA-based blocks (``nonlocal``, ``mhsa2d``, ``mhsa``, ``lsa``) run their double backward under
``sdpa_kernel(SDPBackend.MATH)``: the fused kernels have no double backward.

The README's compatibility matrix is this file's result: each cell is one test id here.

Tiers: compile, export, ONNX and ``resnet_fast``'s graph breaks are the costly checks; the fast tier runs them on
``conftest.REPRESENTATIVE_BLOCKS`` (one block per code path), the whole suite on every block. The others run on
every block in both.
"""
from __future__ import annotations

import copy
import importlib.util
import math
import warnings

import pytest
import timm
import torch
import torch.nn.functional as F
import torchvision
from block_helpers import load_by_order, randomize_
from conftest import REPRESENTATIVE_BLOCKS, tiered
from test_catalogue_tokens import TOKEN_REFERENCES  # talking_heads, class_attn, xca, attn_pool, window
from timm.layers import Attention as TimmAttention
from timm.layers import EcaModule, NonLocalAttn, SEModule
from timm.layers import GlobalContext as TimmGlobalContext
from timm.layers.cbam import CbamModule, SpatialAttn
from timm.layers.coord_attn import CoordAttn, StripAttn
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

import visattn
from visattn.attention import attention_info, create_attention, list_attention
from visattn.attention.spatial import coord_mip

BLOCKS = list_attention()
FEATURE = list_attention("feature")
C, D, HEADS = 16, 16, 2  # feature-map channels; token dim and heads
SDPA_BLOCKS = {"nonlocal", "mhsa2d", "mhsa", "lsa"}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # jit.trace / TracerWarning / ONNX exporter chatter
        yield
    torch._dynamo.reset()


def is_token(name: str) -> bool:
    return attention_info(name)["layout"] == "token"


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    kwargs = {"num_heads": HEADS} if name in ("mhsa", "lsa") else {}
    return randomize_(create_attention(name, D if is_token(name) else C, **kwargs), seed, spread=0.3)


def sample(name: str, seed: int = 1, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (2, 6, D) if is_token(name) else (2, C, 5, 4)
    return torch.randn(shape, generator=g, dtype=dtype)


def grads_of(module: nn.Module, x: torch.Tensor, w: torch.Tensor):
    """Output and grads of ``sum(module(x) * w)`` for ``x`` and every parameter."""
    x = x.clone().requires_grad_()
    y = module(x)
    params = list(module.parameters())
    gs = torch.autograd.grad((y * w).sum(), [x, *params], allow_unused=True)
    return y.detach(), [torch.zeros_like(t) if g is None else g for g, t in zip(gs, [x, *params])]


def assert_all_close(got, want, rtol=1e-5, atol=1e-5):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b.reshape(a.shape), rtol=rtol, atol=atol, msg=lambda m: f"tensor {i}: {m}")


def test_the_representative_blocks_are_registered_and_cover_every_kind_and_layout():
    """The fast tier's costly checks run on conftest's representatives: each must be a block (a renamed one would
    send every case to the slow tier), and together they hold each layout and each kind of tap."""
    assert set(REPRESENTATIVE_BLOCKS) <= set(BLOCKS)
    info = [attention_info(n) for n in REPRESENTATIVE_BLOCKS]
    for key in ("layout", "kind"):
        assert {i[key] for i in info} == {attention_info(n)[key] for n in BLOCKS}, key


# ---- compile -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", tiered(BLOCKS))
def test_compile_fullgraph(name):
    """``fullgraph=True`` raises on any graph break; AOTAutograd also traces the backward."""
    block = build(name).train()
    ref = copy.deepcopy(block)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    x = sample(name)
    w = torch.randn_like(ref(x))
    y, g = grads_of(compiled, x, w)
    y_ref, g_ref = grads_of(ref, x, w)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    assert_all_close(g, g_ref)


# a training-mode BatchNorm over pooled (B=2) vectors is ~ d / sqrt(d^2 + eps): its gradient amplifies rounding
# (sk's fp32 input gradient is 1e-3 off its fp64 one, whatever the compiler); these compare in eval mode
POOLED_BN = {"sk", "srm"}  # srm: its cfc gradient 8e-4 off in train mode (5e-5 of its largest)


@pytest.mark.slow
@pytest.mark.parametrize("name", BLOCKS)
def test_compile_inductor(name):
    """The default backend (Inductor, C++ codegen on CPU): same forward and backward as eager."""
    block = build(name).train(name not in POOLED_BN)
    ref = copy.deepcopy(block)
    compiled = torch.compile(block, fullgraph=True)
    x = sample(name)
    w = torch.randn_like(ref(x))
    y, g = grads_of(compiled, x, w)
    y_ref, g_ref = grads_of(ref, x, w)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
    assert_all_close(g, g_ref, rtol=1e-4, atol=1e-4)


# ---- export and ONNX -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", tiered(BLOCKS))
def test_torch_export(name):
    block = build(name).eval()
    program = torch.export.export(block, (sample(name),))
    x = sample(name, seed=2)  # not the example input
    torch.testing.assert_close(program.module()(x), block(x), rtol=1e-5, atol=1e-5)


def _onnx_available() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("onnx", "onnxruntime", "onnxscript"))


@pytest.mark.skipif(not _onnx_available(), reason="onnx, onnxruntime and onnxscript wheels not installed")
@pytest.mark.parametrize("name", tiered(BLOCKS))
def test_onnx_export_runs_in_onnxruntime(name, tmp_path):
    import onnxruntime as ort

    block = build(name).eval()
    path = tmp_path / f"{name}.onnx"
    program = torch.onnx.export(block, (sample(name),), dynamo=True, verbose=False)
    program.save(str(path))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = sample(name, seed=2)
    (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(out), block(x), rtol=1e-4, atol=1e-5)


# ---- jit.trace -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", BLOCKS)
def test_jit_trace_with_grad(name):
    """Traced in training mode with gradients on (earlier hand-written autograd Functions failed here with
    ``unordered_map::at``; CBAM's ``mean_max`` must not); the trace then runs forward and backward on another input."""
    block = build(name).train()
    ref = copy.deepcopy(block)
    x0 = sample(name).requires_grad_()
    traced = torch.jit.trace(block, (x0,), check_trace=False)
    x = sample(name, seed=2)
    w = torch.randn_like(ref(x))
    y, g = grads_of(traced, x, w)
    y_ref, g_ref = grads_of(ref, x, w)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    assert_all_close(g, g_ref)


# ---- double backward against explicit ops ----------------------------------------------------------------------


def _timm_by_order(make):
    def reference(block):
        ref = make(block).double()
        for m in ref.modules():  # GCNet's code uses nn.LayerNorm's eps; timm's LayerNorm2d defaults to 1e-6
            if isinstance(m, nn.LayerNorm):
                m.eps = 1e-5
        load_by_order(ref, block)
        return ref.train(), list(ref.parameters())

    return reference


def _timm_nonlocal(block):
    """timm's NonLocalAttn with separate theta/phi/g convs; visattn stacks them in one ``qkv``."""
    inter = block.inter_channels
    ref = NonLocalAttn(C, rd_channels=inter).double().train()
    ref.scale = block.scale  # timm scales by C**-0.5, the paper's code (and visattn) by inter**-0.5
    with torch.no_grad():
        for i, conv in enumerate((ref.t, ref.p, ref.g)):
            conv.weight.copy_(block.qkv.weight[i * inter : (i + 1) * inter].view(inter, C, 1, 1))
            conv.bias.copy_(block.qkv.bias[i * inter : (i + 1) * inter])
        ref.z.load_state_dict(block.proj.state_dict())
        ref.norm.load_state_dict(block.norm.state_dict())
    # gradients in visattn's parameter order
    stacked = lambda which: [getattr(ref.t, which), getattr(ref.p, which), getattr(ref.g, which)]  # noqa: E731

    class Aligned(list):
        pass

    params = Aligned([*stacked("weight"), *stacked("bias"), ref.z.weight, ref.z.bias, ref.norm.weight, ref.norm.bias])
    params.align = lambda g: [torch.cat(g[0:3]).flatten(1), torch.cat(g[3:6]), *g[6:]]
    return ref, params


def _timm_attention(block):
    ref = TimmAttention(D, num_heads=HEADS, qkv_bias=True).double().train()
    ref.fused_attn = False  # timm's explicit q k^T softmax path
    ref.load_state_dict(block.state_dict(), strict=True)  # the same names: mhsa is a drop-in
    return ref, list(ref.parameters())


def _batch_norm(norm: nn.BatchNorm2d, y: torch.Tensor) -> torch.Tensor:
    return F.batch_norm(y, None, None, norm.weight, norm.bias, training=True, eps=norm.eps)


def _explicit_mhsa2d(block):
    """BoTNet attention written per token pair: logits ``scale * (q_i k_j + q_i (R_h[dh] + R_w[dw]))``."""
    n, d = block.num_heads, block.head_dim
    M = (block.rel_h.shape[0] + 1) // 2

    def forward(x):
        B, _, H, W = x.shape
        N = H * W
        t = x.flatten(2).transpose(1, 2)  # (B, N, C)
        q, k, v = (t @ block.qkv.weight.T).view(B, N, 3, n, d).permute(2, 0, 3, 1, 4)
        rows = torch.arange(H).repeat_interleave(W)
        cols = torch.arange(W).repeat(H)
        rel = block.rel_h[rows[None, :] - rows[:, None] + M - 1] + block.rel_w[cols[None, :] - cols[:, None] + M - 1]
        logits = block.scale * (q @ k.transpose(-2, -1) + torch.einsum("bhid,ijd->bhij", q, rel))
        y = (logits.softmax(-1) @ v).transpose(1, 2).reshape(B, N, C).transpose(1, 2).reshape(B, C, H, W)
        return x + _batch_norm(block.norm, F.conv2d(y, block.proj.weight, block.proj.bias))

    return forward, list(block.parameters())


def _explicit_lsa(block):
    def forward(x):
        B, N, _ = x.shape
        q, k, v = (x @ block.qkv.weight.T + block.qkv.bias).view(B, N, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        logits = q @ k.transpose(-2, -1) / block.temperature.view(1, -1, 1, 1)
        logits = logits.masked_fill(torch.eye(N, dtype=torch.bool), float("-inf"))
        y = (logits.softmax(-1) @ v).transpose(1, 2).reshape(B, N, D)
        return y @ block.proj.weight.T + block.proj.bias

    return forward, list(block.parameters())


def _explicit_seqpool(block):
    def forward(x):
        w = (x @ block.attention_pool.weight.T + block.attention_pool.bias).softmax(dim=1)  # (B, N, 1)
        return (w * x).sum(1)

    return forward, list(block.parameters())


REFERENCES = {
    "se": _timm_by_order(lambda b: SEModule(C, rd_divisor=1)),
    "eca": _timm_by_order(lambda b: EcaModule(C)),
    "cbam": _timm_by_order(lambda b: CbamModule(C)),
    "spatial": _timm_by_order(lambda b: SpatialAttn(7)),
    "coord": _timm_by_order(lambda b: CoordAttn(C, rd_channels=coord_mip(C), bias=True)),
    "strip": _timm_by_order(lambda b: StripAttn(C)),
    "gc": _timm_by_order(
        lambda b: TimmGlobalContext(C, fuse_add=True, fuse_scale=False, rd_channels=b.mlp_add[0].out_features)
    ),
    "nonlocal": _timm_nonlocal,
    "mhsa": _timm_attention,
    "mhsa2d": _explicit_mhsa2d,
    "lsa": _explicit_lsa,
    "seqpool": _explicit_seqpool,
    "none": lambda b: ((lambda x: x), []),
}
REFERENCES.update(TOKEN_REFERENCES)


from test_catalogue_gates import GATE_REFERENCES  # noqa: E402  (issue 90's gate blocks)

REFERENCES.update(GATE_REFERENCES)
from test_catalogue_conv import CONV_REFERENCES  # noqa: E402  (sk, splat, halo, lambda, bat, psa, criss_cross, danet, a2)

REFERENCES.update(CONV_REFERENCES)


def test_every_block_has_a_double_backward_reference():
    assert set(REFERENCES) == set(BLOCKS)


def penalty_grads(fn, params, x: torch.Tensor, w: torch.Tensor):
    """Grads of the gradient penalty ``|d sum(w * fn(x)) / dx|^2`` for ``x`` and ``params``."""
    x = x.clone().requires_grad_()
    (gx,) = torch.autograd.grad((fn(x) * w).sum(), x, create_graph=True)
    penalty = gx.square().sum()
    if not penalty.requires_grad:  # the identity: constant penalty
        return penalty.detach(), [torch.zeros_like(t) for t in (x, *params)]
    gs = torch.autograd.grad(penalty, [x, *params], allow_unused=True)
    return penalty.detach(), [torch.zeros_like(t) if g is None else g for g, t in zip(gs, (x, *params))]


@pytest.mark.parametrize("name", BLOCKS)
def test_double_backward_matches_reference(name):
    """Second-order gradients (for x and every parameter) equal the reference's within 1e-6 in float64.
    A fixed linear readout ``w`` follows the block, the setting in which the removed hand-written backward
    of ``coord`` gave wrong parameter gradients without an error."""
    block = build(name).double().train()
    ref, ref_params = REFERENCES[name](block)
    x = sample(name, dtype=torch.float64)
    with torch.no_grad():
        w = torch.randn_like(block(x))
    with sdpa_kernel(SDPBackend.MATH):  # the fused SDPA kernels have no double backward
        pen, ours = penalty_grads(block, list(block.parameters()), x, w)
    pen_ref, theirs = penalty_grads(ref, ref_params, x, w)
    if hasattr(ref_params, "align"):
        theirs = theirs[:1] + ref_params.align(theirs[1:])
    torch.testing.assert_close(pen, pen_ref, rtol=1e-6, atol=1e-6)
    assert_all_close(ours, theirs, rtol=1e-6, atol=1e-6)
    if name != "none":  # the comparison is not vacuous
        assert ours[0].abs().max() > 1e-3
        assert any(g.abs().max() > 1e-3 for g in ours[1:]) or not ours[1:]  # (simam: no parameters)


def test_sdpa_blocks_document_the_math_backend():
    """What the docstrings say: outside ``sdpa_kernel(SDPBackend.MATH)`` the first backward works whatever
    kernel runs; double backward is guaranteed only with the math kernel (checked above)."""
    for name in sorted(SDPA_BLOCKS):
        block = build(name).train()
        x = sample(name).requires_grad_()
        block(x).square().sum().backward()
        assert torch.isfinite(x.grad).all()
        assert "SDPBackend.MATH" in (type(block).__doc__ or "") + (type(block).forward.__doc__ or ""), name


# ---- torch.func ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", BLOCKS)
def test_vmap_grad_per_sample_gradients(name):
    """``vmap(grad(loss))`` over the batch gives each sample's parameter gradients, as a Python loop does.
    Eval mode: a training-mode BatchNorm mixes the samples of a batch, so per-sample gradients are only
    defined with running statistics (or after ``torch.func.replace_all_batch_norm_modules_``)."""
    block = build(name).double().eval()  # float64: the comparison is about the transform, not rounding
    x = sample(name, dtype=torch.float64)
    params = {k: v.detach() for k, v in block.named_parameters()}
    buffers = dict(block.named_buffers())
    w = torch.randn_like(block(x[:1]))

    def loss(p, xi):
        return (functional_call(block, (p, buffers), (xi[None],)) * w).sum()

    with sdpa_kernel(SDPBackend.MATH):
        per_sample = vmap(grad(loss), in_dims=(None, 0))(params, x)
        for i in range(x.shape[0]):
            single = grad(loss)(params, x[i])
            for k in params:
                torch.testing.assert_close(per_sample[k][i], single[k], rtol=1e-9, atol=1e-10)
    # and the per-sample grads are not all the same (the test would not notice a broadcast otherwise)
    if params:
        assert any((per_sample[k][0] - per_sample[k][1]).abs().max() > 1e-6 for k in params)


def test_vmap_grad_in_training_mode_with_functional_batch_norm():
    """Training mode works too once BN keeps no running statistics (functorch's recipe)."""
    for name in ("cbam", "nonlocal"):
        block = build(name).train()
        torch.func.replace_all_batch_norm_modules_(block)
        params = {k: v.detach() for k, v in block.named_parameters()}
        x = sample(name)

        def loss(p, xi):
            return functional_call(block, p, (xi[None],)).square().sum()

        with sdpa_kernel(SDPBackend.MATH):
            per_sample = vmap(grad(loss), in_dims=(None, 0))(params, x)
        assert all(torch.isfinite(g).all() and g.shape[0] == 2 for g in per_sample.values())


# ---- whole models: no graph breaks ------------------------------------------------------------------------------


def graph_breaks(model: nn.Module, x: torch.Tensor):
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(x)
    return explained.graph_break_count, [str(r.reason) for r in explained.break_reasons]


@pytest.mark.parametrize("name", tiered(FEATURE))
def test_resnet_fast_has_no_graph_breaks(name):
    model = visattn.create_model("resnet_fast", attention=name).train()
    assert graph_breaks(model, torch.randn(2, 3, 32, 32)) == (0, [])


@pytest.mark.parametrize("arch,kw", [("vit_tiny", {}), ("vit_tiny", {"attn": "lsa", "spt": True, "pool": "seq"}),
                                     ("cct_2", {})], ids=["vit_tiny", "vit_tiny-lsa-spt-seq", "cct_2"])
def test_token_models_have_no_graph_breaks(arch, kw):
    model = visattn.create_model(arch, **kw).train()
    assert graph_breaks(model, torch.randn(2, 3, 32, 32)) == (0, [])


@pytest.mark.slow
@pytest.mark.parametrize("name", FEATURE)
@pytest.mark.parametrize("lib", ["torchvision", "timm"])
def test_resnet18_with_each_block_has_no_graph_breaks(lib, name):
    if lib == "torchvision":
        model = torchvision.models.resnet18(weights=None, num_classes=10)
    else:
        model = timm.create_model("resnet18", pretrained=False, num_classes=10)
    if name != "none":
        assert visattn.insert_attention(model, name) == 8
    assert graph_breaks(model.train(), torch.randn(2, 3, 32, 32)) == (0, [])


@pytest.mark.slow
@pytest.mark.parametrize(
    "lib,arch,name",
    [("torchvision", "regnet_y_400mf", "cbam"), ("torchvision", "convnext_tiny", "gc"),
     ("torchvision", "mobilenet_v3_small", "spatial"), ("timm", "regnetx_002", "coord"),
     ("timm", "convnext_atto", "se"), ("timm", "efficientnet_b0", "eca")],
)
def test_new_backbones_with_blocks_have_no_graph_breaks(lib, arch, name):
    if lib == "torchvision":
        model = getattr(torchvision.models, arch)(weights=None, num_classes=10)
    else:
        model = timm.create_model(arch, pretrained=False, num_classes=10)
    assert visattn.insert_attention(model, name) > 0
    assert graph_breaks(model.train(), torch.randn(2, 3, 32, 32)) == (0, [])


def test_compiled_resnet_fast_trains_like_eager():
    """A whole model with a gate block and a self-attention block, compiled with fullgraph=True: the
    forward and the parameter gradients match eager."""
    torch.manual_seed(0)
    model = visattn.create_model("resnet_fast", attention=["cbam", "se", "nonlocal"], widths=(16, 32, 32)).train()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 3, 32, 32)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out, out_ref = compiled(x), ref(x)
    torch.testing.assert_close(out, out_ref, rtol=1e-4, atol=1e-5)
    out.logsumexp(1).sum().backward()
    out_ref.logsumexp(1).sum().backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=n)
    assert math.isfinite(out.sum().item())
