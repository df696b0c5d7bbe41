"""Every registered model: forward and backward with a non-default class count; README counts match."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from visattn.models import create_model, list_models

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", list_models())
def test_forward_backward(name):
    torch.manual_seed(0)
    model = create_model(name, num_classes=7)
    if getattr(model, "needs_data_init", False):
        model.data_init((torch.rand(16, 3, 32, 32) * 255).to(torch.uint8), (0.5,) * 3, (0.25,) * 3)
    x = torch.randn(2, 3, 32, 32, requires_grad=True)
    out = model(x)
    assert out.shape == (2, 7)
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert all(p.grad is not None for p in trainable), [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]


def test_unknown_model_and_option():
    with pytest.raises(ValueError, match="valid: .*resnet18"):
        create_model("resnet1000")
    with pytest.raises(ValueError, match="unknown option"):
        create_model("resnet18", widthz=3)


@pytest.mark.parametrize("attention", [["none", "none", "nonlocal"], ["se", "eca", "cbam"]])
def test_per_stage_attention(attention):
    model = create_model("resnet_fast", attention=attention)
    kinds = [type(g.units[0].attn).__name__ for g in model.layers]
    assert kinds[0] != kinds[2] or attention[0] == attention[2]
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 10)
    with pytest.raises(ValueError, match="stage"):
        create_model("resnet_fast", attention=["se", "se"])


def test_block_options_pass_through():
    model = create_model("resnet18", attention="se", attn_kwargs={"rd_ratio": 0.25})
    se = model.layers[0][0].attn
    assert sum(p.numel() for p in se.parameters()) > 0
    small = create_model("resnet18", attention="se")
    assert sum(p.numel() for p in model.parameters()) > sum(p.numel() for p in small.parameters())


def _docs_counts():
    text = (ROOT / "docs" / "models.md").read_text()  # the model table lives in the manual
    # rows like: | `vit_tiny` | ... | 2,697,610 | ...  (the model table)
    return {m.group(1): int(m.group(2).replace(",", ""))
            for m in re.finditer(r"^\|\s*`([\w]+)`[^\n]*?\|\s*([\d,]{5,})\s*\|", text, flags=re.M)}


def test_docs_parameter_counts_match_the_code():
    counts = _docs_counts()
    assert counts, "docs/models.md has no model table with parameter counts"
    for name, n in counts.items():
        if name in list_models():
            assert sum(p.numel() for p in create_model(name, num_classes=10).parameters()) == n, name
