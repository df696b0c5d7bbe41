"""Every attention type timm builds by name (``timm.layers.get_attn``) is available through visattn
(``visattn.attention.timm_names.TIMM_ATTN``) and computes timm's function; and the options that carry timm's
variants of a paper's block (eSE, ECA's MLP and circular padding, light CBAM, GC's fusions, simple coordinate
attention, the non-local and BoTNet scalings) keep the block contract: shapes at any map, identity init,
recorded maps, mixed precision, channels_last, ``torch.compile(fullgraph=True)`` and double backward."""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch
from timm.layers import get_attn
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from visattn.attention import AttentionTap, create_attention, list_attention
from visattn.attention.timm_names import TIMM_ATTN, create_timm_attention, timm_attention_options

ROOT = Path(__file__).resolve().parents[1]
C = 64


def timm_names():
    """The names ``timm.layers.get_attn`` accepts, read from its source (so a timm that adds one fails here)."""
    return re.findall(r"attn_type == '(\w+)'", inspect.getsource(get_attn))


def randomize_(module: nn.Module, seed: int = 0) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5 + (1.0 if p.dim() == 1 else 0.0))
    return module


def load_by_order(dst: nn.Module, src: nn.Module) -> None:
    d, s = dst.state_dict(), list(src.state_dict().values())
    assert len(d) == len(s), (list(d), [k for k in src.state_dict()])
    dst.load_state_dict({k: v.reshape(d[k].shape) for k, v in zip(d, s)})


def load_nonlocal(ours: nn.Module, ref: nn.Module) -> None:
    """timm's NonLocalAttn t, p, g convs -> the rows of visattn's ``qkv``; z -> ``proj``."""
    with torch.no_grad():
        ours.qkv.weight.copy_(torch.cat([ref.t.weight, ref.p.weight, ref.g.weight]).flatten(1))
        ours.qkv.bias.copy_(torch.cat([ref.t.bias, ref.p.bias, ref.g.bias]))
    ours.proj.load_state_dict(ref.z.state_dict())
    ours.norm.load_state_dict(ref.norm.state_dict())


def timm_class_name(name: str) -> str:
    cls = get_attn(name)
    return getattr(cls, "func", cls).__name__  # functools.partial for 'ecam', 'gca'


def test_the_table_covers_every_timm_attn_name():
    names = timm_names()
    assert len(names) == 21 and set(names) == set(TIMM_ATTN), sorted(set(names) ^ set(TIMM_ATTN))
    for entry in TIMM_ATTN.values():
        assert entry.parity in ("module", "mapped", "core", "unbuildable")
        assert (ROOT / entry.test).is_file(), entry.test


@pytest.mark.parametrize("name", timm_names())
def test_every_timm_attn_type_is_available(name):
    """Built through visattn at 64 channels with timm's configuration; where timm's own module builds with its
    defaults, the same function (float64, train mode: outputs, input gradients); otherwise the test file that
    compares the mechanism names timm's module."""
    entry = TIMM_ATTN[name]
    if entry.block not in list_attention():
        pytest.skip(f"visattn block {entry.block!r} (timm {name!r}) is not registered yet")
    torch.manual_seed(0)
    ours = create_timm_attention(name, C)
    x = torch.randn(2, C, 9, 7, dtype=torch.float64)
    if entry.parity == "core":
        assert ours.double()(x).shape == x.shape
        assert timm_class_name(name) in (ROOT / entry.test).read_text(), f"{entry.test} does not test timm's module"
        return
    if entry.parity == "unbuildable":
        with pytest.raises(Exception):
            get_attn(name)(C)  # when timm fixes it, this fails: compare as "module" then
        assert ours.double()(x).shape == x.shape
        assert timm_class_name(name) in (ROOT / entry.test).read_text()
        return
    ref = randomize_(get_attn(name)(C), seed=3)
    (load_nonlocal if entry.parity == "mapped" else load_by_order)(ours, ref)
    ours.double().train()
    ref.double().train()
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours(xa), ref(xb)
    tol = 1e-10 * (1 + yb.abs().max().item())
    assert (ya - yb).abs().max().item() <= tol
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    # torch's nn.Hardsigmoid (timm's 'ese' gate) backward multiplies by 1/6 rounded to fp32: 3e-8 relative
    grad_tol = 1e-7 if name == "ese" else 1e-10
    assert (xa.grad - xb.grad).abs().max().item() <= grad_tol * (1 + xb.grad.abs().max().item())


def test_create_timm_attention_options_and_errors():
    assert timm_attention_options("ese", 64) == ("se", {"effective": True})
    assert timm_attention_options("coord", 512)[1]["mip"] == 24  # timm's make_divisible(512 / 24, 8)
    assert timm_attention_options("nl", 256)[1]["rd_channels"] == 32
    block = create_timm_attention("lcbam", 64, init="identity")  # overrides go on top of timm's configuration
    x = torch.randn(2, 64, 5, 4)
    assert block.channel.light and torch.equal(block(x), x)
    with pytest.raises(ValueError, match="unknown timm attention type 'cbam2'; valid: se, ese"):
        create_timm_attention("cbam2", 64)


