"""An FSDP2 unit that one rank skips (conditional compute), on two real CPU processes (gloo).

``tests/scripts/skipped_unit.py`` is launched as a user would (``python script.py``, ``Trainer(devices=2)``), once,
for every configuration: a configuration that raises leaves no collective half-issued, so the next one starts clean.
Before lightning_accum made the ranks agree on each FSDP2 collective, every configuration in which rank 1 alone
skipped the unit ended with gloo aborting a process ("Received data size doesn't match expected size") and no record
from either rank. Now such a unit raises the same error on every rank, before the mismatched all-gather and before
the window's optimizer step; a unit that every rank skips together, and either fix the error names, train as one big
batch in plain PyTorch on one process. The ranks agree in the first windows of every fit (a resumed one too), then
the check steps aside and issues no collective at all; ``check_collectives="always"`` keeps it for every window.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import FSDP2, NO_FSDP2

if not FSDP2:  # every test here trains under FSDP2
    pytest.skip(NO_FSDP2, allow_module_level=True)
import torch

SCRIPTS = Path(__file__).resolve().parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
from skipped_unit import (  # noqa: E402
    FACTOR,
    FIXES,
    GUARD_STEPS,
    LR,
    MICRO_BATCH,
    SAMPLES_PER_RANK,
    SYNCS,
    WINDOW_LAST,
    WINDOW_MIDDLE,
    Net,
    loss_of,
    make_data,
)

from tests.helpers import launch_environment, launched_ahead  # noqa: E402

LIMIT = 300  # seconds for the whole launch: a hang fails the test instead of holding the suite
ONE_RANK_SKIPS = {1: (WINDOW_LAST, WINDOW_MIDDLE)}
EVERYONE_SKIPS = {0: (WINDOW_LAST, WINDOW_MIDDLE), 1: (WINDOW_LAST, WINDOW_MIDDLE)}


def _launch(out: Path) -> Path:
    # `timeout -s KILL` kills the whole process group (Lightning's launcher starts rank 1 as rank 0's child)
    done = subprocess.run(
        ["timeout", "-s", "KILL", str(LIMIT), sys.executable, str(SCRIPTS / "skipped_unit.py"), str(out)],
        capture_output=True,
        text=True,
        check=False,
        env=launch_environment(),
    )
    output = done.stdout + done.stderr
    clues = [line for line in output.splitlines() if any(word in line for word in ("Error", "Traceback", "terminate"))]
    assert done.returncode != 137, f"killed after {LIMIT} s: a rank hung; {clues[-20:]}"
    assert done.returncode == 0, f"exit {done.returncode}; {clues[-20:]}\n{output[-4000:]}"
    return out


out = launched_ahead("out", _launch)


def _records(out: Path, name: str) -> list[dict]:
    return [json.loads((out / f"{name}.rank{rank}.json").read_text()) for rank in (0, 1)]


def reference_weights(
    skips: dict[int, tuple[int, ...]], windows: int, micro_steps: int = SAMPLES_PER_RANK // MICRO_BATCH
) -> dict[str, torch.Tensor]:
    """Plain PyTorch on one process: one SGD step per window on the mean loss over every micro-batch of the window
    on both ranks, each with ``cond`` where its rank runs it; epochs of ``micro_steps`` micro-batches per rank."""
    x, y, use = make_data(skips, micro_steps)
    net = Net()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    for window in range(windows):
        optimizer.zero_grad()
        losses = []
        for step in range(window * FACTOR, (window + 1) * FACTOR):
            for rank in (0, 1):
                first = rank * micro_steps * MICRO_BATCH + step % micro_steps * MICRO_BATCH
                index = slice(first, first + MICRO_BATCH)
                losses.append(loss_of(net, x[index], y[index], use[index]))
        (sum(losses) / len(losses)).backward()
        optimizer.step()
    return {name: param.detach() for name, param in net.named_parameters()}


def _untouched() -> dict[str, list[float]]:
    return {name: param.detach().flatten().tolist() for name, param in Net().named_parameters()}


def deviation(record: dict, reference: dict[str, torch.Tensor]) -> float:
    assert set(record["weights"]) == set(reference)
    return max((torch.tensor(record["weights"][k]) - v.flatten()).abs().max().item() for k, v in reference.items())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("sync", SYNCS)
@pytest.mark.parametrize("where", ["skip_last", "skip_middle"])
def test_a_unit_one_rank_skips_raises_the_same_error_on_every_rank_before_the_step(out, sync, precision, where):
    rank0, rank1 = _records(out, f"{sync}_{precision}_{where}")
    assert rank0.get("raised") == rank1.get("raised")
    message = rank0["raised"]
    assert message.startswith("FSDP2 units ran differently on the ranks"), message
    assert "rank 0: the all-gather of `net.cond`'s parameters for its forward" in message
    assert "rank 1: the all-gather of `net.mid`'s parameters for its forward" in message
    assert "h = h + 0 * unit(h)" in message
    assert ("set_reduce_scatter_unused_params(True)" in message) == ("unused_params" in FIXES)  # torch 2.13 on
    assert rank0["weights"] == rank1["weights"]
    if where == "skip_last":  # raised in window 0: no step, the weights untouched
        assert rank0["optimizer_steps"] == rank1["optimizer_steps"] == 0
        assert rank0["weights"] == _untouched()
    else:  # window 0 stepped as the big batch does; window 1 raised before its step
        assert rank0["optimizer_steps"] == rank1["optimizer_steps"] == 1
        limit = 1e-5 if precision == "fp32" else 2e-3  # bfloat16 forward and backward against a float32 reference
        assert deviation(rank0, reference_weights({}, windows=1)) <= limit


@pytest.mark.parametrize("sync", SYNCS)
def test_a_unit_every_rank_skips_together_trains_exactly(out, sync):
    rank0, rank1 = _records(out, f"{sync}_fp32_everyone_skips")
    assert "raised" not in rank0, rank0.get("raised")
    assert rank0["optimizer_steps"] == rank1["optimizer_steps"] == 2
    assert rank0["weights"] == rank1["weights"]
    assert deviation(rank0, reference_weights(EVERYONE_SKIPS, windows=2)) <= 1e-5


@pytest.mark.parametrize("fix", FIXES)
@pytest.mark.parametrize("sync", SYNCS)
def test_either_fix_the_error_names_trains_a_unit_one_rank_skips_exactly(out, sync, fix):
    rank0, rank1 = _records(out, f"{sync}_fp32_{fix}")
    assert "raised" not in rank0, rank0.get("raised")
    assert rank0["optimizer_steps"] == rank1["optimizer_steps"] == 2
    assert rank0["weights"] == rank1["weights"]
    assert deviation(rank0, reference_weights(ONE_RANK_SKIPS, windows=2)) <= 1e-5


def test_the_reference_sees_the_skip():
    """The skipped micro-batches change the big batch's step: the exactness tests above tell the cases apart."""
    skipped, full = reference_weights(ONE_RANK_SKIPS, windows=2), reference_weights({}, windows=2)
    assert max((skipped[k] - full[k]).abs().max().item() for k in full) > 1e-3


