"""The pure schedule arithmetic, without a Trainer."""

import pytest

from lightning_accum.core.schedule import (
    BatchSizeRamp,
    Schedule,
    build_schedule,
    count_optimizer_steps,
    factor_for_batch_size,
    nearest_valid_batch_sizes,
)


def test_factor_before_the_first_key_is_one_and_keys_are_inclusive():
    schedule = Schedule.from_mapping({3: 4, 10: 2}, unit="step")
    assert [schedule.factor_at(p) for p in (0, 2, 3, 9, 10, 10**6)] == [1, 1, 4, 4, 2, 2]
    assert [schedule.next_change(p) for p in (0, 3, 9, 10)] == [3, 10, 10, None]
    assert schedule.max_factor == 4


def test_the_users_mapping_is_copied_not_mutated():
    scheduling = {2: 4}
    Schedule.from_mapping(scheduling)
    assert scheduling == {2: 4}


def test_nearest_valid_batch_sizes():
    assert nearest_valid_batch_sizes(100, 16) == (96, 112)
    assert nearest_valid_batch_sizes(100, 128) == (128,)
    assert nearest_valid_batch_sizes(96, 16) == (96,)


def test_target_that_does_not_divide_shows_the_numbers_and_the_nearest_targets():
    with pytest.raises(ValueError, match=r"target_batch_size=100.*8 x 16 = 128.*Nearest valid: 128"):
        factor_for_batch_size(100, micro_batch_size=8, world_size=16)
    with pytest.raises(ValueError, match=r"Nearest valid: 96 or 112"):
        factor_for_batch_size(100, micro_batch_size=4, world_size=4)
    assert factor_for_batch_size(256, micro_batch_size=8, world_size=4) == 8


def test_ramp_stages_follow_megatron():
    # Megatron: samples per increment = 300 / 3 = 100; size = 32 + floor(consumed / 100) * 32, capped at 128
    assert BatchSizeRamp(start=32, increment=32, samples=300, target=128).stages() == [
        (0, 32),
        (100, 64),
        (200, 96),
        (300, 128),
    ]
    # a ramp that does not split evenly: thresholds round up to whole samples
    assert BatchSizeRamp(start=8, increment=8, samples=10, target=32).stages() == [(0, 8), (4, 16), (7, 24), (10, 32)]


def test_build_schedule_turns_a_ramp_into_sample_keyed_factors():
    ramp = BatchSizeRamp(start=16, increment=16, samples=1000, target=64)
    schedule = build_schedule(None, "epoch", 64, ramp, micro_batch_size=4, world_size=2)
    assert schedule.unit == "sample"
    assert schedule.points == ((0, 2), (334, 4), (667, 6), (1000, 8))


def test_build_schedule_reports_every_ramp_size_that_does_not_divide():
    ramp = BatchSizeRamp(start=8, increment=12, samples=100, target=32)
    with pytest.raises(ValueError, match=r"\[20\].*multiples of 8"):
        build_schedule(None, "epoch", 32, ramp, micro_batch_size=4, world_size=2)


def test_build_schedule_needs_the_micro_batch_for_a_target():
    with pytest.raises(ValueError, match="micro_batch_size"):
        build_schedule(None, "epoch", 64, None, micro_batch_size=None, world_size=1)


def test_build_schedule_defaults_to_factor_one():
    assert build_schedule(None, "epoch", None, None, None, 1).factor_at(123) == 1


@pytest.mark.parametrize(
    ("scheduling", "unit", "batches", "epochs", "max_steps", "samples_per_micro_step", "expected"),
    [
        ({0: 4}, "epoch", 10, 1, -1, 1, 3),  # 4 + 4 + 2
        ({0: 1, 1: 3, 2: 2}, "epoch", 7, 3, -1, 1, 7 + 3 + 4),
        ({0: 2, 3: 4}, "step", 10, 2, -1, 1, 4 + 3),  # 2,2,2,4 | 4,4,2
        ({0: 1, 7: 3}, "sample", 9, 2, -1, 2, 6 + 3),  # 1,1,1,1,3,2 | 3,3,3
        ({0: 5}, "epoch", 3, 4, -1, 1, 4),  # epochs shorter than the factor
        ({0: 4}, "epoch", 10, 5, 7, 1, 7),  # max_steps first
        ({0: 4}, "epoch", 10, -1, 11, 1, 11),  # no epoch limit
        ({0: 4}, "epoch", 0, 3, -1, 1, 0),
    ],
)
def test_count_optimizer_steps(scheduling, unit, batches, epochs, max_steps, samples_per_micro_step, expected):
    schedule = Schedule.from_mapping(scheduling, unit)
    assert count_optimizer_steps(schedule, batches, epochs, max_steps, samples_per_micro_step) == expected


def test_count_optimizer_steps_needs_a_bound():
    with pytest.raises(ValueError, match="max_epochs"):
        count_optimizer_steps(Schedule.constant(2), 10, max_epochs=-1, max_steps=-1)


def test_a_constant_factor_in_a_token_run_keeps_counting_tokens():
    """``unit="token"`` with no ``scheduling`` (adaptive growth from factor 1, a fixed target batch): the schedule still
    says tokens, so an LR schedule moved by tokens (SampleDrivenLR(unit="token")) is accepted."""
    from lightning_accum.core.schedule import build_schedule

    assert build_schedule(None, "token", None, None, 4, 1).unit == "token"
    assert build_schedule(None, "token", 32, None, 4, 2).unit == "token"
    assert build_schedule(None, "token", 32, None, 4, 2).factor_at(10**9) == 4
    assert build_schedule(None, "epoch", None, None, 4, 1).unit == "step"  # as before
