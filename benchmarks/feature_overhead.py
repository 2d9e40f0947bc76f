"""The callback's own cost: each feature against stock Lightning and a raw PyTorch loop, side by side in one run.

    python benchmarks/feature_overhead.py          # four tables, writes feature_overhead.json

1. Fixed overhead, on a tiny model where it dominates (Linear(32, 32), micro-batch 8, factor 4, 300 optimizer steps,
   a CSVLogger with Lightning's default ``log_every_n_steps``): stock ``Trainer(accumulate_grad_batches=4)``, the
   callback with nothing on, with its logging, with sample weighting, with LR scaling, with the noise scale (its
   default sampling, and measured on every window), and with all of them; logging every step alone and with all of
   them, reported beside the sum of the features' own costs; stock with a ``Callback`` that does nothing
   (what Lightning's dispatch of one more callback costs); and a raw PyTorch loop. Every configuration runs once per
   round, in rotated order, for ``--rounds`` rounds; each ratio is taken round by round against the round's stock run
   (the noise scale against the callback with nothing on) and its median reported with its range.
2. The noise scale measured on every window against the number of parameter tensors (16 to 2048 tensors of a stack
   of Linear(4, 4)): the extra time per micro-step of a measured window, per tensor (the median over the rounds of on
   minus off).
3. The compute-bound MLP of the other benchmarks (4 x Linear(1024, 1024), micro-batch 64): logging against stock,
   the noise scale with its default sampling and on every window against the callback with nothing on.
4. A logged step (``--only logged-step``): on the tiny model logging every optimizer step through a CSVLogger and a
   TensorBoardLogger, the time the metrics feature takes at each logged step against the time the logger's own calls
   inside it take (``log_metrics``, the Custom Scalars layout): what the callback adds to the writes it asks for.

Times are of the training loop from its third window to its end, per micro-step: what a fit pays once (hooks
registered, buffers allocated, a full garbage collection the objects made then may set off) is left out. Every
measurement runs in a fresh interpreter: a warm-up fit, then the fastest of three timed fits.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ratio, rotated_rounds  # noqa: E402

import lightning_accum  # noqa: E402
from lightning_accum import AccumulationScheduler  # noqa: E402

FACTOR = 4


SKIPPED = 2 * FACTOR  # the first two windows' micro-steps are not timed: what a fit pays once (hooks registered,
# buffers allocated, and the full garbage collection the objects made then may set off) is not a per-step cost


class Timer(pl.Callback):
    """Wall time of the training loop from its third window on."""

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if idx == SKIPPED:
            self.start = time.perf_counter()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.seconds = time.perf_counter() - self.start


class Model(pl.LightningModule):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self.net(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-4)


def tiny() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(32, 32)


def stack(tensors: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(4, 4) for _ in range(tensors // 2)))


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(1024, 1024), nn.GELU()) for _ in range(4)))


def loader(width: int, micro_batch: int, steps: int) -> DataLoader:
    data = torch.randn(micro_batch * FACTOR * steps, width, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(data), batch_size=micro_batch)


def lightning_seconds(
    net: Callable[[], nn.Module], data: DataLoader, options: dict[str, Any] | None, empty: bool = False
) -> float:
    """Seconds per micro-step: stock accumulation when ``options`` is None (with a callback that does nothing if
    ``empty``: what Lightning's dispatch of one more callback costs), else the callback with ``options``."""
    timer = Timer()
    callbacks: list[pl.Callback] = [timer]
    extra: dict[str, Any] = {"accumulate_grad_batches": FACTOR}
    if options is not None:
        options = dict(options)
        extra = {"log_every_n_steps": options.pop("log_every_n_steps")} if "log_every_n_steps" in options else {}
        callbacks.insert(0, AccumulationScheduler({0: FACTOR}, **options))
    elif empty:
        callbacks.insert(0, pl.Callback())
    with tempfile.TemporaryDirectory() as logs:
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_epochs=1,
            logger=CSVLogger(logs),
            callbacks=callbacks,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            **extra,
        )
        trainer.fit(Model(net()), data)
    return timer.seconds / (len(data) - SKIPPED)


