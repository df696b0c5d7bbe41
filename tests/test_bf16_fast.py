"""The blocks' bf16 fast paths compute what the plain ones do (issue 94).

On the CPU a bf16 map is pooled with bf16's own sum (fp32 accumulation, one rounding of the result:
:func:`visattn.attention.channel.sum_in`) instead of ``sum(dtype=torch.float32)``, which first copies the whole map
to fp32; coordinate attention's gates take the map's channels-last layout, and its product goes through
:func:`visattn.attention.spatial.coord_gate` (the same output bit for bit, the gates' gradients summed by
:func:`visattn.attention.channel.axis_sum`). Each block's output and gradients under bf16 autocast are compared with
the same block whose pooling takes the plain fp32 path, to bf16's tolerance, and fp32 is unchanged (to 1e-6)."""
from __future__ import annotations

import pytest
import torch
from block_helpers import random_block_step

import visattn.attention.channel as channel
import visattn.attention.spatial as spatial
from visattn import create_attention, list_attention


def plain_sum_in(x, dims, dtype, keepdim=False):
    return x.sum(dims, keepdim=keepdim, dtype=dtype)


# every feature-map block that pools through visattn.attention.channel (those that do not are unaffected and
# compare equal trivially); BatchNorm blocks need a batch > 1, so the batch is 4
BLOCKS = [n for n in list_attention("feature") if n != "none"]


run = random_block_step


@pytest.mark.parametrize("name", BLOCKS)
def test_bf16_fast_path_equals_the_plain_path(name, monkeypatch):
    torch.manual_seed(1)
    x = torch.randn(4, 32, 6, 5).contiguous(memory_format=torch.channels_last)
    g = torch.randn(4, 32, 6, 5)
    fast = run(name, x, g, torch.bfloat16)
    monkeypatch.setattr(channel, "sum_in", plain_sum_in)
    plain = run(name, x, g, torch.bfloat16)
    scale = lambda t: 1 + t.abs().max().item()  # noqa: E731
    # bf16 keeps 8 bits: one rounding of a pooled statistic moves a gate by at most a few bf16 ulps, and the
    # block's output and gradients with it (2^-6 of the largest value covers a handful of ulps through the gate)
    tol = 2 ** -6
    assert (fast[0] - plain[0]).abs().max().item() <= tol * scale(plain[0]), "output"
    assert (fast[1] - plain[1]).abs().max().item() <= tol * scale(plain[1]), "input gradient"
    for a, b in zip(fast[2], plain[2]):
        assert (a - b).abs().max().item() <= 4 * tol * scale(b), "parameter gradient"


