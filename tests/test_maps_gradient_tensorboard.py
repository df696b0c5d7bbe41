"""TensorBoard: gradient-weighted maps beside the raw ones (``maps/<layer>/grad``, ``maps/rollout_grad``), each
described in the text tab, and every card carrying how faithful its map is on the probe (deletion and insertion
scores against random orders and paired against the centre prior, with their intervals) under its pictures, read
back with TensorBoard's reader."""
import io

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("tensorboard")
from conftest import has_colour_bar  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import (  # noqa: E402
    IMAGES,
    SCALARS,
    TENSORS,
    EventAccumulator,
)
from test_maps_gradient import DecidingGate, DecidingTokens, images  # noqa: E402
from torch.utils.tensorboard import SummaryWriter  # noqa: E402

import visattn  # noqa: E402
from visattn.maps import MapSettings, log_attention_maps  # noqa: E402
from visattn.maps.render import LINE_H, colour_bar  # noqa: E402


def read_events(logdir):
    acc = EventAccumulator(str(logdir), size_guidance={IMAGES: 0, SCALARS: 0, TENSORS: 0})
    acc.Reload()
    return acc


def decode(event):
    return np.asarray(Image.open(io.BytesIO(event.encoded_image_string)).convert("RGB"))


def descriptions(acc) -> str:
    return acc.Tensors("maps/descriptions/text_summary")[-1].tensor_proto.string_val[0].decode()


NOTES = 5  # a card's faithfulness lines: the header, deletion vs random, vs the prior, insertion, vs the prior


def notes_band(picture: np.ndarray, lines: int = NOTES) -> np.ndarray:
    """The rows between the last cells and the colour bar, where a card's notes are written."""
    bar = colour_bar(picture.shape[1], "gate").shape[0]
    return picture[-(bar + LINE_H * lines + 2) : -bar]


def note_line(band: np.ndarray, k: int) -> np.ndarray:
    """Line ``k`` of a notes band (0: the header)."""
    return band[LINE_H * k + 1 : LINE_H * (k + 1) + 1]


def green(a):
    return (a[..., 1] > 180) & (a[..., 0] < 160) & (a[..., 2] < 160)


def red(a):
    return (a[..., 0] > 200) & (a[..., 1] < 160) & (a[..., 2] < 160)


def logged_with_and_without_scores(tmp_path):
    """The planted gate's maps logged twice at step 5, with the faithfulness scores and without: the first
    call's summary, and both logs read back."""
    model, x = DecidingGate(grid=(4, 4)), images(8, hw=(32, 32))
    writer = SummaryWriter(str(tmp_path / "on"))
    summary = log_attention_maps(writer, model, x, None, 5, MapSettings(faithfulness=True))
    writer.close()
    writer = SummaryWriter(str(tmp_path / "off"))
    log_attention_maps(writer, model, x, None, 5)
    writer.close()
    return summary, read_events(tmp_path / "on"), read_events(tmp_path / "off")


