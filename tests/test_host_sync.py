"""The package never makes the host wait for the device on an ordinary micro-step.

A host synchronisation is a call that needs a value the device computed (``item``, ``tolist``, ``bool`` / ``int`` /
``float`` of a tensor, ``cpu``, ``nonzero``). Every such call is counted with a ``TorchFunctionMode`` that sees every
torch call of the fit, and kept when the Python stack at the call passes through ``lightning_accum``: Lightning's
own (its progress bar, its logging) are not ours to count. On the CPU the calls cost nothing, but they are the same
calls that would stall a GPU: what is counted here is what a CUDA run waits for.

Each configuration trains factor 4, logging every 50 optimizer steps (a CSV logger), 200 windows. What may read the
device: a logged step, a window the noise scale measures (every 10th by default), and the fit's first
``CHECKED_WINDOWS`` windows, where item weighting checks the counts it otherwise keeps on the device. No other window
reads anything, whatever is switched on.
"""

from __future__ import annotations

import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.data import DataLoader

import lightning_accum
from lightning_accum import AccumulationScheduler
from lightning_accum.features.item_weighting import CHECKED_WINDOWS
from tests.helpers import DictDataset, make_tokens, token_loss

PACKAGE = str(Path(lightning_accum.__file__).resolve().parent)
SYNCHRONISING = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "nonzero"}
BUDGET = 0.03  # host synchronisations per micro-step


class CountSynchronisations(TorchFunctionMode):
    """Counts each synchronising torch call made from inside ``lightning_accum``, by the package's line that made it."""

    def __init__(self) -> None:
        super().__init__()
        self.where: Counter[str] = Counter()
        self.steps: Counter[int] = Counter()  # by the optimizer step the window in progress ends in
        self.step = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in SYNCHRONISING:
            ours = [frame for frame in traceback.extract_stack() if frame.filename.startswith(PACKAGE)]
            if ours:
                self.where[f"{func.__name__} at {Path(ours[-1].filename).name}:{ours[-1].lineno}"] += 1
                self.steps[self.step] += 1
        return func(*args, **(kwargs or {}))


class Counting(pl.Callback):
    """The counter is on from the first training batch to the end of training (a fit's start reads once)."""

    def __init__(self) -> None:
        self.counter = CountSynchronisations()

    def on_train_start(self, *_: Any) -> None:
        self.counter.__enter__()

    def on_train_batch_start(self, trainer: pl.Trainer, *_: Any) -> None:
        self.counter.step = trainer.global_step + 1

    def on_train_end(self, *_: Any) -> None:
        self.counter.__exit__(None, None, None)


class TokenModule(pl.LightningModule):
    """A per-token regression whose batches carry ``labels`` with -100 where no loss is borne."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return token_loss(self.net, batch["features"], batch["labels"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


CONFIGURATIONS = {
    "default": {},
    "sample weighting": {"normalize_by": "sample"},
    "token weighting": {"normalize_by": "token"},
    "token weighting, count_items tensor": {
        "normalize_by": "token",
        "count_items": lambda b: (b["labels"] != -100).sum(),
    },
    "lr rule": {"lr_scaling": "sqrt", "lr_warmup_steps": 5},
    "noise scale": {"noise_scale": True},
    "adaptive": {"noise_scale": True, "adaptive": True},
    "all": {"normalize_by": "token", "lr_scaling": "sqrt", "noise_scale": True, "adaptive": True},
}


def synchronisations(tmp_path: Path, options: dict[str, Any], windows: int = 200) -> CountSynchronisations:
    """The host synchronisations of a fit of ``windows`` windows of factor 4."""
    data = DictDataset(make_tokens(4 * 4 * windows))
    counting = Counting()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=1,
        logger=CSVLogger(tmp_path),
        log_every_n_steps=50,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[AccumulationScheduler({0: 4}, **options), counting],
    )
    trainer.fit(TokenModule(), DataLoader(data, batch_size=4))
    assert trainer.fit_loop.epoch_loop.batch_progress.total.completed == 4 * windows
    return counting.counter


@pytest.mark.parametrize("name", list(CONFIGURATIONS))
def test_host_synchronisations_stay_within_the_logged_and_measured_windows(tmp_path, name):
    options = CONFIGURATIONS[name]
    counted = synchronisations(tmp_path, options)
    interval = 10 if options.get("noise_scale") else 0
    unexpected = {
        step: count
        for step, count in counted.steps.items()
        if step > CHECKED_WINDOWS and step % 50 and not (interval and step % interval == 0)
    }
    assert not unexpected, f"windows that read the device: {unexpected}; where: {dict(counted.where)}"
    per_micro_step = sum(counted.where.values()) / (4 * 200)
    if name != "all":  # every feature at once reads at measured and logged windows for each of them
        assert per_micro_step <= BUDGET, f"{per_micro_step:.3f} per micro-step: {dict(counted.where)}"


def test_the_counter_sees_a_synchronisation_made_in_the_package(tmp_path):
    """The count is not blind: reading the window's token count on every window (what item weighting did before its
    counts stayed on the device) is seen, about once per window."""
    from lightning_accum.features import item_weighting

    original = item_weighting.ItemWeighting._reduce_counts

    def read_every_window(self: Any, ctx: Any) -> torch.Tensor:
        counts = original(self, ctx)
        counts.tolist()
        return counts

    item_weighting.ItemWeighting._reduce_counts = read_every_window  # type: ignore[method-assign]
    try:
        counted = synchronisations(tmp_path, {"normalize_by": "token"}, windows=50)
    finally:
        item_weighting.ItemWeighting._reduce_counts = original  # type: ignore[method-assign]
    assert set(counted.steps) == set(range(1, 51))
    assert any("item_weighting.py" in line for line in counted.where)
