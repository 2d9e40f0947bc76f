"""`lightning-accum plan`: valid configurations, the divisibility explanations, and the memory probe."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_accum.cli import main
from lightning_accum.core.plan import PlanRow, plan, plan_table
from tests.helpers import launch_environment, launched_ahead

ROOT = Path(__file__).resolve().parents[1]


def test_a_global_batch_that_the_devices_do_not_divide_gets_the_nearest_valid_ones():
    result = plan(100, devices=16)
    assert result.rows == ()
    assert result.problems == (
        "global batch 100 is not a multiple of 16 devices: the nearest valid global batches are 96 or 112",
    )


def test_every_micro_batch_that_divides_is_listed_with_its_epoch_cost_and_lr():
    result = plan(64, devices=2, dataset_size=1000, base_lr=1e-3, base_batch=16, rule="sqrt")
    assert [row.micro_batch for row in result.rows] == [32, 16, 8, 4, 2, 1]
    assert result.rows[2] == PlanRow(
        micro_batch=8, factor=4, effective_batch=64, forward_passes_per_epoch=63, updates_per_epoch=16, lr=2e-3
    )
    # 500 samples a device: 63 micro-batches of 8, the last of 4; 16 windows, the last holding 3 micro-batches
    assert all(row.micro_batch * row.factor * 2 == 64 for row in result.rows)
    assert plan(64, devices=2, base_lr=1e-3, base_batch=16, rule="linear").rows[0].lr == pytest.approx(4e-3)


def test_a_micro_batch_that_does_not_divide_is_explained():
    result = plan(512, devices=8, micro_batches=[64, 12])
    assert [row.micro_batch for row in result.rows] == [64]
    assert "micro-batch 12" in result.problems[0]
    assert "nearest valid global batches are 480 or 576" in result.problems[0]


def test_the_memory_bound_keeps_the_micro_batches_that_fit():
    assert [row.micro_batch for row in plan(64, max_micro_batch=10).rows] == [8, 4, 2, 1]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"global_batch": 0}, "`global_batch` must be an integer >= 1, got 0"),
        ({"global_batch": 8, "devices": 0}, "`devices` must be an integer >= 1, got 0"),
        ({"global_batch": 8, "rule": "cubic"}, "cubic"),
        ({"global_batch": 8, "micro_batches": [0]}, "`micro_batch` must be an integer >= 1, got 0"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan(**kwargs)


def test_the_command_prints_the_table_and_exits_2_without_a_valid_plan(capsys):
    assert main(["plan", "--global-batch", "512", "--devices", "8", "--micro-batch", "64", "32"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == plan_table(plan(512, devices=8, micro_batches=[64, 32])).splitlines()[0]
    assert "| 32 | 2 | 512 |" in out
    assert main(["plan", "--global-batch", "100", "--devices", "16"]) == 2
    assert "96 or 112" in capsys.readouterr().out


def _plan(*args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    """``lightning-accum plan ARGS`` as a process of its own, run from the repository's root."""
    return subprocess.run(
        [sys.executable, "-m", "lightning_accum.cli", "plan", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=launch_environment(),
    )


PROBE = ["--global-batch", "512", "--micro-batch", "16", "512", "--probe", "tests.probe_model:WideNet"]


def _peaks(stderr: str) -> dict[int, float]:
    return {
        int(line.split()[2].rstrip(":")): float(line.split()[4])
        for line in stderr.splitlines()
        if line.startswith("probe: micro-batch")
    }


def _probed(_: Path) -> tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str] | None]:
    """The command with a budget every micro-batch fits, then (if it measured both) with one between their peaks."""
    measure = _plan(*PROBE, "--memory-budget", "1e9")
    peaks = _peaks(measure.stderr)
    if measure.returncode or set(peaks) != {16, 512}:
        return measure, None  # the test says what went wrong
    return measure, _plan(*PROBE, "--memory-budget", str((peaks[16] + peaks[512]) / 2))


probed = launched_ahead("probed", _probed)


