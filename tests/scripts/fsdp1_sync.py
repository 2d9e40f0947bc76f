"""FSDP1's sync control on CPU: FSDPAccumulationStrategy.block_backward_sync around a real FullyShardedDataParallel.

Lightning refuses FSDPStrategy on CPU and torch's FSDP1 needs ``device_id=cpu`` to build there, so this script
drives the strategy's public context manager by hand, as Lightning's loop does, over 2 gloo processes:

    python tests/scripts/fsdp1_sync.py OUT_DIR

For gradient_sync "last" and "every", one after the other in the same two processes, it writes
``OUT_DIR/<policy>.json`` (rank 0): reduce-scatters counted with torch.profiler, optimizer steps, micro-steps and the
final full weights.
"""

from __future__ import annotations

import collections
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.utils.data import DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parent))
from two_ranks import LR, MICRO_BATCH, make_data, make_net  # noqa: E402

from lightning_accum import FSDPAccumulationStrategy  # noqa: E402

WINDOWS = [3, 3, 2, 3, 3, 2]  # factor 3 over two epochs of 8 micro-steps


def worker(rank: int, out: Path, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    for policy in ("last", "every"):
        record = train(rank, policy)
        if rank == 0:
            (out / f"{policy}.json").write_text(json.dumps(record))
    dist.destroy_process_group()
    # torch 2.13 can abort at interpreter exit after a profiled gloo run on a loaded machine ("terminate called
    # without an active exception": a C++ thread still joinable when static objects are destroyed); everything this
    # worker had to do is done and written, so leave without running those destructors
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def train(rank: int, policy: str) -> dict[str, Any]:
    """A fresh FSDP1 model trained in windows of WINDOWS under ``policy``: what rank 0 records."""
    model = FullyShardedDataParallel(
        make_net(), device_id=torch.device("cpu"), auto_wrap_policy=ModuleWrapPolicy({nn.Linear})
    )
    strategy = FSDPAccumulationStrategy(gradient_sync=policy)
    strategy.model = model  # what FSDPStrategy.setup assigns after wrapping
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = make_data()
    micro_steps = []  # what Lightning feeds this rank: a shuffling DistributedSampler, seed 0, reshuffled per epoch
    for epoch in range(2):
        sampler = DistributedSampler(range(len(x)), num_replicas=2, rank=rank, shuffle=True, seed=0)
        sampler.set_epoch(epoch)
        order = torch.tensor(list(sampler))
        micro_steps += [(x[index], y[index]) for index in order.split(MICRO_BATCH)]
    steps = 0
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        position = 0
        for size in WINDOWS:
            for index in range(size):
                batch_x, batch_y = micro_steps[position]
                position += 1
                last = index == size - 1
                context = strategy.block_backward_sync() if not last else torch.enable_grad()
                with context:
                    loss = nn.functional.mse_loss(model(batch_x), batch_y) / size
                    loss.backward()
                    strategy.post_backward(loss)
            assert not strategy._reduction_skipped  # the window's last backward was reduced
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
    names = collections.Counter(event.name for event in profiler.events())
    with FullyShardedDataParallel.summon_full_params(model):
        weights = {
            name.replace("_fsdp_wrapped_module.", ""): param.detach().flatten().tolist()
            for name, param in model.named_parameters()
        }
    return {
        "reduce_scatters": names["c10d::_reduce_scatter_base_"],
        "optimizer_steps": steps,
        "micro_steps": position,
        "weights": weights,
    }


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    mp.spawn(worker, args=(out, 29600 + os.getpid() % 1000), nprocs=2)


if __name__ == "__main__":
    main()
