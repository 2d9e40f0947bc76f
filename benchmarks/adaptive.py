"""Adaptive growth against fixed and hand-ramped batches, at equal samples: optimizer steps, held-out loss, wall time.

    python benchmarks/adaptive.py                       # both tasks, seeds 0, 1 and 2; tables, JSON and plots
    python benchmarks/adaptive.py --task synthetic --seeds 0 1 2

Each run trains on the same samples in the same order (one seed: one shuffle, one initialisation), with a learning
rate schedule moved by samples (:class:`lightning_accum.SampleDrivenLR`), so that every run anneals where its data
ends whatever its factor does, and the linear LR rule from the starting batch. The runs of a task differ only in
their accumulation:

- ``small``: the starting factor throughout; ``large``: a large fixed factor throughout (4x the LM's start, 32x the
  synthetic's);
- ``ramp``: a hand ramp from the small to the large batch (Megatron-style, over the first half of the samples);
- ``adaptive``: ``adaptive=True`` from the starting factor, the batch following the noise scale's lower bound.

Tasks:

- ``lm``: the main example's byte-level transformer (``examples/byte_lm.py``, width 128, 4 layers, AdamW with a
  one-cycle schedule, peak LR 2e-3 at the batch of 16) on the standard library's sources, micro-batches of 8
  sequences of 128 bytes, factor 2 (16 sequences) to start, for ``--lm-samples`` sequences (0, the default: one
  epoch of the corpus); held-out loss on 1,024 held-out sequences. ``adaptive`` is the configuration of
  ``examples/configs/lm_adaptive.yaml``.
- ``synthetic``: the noisy quadratic model of Zhang et al. 2019 (arXiv:1907.04164): a linear regression over 64
  features of variances 1/i with label noise 0.5 (a held-out loss of 0.25 is the best there is), SGD with a cosine
  schedule, micro-batches of 8 from factor 1; the critical batch grows as the weights near the target and the label
  noise is all that is left; held-out loss on 8,192 fresh samples, and its excess over 0.25.

Runs go to subprocesses, ``--jobs`` at a time with one thread each (a 2-core machine: 2). Writes
``benchmarks/results/adaptive.json`` and ``adaptive_<task>.png`` (loss against samples and against optimizer steps).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

LM_MICRO, SYN_MICRO = 8, 8
NOISE = 0.5  # the synthetic labels' noise: a held-out loss of NOISE**2 is the best there is

# the callback's arguments of each run, per task
RUNS: dict[str, dict[str, dict[str, Any]]] = {
    "lm": {
        "small": {"scheduling": {0: 2}},
        "large": {"scheduling": {0: 8}},
        "ramp": {"target_batch_size": 64, "ramp_start_batch_size": 16, "ramp_increment": 16},
        "adaptive": {
            "scheduling": {0: 2},
            "noise_scale": True,
            "noise_scale_interval": 2,
            "adaptive": True,
            "adaptive_target": 1.0,
        },
    },
    "synthetic": {
        "small": {},
        "large": {"scheduling": {0: 32}},
        "ramp": {"target_batch_size": 256, "ramp_start_batch_size": 8, "ramp_increment": 8},
        "adaptive": {"noise_scale": True, "noise_scale_interval": 2, "adaptive": True},
    },
}


# ------------------------------------------------------------------ one run (in its own process)


class Curve:
    """Held-out loss at a few points, with the samples and optimizer steps behind each (a Lightning callback)."""

    def __init__(self) -> None:
        import lightning.pytorch as pl

        class _Curve(pl.Callback):
            def __init__(self) -> None:
                self.points: list[dict[str, float]] = []

            def on_validation_end(self, trainer: pl.Trainer, *_: Any) -> None:
                if trainer.sanity_checking or trainer.state.fn != "fit":
                    return
                loss = float(trainer.callback_metrics["val/loss"])
                accumulation = next(c for c in trainer.callbacks if type(c).__name__ == "AccumulationScheduler")
                self.points.append({"samples": accumulation.samples_seen, "steps": trainer.global_step, "loss": loss})

        self.callback = _Curve()


def run_lm(name: str, seed: int, samples: int) -> dict[str, Any]:
    import lightning.pytorch as pl
    from byte_lm import ByteLM, StdlibBytes

    from lightning_accum import AccumulationScheduler

    pl.seed_everything(seed, verbose=False)
    arguments = dict(RUNS["lm"][name])
    data = StdlibBytes(batch_size=LM_MICRO)
    data.setup("fit")
    samples = samples or len(data.train_dataloader()) * LM_MICRO  # 0: one epoch of the corpus
    if "ramp_start_batch_size" in arguments:
        arguments["ramp_samples"] = samples // 2
    callback = AccumulationScheduler(lr_scaling="linear", base_batch_size=16, lr_scale_max=64, **arguments)
    batches = samples // LM_MICRO
    model = ByteLM(context=128, width=128, layers=4, heads=4, lr=2e-3)
    checks = {"limit_train_batches": batches, "val_check_interval": batches // 6, "limit_val_batches": 16}
    return fit(model, callback, (data,), data, checks)


def fit(model: Any, callback: Any, data: tuple[Any, ...], held_out: Any, checks: dict[str, Any]) -> dict[str, Any]:
    """One epoch with the held-out loss at the ``checks``, then validated once more: steps, final loss, wall time of
    the fit, and the curve of held-out loss against samples and optimizer steps."""
    import lightning.pytorch as pl

    curve = Curve().callback
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=1,
        num_sanity_val_steps=0,
        callbacks=[callback, curve],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **checks,
    )
    start = time.perf_counter()
    trainer.fit(model, *data)
    wall = time.perf_counter() - start
    loss = float(trainer.validate(model, held_out, verbose=False)[0]["val/loss"])
    last = {"samples": callback.samples_seen, "steps": trainer.global_step, "loss": loss}
    points = (
        [*curve.points[:-1], last]
        if curve.points and curve.points[-1]["steps"] == last["steps"]
        else [*curve.points, last]
    )
    return {"steps": trainer.global_step, "loss": loss, "wall": wall, "curve": points}


def regression_data(samples: int, seed: int, features: int = 64) -> tuple[Any, Any]:
    """A noisy linear regression with an ill-conditioned input covariance (variances 1/i), the same target for
    every seed: the noisy quadratic model of Zhang et al. 2019 (arXiv:1907.04164), in samples."""
    import torch

    target = torch.randn(features, 1, generator=torch.Generator().manual_seed(1234))
    scales = (1.0 / torch.arange(1, features + 1)).sqrt()
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=generator) * scales
    return x, x @ target + NOISE * torch.randn(samples, 1, generator=generator)


def run_synthetic(name: str, seed: int, samples: int) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_accum
    from lightning_accum import AccumulationScheduler

    class Student(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(64, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.log("val/loss", nn.functional.mse_loss(self.net(x), y))

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.parameters(), lr=0.05)
            steps = int(lightning_accum.estimated_stepping_batches(self.trainer))
            cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
            return [optimizer], [{"scheduler": lightning_accum.SampleDrivenLR(cosine), "interval": "step"}]

    pl.seed_everything(seed, verbose=False)
    arguments = dict(RUNS["synthetic"][name])
    if "ramp_start_batch_size" in arguments:
        arguments["ramp_samples"] = samples // 2
    callback = AccumulationScheduler(lr_scaling="linear", base_batch_size=SYN_MICRO, lr_scale_max=16, **arguments)
    train = DataLoader(TensorDataset(*regression_data(samples, seed)), batch_size=SYN_MICRO)
    held_out = DataLoader(TensorDataset(*regression_data(8192, 10_000 + seed)), batch_size=1024)
    return fit(Student(), callback, (train, held_out), held_out, {"val_check_interval": samples // SYN_MICRO // 8})


# ------------------------------------------------------------------ the comparison


def launch(task: str, name: str, seed: int, samples: int) -> dict[str, Any]:
    command = [sys.executable, __file__, "--one", task, name, str(seed), str(samples)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{task}/{name}/{seed} failed:\n{done.stderr[-3000:]}")
    return {"task": task, "run": name, "seed": seed, **json.loads(lines[-1][len("RESULT ") :])}


def table(results: list[dict[str, Any]], task: str) -> list[str]:
    rows = [r for r in results if r["task"] == task]
    seeds = sorted({r["seed"] for r in rows})
    small = {r["seed"]: r for r in rows if r["run"] == "small"}
    floor = NOISE**2 if task == "synthetic" else 0.0  # the excess over it says more where the loss nears it
    excess = " excess over the floor | vs small |" if floor else ""
    lines = [
        f"| {task} | optimizer steps | vs small | held-out loss | vs small |{excess} wall time |",
        "| --- | ---: | ---: | ---: | ---: |" + (" ---: | ---: |" if floor else "") + " ---: |",
    ]
    for name in RUNS[task]:
        runs = [r for r in rows if r["run"] == name]
        if not runs:  # not asked for (--runs)
            continue
        steps = statistics.mean(r["steps"] for r in runs)
        loss = statistics.mean(r["loss"] for r in runs)
        fewer = statistics.mean(1 - r["steps"] / small[r["seed"]]["steps"] for r in runs)
        worse = statistics.mean(r["loss"] / small[r["seed"]]["loss"] - 1 for r in runs)
        wall = statistics.mean(r["wall"] for r in runs)
        extra = ""
        if floor:
            above = statistics.mean((r["loss"] - floor) / (small[r["seed"]]["loss"] - floor) - 1 for r in runs)
            extra = f" {loss - floor:.5f} | {above:+.0%} |"
        lines.append(f"| {name} | {steps:.0f} | {-fewer:+.0%} | {loss:.4f} | {worse:+.2%} |{extra} {wall:.0f} s |")
    lines.append(f"(means over seeds {', '.join(map(str, seeds))}; each run against the small batch of its seed)")
    return lines


def plot(results: list[dict[str, Any]], task: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    seed = min(r["seed"] for r in results if r["task"] == task)
    floor = NOISE**2 if task == "synthetic" else 0.0
    for r in (r for r in results if r["task"] == task and r["seed"] == seed):
        samples = [p["samples"] for p in r["curve"]]
        steps = [p["steps"] for p in r["curve"]]
        losses = [p["loss"] - floor for p in r["curve"]]
        axes[0].plot(samples, losses, marker="o", label=r["run"])
        axes[1].plot(steps, losses, marker="o", label=r["run"])
    axes[0].set_xlabel("samples")
    axes[1].set_xlabel("optimizer steps")
    axes[0].set_ylabel(f"held-out loss - {floor:g} (the noise floor)" if floor else "held-out loss")
    for axis in axes:
        axis.grid(alpha=0.3)
        if floor:
            axis.set_yscale("log")
    axes[1].legend()
    figure.suptitle(f"{task}: held-out loss at equal samples (seed {seed})")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--one", nargs=4, metavar=("TASK", "RUN", "SEED", "SAMPLES"), help=argparse.SUPPRESS)
    parser.add_argument("--task", choices=["lm", "synthetic", "both"], default="both")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--lm-samples", type=int, default=0, help="0: one epoch of the corpus")
    parser.add_argument("--synthetic-samples", type=int, default=32_768)
    parser.add_argument("--runs", nargs="+", default=None, help="only these runs (small, large, ramp, adaptive)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    if args.one:
        import torch

        torch.set_num_threads(1)
        task, name, seed, samples = args.one
        run = run_lm if task == "lm" else run_synthetic
        print("RESULT " + json.dumps(run(name, int(seed), int(samples))), flush=True)
        return
    tasks = ["synthetic", "lm"] if args.task == "both" else [args.task]
    samples = {"lm": args.lm_samples, "synthetic": args.synthetic_samples}
    names = {task: [name for name in RUNS[task] if args.runs is None or name in args.runs] for task in tasks}
    jobs = [(task, name, seed, samples[task]) for task in tasks for seed in args.seeds for name in names[task]]
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda job: launch(*job), jobs))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "adaptive.json").write_text(json.dumps({"samples": samples, "results": results}, indent=2))
    for task in tasks:
        consumed = next(r["curve"][-1]["samples"] for r in results if r["task"] == task)
        print(f"\n{task}: {consumed} samples, micro-batches of 8")
        print("\n".join(table(results, task)))
        plot(results, task, args.out / f"adaptive_{task}.png")


if __name__ == "__main__":
    main()
