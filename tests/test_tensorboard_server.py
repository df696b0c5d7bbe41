"""A real TensorBoard server on a tiny run's directory serves the attention overlays as PNGs.

The server listens on 127.0.0.1 only, on a free port; the test waits for it by polling its HTTP API (at
most ``DEADLINE_S``) and always stops it (terminate, then kill) in a ``finally`` block.
"""
from __future__ import annotations

import io
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Tuple

import pytest
from PIL import Image

pytest.importorskip("tensorboard")

from visattn.config import build_config, load_config, read_yaml  # noqa: E402
from visattn.trainer import run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEADLINE_S = 60.0
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# Loopback requests must not go through an HTTP proxy from the environment.
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tensorboard_command(logdir: Path, port: int) -> list:
    entry = Path(sys.executable).with_name("tensorboard")  # the venv's console script, beside its python
    head = [str(entry)] if entry.exists() else [sys.executable, "-m", "tensorboard.main"]
    return head + ["--logdir", str(logdir), "--host", "127.0.0.1", "--port", str(port), "--reload_interval", "1"]


def get(port: int, path: str, **params) -> tuple:
    url = f"http://127.0.0.1:{port}{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
    with OPENER.open(url, timeout=10) as r:
        return r.status, r.headers.get("Content-Type", ""), r.read()


def poll(proc: subprocess.Popen, log_path: Path, what: str, probe: Callable[[], Tuple[Any, str]]) -> Any:
    """Call ``probe`` (-> (value or None, what it saw)) every 0.5 s until it returns a value; fail at once if the
    server exits, or after ``DEADLINE_S`` naming the last thing seen."""
    deadline = time.monotonic() + DEADLINE_S
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            found, last = probe()
            if found is not None:
                return found
        except (urllib.error.URLError, ConnectionError, OSError) as e:
            last = f"{e.__class__.__name__}: {e}"
        try:  # the pause between polls; returns at once if the server has died
            proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            continue
        pytest.fail(f"tensorboard exited with {proc.returncode}: {log_path.read_text()[-2000:]}")
    pytest.fail(f"tensorboard served no {what} within {DEADLINE_S:.0f} s ({last})")


def wait_for_tags(proc: subprocess.Popen, port: int, run_name: str, log_path: Path) -> dict:
    """The images plugin's tags of ``run_name``, once it lists any."""
    def probe():
        status, _, body = get(port, "/data/plugin/images/tags")
        tags = json.loads(body).get(run_name, {})
        return (tags if status == 200 and tags else None), f"HTTP {status}, runs {sorted(json.loads(body))}"

    return poll(proc, log_path, f"image tags for run {run_name!r}", probe)


def text_of(proc: subprocess.Popen, port: int, run_name: str, prefix: str, log_path: Path) -> str:
    """The latest text summary whose tag starts with ``prefix`` (SummaryWriter appends "/text_summary"), as the
    text plugin serves it; polled like the images, since plugins load independently."""
    def probe():
        _, _, body = get(port, "/data/plugin/text/tags")
        tags = [t for t in json.loads(body).get(run_name, []) if t.startswith(prefix)]
        if not tags:
            return None, f"text tags {sorted(json.loads(body).get(run_name, []))}"
        _, _, body = get(port, "/data/plugin/text/text", run=run_name, tag=tags[0])
        entries = json.loads(body)
        return (entries[-1]["text"] if entries else None), f"{len(entries)} entries for {tags[0]}"

    return poll(proc, log_path, f"text for {prefix!r}", probe)


