"""A dual encoder with global in-batch negatives on 2 CPU processes (gloo), as a user would train it.

    python tests/scripts/coupled_ranks.py OUT_DIR

Lightning launches the second process itself (devices=2). Each rank holds half of every global batch of 12 pairs (rank
0 its first 6 rows, rank 1 the last 6), runs both towers through ``cached`` (chunks of 3, lent by
``micro_batch_size=3``, which never splits a coupled loader batch) and ``all_gather_with_grad``, under
``DDPAccumulationStrategy`` at factor 2 unless said otherwise. Configurations, one after another, each writing
``OUT_DIR/<name>.rank<r>.json`` on every rank: its final weights, the DDP all-reduces it issued (a counting comm hook),
its optimizer steps, and the error it raised, if any:

- ``global``: the InfoNCE of the whole global batch, the same loss on every rank;
- ``local``: OpenCLIP's ``local_loss=True``: each rank's rows against the gathered batch, both directions;
- ``zero2``: ``global`` under ``DeepSpeedAccumulationStrategy(stage=2)``;
- ``zero3``: ``global`` under ``DeepSpeedAccumulationStrategy(stage=3)`` and no ``AccumulationScheduler``: refused;
- ``unequal`` (last: its error ends the launch's use of the process group): rank 1's batches hold 5 rows, rank 0's 6.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import deepspeed.ops
import lightning.pytorch as pl
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lightning_accum import (  # noqa: E402
    AccumulationScheduler,
    DDPAccumulationStrategy,
    DeepSpeedAccumulationStrategy,
    all_gather_with_grad,
    cached,
)
from tests.test_coupled import LR, DualEncoder, info_nce  # noqa: E402
from tests.test_coupled_fit import make_pairs  # noqa: E402

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # plain gloo, no C++ build

GLOBAL_BATCH, WORLD = 12, 2
ALLREDUCES: list[int] = []


def counting_allreduce_hook(process_group, bucket):  # noqa: ANN001, ANN201 (DDP checks real annotations)
    ALLREDUCES.append(bucket.index())
    return default_hooks.allreduce_hook(process_group, bucket)


def clip_loss(images: torch.Tensor, texts: torch.Tensor, logit_scale: torch.Tensor, rank: int) -> torch.Tensor:
    """OpenCLIP's ClipLoss with ``local_loss=True, gather_with_grad=True``, its gather ``all_gather_with_grad``."""
    all_images, all_texts = all_gather_with_grad(images), all_gather_with_grad(texts)
    logits_per_image = logit_scale * images @ all_texts.T
    logits_per_text = logit_scale * texts @ all_images.T
    labels = torch.arange(len(images)) + len(images) * rank
    return (
        nn.functional.cross_entropy(logits_per_image, labels) + nn.functional.cross_entropy(logits_per_text, labels)
    ) / 2


class GlobalNegatives(pl.LightningModule):
    def __init__(self, unequal: bool = False, local: bool = False) -> None:
        super().__init__()
        self.model = DualEncoder()
        self.unequal, self.local = unequal, local

    def train_dataloader(self) -> DataLoader:
        """Rank r's rows of each global batch: [6r, 6r + 6) of every 12 (5 rows on rank 1 when ``unequal``)."""
        q, d = make_pairs()
        half = GLOBAL_BATCH // WORLD
        size = half - 1 if self.unequal and self.global_rank == 1 else half  # as many batches, one row fewer
        rows = [b + self.global_rank * half + i for b in range(0, len(q), GLOBAL_BATCH) for i in range(size)]
        return DataLoader(TensorDataset(q[rows], d[rows]), batch_size=size, shuffle=False)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        q, d = batch
        if self.local:
            local = cached(self.model.query, q), cached(self.model.document, d)
            return clip_loss(*local, self.model.log_temperature.exp(), self.global_rank)
        queries = all_gather_with_grad(cached(self.model.query, q))
        documents = all_gather_with_grad(cached(self.model.document, d))
        return info_nce(queries, documents, self.model.log_temperature)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


class CountAllReduces(pl.Callback):
    """Lightning registers `ddp_comm_hook` only on CUDA, so register the counting hook on the DDP module here."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.strategy.model.register_comm_hook(None, counting_allreduce_hook)


def run(name: str, out: Path) -> None:
    module = GlobalNegatives(unequal=name == "unequal", local=name == "local")
    callbacks: list[pl.Callback] = [AccumulationScheduler({0: 2}, micro_batch_size=3)]
    strategy: Any = DDPAccumulationStrategy()
    if name.startswith("zero"):
        strategy = DeepSpeedAccumulationStrategy(stage=int(name[-1]))
        callbacks = callbacks if name == "zero2" else []
        # DeepSpeed 0.19 cannot broadcast a parameter without dimensions (a byte view of it): the same value in 1-D
        module.model.log_temperature = nn.Parameter(module.model.log_temperature.detach().reshape(1))
    else:
        callbacks.append(CountAllReduces())
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        callbacks=callbacks,
        accumulate_grad_batches=1 if callbacks else 2,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    ALLREDUCES.clear()
    record: dict[str, Any] = {}
    try:
        trainer.fit(module)
    except ValueError as error:
        record["error"] = str(error)
    record.update(steps=trainer.global_step, allreduces=list(ALLREDUCES))
    if "error" not in record:
        record["weights"] = {key: value.tolist() for key, value in module.model.state_dict().items()}
    (out / f"{name}.rank{trainer.global_rank}.json").write_text(json.dumps(record))


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for name in ("global", "local", "zero2", "zero3", "unequal"):
        run(name, out)


if __name__ == "__main__":
    main()