@pytest.mark.parametrize("name", ["se", "eca", "spatial", "cbam", "coord", "gc"])
def test_fp32_is_unchanged_by_the_bf16_paths(name, monkeypatch):
    torch.manual_seed(2)
    x = torch.randn(4, 32, 6, 5).contiguous(memory_format=torch.channels_last)
    g = torch.randn(4, 32, 6, 5)
    fast = run(name, x, g, None)
    monkeypatch.setattr(channel, "sum_in", plain_sum_in)
    plain = run(name, x, g, None)
    for a, b in zip([fast[0], fast[1], *fast[2]], [plain[0], plain[1], *plain[2]]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_sum_in_is_bf16s_sum_rounded_once():
    """The fast sum is the fp32 sum rounded to bf16 once, not a bf16 running sum (which would stall at 256)."""
    x = torch.ones(4, 65536, dtype=torch.bfloat16)
    assert channel.sum_in(x, (1,), torch.float32).tolist() == [65536.0] * 4
    y = torch.randn(8, 300, 7).bfloat16()
    exact = y.double().sum(1)
    got = channel.sum_in(y, (1,), torch.float32)
    assert got.dtype == torch.float32
    assert ((got.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-6).all()
    assert torch.equal(channel.sum_in(y.float(), (1,), torch.float32), y.float().sum(1))  # fp32: the plain sum


@pytest.mark.parametrize("grad_mode", [False, True])
def test_mean_max_backward_is_autograds_in_the_maps_layout(grad_mode):
    """CBAM's pooling backward, with and without a graph (a double backward): autograd's gradient of mean and amax
    (ties split evenly), in the map's layout."""
    torch.manual_seed(3)
    x = torch.randint(-2, 3, (2, 8, 5, 4)).float().contiguous(memory_format=torch.channels_last)  # many ties
    gm, gt = torch.randn(2, 5, 4), torch.randn(2, 5, 4)
    a = x.clone().requires_grad_()
    mean, top = channel.mean_max(a, (1,), torch.float32)
    (grad,) = torch.autograd.grad((mean * gm).sum() + (top * gt).sum(), a, create_graph=grad_mode)
    b = x.clone().requires_grad_()
    ((b.mean(1) * gm).sum() + (b.amax(1) * gt).sum()).backward()
    torch.testing.assert_close(grad, b.grad)
    assert grad.is_contiguous(memory_format=torch.channels_last)


def test_blocks_alone_get_the_maps_the_network_hands_them():
    """bench/blocks.py's "alone" timing feeds each block what it receives inside the recipe's network: under bf16
    autocast a bf16 map (the convolution and BN before the block write bf16), channels-last; fp32 in fp32."""
    import importlib

    from bench.speed import build

    blocks = importlib.import_module("bench.blocks")
    setup = build(str(blocks.ROOT / "configs" / "attention" / "resnet_fast_none.yaml"), 2, 1, "bf16")
    for precision, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        feeds = list(dict.fromkeys(blocks.block_feeds(setup.model, setup.batches[0][0], precision).values()))
        assert [tuple(s) for s, _ in feeds] == [(2, 64, 15, 15), (2, 256, 7, 7), (2, 256, 3, 3)]
        assert {d for _, d in feeds} == {dtype}
        seen = []
        hook = torch.nn.modules.module.register_module_forward_pre_hook(
            lambda m, inputs: seen.append((inputs[0].dtype, inputs[0].stride(1) == 1)) if m.__class__.__name__ ==
            "SqueezeExcite" else None)
        try:
            for _, run in blocks.alone_variants(["se"], {}, {"se": {}}, feeds, "cpu", precision):
                run()
        finally:
            hook.remove()
        assert seen == [(dtype, True)] * 3


def addcmul_pooling_backward(x, dims, g_mean, g_top):
    """The pooling backward as it was before the tie mask moved to ``eq_`` (a bool mask cast to the map's dtype,
    one addcmul): the reference the fast one must equal bit for bit."""
    count = 1
    for d in dims:
        count *= x.shape[d]
    top = x.amax(dims, keepdim=True)
    mask = (x == top).to(x.dtype)
    ties = channel.sum_in(mask, dims, channel.compute_dtype(x), keepdim=True)
    keep = lambda t: t.reshape(top.shape)  # noqa: E731
    share = (keep(g_top.to(x.dtype)) / ties).to(x.dtype)
    return torch.addcmul(keep(g_mean / count).to(x.dtype), mask, share)


@pytest.mark.parametrize("dims", [(1,), (2, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mean_max_backward_is_bitwise_the_addcmul_one(dims, dtype):
    """CBAM's and the spatial gate's pooling backward (over the channels: a multiply and an add; over the positions:
    the addcmul) equals the single-addcmul form exactly, ties included, in fp32 and bf16, in the map's layout."""
    torch.manual_seed(4)
    x = torch.randint(-3, 4, (3, 16, 5, 6)).to(dtype).contiguous(memory_format=torch.channels_last)  # many ties
    x[0] += torch.randn(16, 5, 6).to(dtype)  # and a sample with few
    acc = channel.compute_dtype(x)
    rest = [d for d in range(4) if d not in dims]
    g_mean, g_top = torch.randn([x.shape[d] for d in rest], dtype=acc), torch.randn([x.shape[d] for d in rest], dtype=acc)
    a = x.clone().requires_grad_()
    mean, top = channel.mean_max(a, dims, acc)
    (grad,) = torch.autograd.grad((mean * g_mean).sum() + (top * g_top).sum(), a)
    ref = addcmul_pooling_backward(x, dims, g_mean, g_top)
    assert grad.dtype == dtype and grad.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(grad, ref)


def test_tie_mask_is_the_comparison_in_the_maps_dtype():
    x = torch.tensor([[1.0, 3.0, 3.0, float("inf"), float("nan")]]).bfloat16()
    top = torch.tensor([[3.0]]).bfloat16()
    assert channel.tie_mask(x, top).tolist() == [[0.0, 1.0, 1.0, 0.0, 0.0]]
    assert channel.tie_mask(x, torch.tensor([[float("inf")]])).tolist() == [[0.0, 0.0, 0.0, 1.0, 0.0]]
    assert channel.tie_mask(x, top).dtype == torch.bfloat16


def bf16_map(*shape, seed=5):
    torch.manual_seed(seed)
    return torch.randn(*shape).bfloat16().contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("dim", [2, 3])
@pytest.mark.parametrize("keepdim", [False, True])
def test_axis_sum_is_the_sum_and_its_backward_the_broadcast(dim, keepdim):
    """A bf16 channels-last map summed along H or W as a product with ones: the fp32-accumulated sum rounded once
    (so within one bf16 rounding of the exact sum, as ``sum`` is), and the gradient the broadcast of the upstream
    one, as ``sum``'s; double backward too."""
    x = bf16_map(3, 24, 7, 5)
    got = channel.axis_sum(x, dim, keepdim)
    want = x.sum(dim, keepdim=keepdim)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    exact = x.double().sum(dim, keepdim=keepdim)
    assert ((got.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-6).all()
    assert ((got.double() - want.double()).abs() <= want.double().abs() * 2 ** -7 + 1e-6).all()
    a = x.clone().requires_grad_()
    g = torch.randn(want.shape).bfloat16().requires_grad_()
    (grad,) = torch.autograd.grad(channel.axis_sum(a, dim, keepdim), a, g, create_graph=True)
    assert torch.equal(grad, (g if keepdim else g.unsqueeze(dim)).expand(x.shape))
    (gg,) = torch.autograd.grad(grad.float().square().sum(), g)  # through the backward: double backward holds
    b = x.clone().requires_grad_()
    (ref,) = torch.autograd.grad(b.sum(dim, keepdim=keepdim), b, g, create_graph=True)
    (gg_ref,) = torch.autograd.grad(ref.float().square().sum(), g)
    assert torch.equal(gg, gg_ref)



def coord_parts(seed=6):
    x = bf16_map(4, 16, 6, 5, seed=seed)
    torch.manual_seed(seed)
    a_h = torch.rand(4, 16, 6, 1).mul(2).bfloat16()
    a_w = torch.rand(4, 16, 5, 1).mul(2).bfloat16().transpose(2, 3)  # (B, C, 1, W), a view as the block makes it
    return x, a_h, a_w


def test_coord_gate_is_the_plain_product_with_the_gates_gradients_to_bf16_rounding():
    """The coordinate gate through its own backward: the output and the input's gradient are autograd's bit for bit;
    the gates' gradients differ from autograd's ``sum`` only in the order of the fp32 accumulation."""
    x, a_h, a_w = coord_parts()
    g = bf16_map(4, 16, 6, 5, seed=7)
    fast = [t.clone().requires_grad_() for t in (x, a_h, a_w)]
    plain = [t.clone().requires_grad_() for t in (x, a_h, a_w)]
    y = spatial.coord_gate(*fast)
    y_ref = plain[0] * plain[1] * plain[2]
    assert torch.equal(y, y_ref) and y.is_contiguous(memory_format=torch.channels_last)
    y.backward(g)
    y_ref.backward(g)
    assert torch.equal(fast[0].grad, plain[0].grad)
    for a, b in zip(fast[1:], plain[1:]):
        assert a.grad.shape == b.grad.shape
        assert ((a.grad.float() - b.grad.float()).abs() <= b.grad.float().abs() * 2 ** -7 + 1e-3).all()


def test_coord_gate_double_backward_and_vmap(monkeypatch):
    """Second derivatives through the gate's backward, to bf16 rounding of autograd's; per-sample gradients under
    ``vmap(grad(...))`` through the gate's own function (its generated vmap rule), autograd's bit for bit."""
    x, a_h, a_w = coord_parts()
    leaves = [t.clone().requires_grad_() for t in (x, a_h, a_w)]
    y = spatial.coord_gate(*leaves)
    grads = torch.autograd.grad(y.float().square().sum(), leaves, create_graph=True)
    penalty = sum(gr.float().square().sum() for gr in grads)
    second = torch.autograd.grad(penalty, leaves)
    plain = [t.clone().requires_grad_() for t in (x, a_h, a_w)]
    y_ref = plain[0] * plain[1] * plain[2]
    grads_ref = torch.autograd.grad(y_ref.float().square().sum(), plain, create_graph=True)
    second_ref = torch.autograd.grad(sum(gr.float().square().sum() for gr in grads_ref), plain)
    for a, b in zip(second, second_ref):
        assert ((a.float() - b.float()).abs() <= b.float().abs() * 2 ** -5 + 2 ** -3).all()

    def loss(xi, hi, wi):  # one sample, as (1, C, H, W): channels-last strides, so the fast path runs under vmap
        return spatial.coord_gate(xi[None], hi[None], wi[None]).float().square().sum()

    calls = []
    apply = spatial._CoordGate.apply
    monkeypatch.setattr(spatial._CoordGate, "apply", lambda *args: calls.append(len(args)) or apply(*args))
    per_sample = torch.func.vmap(torch.func.grad(loss))(x, a_h, a_w)
    assert calls == [3]
    for i in range(x.shape[0]):
        assert torch.equal(per_sample[i], torch.func.grad(lambda xi: (xi[None] * a_h[i:i + 1] * a_w[i:i + 1]).float()
                                                          .square().sum())(x[i]))


def coord_block(seed=9, **options):
    torch.manual_seed(seed)
    block = create_attention("coord", 16, **options).train().to(memory_format=torch.channels_last)
    with torch.no_grad():  # a random block (not its identity start), so every path carries signal
        for p in block.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return block


def coord_step(block, x, autocast=True):
    """The block's output, the input's gradient and the parameters' gradients of one bf16-autocast step."""
    leaf = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = block(leaf)
    y.float().square().sum().backward()
    return y.detach(), leaf.grad, [p.grad for p in block.parameters()]


def assert_bf16_close(got, want, tol=2 ** -6):
    """Within a few bf16 ulps of the largest value (one different rounding of a gate's gradient, carried on)."""
    for a, b in zip(got, want):
        assert a.shape == b.shape
        assert (a.float() - b.float()).abs().max().item() <= tol * (1 + b.float().abs().max().item())


@pytest.mark.parametrize("case, fast", [("bf16 channels-last", True), ("bf16 contiguous", False),
                                        ("fp32 channels-last under autocast", False), ("fp32", False)])
def test_coord_block_takes_the_coord_gate_only_for_bf16_channels_last_maps(case, fast):
    """Under bf16 autocast the block's output comes out of :class:`_CoordGate` for a bf16 channels-last map (what a
    channels-last network hands it); an fp32 map (gates and map then differ in dtype), a contiguous one and fp32
    without autocast keep autograd's plain product."""
    x = bf16_map(4, 16, 6, 5)
    x = {"bf16 channels-last": x, "bf16 contiguous": x.contiguous()}.get(case, x.float())
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case != "fp32"):
        y = coord_block()(x.requires_grad_())
    assert y.grad_fn.name() == ("_CoordGateBackward" if fast else "MulBackward0")
    assert y.dtype == x.dtype


def test_coord_block_output_is_bitwise_the_plain_products(monkeypatch):
    """The block's bf16 output is the plain ``x * a_h * a_w`` bit for bit, with and without a graph; its gradients
    are the plain product's to bf16 rounding (the gates' gradients are summed in another fp32 order)."""
    x = bf16_map(4, 16, 6, 5)
    fast = coord_step(coord_block(), x)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        y_no_grad = coord_block()(x)
    monkeypatch.setattr(spatial, "coord_gate", lambda x, a_h, a_w: x * a_h * a_w)
    plain = coord_step(coord_block(), x)
    assert torch.equal(fast[0], plain[0]) and torch.equal(y_no_grad, plain[0])
    assert_bf16_close([fast[1]], [plain[1]])
    assert_bf16_close(fast[2], plain[2], 4 * 2 ** -6)


def test_coord_gate_sums_in_the_maps_layout_whatever_the_upstream_gradients(monkeypatch):
    """A contiguous upstream gradient (a loss read off an NCHW view) still hands :func:`axis_sum` channels-last
    summands (formed in the map's layout), so its fast sum runs on them; the gradients are bit for bit those of a
    channels-last upstream gradient."""
    layouts = []

    def recording_axis_sum(t, dim, keepdim=False):
        layouts.append(channel.is_channels_last(t))
        return channel.axis_sum(t, dim, keepdim)

    monkeypatch.setattr(spatial, "axis_sum", recording_axis_sum)
    x, a_h, a_w = coord_parts()
    g = bf16_map(4, 16, 6, 5, seed=7)
    grads = []
    for upstream in (g, g.contiguous()):
        leaves = [t.clone().requires_grad_() for t in (x, a_h, a_w)]
        spatial.coord_gate(*leaves).backward(upstream)
        grads.append([t.grad for t in leaves])
    assert layouts == [True] * 4
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("a_h_shape", [(4, 16, 6, 5), (1, 16, 6, 1)])
def test_coord_gate_with_other_gate_shapes_is_the_plain_product(a_h_shape):
    """Gates of other shapes than ``(B, C, H, 1)`` and ``(B, C, 1, W)`` (a full map, one broadcast over the batch)
    take the plain product, whose gradients reduce to each gate's own shape."""
    x, _, a_w = coord_parts()
    torch.manual_seed(10)
    a_h = torch.rand(a_h_shape).bfloat16().requires_grad_()
    y = spatial.coord_gate(x, a_h, a_w)
    assert y.grad_fn.name() == "MulBackward0"
    y.float().sum().backward()
    assert a_h.grad.shape == a_h.shape


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_coord_under_bf16_compiles_fullgraph(backend):
    """Compiled with ``fullgraph=True`` (a graph break raises) under bf16 autocast, forward and backward: AOTAutograd
    gives eager's output bit for bit, Inductor (which fuses the product) within bf16 rounding; gradients to bf16's."""
    x = bf16_map(4, 16, 6, 5)
    eager = coord_step(coord_block(), x)
    torch._dynamo.reset()
    compiled = coord_step(torch.compile(coord_block(), fullgraph=True, backend=backend), x)
    if backend == "aot_eager":
        assert torch.equal(compiled[0], eager[0])
    assert_bf16_close([compiled[0], compiled[1]], [eager[0], eager[1]])
    assert_bf16_close(compiled[2], eager[2], 4 * 2 ** -6)


def test_coord_gate_backward_is_its_derivative_to_second_order_in_float64():
    torch.manual_seed(8)
    x = torch.randn(2, 4, 3, 5, dtype=torch.float64).contiguous(memory_format=torch.channels_last).requires_grad_()
    h = torch.rand(2, 4, 3, 1, dtype=torch.float64, requires_grad=True)
    w = torch.rand(2, 4, 5, 1, dtype=torch.float64).transpose(2, 3).detach().requires_grad_()
    f = lambda a, b, c: spatial._CoordGate.apply(a, b, c)[0]  # noqa: E731
    assert torch.autograd.gradcheck(f, (x, h, w))
    assert torch.autograd.gradgradcheck(f, (x, h, w))