def test_tensorboard_serves_overlay_png(tmp_path):
    run_dir = tmp_path / "run"
    tree = read_yaml(ROOT / "configs" / "smoke.yaml")
    tree["run_dir"] = str(run_dir)
    tree["model"].update(widths=[8, 16, 16], stem_width=8, attention="cbam")
    tree["data"].update(synthetic_size=240, val_size=40)
    tree["train"].update(epochs=1, batch_size=40)
    tree["eval"] = {"batch_size": 100, "tta": "none"}
    tree["log"].update(progress=False, probe_size=2, map_scale=4)
    run(build_config(tree), log=lambda *a, **k: None)

    with serving(run_dir, tmp_path) as (proc, port, log_path):
        tags = wait_for_tags(proc, port, "tb", log_path)  # SummaryWriter writes to RUN/tb: run "tb"
        overlays = sorted(t for t in tags if t.startswith("maps/") and t.endswith(".spatial"))
        assert overlays == [f"maps/layers.{i}.units.0.attn.spatial" for i in range(3)]

        status, ctype, body = get(port, "/data/plugin/images/images", run="tb", tag=overlays[0], sample=0)
        assert status == 200 and "json" in ctype
        entries = json.loads(body)
        assert [e["step"] for e in entries] == [1]
        status, ctype, png = get(port, "/data/plugin/images/individualImage?" + entries[0]["query"])
        assert status == 200 and ctype.startswith("image/png")
        assert png[:8] == PNG_SIGNATURE
        image = Image.open(io.BytesIO(png))
        # two probe images: rows of the 32x32 original and its overlay, each drawn at 128x128, then the colour bar
        assert image.width == 2 * 128 + 2
        assert 2 * 128 < image.height < 2 * 128 + 2 * 60 + 60

        # the text tab: one line per tag, saying what the map is and its scale
        text = text_of(proc, port, "tb", "maps/descriptions", log_path)
        for tag in overlays:
            assert tag in text
        assert "gate value, fixed 0-1" in text
        # the gradient-weighted maps beside them, and (smoke.yaml: log.faithfulness) every map's line and card
        # saying how faithful it is on the probe
        assert {f"{t}/grad" for t in overlays} <= set(tags)
        # the gates, their /grad maps and the stages' /grad maps joined (layers_grad): the text tab is HTML
        assert text.count("on the probe: deletion") == 2 * len(overlays) + 1


def test_the_shipped_cbam_config_shows_every_map_card_with_its_faithfulness(tmp_path):
    """``configs/attention/resnet_fast_cbam.yaml`` as shipped (its model, probe, map and faithfulness settings:
    ``log.faithfulness: auto`` scores the first logging epoch), on a small synthetic split for one epoch: every
    map TensorBoard shows, the gates and their gradient-weighted versions, carries its faithfulness on the probe,
    on the card and in the Text tab."""
    run_dir = tmp_path / "run"
    overrides = [f"run_dir={run_dir}", "data.source=synthetic", "data.synthetic_size=700", "data.val_size=60",
                 "train.epochs=1", "eval.tta=none", "log.progress=false"]
    cfg = load_config(ROOT / "configs" / "attention" / "resnet_fast_cbam.yaml", overrides)
    assert cfg.log.faithfulness == "auto" and cfg.log.gradient_maps and cfg.log.maps_every == 1
    run(cfg, log=lambda *a, **k: None)

    with serving(run_dir, tmp_path) as (proc, port, log_path):
        tags = sorted(t for t in wait_for_tags(proc, port, "tb", log_path) if t.startswith("maps/"))
        gates = [f"maps/layers.{i}.units.0.attn.spatial" for i in range(3)]
        assert tags == sorted(gates + [f"{g}/grad" for g in gates] + ["maps/layers_grad"])
        text = text_of(proc, port, "tb", "maps/descriptions", log_path)
        rows = {tag: row for row in text.split("<tr>") for tag in tags if f"<code>{tag}</code>" in row}
        assert sorted(rows) == tags
        for tag, row in rows.items():
            assert "on the probe: deletion" in row and "insertion" in row, tag
        for tag in tags:  # every card is served as a picture (what it draws: test_maps_gradient_tensorboard.py)
            _, _, body = get(port, "/data/plugin/images/images", run="tb", tag=tag, sample=0)
            _, _, png = get(port, "/data/plugin/images/individualImage?" + json.loads(body)[0]["query"])
            assert png[:8] == PNG_SIGNATURE


@contextmanager
def serving(run_dir: Path, tmp_path: Path) -> Iterator[Tuple[subprocess.Popen, int, Path]]:
    """A TensorBoard server on ``run_dir`` (loopback, a free port), always stopped on the way out."""
    port = free_port()
    log_path = tmp_path / "tensorboard.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(tensorboard_command(run_dir, port), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    try:
        yield proc, port, log_path
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)
