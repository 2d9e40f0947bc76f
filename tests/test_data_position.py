"""The data position (lightning_accum/core/data_position.py), pure: an epoch's global order against torch's own
DistributedSampler, each rank's share of what is left of it, and where a resumed loader starts."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, TensorDataset

from lightning_accum.core.data_position import DataPosition, Dealt, Order, order_of, share


def _torch_global(length: int, world: int, epoch: int, shuffle: bool, drop_last: bool, seed: int = 3) -> list[int]:
    """torch's DistributedSampler on every rank, interleaved: rank r's i-th index is global position i * world + r."""
    ranks = []
    for rank in range(world):
        sampler = DistributedSampler(range(length), world, rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        sampler.set_epoch(epoch)
        ranks.append(list(sampler))
    return [index for column in zip(*ranks, strict=True) for index in column]


@pytest.mark.parametrize(
    ("length", "world", "shuffle", "drop_last"),
    [(12, 2, True, False), (13, 2, True, False), (13, 3, False, False), (13, 3, True, True), (2, 5, True, False)],
)
def test_the_global_order_is_torchs_distributed_sampler_on_every_rank_interleaved(length, world, shuffle, drop_last):
    sampler = DistributedSampler(range(length), world, 0, shuffle=shuffle, seed=3, drop_last=drop_last)
    order = order_of(sampler)
    assert order == Order("distributed", length, shuffle, 3, drop_last, world)
    for epoch in (0, 1, 4):
        assert order.indices(epoch) == _torch_global(length, world, epoch, shuffle, drop_last)


def test_sequential_and_unknown_samplers():
    data = TensorDataset(torch.arange(10.0))
    assert order_of(DataLoader(data).batch_sampler.sampler) == Order("sequential", 10)
    assert Order("sequential", 10).indices(7) == list(range(10))
    assert order_of(RandomSampler(data)) is None  # its order lives in a generator the checkpoint does not hold


@pytest.mark.parametrize(("old", "new"), [(2, 1), (1, 2), (2, 2), (2, 4), (4, 2)])
def test_the_shares_of_what_is_left_on_other_ranks_are_exactly_the_rest_of_the_epoch(old, new):
    """A run on ``old`` ranks consumed 24 of 48 positions; on ``new`` ranks the shares cover the other 24 once."""
    order = Order("distributed", 48, True, 0, False, old)
    indices = order.indices(5)
    shares = [share(indices, 24, 48, rank, new) for rank in range(new)]
    assert sorted(itertools.chain(*shares)) == sorted(indices[24:])
    assert {len(part) for part in shares} == {24 // new}
    # a window of k micro-batches of b rows on every rank is a run of consecutive global positions
    b, k = 2, 12 // (2 * new)
    window = [index for rank in range(new) for index in shares[rank][: k * b]]
    assert sorted(window) == sorted(indices[24 : 24 + k * b * new])


def test_shares_wrap_past_the_end_as_the_distributed_sampler_pads():
    assert share(list(range(5)), 3, 7, 0, 2) == [3, 0]  # positions 3 and 5: 5 wraps to the first index
    assert share(list(range(5)), 3, 7, 1, 2) == [4, 1]  # positions 4 and 6: every rank as many
    assert share(list(range(4)), 4, 4, 0, 2) == []


def test_a_dealt_sampler_starts_its_first_epoch_where_the_run_stopped_and_later_ones_at_their_start():
    order = Order("distributed", 16, True, 7, False, 2)
    dealt = Dealt(order, rank=0, world=1, length=16, epoch=1, start=10)
    assert len(dealt) == 16
    assert list(dealt) == order.indices(1)[10:]
    dealt.set_epoch(2)
    assert list(dealt) == order.indices(2)
    fixed = Dealt(order, 0, 1, 16, epoch=1, start=0, follow_set_epoch=False)
    fixed.set_epoch(0)  # Fabric's wrapper would pass its own count of iterations
    assert list(fixed) == order.indices(1)


def _checkpoint(world: int, batches: int, epoch: int, rows: int = 4, length: int = 64) -> dict:
    """The state a run on ``world`` ranks writes after ``batches`` loader batches of epoch ``epoch`` of its sampler."""
    position = DataPosition()
    position.start_epoch(epoch)
    sampler = DistributedSampler(range(length), world, 0, shuffle=True, seed=0)
    loader = DataLoader(range(length), batch_size=rows, sampler=sampler)
    position.describe(loader, world)
    for _ in range(batches):
        position.took(rows, world)
    return position.state_dict()


def test_a_resumed_loader_starts_at_the_samples_left_and_counts_the_batches_behind_it():
    state = _checkpoint(world=2, batches=4, epoch=3)  # 32 of the epoch's 64 samples
    resumed = DataPosition()
    resumed.load_state_dict(state)
    assert resumed.resumed_from == 2
    loader = DataLoader(range(64), batch_size=4)  # one device: Lightning leaves the plain loader
    plan = resumed.resume(loader, world_size=1, rank=0, epoch=3)
    assert plan.done == 8  # 32 samples are 8 of this rank's 16 batches of 4
    assert list(plan.sampler) == Order("distributed", 64, True, 0, False, 2).indices(3)[32:]
    assert resumed.resume(loader, 1, 0, 3) is None  # asked once


def test_an_epoch_boundary_on_other_ranks_keeps_the_order_and_leaves_the_loop_its_count():
    state = _checkpoint(world=2, batches=8, epoch=1)  # the whole epoch
    resumed = DataPosition()
    resumed.load_state_dict(state)
    plan = resumed.resume(DataLoader(range(64), batch_size=4), world_size=1, rank=0, epoch=1)
    assert plan.done is None
    assert plan.ended  # a loop that counts its batches has all 16 of this rank's behind it
    assert plan.batches == 16
    assert list(plan.sampler) == Order("distributed", 64, True, 0, False, 2).indices(1)
    resumed.load_state_dict(state)
    assert resumed.resume(DataLoader(range(64), batch_size=4), 1, 0, epoch=3).ended is False  # a later one: afresh
    same = DataPosition()
    same.load_state_dict(state)
    two = DistributedSampler(range(64), 2, 1, shuffle=True, seed=0)
    assert same.resume(DataLoader(range(64), batch_size=4, sampler=two), 2, 1, 1).sampler is None  # its own order


def test_a_loader_whose_position_cannot_be_set_is_named_with_what_the_epoch_repeats():
    resumed = DataPosition()
    resumed.load_state_dict(_checkpoint(world=2, batches=4, epoch=0))
    why = resumed.resume(DataLoader(range(64), batch_size=4, shuffle=True), 1, 0, 0)
    assert isinstance(why, str)
    assert "RandomSampler" in why
    assert "after 32 of its samples" in why
    resumed.load_state_dict(_checkpoint(world=2, batches=8, epoch=0))  # its end: nothing is trained again
    assert resumed.resume(DataLoader(range(64), batch_size=4, shuffle=True), 1, 0, 0) is None


def test_a_place_kept_in_another_epoch_than_the_loops_moves_nothing_of_that_epoch():
    """A fit stopped by ``max_steps`` inside epoch 0 resumes with epoch 1 in Lightning's loop: from its start."""
    resumed = DataPosition()
    resumed.load_state_dict(_checkpoint(world=1, batches=4, epoch=0))
    plan = resumed.resume(DataLoader(range(64), batch_size=4), 1, 0, epoch=1)
    assert plan.done is None
    assert list(plan.sampler) == Order("distributed", 64, True, 0, False, 1).indices(1)  # the run's, all of it


def test_a_checkpoint_without_a_data_position_moves_nothing():
    resumed = DataPosition()
    resumed.load_state_dict({})
    assert resumed.resumed_from is None
    assert resumed.resume(DataLoader(range(64), batch_size=4), 1, 0, 0) is None