def raw_seconds(net: Callable[[], nn.Module], data: DataLoader) -> float:
    """A raw PyTorch loop with the same accumulation, per micro-step."""
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    start = 0.0
    for index, (x,) in enumerate(data):
        if index == SKIPPED:
            start = time.perf_counter()
        (model(x).pow(2).mean() / FACTOR).backward()
        if (index + 1) % FACTOR == 0:
            optimizer.step()
            optimizer.zero_grad()
    return (time.perf_counter() - start) / (len(data) - SKIPPED)


MODELS: dict[str, tuple[Callable[[], nn.Module], int, int, int]] = {
    # name: (net, width, micro-batch, optimizer steps)
    "tiny": (tiny, 32, 8, 300),
    "mlp": (mlp, 1024, 64, 32),
    **{f"stack{n}": (functools.partial(stack, n), 4, 8, 20) for n in (16, 128, 512, 2048)},
}


REPEAT = 3  # timed fits per interpreter: the fastest is the configuration's time, the slower lost time to other work


def measure(spec: dict[str, Any]) -> float:
    """Seconds per micro-step of one configuration, in this process: a warm-up fit, then the fastest of ``REPEAT``
    timed ones (the machine's other work only ever adds time).

    ``spec``: ``model`` (a key of :data:`MODELS`), and ``raw`` (a raw PyTorch loop), or ``options`` (the callback's,
    ``None`` for stock) and ``empty`` (stock with a callback that does nothing).
    """
    net, width, micro_batch, steps = MODELS[spec["model"]]
    data = loader(width, micro_batch, steps)
    if spec.get("raw"):
        run = functools.partial(raw_seconds, net, data)
    else:
        run = functools.partial(lightning_seconds, net, data, spec.get("options"), spec.get("empty", False))
    run()
    return min(run() for _ in range(REPEAT))


