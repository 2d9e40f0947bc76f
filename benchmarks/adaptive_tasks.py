"""Adaptive growth against the fixed small batch it replaces, on tasks whose epochs no factor divides.

    python benchmarks/adaptive_tasks.py                   # every task, its seeds; a table and adaptive_tasks.json
    PYTHONPATH=/path/to/other/checkout python benchmarks/adaptive_tasks.py --label before   # another version
    python benchmarks/adaptive_tasks.py --max-factor 8 --seeds 100 101 102 103   # growth to at most 8
    python benchmarks/adaptive_tasks.py --shell fabric --seeds 200 201 202 203      # a Fabric loop's Accumulator
    python benchmarks/adaptive_tasks.py --interval 2 --max-factor 8                 # every 2nd window measured

Each task trains one model twice per seed on the same samples in the same order: at factor 1 throughout (``fixed``),
and with ``AccumulationScheduler(noise_scale=True, adaptive=True, adaptive_max_factor=16)`` from factor 1
(``adaptive``), both with the task's LR rule from the batch of one micro-batch (the scale capped at 4, as the callback
advises past 4) and a constant configured learning rate, for 8 epochs. The factors adaptive growth settles on (5, 6,
7, ...) leave a short window at the end of every epoch, and the run ends on one: the held-out loss after the last step
says what that window's step did. Reported per task: the optimizer steps and the held-out loss of the adaptive run
over the fixed run's, the mean over the seeds with its standard error and the worst seed, and the final factors. At a
constant learning rate the last step's loss scatters from seed to seed (a few percent here): the mean over the seeds
is the task's figure.

Tasks (micro-batches of 8, nothing shared between seeds but the task's definition):

- ``power-law regression`` (seeds 0-7; 4,096 samples an epoch) and ``power-law regression, 4,000`` (seeds 8-15): a
  linear model on 128 Gaussian features of variances ``i ** -1.5`` and a target whose coefficients fall as ``i ** -1``,
  label noise 0.5; SGD at 0.1 and the linear rule; held-out mean squared error on 8,192 fresh samples.
- ``noisy-teacher classification`` (seeds 16-19; 4,000 samples): a random two-layer teacher labels 32-feature inputs
  into 10 classes, 20% of the labels replaced at random; a two-layer student of width 64, Adam at 1e-3 and the
  square-root rule; held-out cross-entropy on 8,192 fresh samples of the same teacher.

``--interval N`` measures every N-th window (``noise_scale_interval``, 10 by default).
``--shell fabric`` trains the same model, data and order in a Lightning Fabric loop through
``lightning_accum.fabric.Accumulator`` with the same arguments, instead of the Trainer. Runs go to subprocesses,
``--jobs`` at a time with one thread each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

MICRO, EPOCHS = 8, 8
# the LR rule's scale capped at 4, as the callback's warning past 4 advises
ADAPTIVE: dict[str, Any] = {"noise_scale": True, "adaptive": True, "adaptive_max_factor": 16, "lr_scale_max": 4}

# name: (samples an epoch, seeds, LR rule)
TASKS: dict[str, tuple[int, tuple[int, ...], str]] = {
    "power-law regression": (4096, tuple(range(0, 8)), "linear"),
    "power-law regression, 4,000": (4000, tuple(range(8, 16)), "linear"),
    "noisy-teacher classification": (4000, tuple(range(16, 20)), "sqrt"),
}


def regression_data(samples: int, seed: int) -> tuple[Any, Any]:
    import torch

    features = 128
    index = torch.arange(1, features + 1, dtype=torch.float32)
    target = index**-1.0 * torch.randn(features, generator=torch.Generator().manual_seed(1234))
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=generator) * index**-0.75
    return x, (x @ target + 0.5 * torch.randn(samples, generator=generator))[:, None]


def teacher_data(samples: int, seed: int) -> tuple[Any, Any]:
    import torch

    fixed = torch.Generator().manual_seed(4321)
    hidden, out = torch.randn(32, 64, generator=fixed) / 32**0.5, torch.randn(64, 10, generator=fixed) / 8
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 32, generator=generator)
    y = (torch.tanh(x @ hidden) @ out * 4).argmax(1)
    noisy = torch.rand(samples, generator=generator) < 0.2
    y[noisy] = torch.randint(0, 10, (int(noisy.sum()),), generator=generator)
    return x, y


def run(
    task: str, name: str, seed: int, max_factor: int = 16, shell: str = "trainer", interval: int = 10
) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_accum import AccumulationScheduler

    samples, _, rule = TASKS[task]
    classify = task.startswith("noisy-teacher")
    data = teacher_data if classify else regression_data
    loss_fn = nn.functional.cross_entropy if classify else nn.functional.mse_loss

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(seed)
            if classify:
                self.net: nn.Module = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 10))
            else:
                self.net = nn.Linear(128, 1)
                nn.init.zeros_(self.net.weight)
                nn.init.zeros_(self.net.bias)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return loss_fn(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            if classify:
                return torch.optim.Adam(self.parameters(), lr=1e-3)
            return torch.optim.SGD(self.parameters(), lr=0.1)

    pl.seed_everything(seed, verbose=False)
    options: dict[str, Any] = {}
    if name == "adaptive":
        options = {**ADAPTIVE, "adaptive_max_factor": max_factor, "noise_scale_interval": interval}
    shuffle = torch.Generator().manual_seed(seed)
    train = DataLoader(TensorDataset(*data(samples, seed)), batch_size=MICRO, shuffle=True, generator=shuffle)
    if shell == "fabric":
        return fabric_run(Model(), train, loss_fn, data, seed, {"lr_scaling": rule, **options})
    callback = AccumulationScheduler(lr_scaling=rule, base_batch_size=MICRO, log_metrics=False, **options)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=EPOCHS,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Model()
    trainer.fit(model, train)
    x, y = data(8192, 10_000 + seed)
    with torch.no_grad():
        held_out = float(loss_fn(model.net(x), y))
    factor = callback.features["adaptive"].factor if name == "adaptive" else 1  # type: ignore[attr-defined]
    return {"steps": trainer.global_step, "loss": held_out, "factor": max(1, factor)}


def fabric_run(model: Any, train: Any, loss_fn: Any, data: Any, seed: int, options: dict[str, Any]) -> dict[str, Any]:
    """The Trainer run's model, loader and arguments in a Fabric loop: ``training_step`` and its optimizer, by hand."""
    import torch
    from lightning.fabric import Fabric

    from lightning_accum.fabric import Accumulator

    fabric = Fabric(accelerator="cpu", devices=1)
    net, optimizer = fabric.setup(model.net, model.configure_optimizers())
    accumulator = Accumulator(fabric, net, optimizer, base_batch_size=MICRO, log_metrics=False, **options)
    for _ in range(EPOCHS):
        for batch in accumulator.batches(train):
            with accumulator.micro_step(batch) as micro:
                micro.backward(loss_fn(net(batch[0]), batch[1]))
            if micro.should_step:
                optimizer.step()
                optimizer.zero_grad()
    x, y = data(8192, 10_000 + seed)
    with torch.no_grad():
        held_out = float(loss_fn(model.net(x), y))
    factor = accumulator.features["adaptive"].factor if "adaptive" in accumulator.features else 1  # type: ignore[attr-defined]
    return {"steps": accumulator.optimizer_steps, "loss": held_out, "factor": max(1, factor)}


