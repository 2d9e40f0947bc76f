"""A screenshot of TensorBoard's Custom Scalars tab, as a person sees it, for docs/img/dashboard.png.

Starts the installed ``tensorboard`` on a free loopback port over a run's logs, opens its Custom Scalars tab in
headless Chromium (Debian package ``chromium``) and saves the page as a PNG. Without ``--logdir`` it first trains the
main example for ``--steps`` optimizer steps (about a minute for 120 on a 2-core CPU) into a temporary directory.

    python examples/dashboard_screenshot.py                          # a fresh short run -> docs/img/dashboard.png
    python examples/dashboard_screenshot.py --logdir lightning_logs --out /tmp/dashboard.png
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
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


def screenshot(port: int, out: Path, width: int, height: int) -> None:
    """Headless Chromium's picture of the Custom Scalars tab, without smoothing (a factor is a step function)."""
    browser = next((shutil.which(name) for name in BROWSERS if shutil.which(name)), None)
    if browser is None:
        raise SystemExit("no Chromium found: install the Debian package `chromium`")
    url = f"http://127.0.0.1:{port}/#custom_scalars&_smoothingWeight=0"
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
    subprocess.run(command, check=True, capture_output=True, timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--logdir", type=Path, help="a TensorBoard log directory (default: train a short run first)")
    parser.add_argument("--steps", type=int, default=120, help="optimizer steps of the short run")
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
