"""A tiny regression model, its Lightning wrapper, and the plain-PyTorch big-batch reference.

The reference never imports lightning_accum: it takes one SGD step per window on the mean loss over the window's
micro-batches, with the windows written out by hand in each test.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

IN_FEATURES = 5
LR = 0.1


def make_data(num_samples: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, IN_FEATURES, generator=generator)
    y = x @ torch.randn(IN_FEATURES, 1, generator=generator) + 0.3 * torch.randn(num_samples, 1, generator=generator)
    return x, y


def make_net(seed: int = 1) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN_FEATURES, 4), nn.Tanh(), nn.Linear(4, 1))


class RegressionModule(pl.LightningModule):
    def __init__(self, seed: int = 1, lr: float = LR) -> None:
        super().__init__()
        self.net = make_net(seed)
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class BatchStream(IterableDataset):
    """Yields ready-made batches and has no length: Lightning cannot know where an epoch ends."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int) -> None:
        self.x, self.y, self.batch_size = x, y, batch_size

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for start in range(0, len(self.x), self.batch_size):
            yield self.x[start : start + self.batch_size], self.y[start : start + self.batch_size]


class ResumableLoader(DataLoader):
    """A DataLoader that Lightning can resume in the middle of an epoch (it has ``state_dict``/``load_state_dict``).

    Its state is the batches yielded in the epoch in progress, as torchdata's StatefulDataLoader keeps it, and a
    state loaded but not yet iterated is reported as is. An epoch iterated to its end resumes as a new epoch, unless
    ``wrap=False``: then, as torchdata's loader does when Lightning never asked it past the last batch, it resumes at
    that end and yields nothing more.
    """

    def __init__(self, *args: Any, wrap: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.yielded = self.skip = 0
        self.wrap = wrap

    def __iter__(self) -> Iterator[Any]:
        skip, self.skip = self.skip, 0
        self.yielded = skip
        for index, batch in enumerate(super().__iter__()):
            if index >= skip:
                self.yielded += 1
                yield batch

    def state_dict(self) -> dict[str, int]:
        consumed = self.skip or self.yielded
        return {"consumed": 0 if consumed >= len(self) and self.wrap else consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.skip = state["consumed"]


def loader(x: torch.Tensor, y: torch.Tensor, batch_size: int) -> DataLoader:
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


def trainer(callbacks: Sequence[pl.Callback] = (), **kwargs: Any) -> pl.Trainer:
    defaults: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    defaults.update(kwargs)
    return pl.Trainer(callbacks=list(callbacks), **defaults)


def reference_snapshots(
    x: torch.Tensor,
    y: torch.Tensor,
    batch_size: int,
    windows: Sequence[Sequence[int]],
    seed: int = 1,
    lr: float = LR,
) -> list[list[torch.Tensor]]:
    """Plain PyTorch, one SGD step per window on the mean loss over its micro-batches; the weights after every step.

    ``windows[e]`` are the window sizes of epoch ``e``, consecutive from the epoch's first batch; they need not cover
    the epoch (``max_steps``, a stop, a skipped rest). Index 0 holds the weights before any step.
    """
    net = make_net(seed)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    batches = [(x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, len(x), batch_size)]
    snapshots = [[p.detach().clone() for p in net.parameters()]]
    for epoch_windows in windows:
        assert sum(epoch_windows) <= len(batches), "the windows of an epoch cannot hold more than its batches"
        start = 0
        for size in epoch_windows:
            window = batches[start : start + size]
            start += size
            optimizer.zero_grad()
            loss = sum(nn.functional.mse_loss(net(bx), by) for bx, by in window) / len(window)
            loss.backward()
            optimizer.step()
            snapshots.append([p.detach().clone() for p in net.parameters()])
    return snapshots


def reference_weights(
    x: torch.Tensor, y: torch.Tensor, batch_size: int, windows: Sequence[Sequence[int]], seed: int = 1, lr: float = LR
) -> list[torch.Tensor]:
    """Plain PyTorch: for each epoch, one SGD step per window on the mean loss over the window's micro-batches."""
    batches = math.ceil(len(x) / batch_size)
    assert all(sum(epoch_windows) == batches for epoch_windows in windows), "the windows must cover each epoch"
    return reference_snapshots(x, y, batch_size, windows, seed, lr)[-1]


def weights(module: pl.LightningModule) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def max_deviation(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a, b, strict=True))


def make_tokens(samples: int, length: int = 6, seed: int = 0) -> dict[str, torch.Tensor]:
    """Sequences of 5-feature tokens with regression labels; -100 marks the positions that bear no loss."""
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(samples, length, 5, generator=generator)
    labels = features.sum(-1) + 0.1 * torch.randn(samples, length, generator=generator)
    lengths = torch.randint(0, length + 1, (samples,), generator=generator)  # some sequences bear no loss at all
    labels[torch.arange(length) >= lengths[:, None]] = -100
    return {"features": features, "labels": labels}


def token_loss(net: nn.Module, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    mask = labels != -100
    prediction = net(features).squeeze(-1)
    return ((prediction - labels)[mask] ** 2).sum() / mask.sum().clamp(min=1)


class DictDataset(torch.utils.data.Dataset):
    def __init__(self, data: dict[str, torch.Tensor]) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data["labels"])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {key: value[index] for key, value in self.data.items()}


def exact_noise_scale(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """B_simple = tr(Sigma) / |G|^2 of the MSE loss, from every per-sample gradient of the dataset (torch.func)."""
    from torch.func import functional_call, grad, vmap

    params = {name: p.detach() for name, p in net.named_parameters()}

    def loss(params: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(functional_call(net, params, (xi[None],)), yi[None])

    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    flat = torch.cat([g.reshape(len(x), -1) for g in per_sample.values()], dim=1).double()
    mean = flat.mean(0)
    return ((flat - mean).pow(2).sum(1).mean() / mean.pow(2).sum()).item()


class MeasuredLR(pl.Callback):
    """The learning rate each plain-SGD step really applied to each param group, from the update: delta = -lr * grad.

    The weights are read in ``on_before_optimizer_step`` (after the window's last backward, before the update) and
    again after the step; use a float64 model (``Trainer(precision="64-true")``) for a precise measurement.
    """

    def __init__(self) -> None:
        self.used: list[list[float]] = []
        self._before: list[torch.Tensor] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.optimizers[0].register_step_post_hook(self._measure)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._before = [p.detach().clone() for group in optimizer.param_groups for p in group["params"][:1]]

    def _measure(self, optimizer: Any, *_: Any) -> None:
        lrs = []
        for group, before in zip(optimizer.param_groups, self._before, strict=True):
            param = group["params"][0]
            grad = param.grad.detach().flatten()
            index = int(grad.abs().argmax())
            lrs.append(float((before.flatten()[index] - param.detach().flatten()[index]) / grad[index]))
        self.used.append(lrs)
