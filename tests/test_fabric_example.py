"""examples/fabric_sft.py on tiny sizes, as a user runs it: the Accumulator's loop lands on the big batch's weights,
litgpt's loop does not, and the table says so."""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(scope="module")
def fabric_sft():
    sys.path.insert(0, str(EXAMPLES))
    try:
        import fabric_sft

        yield fabric_sft
    finally:
        sys.path.remove(str(EXAMPLES))


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
