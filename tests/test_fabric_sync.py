"""Gradient sync under Fabric, on one process: FSDP2's sync state given back as it was, and the Lightning and torch
private names the Fabric shell reads, pinned (a change there fails here first)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies.model_parallel import _FSDPNoSync
from lightning.fabric.wrappers import _FabricModule, _FabricOptimizer, is_wrapped
from torch import nn

from lightning_accum.compat.torch import fully_shard
from lightning_accum.distributed.sync import fsdp2_modules, fsdp2_sync_state, skip_gradient_sync
from lightning_accum.fabric import Accumulator
from tests.test_torch_contract import one_rank_mesh  # noqa: F401 (a fixture)


def _units(mesh: Any) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    for layer in (net[0], net[2], net[4], net):
        fully_shard(layer, mesh=mesh)
    return net


def _states(net: nn.Module) -> list[tuple[bool, bool]]:
    """The sync state of each unit with parameters (the three layers; the root holds none)."""
    assert len(fsdp2_modules(net)) == 4
    return [fsdp2_sync_state(unit) for unit in (net[0], net[2], net[4])]


def test_fsdp2_sync_state_reads_what_the_public_setters_wrote(one_rank_mesh):  # noqa: F811
    """torch-private ``reduce_grads`` and ``all_reduce_grads`` of a unit's param groups (torch 2.13)."""
    net = _units(one_rank_mesh)
    net[0].set_requires_gradient_sync(False, recurse=False)
    net[2].set_requires_all_reduce(False, recurse=False)
    assert _states(net) == [(False, False), (True, False), (True, True)]
    assert fsdp2_sync_state(net) == (True, True)  # a unit without parameters reduces as by default


@pytest.mark.parametrize("policy", ["last", "reduce_scatter"])
def test_skipping_sync_gives_every_unit_its_previous_state_back(one_rank_mesh, policy):  # noqa: F811
    """Ported from Lightning's tests/tests_fabric/strategies/test_model_parallel.py::test_no_backward_sync, which pins
    that Fabric's `no_backward_sync(module, enabled=False)` leaves `set_requires_gradient_sync(False)` called on exit:
    here the states each unit had, set on purpose, come back as they were, and Fabric's context leaves them off."""
    net = _units(one_rank_mesh)
    net[0].set_requires_gradient_sync(False, recurse=False)
    net[2].set_requires_all_reduce(False, recurse=False)
    before = _states(net)
    with skip_gradient_sync(net, policy):
        net(torch.randn(2, 3)).sum().backward()
        assert _states(net)[2] == (policy == "reduce_scatter", False)  # the third's reduction skipped or deferred
    assert _states(net) == before

    net = _units(one_rank_mesh)
    with _FSDPNoSync(net, enabled=False):  # a syncing micro-step, as litgpt's loop enters it
        assert _states(net) == [(True, True)] * 3
    assert _states(net) == [(False, False)] * 3  # the leak the Accumulator avoids


def test_the_fabric_wrappers_hold_what_the_accumulator_reads():
    """Lightning-private: `_FabricModule._forward_module` (the module the strategy wrapped) and `_strategy`,
    `_FabricOptimizer._strategy`; public: `is_wrapped`, `_FabricOptimizer.optimizer`, `.module`."""
    fabric = Fabric(accelerator="cpu", devices=1)
    net = nn.Linear(2, 1)
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert isinstance(model, _FabricModule)
    assert isinstance(optimizer, _FabricOptimizer)
    assert is_wrapped(model)
    assert is_wrapped(optimizer)
    assert model._forward_module is net
    assert model.module is net
    assert model._strategy is fabric.strategy
    assert optimizer._strategy is fabric.strategy
    assert isinstance(optimizer.optimizer, torch.optim.SGD)


def test_the_optimizer_fabric_wraps_steps_the_torch_optimizer_so_its_hooks_see_every_step():
    fabric = Fabric(accelerator="cpu", devices=1)
    net = nn.Linear(2, 1)
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    accumulator = Accumulator(fabric, model, optimizer, scheduling={0: 2}, log_metrics=False)
    batches = [torch.ones(1, 2), 2 * torch.ones(1, 2)]
    for batch in accumulator.batches(batches):
        with accumulator.micro_step(batch) as micro:
            micro.backward(model(batch).sum())
        if micro.should_step:
            optimizer.step()
    assert accumulator.optimizer_steps == 1
    epoch = accumulator.batches(batches)
    batch = next(epoch)
    with accumulator.micro_step(batch) as micro:
        micro.backward(model(batch).sum())
    with pytest.raises(RuntimeError, match="was called after micro-step 1 of a window of 2"):  # the pre-hook sees it
        optimizer.step()
