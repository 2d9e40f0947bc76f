"""The torch-private names lightning_accum relies on (torch 2.13).

The FSDP2 state that lightning_accum/sync.py reads and clears: if these fail after a torch upgrade,
``fsdp2_pending_gradients`` and ``drop_fsdp2_pending_gradients`` must be revisited (an abandoned window's gradients
would leak into the next one, or a step on unreduced gradients would go unnoticed). And
``torch._utils._flatten_dense_tensors``, with which the noise scale squares many small gradients in one dot.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from lightning_accum.sync import drop_fsdp2_pending_gradients, fsdp2_pending_gradients, skip_gradient_sync


@pytest.fixture
def one_rank_mesh():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29671")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _sharded(mesh) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
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


def test_flatten_dense_tensors_concatenates_any_shapes_and_layouts_into_one_new_vector():
    from torch._utils import _flatten_dense_tensors

    tensors = [torch.arange(6.0).reshape(2, 3).t(), torch.tensor([7.0]), torch.ones(2, 2, dtype=torch.bfloat16)]
    flat = _flatten_dense_tensors(tensors)
    assert flat.dim() == 1
    assert flat.dtype == torch.float32  # promoted to the widest dtype
    assert flat.tolist() == [0.0, 3.0, 1.0, 4.0, 2.0, 5.0, 7.0, 1.0, 1.0, 1.0, 1.0]
    flat.zero_()
    assert tensors[1].item() == 7.0  # a copy: the gradients are untouched
