"""What the speed benchmarks share: a backward-dominated MLP, its data, and side-by-side rounds.

Not a benchmark itself; ``overhead.py``, ``noise_overhead.py``, ``feature_overhead.py``, the GPU suite (``gpu/``)
and, for the frozen model, ``noise_estimate.py`` and ``adaptive_rule.py`` import it (run them from the repository root).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

WIDTH, LAYERS, MICRO_BATCH, FACTOR = 1024, 4, 64, 4


class Frozen(pl.LightningModule):
    """MSE regression with a learning rate of 0: the weights never move, so the exact noise scale stays known."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


class MLP(pl.LightningModule):
    """4 layers of width 1024: backward dominates a step."""

    def __init__(self, log_loss: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(LAYERS)))
        self.log_loss = log_loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        loss = self.net(x).pow(2).mean()
        if self.log_loss:
            self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-4)


def fit_seconds(trainer: pl.Trainer, steps: int, log_loss: bool = False) -> float:
    """Wall time of ``trainer.fit`` on a fresh MLP over ``steps`` optimizer steps of ``FACTOR`` micro-batches."""
    data = TensorDataset(torch.randn(MICRO_BATCH * FACTOR * steps, WIDTH, generator=torch.Generator().manual_seed(0)))
    start = time.perf_counter()
    trainer.fit(MLP(log_loss), DataLoader(data, batch_size=MICRO_BATCH))
    return time.perf_counter() - start


def alternate(measure: Callable[[bool], float], rounds: int) -> dict[str, Any]:
    """Time the baseline (``measure(False)``) and the candidate (``measure(True)``) in alternating rounds.

    A warm-up round of the candidate runs first. Returns the per-round times, the per-round ratios candidate /
    baseline, their median and the median times.
    """
    measure(True)  # warm-up
    times: dict[str, list[float]] = {"baseline": [], "candidate": []}
    for _ in range(rounds):
        times["baseline"].append(measure(False))
        times["candidate"].append(measure(True))
    ratios = [b / a for a, b in zip(times["baseline"], times["candidate"], strict=True)]
    return {
        "baseline": statistics.median(times["baseline"]),
        "candidate": statistics.median(times["candidate"]),
        "ratio": statistics.median(ratios),
        "ratios": ratios,
        "rounds": times,
    }


def rotated_rounds(
    measure: Callable[[str], float], names: list[str], count: int, deadline: float | None = None
) -> dict[str, list[float]]:
    """Each configuration once per round, in an order rotated every round, so that drift hits all alike.

    ``measure(name)`` returns one configuration's time. With a ``deadline`` (a ``time.monotonic()`` value), no round
    starts once a round as long as the longest so far would end after it; at least one round always runs.
    """
    times: dict[str, list[float]] = {name: [] for name in names}
    longest = 0.0
    for round_index in range(count):
        if deadline is not None and round_index and time.monotonic() + longest > deadline:
            break
        started = time.monotonic()
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(measure(name))
        longest = max(longest, time.monotonic() - started)
    return times


def ratio(times: dict[str, list[float]], name: str, baseline: str) -> dict[str, float]:
    """Round-by-round ratios ``name / baseline``: their median and range."""
    ratios = [a / b for a, b in zip(times[name], times[baseline], strict=True)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def device() -> str:
    """Where the benchmark ran."""
    return "cuda" if torch.cuda.is_available() else "cpu"
