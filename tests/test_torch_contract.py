"""The torch-private names lightning_accum relies on, on the installed torch: CI runs this module on torch 2.9.1 (the
FSDP2 floor), 2.13.0 and 2.14.1, and on torch 2.4.1, where FSDP2 is refused, the tests that need no FSDP2 unit.

The FSDP2 state that lightning_accum/distributed/sync.py reads and clears: if these fail after a torch upgrade,
``fsdp2_pending_gradients`` and ``drop_fsdp2_pending_gradients`` must be revisited (an abandoned window's gradients
would leak into the next one, or a step on unreduced gradients would go unnoticed). The param groups' comm objects
that ``FSDP2CollectiveGuard`` wraps, and the keywords FSDP2 calls them with (else a unit that one rank skips would
hang or crash the run again instead of raising). And ``torch._utils._flatten_dense_tensors``, with which the noise
scale squares many small gradients in one dot.
"""

from __future__ import annotations

import contextlib
import socket

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from lightning_accum.compat.torch import fully_shard
from lightning_accum.distributed.sync import (
    FORWARD_END,
    FSDP2CollectiveGuard,
    drop_fsdp2_pending_gradients,
    fsdp2_pending_gradients,
    param_groups_of,
    skip_gradient_sync,
)
from tests.helpers import FSDP2, NO_FSDP2


@pytest.fixture
def one_rank_mesh(monkeypatch):
    """A device mesh over one gloo rank, for FSDP2 on this process (skipped where lightning_accum refuses FSDP2)."""
    if not FSDP2:
        pytest.skip(NO_FSDP2)
    # a free port, and only for this test: a MASTER_PORT left in os.environ would be inherited by the two-process
    # launches of later tests, whose rank 0 then cannot listen on it (EADDRINUSE) or waits for a store never started
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _sharded(mesh, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).to(dtype)
    fully_shard(net[0], mesh=mesh)
    fully_shard(net[2], mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def _grads(net: nn.Module) -> list[torch.Tensor]:
    return [p.grad.full_tensor().clone() for p in net.parameters()]


def test_skipped_reductions_are_pending_until_a_synced_backward(one_rank_mesh):
    net = _sharded(one_rank_mesh)
    x = torch.randn(6, 3)
    assert not fsdp2_pending_gradients(net)
    with skip_gradient_sync(net, "last"):
        net(x[:3]).sum().backward()
    assert fsdp2_pending_gradients(net)
    net(x[3:]).sum().backward()
    assert not fsdp2_pending_gradients(net)

    reference = _sharded(one_rank_mesh)
    reference(x).sum().backward()  # the two halves, accumulated
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(_grads(net), _grads(reference), strict=True))


def test_dropping_pending_gradients_forgets_the_abandoned_micro_steps(one_rank_mesh):
    net = _sharded(one_rank_mesh)
    x = torch.randn(6, 3)
    with skip_gradient_sync(net, "last"):
        net(x[:3]).sum().backward()  # a window that will never step
    drop_fsdp2_pending_gradients(net)
    assert not fsdp2_pending_gradients(net)
    net.zero_grad(set_to_none=True)
    net(x[3:]).sum().backward()

    reference = _sharded(one_rank_mesh)
    reference(x[3:]).sum().backward()  # only the new window
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(_grads(net), _grads(reference), strict=True))