def test_a_unit_whose_output_one_rank_leaves_out_of_the_loss_raises_before_its_reduce_scatter(out):
    """Its forward ran on both ranks, its backward only on rank 0: the ranks' reduce-scatters would pair wrongly."""
    rank0, rank1 = _records(out, "every_fp32_output_unused")
    assert rank0.get("raised") == rank1.get("raised")
    assert "rank 0: the reduce-scatter of `net.cond`'s gradients" in rank0["raised"]
    assert "rank 1: the reduce-scatter of `net.inp`'s gradients" in rank0["raised"]
    assert rank0["optimizer_steps"] == rank1["optimizer_steps"] == 0
    assert rank0["weights"] == rank1["weights"] == _untouched()


def test_under_last_a_unit_without_backward_on_a_micro_step_that_reduces_nothing_trains_exactly(out):
    rank0, rank1 = _records(out, "last_fp32_output_unused_middle")
    assert "raised" not in rank0, rank0.get("raised")
    assert rank0["optimizer_steps"] == rank1["optimizer_steps"] == 2
    assert deviation(rank0, reference_weights({1: (WINDOW_MIDDLE,)}, windows=2)) <= 1e-5


CHECKED = 3  # windows that the default `check_collectives=True` checks in each fit


def test_the_check_agrees_in_the_first_windows_of_every_fit_then_issues_no_collective(out):
    """6 windows, then a resume on the same trainer and strategy for 6 more: windows 0-2 of each fit are checked."""
    records = _records(out, "guard_default_resume")
    for record in records:
        assert "raised" not in record, record["raised"]
        assert record["optimizer_steps"] == 12
        assert len(record["guard_all_gathers"]) == 2  # the first fit and the resumed one
        for fit in record["guard_all_gathers"]:
            assert len(fit) == GUARD_STEPS
            assert all(count > 0 for count in fit[: CHECKED * FACTOR])
            assert fit[CHECKED * FACTOR :] == [0] * (GUARD_STEPS - CHECKED * FACTOR)
    # stepping aside in the middle of a fit changes nothing in what is trained
    assert records[0]["weights"] == records[1]["weights"]
    assert deviation(records[0], reference_weights({}, windows=12, micro_steps=GUARD_STEPS)) <= 1e-5


