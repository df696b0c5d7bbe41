"""The transformers' fast path computes what the baseline path computes.

``mhsa``/``lsa`` split the packed ``qkv`` projection into heads without copies and pick their CPU attention
kernel with ``sdpa_cpu`` (``"fp32"``: flash in fp32, the default; ``"native"``: flash in the input precision;
``"matmul"``: ``matmul_attention``); ``block.fast_path = False`` / ``TokenClassifier.set_fast_path(False)``
runs the path as it was. Pinned here, with masks, for every score and for whole ViT and CCT models in training
mode: in fp32 the forward and every gradient equal the baseline's to float rounding; under bf16 autocast
every one is as close to the exact (fp64) result as the baseline's is, up to a small factor (bf16 rounds to
8 significant bits; the kernels round at different places).
"""
from __future__ import annotations

import copy

import pytest
import torch

from visattn import create_model
from visattn.attention.token import SDPA_CPU_MODES, MultiHeadSelfAttention, matmul_attention, sdpa_cpu_mode
from visattn.registry import create_attention

D, HEADS = 48, 6
BLOCKS = [("mhsa", {}), ("mhsa", {"score": "dot"}), ("mhsa", {"score": "general"}), ("lsa", {})]
FP32 = 1e-5  # largest difference, relative to the tensor's largest entry
SEQPOOL_BIAS = "seq_pool.attention_pool.bias"


def _grads(module: torch.nn.Module, x: torch.Tensor, w: torch.Tensor, autocast: bool, **kw) -> dict:
    """The output and the gradients of ``(out * w).sum()`` w.r.t. the input and every parameter, in fp64."""
    x = x.clone().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = module(x, **kw)
    (out.to(w.dtype) * w).sum().backward()
    grads = {"out": out.detach(), "x": x.grad}
    # (sequence pooling's bias has an exactly zero gradient, the softmax being shift-invariant: left out)
    grads.update({n: p.grad for n, p in module.named_parameters() if p.grad is not None and n != SEQPOOL_BIAS})
    return {k: v.double() for k, v in grads.items()}


def _err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _assert_same(got: dict, want: dict, tol: float = FP32) -> None:
    assert got.keys() == want.keys()
    bad = {k: _err(got[k], want[k]) for k in want if _err(got[k], want[k]) > tol}
    assert not bad, f"differ by more than {tol} of their largest entry: {bad}"


def _assert_as_accurate(got: dict, base: dict, exact: dict) -> None:
    """Every tensor of ``got`` is as close to ``exact`` as ``base``'s is, within 3x plus 1% of its largest entry."""
    assert got.keys() == base.keys() == exact.keys()
    errs = {k: (_err(got[k], exact[k]), _err(base[k], exact[k])) for k in exact}
    bad = {k: e for k, e in errs.items() if e[0] > 3 * e[1] + 1e-2}
    assert not bad, f"(fast, baseline) error against fp64: {bad}"


def _check(fast, base, x, w, autocast: bool, mode: str, **kw) -> None:
    with sdpa_cpu_mode(mode):
        got = _grads(fast, x, w, autocast, **kw)
    if not autocast:
        _assert_same(got, _grads(base, x, w, False, **kw))
        return
    exact = _grads(copy.deepcopy(base).double(), x.double(), w.double(), False, **kw)
    _assert_as_accurate(got, _grads(base, x, w, True, **kw), exact)


def _pair(name: str, kw: dict, seed: int = 0):
    torch.manual_seed(seed)
    fast = create_attention(name, D, num_heads=HEADS, **kw)
    with torch.no_grad():  # weights large enough that attention is far from uniform
        for p in fast.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else None
    base = copy.deepcopy(fast)
    base.fast_path = False
    return fast, base


@pytest.mark.parametrize("name, kw", BLOCKS)
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", SDPA_CPU_MODES)
def test_fast_path_equals_baseline(name, kw, autocast, mode):
    fast, base = _pair(name, kw)
    _check(fast, base, torch.randn(3, 17, D), torch.randn(3, 17, D), autocast, mode)


