"""A screenshot of TensorBoard's Custom Scalars tab, as a person sees it, for docs/img/dashboard.png.

Starts the installed ``tensorboard`` on a free loopback port over a run's logs, opens its Custom Scalars tab in
headless Chromium (Debian package ``chromium``) with the settings docs/logging.md recommends (smoothing 0, outliers
kept) and saves the page as a PNG. Without ``--logdir`` it first trains the main example for ``--steps`` optimizer
steps (150: the factor's first change, at step 125, is in the picture) into a temporary directory.

    python examples/dashboard_screenshot.py                          # a fresh short run -> docs/img/dashboard.png
    python examples/dashboard_screenshot.py --logdir lightning_logs --out /tmp/dashboard.png
"""

from __future__ import annotations

import argparse
import http.server
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def train(logdir: Path, steps: int) -> None:
    """The main example (examples/configs/lm_ramp.yaml), cut to ``steps`` optimizer steps, logging to ``logdir``."""
    command = [
        sys.executable,
        str(ROOT / "examples" / "train_lm.py"),
        "fit",
        "--config",
        str(ROOT / "examples" / "configs" / "lm_ramp.yaml"),
        f"--trainer.max_steps={steps}",
        f"--trainer.default_root_dir={logdir}",
        "--trainer.enable_progress_bar=false",
    ]
    subprocess.run(command, check=True, cwd=ROOT)


def serve(logdir: Path, log: Path) -> tuple[subprocess.Popen, int]:
    """TensorBoard on a free loopback port; returns the process and the port once it answers."""
    command = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--port", "0", "--host", "127.0.0.1"]
    server = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and server.poll() is None:
        found = re.search(r"http://127\.0\.0\.1:(\d+)/", log.read_text())
        if found:
            try:
                opener.open(f"http://127.0.0.1:{found.group(1)}/data/runs", timeout=5).read()
                return server, int(found.group(1))
            except OSError:
                pass
        time.sleep(0.25)
    server.kill()
    raise RuntimeError(f"TensorBoard did not start:\n{log.read_text()[-2000:]}")


def outliers_kept(port: int) -> http.server.ThreadingHTTPServer:
    """A loopback proxy to TensorBoard on ``port`` whose page first turns "Ignore outliers in chart scaling" off.

    TensorBoard reads that setting from the browser's localStorage only (smoothing comes from the URL), and
    localStorage belongs to the page's origin: the proxy's page sets it before TensorBoard's code runs.
    """
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    setting = b'<head><script>localStorage.setItem("_ignoreYOutliers", "false")</script>'

    class Proxy(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            with opener.open(f"http://127.0.0.1:{port}{self.path}", timeout=30) as answer:
                body, kind = answer.read(), answer.headers.get("Content-Type", "")
            if self.path in ("/", "/index.html"):
                body = body.replace(b"<head>", setting, 1)
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    return proxy


def screenshot(port: int, out: Path, width: int, height: int) -> None:
    """Headless Chromium's picture of the Custom Scalars tab, as docs/logging.md recommends to view it.

    Without smoothing (a factor is a step function) and with outliers kept (the noise scale grows: its latest values
    are not outliers).
    """
    browser = next((shutil.which(name) for name in BROWSERS if shutil.which(name)), None)
    if browser is None:
        raise SystemExit("no Chromium found: install the Debian package `chromium`")
    proxy = outliers_kept(port)
    url = f"http://127.0.0.1:{proxy.server_address[1]}/#custom_scalars&_smoothingWeight=0"
    out.parent.mkdir(parents=True, exist_ok=True)
    command = [
        browser,
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        f"--window-size={width},{height}",
        "--virtual-time-budget=20000",  # let the charts fetch their data and draw
        f"--screenshot={out}",
        url,
    ]
    try:
        subprocess.run(command, check=True, capture_output=True, timeout=120)
    finally:
        proxy.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--logdir", type=Path, help="a TensorBoard log directory (default: train a short run first)")
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps of the short run")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "dashboard.png", help="the PNG to write")
    parser.add_argument("--width", type=int, default=1500)
    parser.add_argument("--height", type=int, default=2750)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        logdir = args.logdir
        if logdir is None:
            logdir = Path(scratch) / "logs"
            train(logdir, args.steps)
        server, port = serve(logdir, Path(scratch) / "tensorboard.log")
        try:
            screenshot(port, args.out, args.width, args.height)
        finally:
            server.kill()
            server.wait()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
