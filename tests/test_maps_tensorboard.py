"""log_attention_maps: the tags it writes, read back with TensorBoard's own reader, pictures that fit the
default card and carry their colour bar, descriptions in the text tab, NaN maps skipped, and a probe that
leaves the model as it found it. Tiny models with their own taps, independent of the real blocks."""
import copy
import io

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

import visattn

pytest.importorskip("tensorboard")
from conftest import has_colour_bar  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import (  # noqa: E402
    HISTOGRAMS,
    IMAGES,
    SCALARS,
    TENSORS,
    EventAccumulator,
)
from torch.utils.tensorboard import SummaryWriter  # noqa: E402

from visattn.attention.tap import AttentionTap  # noqa: E402
from visattn.maps import MapSettings, log_attention_maps  # noqa: E402
from visattn.maps.render import LINE_H, MAX_WIDTH  # noqa: E402

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
CLASSES = ["plane", "car", "bird"]


class SpatialGate(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 1, 7, padding=3)
        self.tap = AttentionTap("spatial")

    def forward(self, x):
        s = torch.cat([x.mean(1, keepdim=True), x.amax(1, keepdim=True)], 1)
        return x * self.tap(torch.sigmoid(self.conv(s)))  # gate (B, 1, H, W)


class ChannelGate(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.fc = nn.Linear(c, c)
        self.tap = AttentionTap("channel")

    def forward(self, x):
        return x * self.tap(torch.sigmoid(self.fc(x.mean((2, 3)))))[:, :, None, None]  # gate (B, C)


class TokenAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.tap = AttentionTap("token")

    def forward(self, x, grid, prefix):  # (B, N, D)
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = (q @ k.transpose(-2, -1) * (d // self.heads) ** -0.5).softmax(-1)  # (B, heads, N, N)
        attn = self.tap(attn, grid=grid, num_prefix_tokens=prefix)
        return x + self.proj((attn @ v).transpose(1, 2).reshape(b, n, d))


class SeqPool(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.score = nn.Linear(dim, 1)
        self.tap = AttentionTap("pool")

    def forward(self, x, grid):
        w = self.tap(self.score(x).squeeze(-1).softmax(-1), grid=grid, num_prefix_tokens=0)  # (B, N)
        return (w[:, :, None] * x).sum(1)


class TinyHybrid(nn.Module):
    """conv + BN stem, spatial and channel gates, patch tokens on a 4x8 grid, then a class token (pool='cls')
    or sequence pooling (pool='seq') over two token layers."""

    def __init__(self, pool="cls", dim=16, heads=2, num_classes=3):
        super().__init__()
        self.pool = pool
        self.num_prefix_tokens = 1 if pool == "cls" else 0
        self.stem = nn.Sequential(nn.Conv2d(3, dim, 3, padding=1), nn.BatchNorm2d(dim), nn.ReLU())
        self.spatial = SpatialGate()
        self.channel = ChannelGate(dim)
        self.patch = nn.Conv2d(dim, dim, 4, stride=4)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.blocks = nn.ModuleList([TokenAttention(dim, heads) for _ in range(2)])
        self.seq_pool = SeqPool(dim) if pool == "seq" else None
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x):
        x = self.channel(self.spatial(self.stem(x)))
        x = self.patch(x)  # (B, D, h, w)
        grid = tuple(x.shape[-2:])
        x = x.flatten(2).transpose(1, 2)  # (B, h*w, D)
        if self.pool == "cls":
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], 1)
        for blk in self.blocks:
            x = blk(x, grid, self.num_prefix_tokens)
        x = x[:, 0] if self.pool == "cls" else self.seq_pool(x, grid)
        return self.head(self.drop(x))


def read_events(logdir):
    acc = EventAccumulator(str(logdir), size_guidance={IMAGES: 0, HISTOGRAMS: 0, SCALARS: 0, TENSORS: 0})
    acc.Reload()
    return acc


def descriptions(acc) -> str:
    return acc.Tensors("maps/descriptions/text_summary")[-1].tensor_proto.string_val[0].decode()


def decode(event):
    return np.asarray(Image.open(io.BytesIO(event.encoded_image_string)).convert("RGB"))


def probe_batch(b=3, h=16, w=32):
    g = torch.Generator().manual_seed(0)
    return torch.randn(b, 3, h, w, generator=g)


def test_logs_expected_tags_legibly(tmp_path):
    torch.manual_seed(0)
    model = TinyHybrid("cls")
    images = probe_batch()
    with torch.no_grad():
        preds = model.eval()(images).argmax(-1)
    labels = preds.clone()
    labels[1] = (preds[1] + 1) % 3  # image 0 right, image 1 wrong

    writer = SummaryWriter(str(tmp_path))
    summary = log_attention_maps(writer, model, images, labels, step=7,
                                 settings=MapSettings(mean=MEAN, std=STD, class_names=CLASSES))
    writer.close()

    acc = read_events(tmp_path)
    image_tags = set(acc.Tags()["images"])
    # gradient maps by default; the spatial gate's grid and the blocks' token grid differ, so also layers_grad
    expected = {"maps/spatial", "maps/rollout", "maps/spatial/grad", "maps/rollout_grad", "maps/layers_grad"}
    for blk in ("blocks.0", "blocks.1"):
        expected |= {f"maps/{blk}", f"matrix/{blk}", f"maps/{blk}/cls_head0", f"maps/{blk}/cls_head1",
                     f"maps/{blk}/grad"}
    assert image_tags == expected
    assert set(acc.Tags()["histograms"]) == {"channel/channel"}
    assert set(summary["images"]) == expected and summary["histograms"] == ["channel/channel"]
    assert acc.Histograms("channel/channel")[0].step == 7

    # 16x32 images at scale 2 (32x64 tiles): cells of original + overlay, 130 px, two to a row: 266 px wide
    for tag in expected:
        ev = acc.Images(tag)[0]
        assert ev.step == 7
        assert ev.width <= MAX_WIDTH  # fits TensorBoard's default card without a scroll bar
        picture = decode(ev)
        assert has_colour_bar(picture), tag
        if tag.startswith("maps/"):
            assert ev.width == 2 * 130 + 6
            assert 2 * 32 < ev.height < 2 * 32 + 2 * 60 + 60
    about = descriptions(acc)
    for tag in expected | {"channel/channel"}:
        assert f"| `{tag}` |" in about, tag  # one line per tag in the text tab
    assert "fixed 0-1" in about and "x uniform" in about

    grid = decode(acc.Images("maps/spatial")[0])
    green = (grid[:, :, 1] > 180) & (grid[:, :, 0] < 160)
    red = (grid[:, :, 0] > 200) & (grid[:, :, 1] < 160) & (grid[:, :, 2] < 160)
    # Captions sit above each cell's tiles: image 0's (left) in green (right), image 1's (right) in red (wrong).
    cap = slice(0, LINE_H)
    assert green[cap, :130].any() and not red[cap, :130].any()
    assert red[cap, 136:].any()


def test_matrix_has_axes_and_marks_the_class_token(tmp_path):
    torch.manual_seed(0)
    writer = SummaryWriter(str(tmp_path))
    log_attention_maps(writer, TinyHybrid("cls"), probe_batch(b=1), None, 0)
    writer.close()
    pic = decode(read_events(tmp_path).Images("matrix/blocks.0")[0])
    white = (pic == 255).all(-1)
    rows = np.nonzero(white.sum(1) > 200)[0]
    cols = np.nonzero(white.sum(0) > 100)[0]
    assert len(rows) == 1 and len(cols) == 1  # the line after the class token's row and column
    assert (pic[:, :14] != pic[0, 0]).any()  # the sideways "query token" label left of the matrix
    assert has_colour_bar(pic)


def test_nan_map_is_skipped_with_a_warning(tmp_path):
    torch.manual_seed(0)
    model = TinyHybrid("cls")
    model.spatial.conv.bias.data.fill_(float("nan"))  # the spatial gate is NaN, and so is all that follows
    writer = SummaryWriter(str(tmp_path))
    with pytest.warns(RuntimeWarning) as caught:
        summary = log_attention_maps(writer, model, probe_batch(b=2), None, 0, MapSettings(faithfulness=True))
    writer.close()
    messages = " ".join(str(w.message) for w in caught)
    for name in ("maps/spatial", "maps/rollout", "matrix/blocks.0", "channel/channel"):
        assert f"{name} has NaN or inf" in messages
    assert summary["images"] == [] and summary["histograms"] == [] and summary["scalars"] == []
    assert {"spatial", "rollout", "matrix/blocks.1", "channel/channel"} <= set(summary["skipped"])


def test_per_image_norm_and_faithfulness_scalars(tmp_path):
    torch.manual_seed(0)
    model = TinyHybrid("seq")
    writer = SummaryWriter(str(tmp_path))
    summary = log_attention_maps(writer, model, probe_batch(b=2), torch.tensor([0, 2]), 3,
                                 MapSettings(norm="per_image", faithfulness=True))
    writer.close()
    acc = read_events(tmp_path)
    assert set(acc.Tags()["scalars"]) == set(summary["scalars"])
    assert {"faithfulness/seq_pool/deletion", "faithfulness/rollout/insertion"} <= set(summary["scalars"])
    assert all(np.isfinite(acc.Scalars(t)[0].value) and acc.Scalars(t)[0].step == 3 for t in summary["scalars"])
    assert has_colour_bar(decode(acc.Images("maps/seq_pool")[0]))
    assert "stretched per image" in descriptions(acc) or "per image" in str(summary)
    with pytest.raises(ValueError, match="norm"):
        log_attention_maps(writer, model, probe_batch(b=1), None, 0, MapSettings(norm="minmax"))


def test_probe_leaves_model_untouched(tmp_path):
    torch.manual_seed(0)
    model = TinyHybrid("cls")
    images = probe_batch(b=2)
    model.train()
    model.stem[1].eval()  # a frozen BN inside a training model must stay frozen
    model(images).sum().backward()  # some gradients to keep
    state = copy.deepcopy(model.state_dict())
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    modes = {n: m.training for n, m in model.named_modules()}
    rng = torch.get_rng_state()

    writer = SummaryWriter(str(tmp_path))
    log_attention_maps(writer, model, images, None, step=0, settings=MapSettings(mean=MEAN, std=STD))
    writer.close()

    assert {n: m.training for n, m in model.named_modules()} == modes
    after = model.state_dict()
    assert all(torch.equal(state[k], after[k]) for k in state)  # incl. BN running stats and counters
    assert all(torch.equal(grads[n], p.grad) for n, p in model.named_parameters() if n in grads)
    assert torch.equal(rng, torch.get_rng_state())
    assert all(t.sink is None for t in model.modules() if isinstance(t, AttentionTap))


def test_seq_pool_model_without_class_token(tmp_path):
    torch.manual_seed(0)
    model = TinyHybrid("seq")
    writer = SummaryWriter(str(tmp_path))
    summary = log_attention_maps(writer, model, probe_batch(b=2), torch.tensor([0, 2]), step=1, settings=MapSettings(scale=2))
    writer.close()
    tags = set(read_events(tmp_path).Tags()["images"])
    assert {"maps/seq_pool", "maps/rollout", "maps/blocks.0", "matrix/blocks.1"} <= tags
    assert not any("cls_head" in t for t in tags)
    assert tags == set(summary["images"])


def test_head_maps_option(tmp_path):
    model = TinyHybrid("cls")
    writer = SummaryWriter(str(tmp_path))
    last = log_attention_maps(writer, model, probe_batch(b=1), None, 0, MapSettings(scale=1, head_maps="last"))
    assert all(has_colour_bar(decode(e)) for t in ["maps/rollout"] for e in read_events(tmp_path).Images(t))
    none = log_attention_maps(writer, model, probe_batch(b=1), None, 0, MapSettings(scale=1, head_maps="none"))
    writer.close()
    assert sorted(t for t in last["images"] if "cls_head" in t) == ["maps/blocks.1/cls_head0", "maps/blocks.1/cls_head1"]
    assert not any("cls_head" in t for t in none["images"])
    with pytest.raises(ValueError, match="head_maps"):
        log_attention_maps(writer, model, probe_batch(b=1), None, 0, MapSettings(head_maps="first"))


# --------------------------------------------------------------------------------------------- real models


@pytest.mark.parametrize(
    "name,kwargs,expect",
    [
        ("vit_tiny", dict(img_size=(16, 32), depth=2, dim=32, num_heads=2), {"maps/rollout", "maps/blocks.1.attn/cls_head1"}),
        ("vit_tiny", dict(img_size=(16, 32), depth=2, dim=32, num_heads=2, pool="mean"), {"maps/rollout"}),
        ("cct_2", dict(img_size=(16, 32), depth=2, dim=32, num_heads=2), {"maps/rollout", "maps/seq_pool"}),
        ("resnet_fast", dict(attention="cbam", widths=(16, 32, 32)), {"maps/layers.2.units.0.attn.spatial"}),
    ],
)
def test_real_models(tmp_path, name, kwargs, expect):
    torch.manual_seed(0)
    model = visattn.create_model(name, num_classes=3, **kwargs).train()
    state = copy.deepcopy(model.state_dict())
    writer = SummaryWriter(str(tmp_path))
    summary = log_attention_maps(writer, model, probe_batch(b=2), torch.tensor([0, 1]), 0,
                                 MapSettings(MEAN, STD, CLASSES, scale=2))
    writer.close()
    tags = set(read_events(tmp_path).Tags()["images"])
    assert expect <= tags and tags == set(summary["images"]) and not summary["skipped"]
    assert model.training and all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


@pytest.mark.parametrize("setting,cost,steps_scored,said", [
    ("auto", 2.0, [1], True),  # 2 s against a 10 s epoch: over the 5% budget, scored once, then off with a line
    ("auto", 0.2, [1, 2, 3], False),  # within the budget: kept
    (True, 2.0, [1, 2, 3], False),  # always
    (False, 0.0, [], False),  # never
], ids=["auto-over", "auto-within", "true", "false"])
def test_map_logger_keeps_faithfulness_only_within_its_budget(monkeypatch, setting, cost, steps_scored, said):
    from visattn.config import Config
    from visattn.maps import MapLogger, tensorboard

    scored, lines = [], []

    def fake_log(writer, model, images, labels, step, settings, boxes=None, cards=tensorboard.CARDS):
        assert settings.scale == 2 and settings.class_names == CLASSES and boxes is None
        assert list(cards) == list(tensorboard.CARDS)  # the logger iterates its list of cards
        if settings.faithfulness:
            scored.append(step)
            return {"skipped": ["rollout"], "faithfulness_seconds": [cost]}
        return {"skipped": []}

    monkeypatch.setattr(tensorboard, "log_attention_maps", fake_log)
    cfg = Config()
    cfg = cfg.model_copy(update={"log": cfg.log.model_copy(update={"faithfulness": setting})})
    logger = MapLogger(cfg, CLASSES, say=lines.append)
    skipped = [logger.log(None, None, (None, None), step, epoch_seconds=10.0) for step in (1, 2, 3)]
    assert scored == steps_scored and logger.faithfulness_on == (setting is True or (setting == "auto" and not said))
    assert skipped[0] == (["rollout"] if steps_scored else [])
    assert len(lines) == int(said)
    if said:
        assert lines[0] == ("log.faithfulness=auto: the faithfulness scores took 2.0 s, more than 5% of the 10 s "
                            "epoch; not computed again in this run (log.faithfulness=true keeps them)")
