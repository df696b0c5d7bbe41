"""precision=auto picks what the machine computes fast: bf16 only where the CPU has it in hardware."""
from __future__ import annotations

import pytest
import torch

from visattn import evaluate


@pytest.mark.parametrize("amx,avx512_bf16,want", [(True, False, "bf16"), (False, True, "bf16"), (False, False, "fp32")])
def test_auto_on_the_cpu_is_bf16_only_with_native_bf16(monkeypatch, amx, avx512_bf16, want):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    assert evaluate.resolve_precision("auto", torch.device("cpu")) == want


def test_an_explicit_precision_is_kept():
    for p in ("bf16", "fp16", "fp32"):
        assert evaluate.resolve_precision(p, torch.device("cpu")) == p


def test_a_torch_without_the_probes_falls_back_to_fp32(monkeypatch):
    for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"):
        monkeypatch.delattr(torch.cpu, name, raising=False)
    assert evaluate.resolve_precision("auto", torch.device("cpu")) == "fp32"
