"""A dual encoder with global in-batch negatives on 2 CPU processes (gloo), as a user would train it.

    python tests/scripts/coupled_ranks.py OUT_DIR

Lightning launches the second process itself (devices=2). Each rank holds half of every global batch of 12 pairs (rank
0 its first 6 rows, rank 1 the last 6), runs both towers through ``cached`` (chunks of 3, lent by
``micro_batch_size=3``, which never splits a coupled loader batch) and ``all_gather_with_grad``, and computes the
InfoNCE of the whole global batch, under ``DDPAccumulationStrategy`` at factor 2. Configurations, one after another:

- ``global``: every rank writes ``OUT_DIR/global.rank<r>.json``: its final weights, the DDP all-reduces it issued
  (a counting comm hook) and its optimizer steps;
- ``unequal`` (last: its error ends the launch's use of the process group): rank 1's batches hold 5 rows, rank 0's 6;
  every rank writes the error it raised to ``OUT_DIR/unequal.rank<r>.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lightning_accum import (  # noqa: E402
    AccumulationScheduler,
    DDPAccumulationStrategy,
    all_gather_with_grad,
    cached,
)
from tests.test_coupled import LR, DualEncoder, info_nce  # noqa: E402
from tests.test_coupled_fit import make_pairs  # noqa: E402

GLOBAL_BATCH, WORLD = 12, 2
ALLREDUCES: list[int] = []


def counting_allreduce_hook(process_group, bucket):  # noqa: ANN001, ANN201 (DDP checks real annotations)
    ALLREDUCES.append(bucket.index())
    return default_hooks.allreduce_hook(process_group, bucket)


class GlobalNegatives(pl.LightningModule):
    def __init__(self, unequal: bool = False) -> None:
        super().__init__()
        self.model = DualEncoder()
        self.unequal = unequal

    def train_dataloader(self) -> DataLoader:
        """Rank r's rows of each global batch: [6r, 6r + 6) of every 12 (5 rows on rank 1 when ``unequal``)."""
        q, d = make_pairs()
        half = GLOBAL_BATCH // WORLD
        size = half - 1 if self.unequal and self.global_rank == 1 else half  # as many batches, one row fewer
        rows = [b + self.global_rank * half + i for b in range(0, len(q), GLOBAL_BATCH) for i in range(size)]
        return DataLoader(TensorDataset(q[rows], d[rows]), batch_size=size, shuffle=False)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        q, d = batch
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
    module = GlobalNegatives(unequal=name == "unequal")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=DDPAccumulationStrategy(),
        callbacks=[AccumulationScheduler({0: 2}, micro_batch_size=3), CountAllReduces()],
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
    record.update(
        steps=trainer.global_step,
        allreduces=list(ALLREDUCES),
        weights={key: value.tolist() for key, value in module.model.state_dict().items()},
    )
    (out / f"{name}.rank{trainer.global_rank}.json").write_text(json.dumps(record))


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for name in ("global", "unequal"):
        run(name, out)


if __name__ == "__main__":
    main()
