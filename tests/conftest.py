"""The session's settings: one intra-op thread for torch, and the launches of processes started ahead of the tests.

The tests train tiny models: a second thread buys nothing, and on a 2-core machine where other work runs each parallel
region waits for whichever thread is descheduled (a fit of examples/train_lm.py 0.5 s on one thread, 22 s on two).
Lightning gives each rank of a CPU launch one thread on 2 cores anyway. A value a person sets is kept.
"""

import os

import pytest
import torch

if "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

from tests.helpers import LAUNCH_SECONDS, start_launches, stop_launches  # noqa: E402  (after the thread count: it keeps the environment)


@pytest.fixture(scope="session", autouse=True)
def _launches_ahead(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """The launches of the modules this session runs (tests.helpers.launched_ahead), started before their tests."""
    start_launches(
        {item.module.__name__ for item in request.session.items if getattr(item, "module", None)}, tmp_path_factory
    )
    yield
    stop_launches()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The launches run ahead, slowest first, with their wall time beside the tests: where the suite's time goes."""
    if not LAUNCH_SECONDS:
        return
    terminalreporter.section("launches run ahead (wall seconds, beside the tests)")
    for (module, name), seconds in sorted(LAUNCH_SECONDS.items(), key=lambda item: -item[1]):
        terminalreporter.write_line(f"{seconds:7.1f} s  {module}::{name}")
    terminalreporter.write_line(f"{sum(LAUNCH_SECONDS.values()):7.1f} s  in all")