# ---- the options keep the block contract ---------------------------------------------------------------------

VARIANTS = [
    ("se", dict(effective=True)),
    ("eca", dict(use_mlp=True)),
    ("eca", dict(padding="circular")),
    ("eca", dict(padding="circular", use_mlp=True)),
    ("cbam", dict(light=True)),
    ("spatial", dict(light=True)),
    ("gc", dict(fusion="scale")),
    ("gc", dict(fusion="both", norm_eps=1e-6)),
    ("coord", dict(combine="sum", norm_layer=None, act_layer=nn.SiLU)),
    ("coord", dict(bias=False)),
    ("strip", dict(use_conv=False)),
    ("nonlocal", dict(scale_by="channels")),
    ("mhsa2d", dict(scale_pos=False)),
]
IDS = ["-".join([n, *(f"{k}={getattr(v, '__name__', v)}" for k, v in o.items())]) for n, o in VARIANTS]


def taps(module: nn.Module):
    return [m for m in module.modules() if isinstance(m, AttentionTap)]


@pytest.mark.parametrize("name,options", VARIANTS, ids=IDS)
def test_variant_shapes_maps_and_precision(name, options):
    torch.manual_seed(0)
    block = randomize_(create_attention(name, C, **options))
    for shape, train in (((2, C, 7, 9), True), ((1, C, 1, 1), False), ((2, C, 1, 1), True)):
        x = torch.randn(shape)
        block.train(train)
        records = []
        for t in taps(block):
            t.sink = records
        y = block(x)
        for t in taps(block):
            t.sink = None
        assert y.shape == x.shape and torch.isfinite(y).all(), shape
        assert records and {r.kind for r in records} == {t.kind for t in taps(block)}
        for r in records:
            want = {"channel": (shape[0], C), "spatial": (shape[0], 1, *shape[2:]),
                    "token": (shape[0], r.weights.shape[1], shape[2] * shape[3], shape[2] * shape[3])}[r.kind]
            assert tuple(r.weights.shape) == want and torch.isfinite(r.weights).all()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.isfinite(block(x * 100).float()).all()
        torch.testing.assert_close(block(x.contiguous(memory_format=torch.channels_last)), block(x), rtol=1e-5, atol=1e-5)
    block.eval()
    for dtype in (torch.bfloat16, torch.float16):
        half = create_attention(name, C, **options).to(dtype).eval()
        assert torch.isfinite(half(torch.randn(1, C, 5, 6, dtype=dtype)).float()).all()


def last_layers(block: nn.Module):
    """The parameters ``init="identity"`` zeroes: the gates' logit layers, GC's branch ends, the residual norm."""
    if hasattr(block, "identity_layers"):
        return list(block.identity_layers())
    if hasattr(block, "channel") and hasattr(block, "spatial"):  # CBAM
        return [*block.channel.identity_layers(), *block.spatial.identity_layers()]
    if hasattr(block, "mlp_add"):  # GC
        return [m[-1].weight for m in (block.mlp_add, block.mlp_scale) if m is not None]
    return [block.norm.weight]  # the self-attention blocks' residual BN


@pytest.mark.parametrize("name,options", VARIANTS, ids=IDS)
def test_variant_identity_init(name, options):
    if name == "strip" and not options.get("use_conv", True):
        pytest.skip("strip without its convs has no layer to zero: init='identity' is refused (tested in test_blocks)")
    torch.manual_seed(0)
    block = create_attention(name, C, init="identity", **options).train()
    # channel offsets of both signs, so the pooled vectors vary in sign and no small ReLU bottleneck is dead
    x = (torch.randn(2, C, 6, 5) + 2 * torch.randn(1, C, 1, 1)).requires_grad_()
    y = block(x)
    assert torch.equal(y, x)
    y.square().sum().backward()
    last = [p for p in last_layers(block) if p is not None]
    assert last and all(p.abs().sum() == 0 and p.grad is not None and p.grad.abs().sum() > 0 for p in last)
    block.zero_init_last()
    assert torch.equal(block(x), x)


@pytest.mark.parametrize("name,options", VARIANTS, ids=IDS)
def test_variant_compiles_fullgraph_exports_and_double_backward(name, options):
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = randomize_(create_attention(name, 8, **options)).train()
    x = torch.randn(2, 8, 5, 4)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), block(x), rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
    exported = torch.export.export(block.eval(), (x,))
    torch.testing.assert_close(exported.module()(x), block(x), rtol=1e-5, atol=1e-5)
    block = block.double().eval()
    xd = torch.randn(2, 8, 4, 3, dtype=torch.float64, requires_grad=True)
    with sdpa_kernel(SDPBackend.MATH):
        assert torch.autograd.gradgradcheck(block, (xd,), eps=1e-6, atol=1e-4, fast_mode=True)
