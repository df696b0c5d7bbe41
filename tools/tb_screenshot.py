"""A real screenshot of TensorBoard's Images tab for a run folder, taken with headless Chromium.

    python tools/tb_screenshot.py RUN_DIR/tb assets/tensorboard_timm.png --filter 'maps/.*conv3' [--size 1280,900]

Starts ``tensorboard --logdir LOGDIR`` on a free loopback port, waits until it serves the run, points headless
Chromium (``/usr/bin/chromium``, Debian's package) at the Images tab with ``--filter`` as the tag filter, and writes
the PNG. The server is always stopped. Chromium runs without network access beyond loopback.
"""
from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(url: str, deadline: float) -> None:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    while time.monotonic() < deadline:
        try:
            with opener.open(url, timeout=5) as r:
                if r.status == 200 and len(r.read()) > 2:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit(f"tb_screenshot: TensorBoard did not serve {url} in time")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logdir")
    ap.add_argument("out")
    ap.add_argument("--filter", default="maps/", help="the Images tab's tag filter (a regular expression)")
    ap.add_argument("--size", default="1280,900", help="window width,height in pixels")
    ap.add_argument("--wait-ms", type=int, default=15000, help="Chromium's virtual time budget for the page to render")
    args = ap.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("tb_screenshot: no chromium on PATH (apt-get install chromium)")
    port = free_port()
    tb = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", args.logdir, "--host", "127.0.0.1",
                           "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(f"http://127.0.0.1:{port}/data/plugin/images/tags", time.monotonic() + 120)
        url = f"http://127.0.0.1:{port}/?tagFilter={urllib.parse.quote(args.filter)}#images"
        with tempfile.TemporaryDirectory() as profile:
            subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={args.size}",
                            f"--virtual-time-budget={args.wait_ms}", f"--screenshot={Path(args.out).resolve()}", url],
                           check=True, capture_output=True, timeout=180)
    finally:
        tb.terminate()
        try:
            tb.wait(10)
        except subprocess.TimeoutExpired:
            tb.kill()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
