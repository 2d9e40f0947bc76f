"""The dashboard as TensorBoard itself serves it: the installed ``tensorboard`` on a loopback port, asked over HTTP.

A short real fit writes the logs; the test reads the Custom Scalars layout from TensorBoard's data API and resolves
every chart's patterns there, as the browser does, then checks each chart draws exactly the tags meant for it and
that no chart overlays quantities whose ranges differ by more than 10x.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_accum import AccumulationScheduler
from tests.helpers import RegressionModule, loader, make_data, trainer

RUN = "run/version_0"
# what each chart must draw: written out here, not read from the code under test
INTENDED = {
    "factor": {"accum/factor"},
    "effective batch": {"accum/effective_batch_size"},
    "items in the window": {"accum/window_samples"},
    "lr as used": {"accum/lr"},
    "lr scale": {"accum/lr_scale"},
    "window loss": {"accum/window_loss"},
    "throughput (samples/s)": {"accum/samples_per_second"},
    "samples seen": {"accum/samples_seen"},
    "optimizer steps": {"accum/optimizer_steps"},
    "micro-steps": {"accum/micro_steps"},
    "memory (MiB)": {"accum/memory_rss_mb"},
    "critical batch (noise scale, with adaptive growth's bounds)": {
        "accum/noise_scale",
        "accum/noise_scale_low",
        "accum/noise_scale_high",
    },
    "noise scale / effective batch (above 1: a larger batch pays)": {"accum/noise_scale_to_batch"},
    "|G|^2": {"accum/noise_grad_sq"},
    "tr(Sigma)": {"accum/noise_trace"},
    "measurements behind the estimate": {"accum/noise_measurements"},
}
NOT_CHARTED = {"accum/micro_batch_size", "accum/world_size"}  # constants of the run, in the summary instead


_LOOPBACK = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through a proxy


def _get(port: int, path: str, **query: str) -> object:
    url = f"http://127.0.0.1:{port}{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
    with _LOOPBACK.open(url, timeout=10) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A fit's logs, served by a real TensorBoard on a free loopback port: yields (port, tags logged)."""
    logdir = tmp_path_factory.mktemp("tb")
    x, y = make_data(64)
    logger = TensorBoardLogger(logdir, name="run", version=0)
    callback = AccumulationScheduler(
        {0: 2, 3: 4},
        unit="step",
        lr_scaling="sqrt",
        normalize_by="sample",
        noise_scale=True,
        noise_scale_interval=1,
        adaptive=True,
    )
    trainer([callback], max_epochs=2, logger=logger, log_every_n_steps=1).fit(RegressionModule(), loader(x, y, 4))
    command = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--port", "0", "--host", "127.0.0.1"]
    log = open(logdir / "tensorboard.log", "w+")  # noqa: SIM115 - read while the server runs
    # a session of its own: the server is `timeout`'s child, and killing `timeout` alone would leave it running
    server = subprocess.Popen(
        ["timeout", "-s", "KILL", "120", *command], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        port = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and server.poll() is None:
            found = re.search(r"http://127\.0\.0\.1:(\d+)/", (logdir / "tensorboard.log").read_text())
            if found:
                port = int(found.group(1))
                try:
                    if RUN in _get(port, "/data/runs"):  # type: ignore[operator]
                        break
                except OSError:
                    pass
            time.sleep(0.25)
        assert port is not None, (logdir / "tensorboard.log").read_text()[-2000:]
        tags = set(_get(port, "/data/plugin/scalars/tags")[RUN])  # type: ignore[index]
        yield port, tags
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        log.close()
        _assert_group_gone(server.pid)


def _assert_group_gone(group: int) -> None:
    """No process of the server's session outlives the test (the README's test command leaves nothing running)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    raise AssertionError(f"TensorBoard's process group {group} is still running after the test")


def _charts(port: int) -> dict[str, list[str]]:
    layout = _get(port, "/data/plugin/custom_scalars/layout")
    return {
        chart["title"]: chart["multiline"]["tag"]
        for category in layout["category"]  # type: ignore[index]
        for chart in category["chart"]
    }


def _resolve(port: int, patterns: list[str]) -> dict[str, list[float]]:
    """What TensorBoard draws for a chart: the union over its patterns of the tags they match, with their values."""
    series: dict[str, list[float]] = {}
    for pattern in patterns:
        answer = _get(port, "/data/plugin/custom_scalars/scalars", run=RUN, tag=pattern)
        assert answer["regex_valid"], pattern  # type: ignore[index]
        for tag, events in answer["tag_to_events"].items():  # type: ignore[index]
            series[tag] = [value for _, _, value in events]
    return series


def test_every_chart_draws_exactly_the_tags_meant_for_it(served):
    port, _ = served
    charts = _charts(port)
    assert set(charts) == set(INTENDED)
    for title, patterns in charts.items():
        assert set(_resolve(port, patterns)) == INTENDED[title], title


def test_every_logged_quantity_has_a_chart(served):
    port, tags = served
    logged = {tag for tag in tags if tag.startswith("accum/")}
    charted = set().union(*INTENDED.values())
    assert logged - NOT_CHARTED == charted


def test_no_chart_overlays_quantities_whose_ranges_differ_by_more_than_10x(served):
    port, _ = served
    for title, patterns in _charts(port).items():
        peaks = [max(abs(value) for value in values) for values in _resolve(port, patterns).values() if values]
        if len(peaks) > 1:
            assert max(peaks) <= 10 * min(peaks), title


def test_a_quantity_first_logged_after_the_first_step_joins_the_dashboard(tmp_path):
    """Logging every step with the noise scale measured every 5th window: the first logged steps have no estimate, and
    the layout TensorBoard shows (its latest) gains the noise scale's charts once the first estimate is logged."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2, metadata

    x, y = make_data(64)
    logger = TensorBoardLogger(tmp_path, name="run", version=0)
    callback = AccumulationScheduler({0: 2}, noise_scale=True, noise_scale_interval=5)
    trainer([callback], max_epochs=1, logger=logger, log_every_n_steps=1).fit(RegressionModule(), loader(x, y, 4))
    events = EventAccumulator(str(tmp_path / "run" / "version_0"), size_guidance={"tensors": 0})
    events.Reload()
    layouts = [
        layout_pb2.Layout.FromString(t.tensor_proto.string_val[0]) for t in events.Tensors(metadata.CONFIG_SUMMARY_TAG)
    ]
    assert "noise scale" not in [category.title for category in layouts[0].category]
    assert "noise scale" in [category.title for category in layouts[-1].category]
