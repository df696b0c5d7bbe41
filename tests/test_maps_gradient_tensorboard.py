"""TensorBoard: gradient-weighted maps beside the raw ones (``maps/<layer>/grad``, ``maps/rollout_grad``), each
described in the text tab, and every card carrying how faithful its map is on the probe (deletion and insertion
scores against random orders, with their intervals) under its pictures, read back with TensorBoard's reader."""
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
from visattn.maps import log_attention_maps  # noqa: E402
from visattn.maps.draw import LINE_H, colour_bar  # noqa: E402


def read_events(logdir):
    acc = EventAccumulator(str(logdir), size_guidance={IMAGES: 0, SCALARS: 0, TENSORS: 0})
    acc.Reload()
    return acc


def decode(event):
    return np.asarray(Image.open(io.BytesIO(event.encoded_image_string)).convert("RGB"))


def descriptions(acc) -> str:
    return acc.Tensors("maps/descriptions/text_summary")[-1].tensor_proto.string_val[0].decode()


def notes_band(picture: np.ndarray, lines: int = 3) -> np.ndarray:
    """The rows between the last cells and the colour bar, where a card's notes are written."""
    bar = colour_bar(picture.shape[1], "gate").shape[0]
    return picture[-(bar + LINE_H * lines + 2) : -bar]


def green(a):
    return (a[..., 1] > 180) & (a[..., 0] < 160) & (a[..., 2] < 160)


def red(a):
    return (a[..., 0] > 200) & (a[..., 1] < 160) & (a[..., 2] < 160)


def test_cards_say_how_faithful_their_map_is(tmp_path):
    model, x = DecidingGate(grid=(4, 4)), images(8, hw=(32, 32))
    writer = SummaryWriter(str(tmp_path / "on"))
    summary = log_attention_maps(writer, model, x, None, 5, faithfulness=True)
    writer.close()
    writer = SummaryWriter(str(tmp_path / "off"))
    log_attention_maps(writer, model, x, None, 5)
    writer.close()
    on, off = read_events(tmp_path / "on"), read_events(tmp_path / "off")
    assert set(on.Tags()["images"]) == set(off.Tags()["images"]) == {"maps/tap", "maps/tap/grad"}
    assert {"faithfulness/tap/deletion", "faithfulness/tap/grad/insertion"} <= set(on.Tags()["scalars"])
    for tag in ("maps/tap", "maps/tap/grad"):
        with_notes, plain = decode(on.Images(tag)[0]), decode(off.Images(tag)[0])
        assert with_notes.shape[0] == plain.shape[0] + 3 * LINE_H + 2  # three lines above the colour bar
        assert has_colour_bar(with_notes) and on.Images(tag)[0].step == 5
        assert np.array_equal(with_notes[: plain.shape[0] - colour_bar(plain.shape[1], "gate").shape[0]],
                              plain[: plain.shape[0] - colour_bar(plain.shape[1], "gate").shape[0]])  # cells as before
    # the gradient map ranks the deciding cell first: better than random, written in green; the raw gate
    # ranks it last: worse than random, in red (no labels given, so the captions above are neither)
    grad_band, raw_band = notes_band(decode(on.Images("maps/tap/grad")[0])), notes_band(decode(on.Images("maps/tap")[0]))
    assert green(grad_band).sum() > 20 and not red(grad_band).any()
    assert red(raw_band).sum() > 20 and not green(raw_band).any()
    about = descriptions(on)
    line = next(s for s in about.splitlines() if s.startswith("| `maps/tap/grad` |"))
    assert "on the probe: deletion +" in line and "insertion +" in line and "explained class: the predicted class" in line
    raw_line = next(s for s in about.splitlines() if s.startswith("| `maps/tap` |"))
    assert "on the probe: deletion -" in raw_line
    assert any(s.startswith("maps/tap/grad: deletion +") for s in summary["faithfulness"])
    assert "on the probe" not in descriptions(off)


def test_gradient_maps_and_rollout_are_logged_and_described(tmp_path):
    writer = SummaryWriter(str(tmp_path))
    x = images(3)
    summary = log_attention_maps(writer, DecidingTokens(1), x, torch.tensor([0, 1, 0]), 2, head_maps="none")
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
    summary = log_attention_maps(writer, model, images(2, hw=(16, 32)), torch.tensor([0, 1]), 0, head_maps="none",
                                 faithfulness=True)
    writer.close()
    tags = set(read_events(tmp_path).Tags()["images"])
    assert expect <= tags and tags == set(summary["images"]) and model.training
    assert len(summary["faithfulness"]) == len(tags) - sum(t.startswith("matrix/") for t in tags)
