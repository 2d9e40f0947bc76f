"""Fabric loops with the Accumulator on 2 CPU processes (gloo), launched as a user would, and what they did.

    python tests/scripts/fabric_ranks.py OUT_DIR

``Fabric(accelerator="cpu", devices=2, strategy=...)`` launches the second process itself. One launch runs every
configuration of CONFIGS in turn, each with a fresh Fabric, model and optimizer (a process costs seconds of imports):
DDP and FSDP2 (``ModelParallelStrategy``, ``fully_shard`` on each layer and the root) under the Accumulator, litgpt's
own ``no_backward_sync`` loop for contrast, loaders that differ between the ranks, and Lightning's own
``no_backward_sync`` test ported. Every rank writes ``OUT_DIR/<name>.rank<r>.json``: the optimizer steps, the
collectives it issued (torch.profiler's ``c10d::`` events, and DDP's all-reduced buckets through a counting comm
hook), each FSDP2 unit's gradient sync state after the loop, the error raised if any, and the full weights.
"""

from __future__ import annotations

import collections
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy, ModelParallelStrategy
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from lightning_accum.compat.torch import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from fabric_common import LR, TinyLM, leave, litgpt_loop, make_pairs, mean_loss, micro_batches  # noqa: E402

from lightning_accum.distributed.sync import fsdp2_modules, fsdp2_sync_state  # noqa: E402
from lightning_accum.fabric import Accumulator  # noqa: E402
from tests.helpers import BACKENDS  # noqa: E402

ROWS, PAIRS = 3, 24  # each rank: 8 micro-batches of 3 pairs, its own pairs (ragged: different token counts)
BUCKETS: list[int] = []


def rank_data(rank: int, pairs: int = PAIRS) -> list[dict[str, torch.Tensor]]:
    return micro_batches(make_pairs(pairs, seed=10 + rank), ROWS)


def counting_allreduce_hook(process_group, bucket):  # noqa: ANN001, ANN201 (DDP checks real annotations)
    BUCKETS.append(bucket.index())
    return default_hooks.allreduce_hook(process_group, bucket)


def shard_layers(model: nn.Module, mesh: Any) -> nn.Module:
    for layer in (model.block, model.head):
        fully_shard(layer, mesh=mesh["data_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def strategy(backend: str) -> Any:
    if backend == "ddp":
        return DDPStrategy()
    return ModelParallelStrategy(parallelize_fn=shard_layers, data_parallel_size=2, tensor_parallel_size=1)


def set_up(backend: str, net: nn.Module, precision: str = "32-true") -> tuple[Fabric, Any, Any]:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy(backend), precision=precision)
    fabric.launch()
    model = fabric.setup_module(net)
    return fabric, model, fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=LR))


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor  # a DTensor under FSDP2


def full_weights(model: nn.Module) -> dict[str, list[float]]:
    weights = {}
    for name, param in model.named_parameters():
        weights[name.removeprefix("_forward_module.").removeprefix("module.")] = full(param).detach().flatten().tolist()
    return weights


def accumulated(backend: str, fabric: Fabric, model: Any, optimizer: Any, data: Any, **options: Any) -> dict:
    accumulator = Accumulator(fabric, model, optimizer, log_metrics=False, **options)
    first_window: dict[str, list[float]] = {}  # the gradient the first step used, as the optimizer saw it
    for batch in accumulator.batches(data):
        with accumulator.micro_step(batch) as micro:
            micro.backward(mean_loss(model, batch))
        if micro.should_step:
            if not first_window:
                named = model.module.named_parameters()
                first_window = {name: full(p.grad).float().flatten().tolist() for name, p in named}
            optimizer.step()
            optimizer.zero_grad()
    return {"optimizer_steps": accumulator.optimizer_steps, "first_window": first_window}


def litgpt(backend: str, fabric: Fabric, model: Any, optimizer: Any, data: Any, factor: int) -> dict:
    """litgpt's finetune/full.py accumulation, with Fabric's own no_backward_sync."""
    return {"optimizer_steps": litgpt_loop(fabric, model, optimizer, data, factor)}


def generator(data: list) -> Iterator[Any]:
    yield from data  # no length: the ranks agree on each window instead


def lightning_port(backend: str, out: Path, name: str) -> None:
    """Ported from litgpt's tests/test_distributed.py::test_no_backward_sync (strategies "ddp" and "fsdp"; FSDP1 needs
    CUDA, so FSDP2 here): 6 micro-steps, factor 3, each rank's input i * (rank + 1), loss ``model(x).sum()``. Under
    ``fabric.no_backward_sync`` the window's gradient is the sum over its micro-steps, averaged over ranks (9.0, then
    22.5); the Accumulator makes it the window's mean over micro-steps and ranks: 18 / 6 = 3.0, then 45 / 6 = 7.5."""
    world = 2
    net = nn.Linear(1, 1 if backend == "ddp" else world, bias=False)  # FSDP2 shards the rows
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy_for_linear(backend))
    fabric.launch()
    model = fabric.setup_module(net)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.0))
    accumulator = Accumulator(fabric, model, optimizer, scheduling={0: 3}, log_metrics=False)
    inputs = [torch.tensor([float(i * (fabric.local_rank + 1))]) for i in range(1, 7)]
    grads = []
    for x in accumulator.batches(inputs):
        with accumulator.micro_step(x) as micro:
            micro.backward(model(x).sum())
        if micro.should_step:
            grads.append(full(model.weight.grad).flatten().tolist())
            optimizer.step()
            optimizer.zero_grad()
    write(out, name, fabric.global_rank, {"grads": grads})


