"""What the console shows beside Lightning's progress bars, read from a terminal as a user sees it.

``tests/scripts/console_fit.py`` fits with the TQDM bar, with the Rich bar, and with the TQDM bar over
``micro_batch_size="auto"`` running out of memory, on a pseudo-terminal (so both bars draw as on a user's screen);
:func:`_screen` applies what a terminal does with the output (carriage returns, erased lines, the cursor moved up) and
the tests read the lines left on it: each of the package's lines whole on a line of its own, not after a bar's text,
and the bar's ``factor`` and ``eff_batch`` as integers.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from lightning_accum import AccumulationScheduler
from tests.helpers import RegressionModule, loader, make_data, trainer

ROOT = Path(__file__).resolve().parents[1]
BARS = ("tqdm", "rich")
FITS = (*BARS, "auto")  # the script's fits, in the order it runs them
CHANGE = "AccumulationScheduler: optimizer step 2, 16 samples seen: factor 2 -> 4, effective batch 8 -> 16 samples"
SUMMARY = "AccumulationScheduler: micro 4 x factor 2 x world 1 = 8 samples; lr 0.1 (not scaled)"
RETRIES = [
    f"AccumulationScheduler: out of memory with micro-batches of {old}; training this batch again, as the first of a"
    f" new window, with micro-batches of {new} (optimizer step 0)"
    for old, new in [(16, 8), (8, 4)]
]


def _on_a_terminal(*arguments: str, columns: int = 250, timeout: float = 120) -> str:
    """What ``tests/scripts/console_fit.py arguments`` writes to a terminal ``columns`` wide (stdout and stderr)."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    environment = {name: value for name, value in os.environ.items() if name not in ("COLUMNS", "LINES", "NO_COLOR")}
    environment["TERM"] = "xterm-256color"  # a terminal Rich draws its live bar on, whatever CI's TERM says
    command = [sys.executable, str(ROOT / "tests" / "scripts" / "console_fit.py"), *arguments]
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=follower, stderr=follower, env=environment)
    os.close(follower)
    output = b""
    deadline = time.monotonic() + timeout
    try:
        while select.select([leader], [], [], max(0.0, deadline - time.monotonic()))[0]:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the script exited and closed the terminal
                break
            if not chunk:
                break
            output += chunk
    finally:
        os.close(leader)
        process.kill()
        process.wait()
    return output.decode(errors="replace")


_TOKEN = re.compile(r"\x1b\[([0-9;?]*)([A-Za-z])|\r|\n|[^\x1b\r\n]+")


def _screen(output: str) -> list[str]:
    """The lines a terminal shows for ``output``: text overwrites from the cursor, ``\\r`` goes back to the line's
    start, ``\\n`` to the next line's, ``ESC[nA`` up n lines, ``ESC[K`` / ``ESC[2K`` erase; colours are dropped."""
    lines, row, column = [""], 0, 0
    for token in _TOKEN.finditer(output):
        text, argument, command = token.group(0), token.group(1), token.group(2)
        if text == "\r":
            column = 0
        elif text == "\n":  # the terminal's ONLCR: a newline also returns the carriage
            row, column = row + 1, 0
        elif command == "A":
            row = max(0, row - int(argument or 1))
        elif command == "K":
            lines[row] = "" if argument == "2" else lines[row][:column]
        elif command is None:
            line = lines[row].ljust(column)
            lines[row] = line[:column] + text + line[column + len(text) :]
            column += len(text)
        lines.extend("" for _ in range(row + 1 - len(lines)))
    return [line.rstrip() for line in lines]


@pytest.fixture(scope="module")
def screens() -> dict[str, list[str]]:
    """The screen each fit leaves, from its `== <name> ==` line on."""
    lines = _screen(_on_a_terminal(*FITS))
    starts = [lines.index(f"== {fit} ==") for fit in FITS]
    return {fit: lines[start:end] for fit, start, end in zip(FITS, starts, [*starts[1:], len(lines)], strict=True)}


@pytest.mark.parametrize("bar", BARS)
def test_the_packages_lines_are_printed_whole_above_the_bar_not_after_its_text(screens, bar):
    screen = screens[bar]
    assert CHANGE in screen, "\n".join(screen)  # a line of its own, exactly the message
    assert SUMMARY in screen
    assert not [line for line in screen if "AccumulationScheduler:" in line and not line.startswith("Accumul")]


def test_the_out_of_memory_retries_are_printed_whole_above_the_bar(screens):
    screen = screens["auto"]
    assert all(retry in screen for retry in RETRIES), "\n".join(screen)


@pytest.mark.parametrize(("bar", "shown"), [("tqdm", "{}={}"), ("rich", "{}: {}")])
def test_the_bar_shows_the_factor_and_the_effective_batch_as_integers(screens, bar, shown):
    drawn = " ".join(line for line in screens[bar] if line.startswith("Epoch 0"))
    factors = re.findall(r"factor[=:] ?([0-9.]+)", drawn)
    batches = re.findall(r"eff_batch[=:] ?([0-9.]+)", drawn)
    assert factors
    assert batches
    assert all(value.isdigit() for value in factors + batches), drawn
    last_bar = [line for line in screens[bar] if line.startswith("Epoch 0")][-1]  # the epoch's end: a short window
    assert shown.format("factor", 4) in last_bar
    assert shown.format("eff_batch", "4 (short window)") in last_bar


def test_without_a_bar_the_lines_go_through_lightnings_rank_zero_logging(caplog):
    x, y = make_data(36)
    with caplog.at_level("INFO"):
        trainer([AccumulationScheduler({0: 2, 2: 4}, unit="step")], max_epochs=1).fit(
            RegressionModule(), loader(x, y, 4)
        )
    logged = [record.message for record in caplog.records if record.name == "lightning.pytorch.utilities.rank_zero"]
    assert SUMMARY in logged
    assert CHANGE in logged
