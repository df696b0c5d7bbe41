"""The grid probe card (#93): ``maps/grid_probe`` logs one picture per logging step, its per-class maps follow a
planted model's classes to their cells, and ``python -m visattn.visualize --grid`` writes the same picture."""
import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from visattn.maps import MapSettings, log_attention_maps
from visattn.maps.grid import grid_cells, grid_probe, tile
from visattn.visualize import main as visualize_main


class CellStage(nn.Module):
    """Channel k: the image's first channel inside cell k of a 2x2 layout (the input's quarters), zero elsewhere."""

    def forward(self, x):
        h, w = x.shape[-2:]
        cy = torch.arange(h) * 2 // h
        cx = torch.arange(w) * 2 // w
        cell = cy[:, None] * 2 + cx[None, :]
        masks = torch.stack([(cell == k).to(x.dtype) for k in range(4)])  # (4, H, W)
        return self.scale * x[:, :1] * masks[None]

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))


class Planted(nn.Module):
    """Class k's logit is the mean of channel k: class k reads cell k and nothing else."""

    def __init__(self):
        super().__init__()
        self.stage = CellStage()
        self.head = nn.Flatten(2)

    def forward(self, x):
        return self.head(self.stage(x)).mean(-1)


class Writer:
    def __init__(self):
        self.images, self.texts = [], []

    def add_image(self, tag, img, step, dataformats="HWC"):
        self.images.append((tag, step, np.asarray(img)))

    def add_text(self, tag, text, step):
        self.texts.append((tag, text))

    def add_histogram(self, *a, **k):
        pass

    def add_scalar(self, *a, **k):
        pass


def probe(b=6, size=8):
    """Positive images (the planted evidence is the first channel's value) and labels 0, 1, 2, 3, 0, 1."""
    gen = torch.Generator().manual_seed(0)
    return torch.rand(b, 3, size, size, generator=gen) + 0.5, torch.arange(b) % 4


def test_tile_keeps_cells_in_place():
    cells = torch.arange(4.0)[:, None, None, None].expand(4, 1, 2, 3)
    grid = tile(cells, 2)[0, 0]
    assert grid.shape == (4, 6)
    assert grid[:2, :3].eq(0).all() and grid[:2, 3:].eq(1).all() and grid[2:, :3].eq(2).all() and grid[2:, 3:].eq(3).all()
    assert grid_cells(torch.tensor([3, 3, 1, 0, 1, 2, 5])) == [0, 2, 3, 5]
    assert grid_cells(torch.tensor([0, 1, 1, 2])) is None


def test_planted_class_maps_differ_and_sit_in_their_cells():
    x, y = probe()
    gp = grid_probe(Planted(), x, y)
    assert gp is not None and gp.map.name == "gradcam" and not gp.downscaled
    assert gp.classes.tolist() == [0, 1, 2, 3]
    heat = gp.map.heat
    for a in range(4):
        for b in range(a + 1, 4):
            assert not torch.allclose(heat[a], heat[b]), (a, b)
    assert torch.allclose(gp.share, torch.ones(4, dtype=gp.share.dtype))
    # a class placed in another cell: its map follows the class, not the position
    order = torch.tensor([1, 0, 2, 3])
    gp2 = grid_probe(Planted(), x[order], y[order])
    assert gp2.classes.tolist() == [1, 0, 2, 3]
    # class 1 now sits in cell 0 but the model reads cell 1 for it (and class 0 the other way round): no mass
    assert gp2.share.tolist() == pytest.approx([0.0, 0.0, 1.0, 1.0])
    h = gp2.map.heat[0]  # class 1's map: all of it in the top-right quarter, where the model reads class 1
    assert h.shape == (16, 16) and h[:8, 8:].min() > 0 and h[8:].abs().sum() == 0 and h[:, :8].abs().sum() == 0


def test_card_logs_one_grid_per_step_only_when_asked():
    x, y = probe()
    model, writer = Planted(), Writer()
    on = MapSettings(class_names=list("abcd"), grid_probe=True, gradient_maps=False)
    for step in (0, 1):
        summary = log_attention_maps(writer, model, x, y, step, on)
        assert "maps/grid_probe" in summary["images"]
    grids = [(tag, step, img) for tag, step, img in writer.images if tag == "maps/grid_probe"]
    assert [s for _, s, _ in grids] == [0, 1]
    assert np.array_equal(grids[0][2], grids[1][2])  # a fixed grid: the same picture at a fixed model
    assert grids[0][2].ndim == 3 and grids[0][2].shape[-1] == 3 and grids[0][2].shape[1] > 4 * 16
    assert "maps/grid_probe" in writer.texts[-1][1]
    off = Writer()
    log_attention_maps(off, model, x, y, 0, MapSettings(gradient_maps=False))
    assert not any(tag == "maps/grid_probe" for tag, _, _ in off.images)
    few = Writer()
    summary = log_attention_maps(few, model, x, torch.tensor([0, 1, 2, 0, 1, 2]), 0, on)
    assert "maps/grid_probe" in summary["skipped"]