def test_check_collectives_checks_the_windows_it_names(out):
    (always,), (two,) = (_records(out, name)[0]["guard_all_gathers"] for name in ("guard_always", "guard_two_windows"))
    assert len(always) == GUARD_STEPS
    assert all(count > 0 for count in always)  # every micro-step of every window
    assert two == always[: 2 * FACTOR] + [0] * (GUARD_STEPS - 2 * FACTOR)


def test_a_unit_one_rank_skips_in_the_last_checked_window_raises_the_same_error_on_every_rank(out):
    rank0, rank1 = _records(out, "guard_default_skip_window2")
    assert rank0.get("raised") == rank1.get("raised")
    assert rank0["raised"].startswith("FSDP2 units ran differently on the ranks"), rank0["raised"]
    assert "rank 1: the all-gather of `net.mid`'s parameters for its forward" in rank0["raised"]
    assert rank0["optimizer_steps"] == rank1["optimizer_steps"] == 2  # windows 0 and 1 stepped; window 2 raised
    assert deviation(rank0, reference_weights({}, windows=2, micro_steps=GUARD_STEPS)) <= 1e-5


def test_with_the_check_always_on_a_unit_one_rank_skips_in_a_later_window_raises_on_every_rank(out):
    rank0, rank1 = _records(out, "guard_always_skip_window4")
    assert rank0.get("raised") == rank1.get("raised")
    assert rank0["raised"].startswith("FSDP2 units ran differently on the ranks"), rank0["raised"]
    assert rank0["optimizer_steps"] == rank1["optimizer_steps"] == 4
    assert deviation(rank0, reference_weights({}, windows=4, micro_steps=GUARD_STEPS)) <= 1e-5


@pytest.mark.parametrize(
    ("value", "windows"), [(True, CHECKED), (False, 0), (0, 0), (1, 1), (50, 50), ("always", None)]
)
def test_check_collectives_takes_a_switch_a_number_of_windows_or_always(value, windows):
    from lightning_accum import ModelParallelAccumulationStrategy

    assert ModelParallelAccumulationStrategy(check_collectives=value)._checked_windows == windows


@pytest.mark.parametrize("value", ["yes", "never", -1, 2.5, None])
def test_a_bad_check_collectives_names_the_argument_and_the_value(value):
    from lightning_accum import ModelParallelAccumulationStrategy

    with pytest.raises(ValueError, match=rf"`check_collectives` must be True .*, got {re.escape(repr(value))}$"):
        ModelParallelAccumulationStrategy(check_collectives=value)