def test_the_probe_measures_the_real_model_and_picks_the_largest_micro_batch_that_fits(probed):
    measure, chosen = probed
    assert measure.returncode == 0, measure.stderr[-2000:]
    peaks = _peaks(measure.stderr)
    assert list(peaks) == [16, 512]
    assert peaks[512] > peaks[16] + 4  # activations grow with the micro-batch (512 x 4096 floats = 8 MiB a layer)
    assert chosen is not None
    assert chosen.returncode == 0, chosen.stderr[-2000:]
    rows = [line for line in chosen.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [int(row.split("|")[1]) for row in rows] == [16]  # 512 does not fit the budget


def _unimportable(_: Path) -> subprocess.CompletedProcess[str]:
    return _plan(
        "--global-batch", "8", "--micro-batch", "4", "--probe", "nosuch:X", "--memory-budget", "100", timeout=300
    )


unimportable = launched_ahead("unimportable", _unimportable)


def test_a_probe_target_that_does_not_import_exits_2_naming_it_without_a_traceback(unimportable):
    done = unimportable
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == (
        "lightning-accum plan: error: argument --probe: no module named 'nosuch', got 'nosuch:X'"
    )


@pytest.mark.parametrize(
    ("target", "says"),
    [
        ("nosuch:X", "no module named 'nosuch'"),
        ("tests.nosuch:X", "no module named 'tests.nosuch'"),
        ("tests.probe_model:Nope", "module 'tests.probe_model' has no attribute 'Nope'"),
        (
            "tests.helpers:RegressionModule",
            "the probe builds its micro-batches from `RegressionModule.example_input_array`, which is not set",
        ),
    ],
)
def test_the_probe_process_answers_what_it_cannot_probe_for_the_command_to_name(target, says, capsys):
    """What `plan --probe` prints after `argument --probe:` (the process above shows it for one)."""
    assert main(["_probe", target, "2"]) == 2
    answer = json.loads(capsys.readouterr().out)["unprobeable"]
    assert answer == f"{says}, got {target!r}"


def test_the_help_lists_only_the_public_commands_and_shows_the_defaults(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    top = capsys.readouterr().out
    assert "_probe" not in top
    assert "SUPPRESS" not in top
    assert "plan" in top
    assert "list the micro-batch / factor / learning-rate configurations" in top  # each command with its description
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    planner = capsys.readouterr().out
    assert "(default: 1)" in planner  # --devices
    assert "(default: none)" in planner  # --rule
    assert "(default: None)" not in planner  # an option without a default says nothing


def test_the_private_probe_command_still_runs_when_called_by_name(capsys):
    assert main(["_probe", "tests.probe_model:WideNet", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["peak_bytes"] >= 0


@pytest.mark.parametrize(
    ("args", "flag", "value"),
    [
        (["--global-batch", "0"], "--global-batch", "0"),
        (["--global-batch", "8", "--devices", "0"], "--devices", "0"),
        (["--global-batch", "8", "--rule", "cubic"], "--rule", "cubic"),
        (["--global-batch", "8", "--micro-batch", "4", "0"], "--micro-batch", "0"),
        (["--global-batch", "8", "--dataset-size", "-5"], "--dataset-size", "-5"),
        (["--global-batch", "8", "--base-batch", "0"], "--base-batch", "0"),
        (["--global-batch", "8", "--base-lr=-1e-3"], "--base-lr", "-1e-3"),
        (
            ["--global-batch", "8", "--probe", "tests.probe_model:WideNet", "--memory-budget", "0"],
            "--memory-budget",
            "0",
        ),
        (["--global-batch", "8", "--probe", "WideNet", "--memory-budget", "10"], "--probe", "WideNet"),
    ],
)
def test_a_bad_value_exits_2_naming_the_flag(args, flag, value, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["plan", *args])
    assert exited.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("lightning-accum plan: error:")  # the subcommand's usage, not the top level's
    assert flag in error
    assert value in error
    parameter = flag[2:].replace("-", "_")
    assert not re.search(rf"(?<![-\w]){parameter}\b", error)  # not the Python parameter (global_batch)
