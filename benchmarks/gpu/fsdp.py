"""FSDP1 and FSDP2 on one device: the accumulation strategies run and match a plain-PyTorch big batch.

    python benchmarks/gpu/fsdp.py --out DIR [--dry]

World size 1: ``FSDPAccumulationStrategy`` (FSDP1, each Linear its own unit; needs CUDA) and
``ModelParallelAccumulationStrategy`` (FSDP2, ``fully_shard`` on each Linear and the root; CUDA, or gloo on a CPU),
each with ``gradient_sync="last"`` and ``"every"``. An MLP trains two epochs of 8 micro-batches of 8 at factor 3 (each
epoch ends with a window of 2), SGD; the full weights at the end of the fit against the big-batch reference on the
same device (fp32, TF32 off).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # harness, common
import lightning.pytorch as pl  # noqa: E402
from harness import Report, arguments, device, max_deviation, quiet, trainer, weights  # noqa: E402

from lightning_accum import AccumulationScheduler, FSDPAccumulationStrategy, ModelParallelAccumulationStrategy  # noqa: E402
from lightning_accum.compat.torch import has_fsdp2_mechanics  # noqa: E402

FACTOR, MICRO_BATCH, BATCHES, EPOCHS, LR, EXACT = 3, 8, 8, 2, 0.1, 1e-6


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))


def make_data() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(MICRO_BATCH * BATCHES, 16, generator=generator)
    return TensorDataset(x, x[:, :1] * x[:, 1:2] + 0.1 * torch.randn(len(x), 1, generator=generator))


class Regression(pl.LightningModule):
    def __init__(self, fsdp2: bool) -> None:
        super().__init__()
        self.net = make_net()
        self.fsdp2 = fsdp2
        self.final: list[torch.Tensor] = []

    def configure_model(self) -> None:
        if self.fsdp2:
            from lightning_accum.compat.torch import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def on_train_end(self) -> None:  # while the strategy still holds the wrapped model
        if self.fsdp2:
            self.final = [w.clone() for w in weights(self.net)]
            return
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(self.trainer.strategy.model):
            self.final = [p.detach().clone() for p in self.net.parameters()]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def big_batch() -> list[torch.Tensor]:
    """Plain PyTorch: one SGD step per window on one forward of the window's rows."""
    net = make_net().to(device())
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    x, y = (t.to(device()) for t in make_data().tensors)
    starts = range(0, BATCHES, FACTOR)
    for _ in range(EPOCHS):
        for start in starts:
            rows = slice(start * MICRO_BATCH, min(start + FACTOR, BATCHES) * MICRO_BATCH)
            optimizer.zero_grad()
            nn.functional.mse_loss(net(x[rows]), y[rows]).backward()
            optimizer.step()
    return [p.detach() for p in net.parameters()]


def strategy(name: str, sync: str) -> pl.strategies.Strategy:
    if name == "FSDP1":
        return FSDPAccumulationStrategy(gradient_sync=sync, auto_wrap_policy={nn.Linear})
    return ModelParallelAccumulationStrategy(gradient_sync=sync, data_parallel_size=1, tensor_parallel_size=1)


def main(argv: Sequence[str] | None = None) -> None:
    args = arguments(argv, __doc__.split("\n")[0])
    quiet()
    torch.set_float32_matmul_precision("highest")
    report = Report(
        args.out,
        "fsdp",
        "FSDP1 and FSDP2 on one device",
        f"World size 1; an MLP, two epochs of {BATCHES} micro-batches of {MICRO_BATCH} at factor {FACTOR} (each epoch"
        " ends with a window of 2), SGD; full weights after the fit against the plain-PyTorch big batch.",
    )
    report.table("runs", ["strategy", "gradient_sync", "optimizer steps", "max abs weight deviation", "verdict"])
    reference = big_batch()
    expected_steps = EPOCHS * len(range(0, BATCHES, FACTOR))
    for name in ("FSDP1", "FSDP2"):
        for sync in ("last", "every"):
            label = "FSDPAccumulationStrategy" if name == "FSDP1" else "ModelParallelAccumulationStrategy"
            if name == "FSDP1" and not torch.cuda.is_available():
                report.row("runs", [label, sync, "-", "-", "skipped: FSDP1 needs CUDA"], strategy=name, sync=sync)
                continue
            if name == "FSDP2" and not has_fsdp2_mechanics():
                refused = f"skipped: refused on torch {torch.__version__} (docs/compatibility.md)"
                report.row("runs", [label, sync, "-", "-", refused], strategy=name, sync=sync)
                continue
            module = Regression(fsdp2=name == "FSDP2")
            run = trainer(
                strategy=strategy(name, sync),
                max_epochs=EPOCHS,
                use_distributed_sampler=False,  # Lightning's sampler would shuffle: the reference takes them in order
                callbacks=[AccumulationScheduler({0: FACTOR}, log_metrics=False)],
            )
            run.fit(module, DataLoader(make_data(), batch_size=MICRO_BATCH))
            deviation = max_deviation(module.final, reference)
            good = deviation <= EXACT and run.global_step == expected_steps
            report.row(
                "runs",
                [label, sync, str(run.global_step), f"{deviation:.1e}", "matches" if good else "DOES NOT MATCH"],
                strategy=name,
                sync=sync,
                steps=run.global_step,
                deviation=deviation,
                passed=good,
            )
    report.finish()


if __name__ == "__main__":
    main()