def test_cards_say_how_faithful_their_map_is(tmp_path):
    summary, on, off = logged_with_and_without_scores(tmp_path)
    assert set(on.Tags()["images"]) == set(off.Tags()["images"]) == {"maps/tap", "maps/tap/grad"}
    # the maps' scores and the centre prior's (a scalar only: it has no picture)
    assert set(on.Tags()["scalars"]) == {f"faithfulness/{m}/{s}" for m in ("tap", "tap/grad", "centre")
                                         for s in ("deletion", "insertion")} | {"gates/tap/mean", "gates/tap/std"}
    assert set(off.Tags()["scalars"]) == {"gates/tap/mean", "gates/tap/std"}  # the gate's curve, scored or not
    for tag in ("maps/tap", "maps/tap/grad"):
        with_notes, plain = decode(on.Images(tag)[0]), decode(off.Images(tag)[0])
        assert with_notes.shape[0] == plain.shape[0] + NOTES * LINE_H + 2  # five lines above the colour bar
        assert has_colour_bar(with_notes) and on.Images(tag)[0].step == 5
        assert np.array_equal(with_notes[: plain.shape[0] - colour_bar(plain.shape[1], "gate").shape[0]],
                              plain[: plain.shape[0] - colour_bar(plain.shape[1], "gate").shape[0]])  # cells as before
    # the deciding cell (2, 1) of the 4x4 grid is one of the four central cells, all of which the centre prior
    # removes first. The gradient map ranks it first: better than random (green), but no better than the prior
    # (grey: the same curves, difference exactly 0). The raw gate ranks it last: worse than random and than
    # the prior (red). No labels are given, so the captions above are neither colour.
    grad_band, raw_band = notes_band(decode(on.Images("maps/tap/grad")[0])), notes_band(decode(on.Images("maps/tap")[0]))
    for k in (1, 3):
        assert green(note_line(grad_band, k)).sum() > 20 and not red(note_line(grad_band, k)).any()
        assert red(note_line(raw_band, k)).sum() > 20 and not green(note_line(raw_band, k)).any()
    for k in (2, 4):
        assert not green(note_line(grad_band, k)).any() and not red(note_line(grad_band, k)).any()
        assert note_line(grad_band, k).max() > 100  # grey text is there
        assert red(note_line(raw_band, k)).sum() > 20 and not green(note_line(raw_band, k)).any()
    about = descriptions(on)
    line = next(s for s in about.splitlines() if s.startswith("| `maps/tap/grad` |"))
    assert "on the probe: deletion +" in line and "insertion +" in line and "explained class: the predicted class" in line
    assert "minus the centre prior's: deletion +0.000 [+0.000, +0.000]" in line
    raw_line = next(s for s in about.splitlines() if s.startswith("| `maps/tap` |"))
    assert "on the probe: deletion -" in raw_line and "minus the centre prior's: deletion -" in raw_line
    assert "| `faithfulness/centre/deletion` |" in about
    assert any(s.startswith("maps/tap/grad: deletion +") and "vs the centre prior: deletion +0.000" in s
               for s in summary["faithfulness"])
    assert any(s.startswith("centre prior: deletion +") for s in summary["faithfulness"])
    assert "on the probe" not in descriptions(off)


def test_gradient_maps_and_rollout_are_logged_and_described(tmp_path):
    writer = SummaryWriter(str(tmp_path))
    x = images(3)
    summary = log_attention_maps(writer, DecidingTokens(1), x, torch.tensor([0, 1, 0]), 2, MapSettings(head_maps="none"))
    writer.close()
    acc = read_events(tmp_path)
    tags = set(acc.Tags()["images"])
    assert tags == {"maps/tap", "maps/tap/grad", "maps/rollout", "maps/rollout_grad", "matrix/tap"} == set(summary["images"])
    about = descriptions(acc)
    for tag in tags:
        assert f"| `{tag}` |" in about
    assert "Chefer" in about and "explained class: the true class" in about
    assert not summary["faithfulness"]


@pytest.mark.parametrize("name,kwargs,expect", [
    ("vit_tiny", dict(img_size=(16, 32), depth=2, dim=32, num_heads=2), {"maps/rollout_grad", "maps/blocks.1.attn/grad"}),
    ("resnet_fast", dict(attention="coord", widths=(8, 16, 16)), {"maps/layers.2.units.0.attn/grad"}),
])
def test_real_models_with_faithfulness(tmp_path, name, kwargs, expect):
    torch.manual_seed(0)
    model = visattn.create_model(name, num_classes=3, **kwargs).train()
    writer = SummaryWriter(str(tmp_path))
    summary = log_attention_maps(writer, model, images(2, hw=(16, 32)), torch.tensor([0, 1]), 0,
                                 MapSettings(head_maps="none", faithfulness=True))
    writer.close()
    tags = set(read_events(tmp_path).Tags()["images"])
    assert expect <= tags and tags == set(summary["images"]) and model.training
    # one line per map picture, and one for the centre prior
    assert len(summary["faithfulness"]) == len(tags) - sum(t.startswith("matrix/") for t in tags) + 1