def test_model_that_takes_only_its_size_sees_a_downscaled_grid():
    class Fixed(Planted):
        def forward(self, x):
            if x.shape[-1] != 8:
                raise ValueError("fixed position embedding")
            return super().forward(x)

    x, y = probe()
    gp = grid_probe(Fixed(), x, y)
    assert gp.downscaled and gp.input_hw == (8, 8) and tuple(gp.grid.shape[-2:]) == (16, 16)
    assert gp.share.min() > 0.9  # cell placement survives the downscale


@pytest.mark.parametrize("name, kwargs", [
    ("resnet_fast", dict(widths=[8, 16, 16], stem_width=8, attention="none")),
    ("cct_2", dict(img_size=32)),
])
def test_stage_gradcam_matches_the_grid_games(name, kwargs):
    """Grad-CAM at the last stage output (a token model: its final LayerNorm's grid tokens), float64, against
    bench/grid_game.py's ``gradcam@<last stage>``, and by hand for the CNN."""
    import visattn
    from bench.grid_game import gradcams
    from visattn.maps.grid import stage_gradcam

    torch.manual_seed(0)
    model = visattn.create_model(name, num_classes=10, **kwargs).eval().double()
    x, y = torch.randn(4, 3, 32, 32, dtype=torch.float64), torch.tensor([0, 3, 5, 9])
    ours = stage_gradcam(model, x, y)
    ref = gradcams(model, x, y)
    last = list(ref)[-1]
    assert last == ("gradcam@norm" if name == "cct_2" else "gradcam@layers.2")
    torch.testing.assert_close(ours.heat.double(), ref[last][1].double(), rtol=1e-6, atol=1e-9)
    assert ours.heat.abs().max() > 0
    if name == "resnet_fast":  # by hand: the last stage's output A, relu(sum_c mean(dlogit/dA_c) A_c)
        a = model.layers(model.stem(x)).detach().requires_grad_(True)
        logits = model.fc(torch.flatten(model.pool(a), 1))
        (g,) = torch.autograd.grad(logits.gather(1, y[:, None]).sum(), a)
        cam = torch.relu((g.mean((2, 3), keepdim=True) * a.detach()).sum(1))
        torch.testing.assert_close(ours.heat.double(), cam, rtol=1e-4, atol=1e-7)  # the map is fp32


def test_config_key_reaches_the_settings():
    from conftest import SMOKE

    from visattn.config import load_config

    assert MapSettings.from_config(load_config(SMOKE, ["log.grid_probe=true"])).grid_probe
    assert not MapSettings.from_config(load_config(SMOKE, [])).grid_probe


def test_visualize_grid_writes_png(finished_run, tmp_path, capsys):
    out = tmp_path / "pics"
    code = visualize_main(["--checkpoint", str(finished_run / "last.pt"), "--grid", "--data", "synthetic",
                           "--out", str(out), "--scale", "2"])
    assert code == 0, capsys.readouterr().err
    img = np.asarray(Image.open(out / "grid_probe.png"))
    assert img.ndim == 3 and img.shape[1] >= 4 * 64
    assert capsys.readouterr().out.startswith("wrote ")


def test_visualize_grid_without_out_is_one_line(finished_run, capsys):
    assert visualize_main(["--checkpoint", str(finished_run / "last.pt"), "--grid"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "--grid" in err and "\n" not in err


@pytest.mark.parametrize("labels", [[0, 0, 1, 1, 2, 2]])
def test_too_few_classes_gives_none(labels):
    x, _ = probe()
    assert grid_probe(Planted(), x, torch.tensor(labels)) is None


def test_map_logger_draws_the_grid_and_leaves_the_model_alone():
    """Through a run's MapLogger (log.grid_probe=true), on a real CNN in training mode: the card is drawn, and
    the model's weights, BN statistics, train flags and gradients are as they were."""
    import copy

    from conftest import SMOKE

    import visattn
    from visattn.config import load_config
    from visattn.maps import MapLogger

    cfg = load_config(SMOKE, ["log.grid_probe=true", "log.faithfulness=false"])
    torch.manual_seed(0)
    model = visattn.create_model("resnet_fast", num_classes=10, widths=[8, 16, 16], stem_width=8,
                                 attention="cbam").train()
    state = copy.deepcopy(model.state_dict())
    x, y = torch.randn(8, 3, 32, 32), torch.arange(8)
    writer = Writer()
    MapLogger(cfg, [str(i) for i in range(10)], say=lambda *a: None).log(writer, model, (x, y), 3)
    grids = [(tag, step) for tag, step, _ in writer.images if tag == "maps/grid_probe"]
    assert grids == [("maps/grid_probe", 3)]
    assert model.training and all(m.training for m in model.modules())
    assert all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
