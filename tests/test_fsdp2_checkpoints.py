"""FSDP2 checkpoints, sharded and full, saved in the middle of a run and resumed in new processes, end where the run
never interrupted ends: in a Fabric loop with the Accumulator in the saved state, and in the Trainer with the callback
(issue 45). Two real CPU ranks (gloo), each on its own token-weighted micro-batches, factor 3.

What a resume must get right beyond the weights, and why it is measured here and not in one process: torch's
distributed checkpoint initializes an optimizer without state (before its first step, and plain SGD always) by calling
``optimizer.step()`` on zero gradients at LR 0, which the Accumulator must let through and leave the LRs as
configured; and Fabric's sharded load puts the accumulator's saved dict in the state instead of restoring the object
it holds, so the Accumulator would restart at optimizer step 0 and train the saved epoch again.

tests/scripts/fsdp2_checkpoints.py runs every configuration in two launches: the uninterrupted runs and the saving ones,
then (new processes, as a resumed job would be) the loads. On CPU the resumed run takes the same operations in the same
order as the uninterrupted one, so the weights must be equal bit for bit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.helpers import FSDP2, NO_FSDP2

if not FSDP2:  # every test here trains under FSDP2
    pytest.skip(NO_FSDP2, allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from fsdp2_checkpoints import EPOCHS, KINDS  # noqa: E402

from tests.helpers import launch_ranks, launched_ahead  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "scripts" / "fsdp2_checkpoints.py"
STEPS_PER_EPOCH = 3  # each rank's 8 micro-batches at factor 3: windows of 3, 3 and the 2 left
FIRST = "uninterrupted,saved,trainer_uninterrupted,trainer_saved"
SECOND = "loaded,trainer_resumed"  # from the checkpoints the first launch wrote


def _launch(out: Path) -> Path:
    launch_ranks(SCRIPT, out, FIRST, limit=240)
    return launch_ranks(SCRIPT, out, SECOND, limit=240)


launched = launched_ahead("launched", _launch)


def records(out: Path, mode: str, kind: str) -> list[dict]:
    return [json.loads((out / f"{mode}_{kind}.rank{rank}.json").read_text()) for rank in (0, 1)]


def largest_gap(a: dict[str, list[float]], b: dict[str, list[float]]) -> float:
    return max(abs(x - y) for name in a for x, y in zip(a[name], b[name], strict=True))


def configured_lrs(kind: str) -> list[float]:
    return [KINDS[kind][2]]  # one param group


@pytest.mark.parametrize("kind", list(KINDS))
def test_fabric_saves_before_the_first_step_and_after_an_epoch_leave_the_lr_as_configured(launched, kind):
    """Both saves take torch's zero-LR step (plain SGD: both; SGD with momentum: the one before its first step)."""
    for record in records(launched, "saved", kind):
        for save in ("before_first_step", "after_epoch"):
            assert f"raised_{save}" not in record, f"fabric.save {save}: {record[f'raised_{save}']}"
            # torch puts the LRs back only if its step returns: one that raised leaves them at 0.0
            assert record[f"lrs_{save}"] == configured_lrs(kind), save
        assert record["steps_before_first_step"] == 0
        assert record["steps_after_epoch"] == STEPS_PER_EPOCH


@pytest.mark.parametrize("kind", list(KINDS))
def test_fabric_load_restores_the_accumulator_created_before_it(launched, kind):
    """The documented order: the Accumulator first, then ``fabric.load`` into the state that holds it. A fresh
    optimizer has no state, so the load takes torch's zero-LR step too."""
    for record in records(launched, "loaded", kind):
        assert "raised" not in record, f"fabric.load: {record['raised']}"
        loaded = record["loaded"]
        # the object the loop uses stays in the state (a sharded load would leave the saved dict there)
        assert loaded["accumulator_kept"], f"state['accumulator'] is a {loaded['accumulator_type']}"
        assert loaded["optimizer_steps"] == STEPS_PER_EPOCH  # where the saved run was, not step 0
        assert loaded["epoch"] == 1  # so `range(accumulator.epoch, EPOCHS)` trains the remaining epoch only
        assert loaded["lrs"] == configured_lrs(kind)


@pytest.mark.parametrize(("kind", "what"), [("sharded", "dict"), ("full", "Probe")])
def test_contract_lightnings_sharded_load_replaces_a_stateful_entry_with_its_saved_dict(launched, kind, what):
    """The behaviour lightning_accum/fabric/_shadows.py works around, in the Lightning installed: a sharded load puts
    the saved ``{"value": 7}`` in place of the user's stateful object (a full load restores the object in place). If
    this fails, Lightning restores stateful entries of sharded checkpoints itself and ``keep_on_load`` can go."""
    for record in records(launched, "loaded", kind):
        assert record["loaded"]["probe"] == [what, {"value": 7}]


@pytest.mark.parametrize("kind", list(KINDS))
def test_fabric_run_resumed_from_its_checkpoint_ends_with_the_uninterrupted_runs_weights(launched, kind):
    uninterrupted, resumed = records(launched, "uninterrupted", kind), records(launched, "loaded", kind)
    for done, again in zip(uninterrupted, resumed, strict=True):  # rank by rank
        assert "raised" not in again, f"fabric.load: {again['raised']}"
        assert done["optimizer_steps"] == again["optimizer_steps"] == EPOCHS * STEPS_PER_EPOCH
        assert done["lrs"] == again["lrs"] == configured_lrs(kind)
        # the same operations in the same order on CPU: bit for bit
        assert again["weights"] == done["weights"], f"max |difference| {largest_gap(again['weights'], done['weights'])}"
    assert resumed[0]["weights"] == resumed[1]["weights"]


@pytest.mark.parametrize("kind", list(KINDS))
def test_trainer_resumed_from_its_checkpoint_ends_with_the_uninterrupted_fits_weights(launched, kind):
    """``ModelParallelAccumulationStrategy`` and ``AccumulationScheduler``: one epoch, ``trainer.save_checkpoint``,
    then ``fit(ckpt_path=...)`` to the end in new processes."""
    saved, resumed = records(launched, "trainer_saved", kind), records(launched, "trainer_resumed", kind)
    for before, done, again in zip(saved, records(launched, "trainer_uninterrupted", kind), resumed, strict=True):
        assert "raised" not in before, f"trainer.save_checkpoint: {before['raised']}"
        assert before["global_step"] == STEPS_PER_EPOCH
        assert before["lrs"] == configured_lrs(kind)
        assert done["global_step"] == again["global_step"] == EPOCHS * STEPS_PER_EPOCH
        assert again["lrs"] == configured_lrs(kind)
        assert again["weights"] == done["weights"], f"max |difference| {largest_gap(again['weights'], done['weights'])}"
    assert resumed[0]["weights"] == resumed[1]["weights"]


def test_both_ranks_recorded_the_same(launched):
    """Every rank saw the same run: the same steps, LRs, errors and full weights."""
    modes = [mode for launch_modes in (FIRST, SECOND) for mode in launch_modes.split(",")]
    for mode in modes:
        for kind in KINDS:
            rank0, rank1 = records(launched, mode, kind)
            assert rank0 == rank1, f"{mode}, {kind}"
