"""examples/fabric_sft.py and fabric_pretrain.py on tiny sizes, as a user runs them: the Accumulator's loop lands on
the big batch's weights, litgpt's loop does not, and the table says so; the pretraining loop spends its token budget
under every batch schedule."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tests.helpers import launch_environment, launched_ahead

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _example(name: str) -> Iterator[ModuleType]:
    """``examples/<name>.py`` imported as a user's script imports its neighbours (``examples/`` on the path)."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(EXAMPLES))


@pytest.fixture(scope="module")
def fabric_sft():
    yield from _example("fabric_sft")


def test_the_example_prints_the_accumulator_on_the_big_batch_and_litgpts_loop_away_from_it(fabric_sft, capsys):
    root = Path(sysconfig.get_paths()["stdlib"]) / "email"  # a part of the standard library: fewer files to parse
    tiny = ["--pairs", "90", "--width", "16", "--layers", "1", "--epochs", "2", "--optimizer", "sgd"]
    rows = fabric_sft.main([*tiny, "--root", str(root)])
    printed = capsys.readouterr().out
    # 90 pairs in 23 micro-batches (the last of 2 pairs), factor 8: windows 8, 8 and the 7 left, which litgpt skips
    assert "90 pairs in 23 micro-batches of 4" in printed
    assert "3 steps an epoch, the last on 7 micro-batches; litgpt's loop takes 2" in printed
    assert [row["epoch"] for row in rows] == [1, 2]
    for row in rows:
        assert row["accumulator"] <= 1e-5
        assert row["litgpt"] >= 1e-2
        assert f"| {row['epoch']} | {row['accumulator']:.1e} | {row['litgpt']:.1e} |" in printed


@pytest.fixture(scope="module")
def fabric_pretrain():
    yield from _example("fabric_pretrain")


def test_the_pretraining_example_compares_five_batch_schedules_at_one_token_budget(fabric_pretrain, capsys):
    """Tiny sizes: every schedule spends the budget (each run ends at the window that reaches it), the large batch takes
    about a fourth of the small one's steps, the ramp, Seesaw and adaptive growth fewer than the small one, and the
    table prints each schedule's means."""
    tiny = ["--seeds", "0", "--tokens", "40000", "--corpus-bytes", "200000", "--width", "16", "--layers", "1"]
    rows = fabric_pretrain.main([*tiny, "--heads", "2", "--max-factor", "4", "--context", "32"])
    printed = capsys.readouterr().out
    by_name = {row["schedule"]: row for row in rows}
    assert list(by_name) == ["small", "large", "ramp", "seesaw", "adaptive"]
    small = by_name["small"]["steps"]
    assert small == 40000 // (8 * 32) + (40000 % (8 * 32) > 0)  # micro-batches of 8 x 32 tokens, factor 1
    assert by_name["large"]["steps"] == pytest.approx(small / 4, abs=1)
    assert by_name["ramp"]["steps"] < small
    assert by_name["adaptive"]["steps"] <= small
    assert small / 2 < by_name["seesaw"]["steps"] < small  # factor 1 until the cosine's LR halves, half-way
    for row in rows:
        assert 0 < row["loss"] < 6  # bytes: ln 256 = 5.5 at chance
        assert f"| {row['schedule']} | {row['steps']:.0f} | {row['steps_ratio']:.2f} |" in printed


def test_the_pretraining_example_trains_on_a_users_file_and_writes_every_run(fabric_pretrain, tmp_path):
    """``--data FILE --schedules small seesaw --json OUT``: small always runs first; OUT holds each run's seed,
    schedule, optimizer steps, held-out loss and seconds."""
    text = tmp_path / "mine.txt"
    text.write_bytes(b"".join(path.read_bytes() for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))))
    out = tmp_path / "runs.json"
    tiny = ["--tokens", "20000", "--corpus-bytes", "100000", "--width", "16", "--layers", "1", "--heads", "2"]
    chosen = ["--seeds", "3", "4", "--schedules", "seesaw", "--data", str(text), "--json", str(out)]
    rows = fabric_pretrain.main([*tiny, "--context", "32", *chosen])
    assert [row["schedule"] for row in rows] == ["small", "seesaw"]
    runs = json.loads(out.read_text())["runs"]
    assert [(run["seed"], run["schedule"]) for run in runs] == [
        (3, "small"),
        (3, "seesaw"),
        (4, "small"),
        (4, "seesaw"),
    ]
    for run in runs:
        assert {"seed", "schedule", "steps", "loss", "seconds"} <= run.keys()
        assert run["steps"] > 0
        assert 0 < run["loss"] < 6
    (tmp_path / "short.txt").write_bytes(b"x" * 100)
    with pytest.raises(ValueError, match=r"at least 20000"):
        fabric_pretrain.main([*tiny, "--data", str(tmp_path / "short.txt")])


TINY_RANKS = ["--tokens", "20000", "--corpus-bytes", "100000", "--width", "16", "--layers", "1", "--heads", "2"]


def _two_processes(out: Path) -> dict:
    """``--devices 2 --micro-batch 4`` as a user starts it: Fabric launches the second process (gloo), under a hard
    timeout (`timeout -s KILL`: the launcher starts rank 1 as rank 0's child)."""
    command = [sys.executable, str(EXAMPLES / "fabric_pretrain.py"), *TINY_RANKS, "--context", "32", "--seeds", "0"]
    command += ["--devices", "2", "--micro-batch", "4", "--schedules", "ramp", "seesaw"]
    command += ["--json", str(out / "runs.json")]
    done = subprocess.run(
        ["timeout", "-s", "KILL", "300", *command],
        capture_output=True,
        text=True,
        check=False,
        env=launch_environment(),
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return {"printed": done.stdout, **json.loads((out / "runs.json").read_text())}


two_processes = launched_ahead("two_processes", _two_processes)


def test_on_two_processes_the_budget_is_spent_over_both_and_rank_zero_reports(two_processes, fabric_pretrain):
    """Two ranks of 4 sequences take the steps one process of 8 takes on the same budget (20,000 tokens in global
    batches of 8 x 32), the ramp (its global batches in steps of both ranks' micro-batches) and Seesaw fewer; one
    table and one JSON, from rank zero."""
    runs = two_processes["runs"]
    assert [(run["seed"], run["schedule"]) for run in runs] == [(0, "small"), (0, "ramp"), (0, "seesaw")]
    small, ramp, seesaw = (run["steps"] for run in runs)
    assert ramp < small
    assert small == -(-20000 // (8 * 32))
    assert small / 2 < seesaw < small
    assert two_processes["args"]["devices"] == 2
    printed = two_processes["printed"].splitlines()
    assert sum(line.startswith("| 0 | small | ") for line in printed) == 1  # rank 1 prints nothing
    assert sum(line.startswith("| small | ") for line in printed) == 1
    assert "micro-batches of 4 x 32 bytes on each of 2 processes" in two_processes["printed"]
    one = fabric_pretrain.main([*TINY_RANKS, "--context", "32", "--seeds", "0", "--schedules", "small"])
    assert one[0]["steps"] == small