def isolated(spec: dict[str, Any]) -> float:
    """:func:`measure` in a fresh interpreter.

    Every measurement starts from a fresh process: in one long process (or in children forked from it), what earlier
    configurations allocated and freed changes how later ones page-fault (glibc adapts its thresholds to the history
    of the heap), by more than the differences measured here.
    """
    command = [sys.executable, str(Path(__file__).resolve()), "--measure", json.dumps(spec)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{spec} failed with exit code {done.returncode}:\n{done.stderr[-4000:]}")
    return float(done.stdout.strip().splitlines()[-1])


def rounds(specs: dict[str, dict[str, Any]], count: int) -> dict[str, list[float]]:
    """Each configuration once per round, in an order rotated every round, each in a process of its own."""
    return rotated_rounds(lambda name: isolated(specs[name]), list(specs), count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument(
        "--only",
        choices=("tiny", "tensors", "compute-bound", "logged-step"),
        nargs="+",
        default=None,
        help="run only these tables",
    )
    parser.add_argument("--logged-step", default=None, help=argparse.SUPPRESS)  # one logger's run, for its table
    parser.add_argument("--measure", type=json.loads, default=None, help=argparse.SUPPRESS)  # one run, for isolated()
    args = parser.parse_args()
    if args.measure is not None:
        logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
        warnings.filterwarnings("ignore")
        print(measure(args.measure))
        return
    if args.logged_step is not None:
        logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
        warnings.filterwarnings("ignore")
        print(json.dumps(logged_step(args.logged_step)))
        return
    results: dict[str, Any] = {"version": lightning_accum.__version__, "torch_threads": torch.get_num_threads()}
    tables = set(args.only or ("tiny", "tensors", "compute-bound"))
    if "tiny" in tables:
        results["tiny"] = tiny_table(args.rounds)
    if "tensors" in tables:
        results["noise_per_tensor"] = tensors_table(args.rounds)
    if "compute-bound" in tables:
        results["compute_bound"] = compute_bound_table(args.rounds)
    if "logged-step" in tables:
        results["logged_step"] = logged_step_table(args.rounds)
    args.out.mkdir(parents=True, exist_ok=True)
    name = "feature_overhead.json" if args.only is None else f"feature_overhead_{'_'.join(sorted(tables))}.json"
    (args.out / name).write_text(json.dumps(results, indent=2))
    print(f"\nwrote {args.out / name}")


EVERY_WINDOW = {"noise_scale": True, "noise_scale_interval": 1}


def tiny_table(count: int) -> list[dict[str, Any]]:
    """Fixed overhead per feature on the tiny model, against stock and a raw loop."""

    configs: dict[str, dict[str, Any] | None] = {
        "stock": None,
        "nothing on": {"log_metrics": False},
        "logging": {},
        "sample weighting": {"log_metrics": False, "normalize_by": "sample"},
        "lr scaling": {"log_metrics": False, "lr_scaling": "linear"},
        "noise scale": {"log_metrics": False, "noise_scale": True},
        "noise scale, every window": {"log_metrics": False, "noise_scale": True, "noise_scale_interval": 1},
        "all": {"normalize_by": "sample", "lr_scaling": "linear", "noise_scale": True},
        "logging every step": {"log_every_n_steps": 1},
        "all, logging every step": {
            "normalize_by": "sample",
            "lr_scaling": "linear",
            "noise_scale": True,
            "log_every_n_steps": 1,
        },
    }
    measures: dict[str, dict[str, Any]] = {name: {"model": "tiny", "options": opts} for name, opts in configs.items()}
    measures["a callback doing nothing"] = {"model": "tiny", "options": None, "empty": True}
    measures["raw PyTorch"] = {"model": "tiny", "raw": True}
    times = rounds(measures, count)
    tiny_rows = []
    print("| tiny model | ms/micro-step | ratio to stock (median) | range | ratio to raw PyTorch |")
    print("| --- | ---: | ---: | --- | ---: |")
    for name in measures:
        baseline = "nothing on" if name.startswith("noise scale") else "stock"
        versus = ratio(times, name, baseline)
        raw = ratio(times, name, "raw PyTorch")["median"]
        label = f"{versus['median']:.3f}" + (" (to nothing on)" if baseline != "stock" else "")
        print(
            f"| {name} | {statistics.median(times[name]) * 1e3:.3f} | {label} |"
            f" {versus['min']:.3f} to {versus['max']:.3f} | {raw:.2f} |"
        )
        tiny_rows.append({"name": name, "ms": statistics.median(times[name]) * 1e3, "ratio": versus, "to_raw": raw})
    # every feature at once, logging every step, beside the sum of each one's own cost over the callback with nothing
    # on (the noise scale's measured against stock like the others here)
    own = {name: ratio(times, name, "stock")["median"] for name in ("nothing on", *FEATURES, "logging every step")}
    summed = own["logging every step"] + sum(own[name] - own["nothing on"] for name in FEATURES)
    together = ratio(times, "all, logging every step", "stock")["median"]
    print(
        f"\nall features, logging every step: {together:.3f} of stock; the sum of their own costs"
        f" (logging every step {own['logging every step']:.3f}, plus each of {', '.join(FEATURES)} over nothing on):"
        f" {summed:.3f}"
    )
    tiny_rows.append({"name": "sum of the features' own, logging every step", "ratio": {"median": summed}})
    return tiny_rows


FEATURES = ("sample weighting", "lr scaling", "noise scale")  # the features of "all", each alone


def tensors_table(count: int) -> list[dict[str, Any]]:
    """The extra time per parameter tensor and micro-step of a window the noise scale measures, 16 to 2048 tensors."""
    print("\n| parameter tensors | noise scale off (ms/micro-step) | every window | extra per tensor per micro-step |")
    print("| ---: | ---: | ---: | ---: |")
    per_tensor = []
    for tensors in (16, 128, 512, 2048):
        pair = rounds(
            {
                "off": {"model": f"stack{tensors}", "options": {"log_metrics": False}},
                "on": {"model": f"stack{tensors}", "options": {"log_metrics": False, **EVERY_WINDOW}},
            },
            count,
        )
        off, on = statistics.median(pair["off"]), statistics.median(pair["on"])
        # the median of the rounds' differences: each round's pair ran back to back
        extra_us = statistics.median(b - a for a, b in zip(pair["off"], pair["on"], strict=True)) / tensors * 1e6
        print(f"| {tensors} | {off * 1e3:.2f} | {on * 1e3:.2f} | {extra_us:.2f} us |")
        per_tensor.append({"tensors": tensors, "off_ms": off * 1e3, "on_ms": on * 1e3, "us_per_tensor": extra_us})
    return per_tensor


def compute_bound_table(count: int) -> dict[str, Any]:
    """Logging against stock and the noise scale on against off, on the compute-bound MLP."""
    times = rounds(
        {
            "stock": {"model": "mlp", "options": None},
            "logging": {"model": "mlp", "options": {}},
            "nothing on": {"model": "mlp", "options": {"log_metrics": False}},
            "noise scale": {"model": "mlp", "options": {"log_metrics": False, "noise_scale": True}},
            "noise scale, every window": {"model": "mlp", "options": {"log_metrics": False, **EVERY_WINDOW}},
        },
        count,
    )
    rows = {
        "all logging / stock": ratio(times, "logging", "stock"),
        "noise scale (default sampling) / off": ratio(times, "noise scale", "nothing on"),
        "noise scale, every window / off": ratio(times, "noise scale, every window", "nothing on"),
    }
    print("\n| compute-bound MLP | ratio (median) | range |")
    print("| --- | ---: | --- |")
    for name, row in rows.items():
        print(f"| {name} | {row['median']:.3f} | {row['min']:.3f} to {row['max']:.3f} |")
    return rows


def logged_step(kind: str) -> dict[str, float]:
    """Per logged step, in microseconds (the median over the steps of the fastest of 2 fits after a warm-up): the
    metrics feature's ``window_closed`` and, inside it, the logger's own calls."""
    from lightning.pytorch.loggers import TensorBoardLogger

    from lightning_accum.features import Metrics

    feature: list[float] = []
    writes: list[float] = []
    inner = Metrics.window_closed

    def timed_feature(self: Metrics, ctx: Any) -> None:
        start = time.perf_counter()
        inner(self, ctx)
        feature.append(time.perf_counter() - start)

    def timed(method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                writes[-1] += time.perf_counter() - start

        return call

    Metrics.window_closed = timed_feature  # type: ignore[method-assign]
    net, width, micro_batch, steps = MODELS["tiny"]
    data = loader(width, micro_batch, steps)
    best: dict[str, float] | None = None
    for _ in range(3):
        feature.clear()
        writes.clear()
        with tempfile.TemporaryDirectory() as logs:
            logger = CSVLogger(logs) if kind == "csv" else TensorBoardLogger(logs)
            logger.log_metrics = timed(logger.log_metrics)  # type: ignore[method-assign]
            if kind == "tensorboard":
                logger.experiment.add_custom_scalars = timed(logger.experiment.add_custom_scalars)

            class Writes(pl.Callback):  # a slot per optimizer step for the logger's time inside the feature
                def on_before_optimizer_step(self, *_: Any) -> None:
                    writes.append(0.0)

            trainer = pl.Trainer(
                accelerator="cpu",
                max_epochs=1,
                logger=logger,
                log_every_n_steps=1,
                callbacks=[AccumulationScheduler({0: FACTOR}), Writes()],
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
            )
            trainer.fit(Model(net()), data)
        pairs = list(zip(feature, writes, strict=True))[2:]  # the first two steps write the layout and the summary
        row = {
            "feature_us": statistics.median(f for f, _ in pairs) * 1e6,
            "logger_us": statistics.median(w for _, w in pairs) * 1e6,
            "ratio": statistics.median(f / w for f, w in pairs),
        }
        if best is None or row["feature_us"] < best["feature_us"]:
            best = row
    assert best is not None
    return best


def logged_step_table(count: int) -> dict[str, Any]:
    """:func:`logged_step` for each logger, once per round in a fresh interpreter; the median over the rounds."""
    rows: dict[str, Any] = {}
    print("\n| logger, logging every step | metrics feature per logged step | the logger's calls in it | ratio |")
    print("| --- | ---: | ---: | ---: |")
    for kind in ("csv", "tensorboard"):
        runs = []
        for _ in range(count):
            command = [sys.executable, str(Path(__file__).resolve()), "--logged-step", kind]
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"logged step, {kind}: exit code {done.returncode}:\n{done.stderr[-4000:]}")
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        row = {key: statistics.median(run[key] for run in runs) for key in ("feature_us", "logger_us", "ratio")}
        rows[kind] = {**row, "runs": runs}
        print(f"| {kind} | {row['feature_us']:.0f} us | {row['logger_us']:.0f} us | {row['ratio']:.2f} |")
    return rows


if __name__ == "__main__":
    main()