def test_the_comms_the_guard_wraps_are_fsdp2s_and_are_called_with_its_keywords(one_rank_mesh):
    import re
    from inspect import getsource

    from torch.distributed.fsdp._fully_shard._fsdp_collectives import foreach_all_gather, foreach_reduce
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    net = _sharded(one_rank_mesh)
    groups = [g for m in net.modules() if hasattr(m, "_get_fsdp_state") for g in param_groups_of(m._get_fsdp_state())]
    assert len(groups) == 2
    defaults = [(g._all_gather_comm, g._reduce_scatter_comm) for g in groups]
    assert {(type(a).__name__, type(r).__name__) for a, r in defaults} == {("DefaultAllGather", "DefaultReduceScatter")}
    # FSDP2 hands each param group's comms to its collectives, and calls them by keyword
    assert re.search(r"all_gather_comm\(\s*output_tensor=\w+,\s*input_tensor=", getsource(foreach_all_gather))
    assert re.search(r"reduce_scatter_comm\(\s*output_tensor=\w+,\s*input_tensor=", getsource(foreach_reduce))
    source = getsource(FSDPParamGroup)
    assert "self._all_gather_comm," in source
    assert "self._reduce_scatter_comm," in source

    seen = []
    hooks = [len(module._forward_hooks) for module in net.modules()]
    guard = FSDP2CollectiveGuard(net)
    assert [len(module._forward_hooks) for module in net.modules()] != hooks
    assert guard.agree(FORWARD_END, 0) == [[FORWARD_END, 0, 0, -1, 0]]  # one rank: the agreement is its own row
    guard.agree = lambda event, *args, **kwargs: seen.append(event) or []  # type: ignore[method-assign]
    try:
        assert all(type(g._all_gather_comm).__name__ == "_AgreedAllGather" for g in groups)
        output, wrapped = torch.empty(4), groups[0]._all_gather_comm
        assert wrapped(output_tensor=output, input_tensor=torch.ones(4), group=dist.group.WORLD) is None
        assert output.tolist() == [1.0] * 4  # delegated to torch's all-gather
        net(torch.randn(2, 3)).sum().backward()
        assert FORWARD_END in seen  # the end of the root's forward
    finally:
        guard.remove()
    # stepped aside: FSDP2's own comm objects and no hook of the guard's, so that it costs nothing more
    assert [(g._all_gather_comm, g._reduce_scatter_comm) for g in groups] == defaults
    assert [len(module._forward_hooks) for module in net.modules()] == hooks


def test_the_current_graph_task_id_tells_a_backward_apart():
    inside = []
    x = torch.ones(2, requires_grad=True)
    x.register_hook(lambda grad: inside.append(torch._C._current_graph_task_id()))
    x.sum().backward()
    assert torch._C._current_graph_task_id() == -1
    assert len(inside) == 1
    assert inside[0] != -1


def test_flatten_dense_tensors_concatenates_any_shapes_and_layouts_into_one_new_vector():
    from torch._utils import _flatten_dense_tensors

    tensors = [torch.arange(6.0).reshape(2, 3).t(), torch.tensor([7.0]), torch.ones(2, 2, dtype=torch.bfloat16)]
    flat = _flatten_dense_tensors(tensors)
    assert flat.dim() == 1
    assert flat.dtype == torch.float32  # promoted to the widest dtype
    assert flat.tolist() == [0.0, 3.0, 1.0, 4.0, 2.0, 5.0, 7.0, 1.0, 1.0, 1.0, 1.0]
    flat.zero_()
    assert tensors[1].item() == 7.0  # a copy: the gradients are untouched


def test_each_fsdp2_unit_yields_its_param_groups_on_this_torch_and_on_older_ones(one_rank_mesh):
    from types import SimpleNamespace

    from lightning_accum.distributed.sync import param_groups_of

    net = _sharded(one_rank_mesh)
    states = [m._get_fsdp_state() for m in net.modules() if hasattr(m, "_get_fsdp_state")]
    found = [group for state in states for group in param_groups_of(state)]
    assert len(found) == 2  # the two units with parameters: every check that walks the groups sees them
    assert all(type(group).__name__ == "FSDPParamGroup" for group in found)
    # torch releases before the list of groups per unit hold one group, or None, under the singular name
    assert param_groups_of(SimpleNamespace(_fsdp_param_group=found[0])) == [found[0]]
    assert param_groups_of(SimpleNamespace(_fsdp_param_group=None)) == []


