"""A tiny regression model, its Lightning wrapper, and the plain-PyTorch big-batch reference.

The reference never imports lightning_accum: it takes one SGD step per window on the mean loss over the window's
micro-batches, with the windows written out by hand in each test. The last section launches processes for the tests.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from lightning_accum.compat.torch import FSDP2_FLOOR, has_fsdp2_mechanics

if TYPE_CHECKING:  # the scripts the tests launch import this module too: they need no pytest
    import pytest

IN_FEATURES = 5
LR = 0.1

# lightning_accum's FSDP2 mechanics run on this torch (else they are refused: tests/test_torch_versions.py); the
# backends a multi-rank launch trains under here
FSDP2 = has_fsdp2_mechanics()
BACKENDS = ("ddp", "fsdp2") if FSDP2 else ("ddp",)
NO_FSDP2 = (
    f"lightning_accum refuses FSDP2 on torch {torch.__version__} (it needs torch>="
    f"{'.'.join(map(str, FSDP2_FLOOR))}): the refusal is tested in tests/test_torch_versions.py"
)


def rank_records(out: Path, name: str) -> list[dict]:
    """The two ranks' JSON records of the launched run ``name`` in ``out``; skipped for an FSDP2 run where it is
    refused (the launch left it out)."""
    if not FSDP2 and "fsdp2" in f"{Path(out).name}/{name}":
        import pytest

        pytest.skip(NO_FSDP2)
    return [json.loads((Path(out) / f"{name}.rank{rank}.json").read_text()) for rank in (0, 1)]


def backends(*names: str) -> list[Any]:
    """Parameters for ``pytest.mark.parametrize``: ``names``, those under FSDP2 skipped where it is refused."""
    import pytest

    return [
        pytest.param(name, marks=pytest.mark.skipif(not FSDP2, reason=NO_FSDP2)) if "fsdp2" in name else name
        for name in names
    ]


def mse(prediction: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """``nn.functional.mse_loss``; in a narrow dtype written out (torch 2.4's CPU has no bfloat16 MSE kernel)."""
    if prediction.dtype in (torch.float32, torch.float64):
        return nn.functional.mse_loss(prediction, target, reduction=reduction)
    squares = (prediction - target).square()
    return squares.sum() if reduction == "sum" else squares.mean()


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
        return mse(self.net(x), y)

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


def trainer(callbacks: Sequence[pl.Callback] = (), trainer_class: type = pl.Trainer, **kwargs: Any) -> pl.Trainer:
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
    return trainer_class(callbacks=list(callbacks), **defaults)


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


class LinearTokenModule(pl.LightningModule):
    """``Linear(5, 1)`` on :func:`make_tokens` batches, the loss :func:`token_loss`, plain SGD at 0.1."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(5, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return token_loss(self.net, batch["features"], batch["labels"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class DictDataset(torch.utils.data.Dataset):
    def __init__(self, data: dict[str, torch.Tensor]) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data["labels"])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {key: value[index] for key, value in self.data.items()}


def per_sample_gradients(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Every sample's gradient of the MSE loss, flattened (one row each, float64; torch.func)."""
    from torch.func import functional_call, grad, vmap

    params = {name: p.detach() for name, p in net.named_parameters()}

    def loss(params: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(functional_call(net, params, (xi[None],)), yi[None])

    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    return torch.cat([g.reshape(len(x), -1) for g in per_sample.values()], dim=1).double()


def exact_noise_scale(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """B_simple = tr(Sigma) / |G|^2 of the MSE loss, from every per-sample gradient of the dataset (torch.func)."""
    flat = per_sample_gradients(net, x, y)
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


# ------------------------------------------------------------------ launching processes

_SESSION_ENVIRONMENT = dict(os.environ)  # as the suite started: tests/conftest.py imports this module first

# what a launcher (Lightning's, torchrun) sets for the ranks it starts, and Lightning's seed_everything for its
# samplers: an in-process fit of an earlier test leaves them in os.environ, and a script launched with them would
# take itself for a rank an outside launcher started and wait for the others, or shuffle with another seed
LAUNCHER_VARIABLES = frozenset(
    {
        "LOCAL_RANK",
        "NODE_RANK",
        "GLOBAL_RANK",
        "RANK",
        "GROUP_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "PL_GLOBAL_SEED",
        "PL_SEED_WORKERS",
    }
)


def launch_environment() -> dict[str, str]:
    """The environment for a process a test launches: the one the suite started with, as a user's shell holds it.

    Not this process's own: in-process fits leave LAUNCHER_VARIABLES in it, tests set variables for themselves, and
    launches run in another thread while tests run (:func:`launched_ahead`).
    """
    return {key: value for key, value in _SESSION_ENVIRONMENT.items() if key not in LAUNCHER_VARIABLES}


def launch_ranks(script: Path, out: Path, *args: str, limit: int = 300) -> Path:
    """Run ``script OUT ARGS...`` (ranks that Fabric's or the Trainer's launcher starts) under a hard timeout; ``out``
    once it succeeded."""
    # `timeout -s KILL` kills the whole process group (the launcher starts rank 1 as rank 0's child): a hang fails the
    # test instead of holding the suite
    done = subprocess.run(
        ["timeout", "-s", "KILL", str(limit), sys.executable, str(script), str(out), *args],
        capture_output=True,
        text=True,
        check=False,
        env=launch_environment(),
    )
    clues = [line for line in (done.stdout + done.stderr).splitlines() if "Error" in line or "Traceback" in line]
    where = " ".join([script.name, *args])
    assert done.returncode != 137, f"{where}: killed after {limit} s: a rank hung; {clues[-20:]}"
    assert done.returncode == 0, f"{where}: exit {done.returncode}; {clues[-20:]}\n{done.stderr[-4000:]}"
    return out


_LAUNCHES: dict[tuple[str, str], Callable[[Path], Any]] = {}  # (module, fixture name) -> launch
LAUNCH_SECONDS: dict[tuple[str, str], float] = {}  # (module, fixture name) -> wall seconds the launch took
_STARTED: dict[tuple[str, str], Future[Any]] = {}
_WAITING: list[tuple[tuple[str, str], Path]] = []  # started, not yet running: the next one first
_LOCK = threading.Lock()


def launched_ahead(name: str, launch: Callable[[Path], Any]) -> Any:
    """A module-scoped fixture ``name`` whose value is ``launch(folder)``, a launch of processes run ahead of the tests.

    A launch spends seconds importing torch and Lightning, mostly on one core. The session queues the launches of the
    modules it runs (:func:`start_launches`, from tests/conftest.py) and a background thread runs them in turn, while
    the tests use the other core; a fixture whose launch is not done yet runs the next queued one itself meanwhile, so
    that two run at once. A launch the session did not queue runs when its fixture is first asked for.
    """
    import pytest

    key = (launch.__module__, name)
    _LAUNCHES[key] = launch

    @pytest.fixture(scope="module", name=name)
    def launched(tmp_path_factory: pytest.TempPathFactory) -> Any:
        started = _STARTED.get(key)
        if started is None:
            return launch(tmp_path_factory.mktemp(name))
        while not started.done() and _run_next(preferring=key):
            pass
        return started.result()

    return launched


def start_launches(modules: set[str], tmp_path_factory: pytest.TempPathFactory) -> None:
    """Queue the launches of ``modules`` in the order the modules registered them, and start the background thread."""
    for key in _LAUNCHES:
        if key[0] in modules:
            _STARTED[key] = Future()
            _WAITING.append((key, tmp_path_factory.mktemp(key[1])))
    threading.Thread(target=_run_all, name="launches", daemon=True).start()


def stop_launches() -> None:
    """Run no launch that has not started (the session ends)."""
    with _LOCK:
        _WAITING.clear()


def _run_all() -> None:
    while _run_next():
        pass


def _run_next(preferring: tuple[str, str] | None = None) -> bool:
    """Run the launch ``preferring`` if it waits, or else the next one that waits; False if none does."""
    with _LOCK:
        if not _WAITING:
            return False
        index = next((i for i, (key, _) in enumerate(_WAITING) if key == preferring), 0)
        key, folder = _WAITING.pop(index)
    started = time.perf_counter()
    try:
        _STARTED[key].set_result(_LAUNCHES[key](folder))
    except BaseException as error:  # re-raised where the fixture asks for the result
        _STARTED[key].set_exception(error)
        if not isinstance(error, Exception):
            raise  # an interrupt stops the session, here too
    finally:
        LAUNCH_SECONDS[key] = time.perf_counter() - started
    return True


def run_forked(
    jobs: dict[str, Sequence[str]], preload: Sequence[str], folder: Path, limit: int = 300
) -> dict[str, tuple[int, str]]:
    """Run each job, ``[SCRIPT, ARG, ...]``, as a process of its own that runs as ``python SCRIPT ARG ...`` from
    ``folder``; name -> (exit status, stdout and stderr combined). The processes fork from one interpreter that has
    imported ``preload`` (tests/scripts/forked.py), one per core at a time, all under ``timeout -s KILL limit``."""
    out = Path(tempfile.mkdtemp(prefix="forked-", dir=folder))
    spec = {"preload": preload, "jobs": jobs, "cwd": str(folder), "out": str(out), "parallel": os.cpu_count() or 2}
    (out / "spec.json").write_text(json.dumps(spec))
    driver = Path(__file__).resolve().parent / "scripts" / "forked.py"
    done = subprocess.run(
        ["timeout", "-s", "KILL", str(limit), sys.executable, str(driver), str(out / "spec.json")],
        capture_output=True,
        text=True,
        check=False,
        env=launch_environment(),
    )
    ended = out / "returncodes.json"
    returncodes = json.loads(ended.read_text()) if ended.exists() else {}
    unfinished = [name for name in jobs if name not in returncodes]
    assert done.returncode == 0, f"exit {done.returncode}, unfinished: {unfinished}\n{done.stderr[-4000:]}"
    return {name: (returncodes[name], (out / f"{name}.txt").read_text()) for name in jobs}