def launch(task: str, name: str, seed: int, max_factor: int, shell: str, interval: int) -> dict[str, Any]:
    command = [sys.executable, __file__, "--one", task, name, str(seed), "--max-factor", str(max_factor)]
    command += ["--shell", shell, "--interval", str(interval)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{task}/{name}/{seed} failed:\n{done.stderr[-3000:]}")
    return {"task": task, "run": name, "seed": seed, **json.loads(lines[-1][len("RESULT ") :])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--one", nargs=3, metavar=("TASK", "RUN", "SEED"), help=argparse.SUPPRESS)
    parser.add_argument("--label", default="this checkout")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="these seeds for every task")
    parser.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS))
    parser.add_argument("--max-factor", type=int, default=16, help="adaptive_max_factor")
    parser.add_argument("--shell", choices=["trainer", "fabric"], default="trainer", help="the Trainer or Fabric")
    parser.add_argument("--interval", type=int, default=10, help="noise_scale_interval")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    if args.one:
        import torch

        torch.set_num_threads(1)
        task, name, seed = args.one
        result = run(task, name, int(seed), args.max_factor, args.shell, args.interval)
        print("RESULT " + json.dumps(result), flush=True)
        return
    seeds = {task: args.seeds or TASKS[task][1] for task in args.tasks}
    jobs = [(task, name, seed) for task in args.tasks for seed in seeds[task] for name in ("fixed", "adaptive")]
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda job: launch(*job, args.max_factor, args.shell, args.interval), jobs))
    rows = []
    for task in args.tasks:
        fixed = {r["seed"]: r for r in results if r["task"] == task and r["run"] == "fixed"}
        adaptive = [r for r in results if r["task"] == task and r["run"] == "adaptive"]
        steps = [r["steps"] / fixed[r["seed"]]["steps"] for r in adaptive]
        losses = [r["loss"] / fixed[r["seed"]]["loss"] for r in adaptive]
        rows.append(
            {
                "task": task,
                "seeds": [r["seed"] for r in adaptive],
                "steps_ratio": steps,
                "loss_ratio": losses,
                "fixed_loss": [fixed[r["seed"]]["loss"] for r in adaptive],
                "final_factors": [r["factor"] for r in adaptive],
            }
        )
    args.out.mkdir(parents=True, exist_ok=True)
    name = "adaptive_tasks.json" if args.label == "this checkout" else f"adaptive_tasks_{args.label}.json"
    (args.out / name).write_text(json.dumps({"label": args.label, "rows": rows, "results": results}, indent=2))
    print(
        f"\n| {args.label}: task | seeds | optimizer steps, adaptive / fixed | held-out loss, adaptive / fixed"
        " (mean +- s.e.) | worst seed | final factors |"
    )
    print("| --- | --- | ---: | ---: | ---: | --- |")
    for row in rows:
        ratios = row["loss_ratio"]
        error = statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else 0.0
        print(
            f"| {row['task']} | {len(ratios)} | {statistics.mean(row['steps_ratio']):.2f} |"
            f" {statistics.mean(ratios):.4f} +- {error:.4f} | {max(ratios):.4f} | {row['final_factors']} |"
        )
    kept = all(statistics.mean(r["loss_ratio"]) <= 1.01 and statistics.mean(r["steps_ratio"]) <= 0.5 for r in rows)
    print(f"\nevery task's held-out ratio <= 1.01 at <= 0.5 of the fixed run's steps: {'yes' if kept else 'no'}")


if __name__ == "__main__":
    main()