@pytest.mark.parametrize("name", ["mhsa", "lsa"])
@pytest.mark.parametrize("mask", ["bool", "float", "causal"])
@pytest.mark.parametrize("mode", SDPA_CPU_MODES)
def test_fast_path_equals_baseline_with_masks(name, mask, mode):
    if name == "lsa" and mask == "causal":
        pytest.skip("lsa refuses is_causal")
    fast, base = _pair(name, {})
    n = 9
    keep = torch.rand(3, 1, n, n) > 0.3
    keep |= torch.eye(n, dtype=torch.bool).roll(1, 1)  # every row keeps a key other than itself
    kw = {"is_causal": True} if mask == "causal" else {"attn_mask": keep if mask == "bool" else
                                                       torch.randn(3, 1, n, n).masked_fill(~keep, float("-inf"))}
    x, w = torch.randn(3, n, D), torch.randn(3, n, D)
    for autocast in (False, True):
        _check(fast, base, x, w, autocast, mode, **kw)


def test_fast_path_is_bitwise_the_baseline_in_fp32_flash():
    """Default mode in fp32: the same flash kernel on the same numbers, only the strides differ."""
    fast, base = _pair("mhsa", {})
    x = torch.randn(2, 65, D)
    assert torch.equal(fast(x), base(x))


def test_matmul_attention_is_sdpa():
    q, k, v = torch.randn(3, 2, 4, 11, 8, dtype=torch.float64).unbind(0)
    mask = torch.rand(2, 1, 11, 11) > 0.2
    mask |= torch.eye(11, dtype=torch.bool)
    for kw in ({}, {"scale": 0.7}, {"attn_mask": mask}, {"is_causal": True},
               {"attn_mask": torch.randn(11, 11, dtype=torch.float64)}):
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, **kw)
        torch.testing.assert_close(matmul_attention(q, k, v, **kw), ref)


def test_sdpa_cpu_mode_restores_and_rejects_unknown_modes():
    assert MultiHeadSelfAttention.sdpa_cpu == "fp32"
    with sdpa_cpu_mode("matmul"):
        assert create_attention("lsa", D).sdpa_cpu == "matmul"
    assert MultiHeadSelfAttention.sdpa_cpu == "fp32"
    with pytest.raises(ValueError, match="fp32, native, matmul"):
        with sdpa_cpu_mode("fast"):
            pass


def test_recording_still_takes_the_explicit_path_on_the_fast_path():
    """The maps code records through the tap: on the fast path too, the recorded weights are what is applied."""
    from visattn import record_attention

    model = create_model("vit_tiny", depth=2, pool="mean").eval()
    x = torch.randn(2, 3, 32, 32)
    with record_attention(model) as recs:
        out = model(x)
    assert len(recs) == 2 and all(r.weights.shape == (2, 12, 64, 64) for r in recs)
    torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name, kw", [("vit_tiny", {"depth": 2, "pool": "mean"}),
                                      ("vit_tiny", {"depth": 2, "pool": "cls", "attn": "lsa", "spt": True}),
                                      ("cct_2", {})])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", SDPA_CPU_MODES)
def test_models_fast_path_equals_baseline_in_training(name, kw, autocast, mode):
    """Training mode (DropPath, dropout): both paths draw the same random numbers and compute the same step."""
    torch.manual_seed(0)
    fast = create_model(name, num_classes=10, drop_path_rate=0.2, attn_drop_rate=0.0, **kw).train()
    base = copy.deepcopy(fast).set_fast_path(False)
    assert not any(getattr(m, "fast_path", False) for m in base.modules())
    x, w = torch.randn(4, 3, 32, 32), torch.randn(4, 10)
    runs = []
    for model, ac, dtype in ((fast, autocast, None), (base, autocast, None), (base, False, torch.float64)):
        model = copy.deepcopy(model).to(dtype) if dtype else model
        torch.manual_seed(1)  # the same DropPath draws
        with sdpa_cpu_mode(mode):
            runs.append(_grads(model, x.to(dtype or x.dtype), w.to(dtype or w.dtype), ac))
    got, base_run, exact = runs
    if autocast:
        _assert_as_accurate(got, base_run, exact)
    else:
        _assert_same(got, base_run, 1e-4 if mode == "matmul" else FP32)