def strategy_for_linear(backend: str) -> Any:
    if backend == "ddp":
        return DDPStrategy()

    def shard(model: nn.Module, mesh: Any) -> nn.Module:
        fully_shard(model, mesh=mesh["data_parallel"])
        return model

    return ModelParallelStrategy(parallelize_fn=shard, data_parallel_size=2, tensor_parallel_size=1)


def run(
    out: Path,
    name: str,
    backend: str,
    loop: Callable[..., dict],
    data: Callable[[int], Any],
    precision: str = "32-true",
    **options: Any,
) -> None:
    BUCKETS.clear()
    fabric, model, optimizer = set_up(backend, TinyLM(), precision)
    if backend == "ddp":
        model._forward_module.register_comm_hook(None, counting_allreduce_hook)
    record: dict[str, Any] = {}
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    with profiler:
        try:
            record.update(loop(backend, fabric, model, optimizer, data(fabric.global_rank), **options))
        except ValueError as error:
            record["raised"] = str(error)
    names = collections.Counter(event.name for event in profiler.events())
    record["collectives"] = {key: count for key, count in names.items() if key.startswith("c10d::")}
    record["buckets"] = len(BUCKETS)
    units = fsdp2_modules(model._forward_module)
    record["sync_after"] = [list(fsdp2_sync_state(unit)) for unit in units]
    # DDP's own reduction after the loop (the Accumulator turns it off for bf16 windows, and back on at their end)
    record["ddp_sync_after"] = getattr(model._forward_module, "require_backward_grad_sync", None)
    record["weights"] = full_weights(model)
    write(out, name, fabric.global_rank, record)


def write(out: Path, name: str, rank: int, record: dict) -> None:
    (out / f"{name}.rank{rank}.json").write_text(json.dumps(record))


CONFIGS: dict[str, dict[str, Any]] = {
    "ddp_token_k3": dict(
        backend="ddp", loop=accumulated, data=rank_data, scheduling={0: 3}, normalize_by="token", shift_labels=True
    ),
    "ddp_every_k3": dict(
        backend="ddp",
        loop=accumulated,
        data=rank_data,
        scheduling={0: 3},
        normalize_by="token",
        shift_labels=True,
        gradient_sync="every",
    ),
    # bf16-true: DDP's own reduction off for the window, the float32 sums all-reduced once
    "ddp_bf16_k3": dict(
        backend="ddp",
        loop=accumulated,
        data=rank_data,
        precision="bf16-true",
        scheduling={0: 3},
        normalize_by="token",
        shift_labels=True,
        grad_accum_dtype="float32",
    ),
    "fsdp2_token_k3": dict(
        backend="fsdp2", loop=accumulated, data=rank_data, scheduling={0: 3}, normalize_by="token", shift_labels=True
    ),
    # factor 1: 8 windows, past the first 3 whose counts item weighting reads on the host (the scale stays a tensor)
    "fsdp2_token_k1": dict(
        backend="fsdp2", loop=accumulated, data=rank_data, scheduling={0: 1}, normalize_by="token", shift_labels=True
    ),
    # 6 micro-batches: the loop ends on a step, whose `no_backward_sync(enabled=False)` leaves every unit's sync off
    "fsdp2_litgpt_k3": dict(backend="fsdp2", loop=litgpt, data=lambda rank: rank_data(rank, 18), factor=3),
    # rank 1's loader holds 7 micro-batches, rank 0's 8
    "disagree_sized": dict(
        backend="ddp", loop=accumulated, data=lambda rank: rank_data(rank, PAIRS - 3 * rank), scheduling={0: 3}
    ),
    "disagree_unsized": dict(
        backend="fsdp2",
        loop=accumulated,
        data=lambda rank: generator(rank_data(rank, PAIRS - 3 * rank)),
        scheduling={0: 3},
    ),
}
# bf16-true under FSDP2: each unscaled micro-batch gradient weighed in float32 as FSDP2 accumulates it, the token
# scale applied to the reduced float32 shards, each rounded once
CONFIGS["fsdp2_bf16_k3"] = {**CONFIGS["ddp_bf16_k3"], "backend": "fsdp2"}


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for name, options in CONFIGS.items():
        if options["backend"] in BACKENDS:  # FSDP2 where lightning_accum runs it on this torch
            run(out, name, **options)
    for backend in BACKENDS:
        lightning_port(backend, out, f"lightning_port_{backend}")
    leave()


if __name__ == "__main__":
    main()
