"""The window bookkeeping, without a Trainer."""

import pytest

from lightning_accum.core.window import Window


def test_a_full_window_closes_and_needs_no_correction():
    window = Window()
    assert window.closed  # nothing open before the first micro-step
    window.open(3)
    taken = []
    for _ in range(3):
        window.take(ends_epoch=False)
        taken.append((window.is_first, window.closed))
    assert taken == [(True, False), (False, False), (False, True)]
    assert window.gradient_correction == 1.0


def test_a_window_cut_by_the_end_of_an_epoch_is_corrected_to_its_mean():
    window = Window()
    window.open(4)
    window.take(ends_epoch=False)
    window.take(ends_epoch=True)
    assert window.closed
    assert window.gradient_correction == 2.0  # each loss was divided by 4, but only 2 were summed


def test_state_round_trip_and_old_checkpoints():
    window = Window()
    window.open(5)
    window.take(ends_epoch=False)
    restored = Window()
    restored.load_state_dict(window.state_dict())
    assert restored == window
    empty = Window()
    empty.load_state_dict({})
    assert empty == Window()


def test_a_window_needs_a_micro_step():
    with pytest.raises(ValueError, match="size=0"):
        Window().open(0)
