"""Map kinds are one table (visattn/maps/kinds.py) and the TensorBoard cards one protocol (issue 89, item 3):
every tap kind has an entry, the readout, render, record and tensorboard modules switch on no kind name, and the
``"covariance"`` kind (XCA's channel x channel weights) reads back as a ``d x d`` matrix and is drawn as one,
never placed on the image."""
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from visattn.attention.tap import DEFAULT_SCALE, KINDS, AttentionRecord, AttentionTap
from visattn.maps import MapSettings, log_attention_maps, read_maps, record_attention, spatial_heatmap
from visattn.maps import tensorboard as tb
from visattn.maps.kinds import TABLE, kind_of, record_kind

MAPS = Path(__file__).resolve().parents[1] / "visattn" / "maps"


def test_every_tap_kind_has_one_entry_with_its_default_scale():
    assert {k for k, v in TABLE.items() if not v.derived} == set(KINDS)
    for k in KINDS:
        assert TABLE[k].scale == DEFAULT_SCALE[k]
    with pytest.raises(ValueError, match="unknown kind 'rollout'"):
        record_kind(AttentionRecord("x", "rollout", torch.zeros(1, 4)))


@pytest.mark.parametrize("module", ["readout.py", "render.py", "record.py", "tensorboard.py", "faithful.py"])
def test_no_module_switches_on_a_kind_name(module):
    text = (MAPS / module).read_text()
    assert not re.findall(r"kind\s*[!=]=", text), f"{module} compares a kind by name: consult visattn.maps.kinds"


class Xca(nn.Module):
    """A toy cross-covariance attention: softmax over channels of a planted (heads, d, d) score, per image."""

    def __init__(self, heads=2, d=4):
        super().__init__()
        self.score = nn.Parameter(torch.randn(heads, d, d))
        self.tap = AttentionTap("covariance")
        self.head = nn.Linear(heads * d, 3)

    def forward(self, x):  # x: (B, 3, H, W)
        b = x.shape[0]
        attn = self.tap((self.score[None] * x.mean((1, 2, 3))[:, None, None, None]).softmax(-1))
        return self.head(attn.sum(-1).reshape(b, -1))


def test_covariance_reads_back_as_a_matrix_and_is_never_placed():
    torch.manual_seed(0)
    m = Xca().eval()
    x = torch.rand(2, 3, 8, 8)
    with record_attention(m) as rec:
        m(x)
    (r,) = rec.records
    assert r.kind == "covariance" and r.value_scale == "relative" and r.weights.shape == (2, 2, 4, 4)
    assert torch.allclose(spatial_heatmap(r), r.weights.mean(1))
    assert read_maps(rec.records, m, x.shape) == []  # nothing placed on the image by default
    (lm,) = read_maps(rec.records, m, x.shape, matrices=True)
    assert lm.kind == "covariance" and not lm.placed and lm.keys == 4 and lm.heat.shape == (2, 4, 4)
    assert "not placed on the image" in lm.description and "query channel x key channel" in lm.description


class Writer:
    def __init__(self):
        self.images, self.texts, self.scalars = {}, {}, {}

    def add_image(self, tag, img, step, dataformats=None):
        self.images[tag] = img

    def add_text(self, tag, text, step):
        self.texts[tag] = text

    def add_scalar(self, tag, v, step):
        self.scalars[tag] = v

    def add_histogram(self, tag, v, step):
        raise AssertionError("no channel records here")


def test_covariance_gets_a_matrix_card_with_channel_axes_and_no_overlay():
    torch.manual_seed(0)
    w = Writer()
    summary = log_attention_maps(w, Xca(), torch.rand(2, 3, 8, 8), torch.tensor([0, 1]), 0,
                                 MapSettings(faithfulness=True))
    assert summary["images"] == ["matrix/tap"] and not any(t.startswith("maps/") for t in w.images)
    assert "channel-by-channel attention" in w.texts["maps/descriptions"]
    assert not any(t.startswith("faithfulness/") for t in w.scalars)  # a matrix is not scored on the image


def test_a_new_card_is_one_class_in_the_list():
    seen = []

    class CountMaps:
        def log(self, probe: tb.Probe) -> None:
            seen.append(len(probe.maps))
            probe.writer.add_scalar("maps/count", len(probe.maps), probe.step)
            probe.summary["scalars"].append("maps/count")

    w = Writer()
    summary = log_attention_maps(w, Xca(), torch.rand(2, 3, 8, 8), None, 0, cards=[*tb.CARDS, CountMaps()])
    assert seen == [0] and summary["scalars"] == ["maps/count"] and w.scalars["maps/count"] == 0


def test_derived_kinds_name_their_words_and_an_unknown_kind_keeps_its_note():
    assert all(TABLE[k].words is not None for k in ("head", "rollout", "attention_gradient", "gradient_rollout",
                                                    "layers_gradient", "spatial", "token", "pool", "covariance"))
    assert kind_of("prior").words is None and kind_of("prior").placed
