"""The wheel as users install it: a short CPU training run written as the README's "In your own code" writes it.

Run by .ci/run from a temporary directory outside the source tree, in a fresh venv holding the built wheel (not an
editable install). Usage: ``python wheel_smoke.py CHECKOUT`` (the source tree, which must not be where
``lightning_accum`` is imported from). ``ProbeNet`` is the target of the stage's
``lightning-accum plan --probe wheel_smoke:ProbeNet``, which measures it in subprocesses of the installed command.
"""

from __future__ import annotations

import importlib
import sys
import sysconfig
import tempfile
from importlib.resources import files
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_accum
from lightning_accum import AccumulationScheduler

BATCHES_PER_EPOCH = 20  # 40 samples, loader batches of 2
EPOCHS = 2


class TinyRegression(pl.LightningModule):
    """A linear regression that records the micro-batches of each optimizer step."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)
        self.micro_steps = 0
        self.factors: list[int] = []  # micro-batches per optimizer step
        self.estimated: int | float | None = None

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """The mean squared error of one micro-batch."""
        self.micro_steps += 1
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Record the window's micro-batches."""
        self.factors.append(self.micro_steps)
        self.micro_steps = 0

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """SGD; records the optimizer steps the schedule takes, as an LR schedule would be sized with them."""
        self.estimated = lightning_accum.estimated_stepping_batches(self.trainer)
        return torch.optim.SGD(self.parameters(), lr=0.05)


class ProbeNet(pl.LightningModule):
    """The target of ``lightning-accum plan --probe``: a module with an ``example_input_array``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 1))
        self.example_input_array = torch.randn(4, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP."""
        return self.net(x)


def main(checkout: Path) -> None:
    """Train 2 epochs under a step schedule and check where the package came from and the steps it took."""
    installed = Path(lightning_accum.__file__).resolve()
    site_packages = Path(sysconfig.get_paths()["purelib"]).resolve()
    assert installed.is_relative_to(site_packages), f"lightning_accum imported from {installed}, not {site_packages}"
    assert not installed.is_relative_to(checkout), f"lightning_accum imported from the checkout: {installed}"
    assert (files("lightning_accum") / "py.typed").is_file(), "the wheel lacks lightning_accum/py.typed"
    standalone = importlib.import_module("lightning_accum.pytorch_lightning")  # the standalone namespaces' modules
    importlib.import_module("lightning_accum.lightning_fabric")
    assert standalone.AccumulationScheduler.__module__ == "lightning_accum.pytorch_lightning"

    torch.manual_seed(0)
    x = torch.randn(2 * BATCHES_PER_EPOCH, 4)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    loader = DataLoader(TensorDataset(x, y), batch_size=2)
    model = TinyRegression()
    # factor 2 for the first 4 optimizer steps, then 4 -- exactly at step 4, in the middle of the first epoch
    accumulation = AccumulationScheduler(scheduling={0: 2, 4: 4}, unit="step")
    with tempfile.TemporaryDirectory() as root:
        trainer = pl.Trainer(
            max_epochs=EPOCHS,
            accelerator="cpu",
            devices=1,
            callbacks=[accumulation],
            default_root_dir=root,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
        trainer.fit(model, loader)
        logged = sorted(path.name for path in Path(root).rglob("events.out.tfevents.*"))
    # epoch 0: 4 steps of 2 batches, then 3 of 4; epoch 1: 5 of 4
    expected = [2] * 4 + [4] * 3 + [4] * 5
    assert model.factors == expected, f"micro-batches per optimizer step {model.factors}, expected {expected}"
    assert model.estimated == len(expected), f"estimated_stepping_batches {model.estimated}, took {len(expected)}"
    assert trainer.global_step == len(expected), f"trainer.global_step {trainer.global_step}"
    assert logged, "no TensorBoard event file written"
    print(
        f"wheel smoke: lightning_accum {lightning_accum.__version__} from {installed.parent}, lightning"
        f" {pl.__version__}, torch {torch.__version__}: {trainer.global_step} optimizer steps"
        f" = estimated_stepping_batches {model.estimated}, micro-batches per step {model.factors}"
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve())