def test_fsdp2_weights_make_the_window_the_float32_weighted_sum_rounded_once(one_rank_mesh):
    """lightning_accum/distributed/fsdp2_precision.py relies on FSDP2 (torch 2.13) keeping each unit's
    ``_unsharded_param`` from one iteration to the next (its post-accumulate-grad hook stays), reducing
    ``unsharded_accumulated_grad`` when one is set, and calling a param group's ``_all_reduce_hook`` on the reduced
    shard in the reduce dtype before casting it to the shard's dtype. Then three bfloat16 micro-batches weighted 1/3,
    1/6 and 1/2 and scaled by 1.25 give the
    correctly rounded float32 result, where the same weights on the bfloat16 losses do not."""
    from lightning_accum.distributed.fsdp2_precision import FSDP2Weights, widen_reduce_dtype

    x = torch.randn(9, 3)
    weights, scale = [1 / 3, 1 / 6, 1 / 2], 1.25

    def window(net: nn.Module, wide: FSDP2Weights | None) -> list[torch.Tensor]:
        for index, weight in enumerate(weights):
            with skip_gradient_sync(net, "last") if index < 2 else contextlib.nullcontext():
                out = net(x[3 * index : 3 * index + 3].bfloat16()).float().pow(2).mean()
                if wide is None:
                    (out * weight * scale).backward()
                    continue
                wide.watch()  # between forward and backward, as the shells' BEFORE_BACKWARD
                wide.weight = weight
                if index == 2:
                    wide.arm(scale)
                out.backward()
        return _grads(net)

    # plain PyTorch: each micro-batch's bfloat16 gradient of its unscaled loss, weighted and summed in float64
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).bfloat16()  # _sharded's, unsharded
    sums = [torch.zeros_like(p, dtype=torch.float64) for p in reference.parameters()]
    for index, weight in enumerate(weights):
        reference.zero_grad()
        reference(x[3 * index : 3 * index + 3].bfloat16()).float().pow(2).mean().backward()
        for total, p in zip(sums, reference.parameters(), strict=True):
            total += weight * scale * p.grad.double()
    expected = [total.to(torch.bfloat16) for total in sums]

    net = _sharded(one_rank_mesh, torch.bfloat16)
    restore = widen_reduce_dtype(net, torch.float32)
    wide = FSDP2Weights(net, torch.float32)
    groups = [param_groups_of(unit._get_fsdp_state())[0] for unit in (net[0], net[2])]
    for _ in range(2):  # the hooks registered in the first window still fire in the second
        net.zero_grad(set_to_none=True)
        grads = window(net, wide)
        assert wide.disarm()  # the reducing backward applied the scale
        assert all(torch.equal(g.bfloat16(), e) for g, e in zip(grads, expected, strict=True))
    wide.remove()
    restore()
    assert all(group._all_reduce_hook is None for group in groups)

    narrow = _sharded(one_rank_mesh, torch.bfloat16)  # the weights on the bfloat16 losses: rounded in bfloat16
    assert not all(torch.equal(g.bfloat16(), e) for g, e in zip(window(narrow, None), expected, strict=True))


def test_fsdp2_weights_serve_a_unit_frozen_at_the_start_and_unfrozen_later(one_rank_mesh):
    """A backbone frozen when the fit starts and unfrozen after a step (``BackboneFinetuning``): its unit must already
    reduce in float32, else FSDP2 hands a float32 reduced gradient to a bfloat16 parameter (it raised in
    ``foreach_reduce``). Its first window is the correctly rounded weighted sum, as the other unit's."""
    from lightning_accum.distributed.fsdp2_precision import FSDP2Weights, widen_reduce_dtype

    x = torch.randn(6, 3)
    net = _sharded(one_rank_mesh, torch.bfloat16)
    net[0].requires_grad_(False)
    restore = widen_reduce_dtype(net, torch.float32)
    wide = FSDP2Weights(net, torch.float32)
    for unfrozen in (False, True):
        net[0].requires_grad_(unfrozen)
        net.zero_grad(set_to_none=True)
        for index in range(2):
            with skip_gradient_sync(net, "last") if index == 0 else contextlib.nullcontext():
                out = net(x[3 * index : 3 * index + 3].bfloat16()).float().pow(2).mean()
                wide.watch()
                wide.weight = 1 / 3 if index == 0 else 2 / 3
                out.backward()
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).bfloat16()  # _sharded's, unsharded
    sums = [torch.zeros_like(p, dtype=torch.float64) for p in reference.parameters()]
    for index, weight in enumerate((1 / 3, 2 / 3)):
        reference.zero_grad()
        reference(x[3 * index : 3 * index + 3].bfloat16()).float().pow(2).mean().backward()
        for total, p in zip(sums, reference.parameters(), strict=True):
            total += weight * p.grad.double()
    got = _grads(net)
    assert got[0].dtype == torch.bfloat16
    assert all(torch.equal(g, total.to(torch.bfloat16)) for g, total in zip(got[:2], sums[:2], strict=True))
    wide.remove()
    restore()
