"""What is logged once per optimizer step: the metric dict, the memory probe, the TensorBoard layout and summary.

This module owns the names and meaning of every ``accum/...`` key (each feature adds its own keys, listed here too).
It builds values from what it is handed and never reads Trainer state; the metrics feature
(:mod:`lightning_accum.features.metrics`) decides when to log and through which loggers.

| key | meaning |
| --- | --- |
| ``accum/factor`` | the scheduled accumulation factor of the window that just stepped |
| ``accum/effective_batch_size`` | samples in that window: micro-batch x micro-batches taken x world size |
| ``accum/micro_batch_size`` | samples per micro-batch on one rank |
| ``accum/coupled_batch``, ``accum/chunk_size`` | a step that calls ``cached``: the rows its loss couples (the loader
  batch, never split) and the chunk they are run in |
| ``accum/world_size`` | number of ranks |
| ``accum/lr`` | the learning rate the step really used (first param group, scale included), read before the step |
| ``accum/lr_group_<i>`` | the same for each param group, when their rates differ |
| ``accum/lr_scale`` | the factor the LR rule applied to the configured learning rate |
| ``accum/beta2`` | with ``beta2_follows_batch=True``: the beta2 the step used (first param group) |
| ``accum/samples_seen`` | samples consumed by all ranks together |
| ``accum/optimizer_steps`` | optimizer steps taken (``trainer.global_step``) |
| ``accum/micro_steps`` | micro-batches trained on (one rank) |
| ``accum/window_loss`` | mean training loss over the window's micro-batches (rank zero's) |
| ``accum/samples_per_second`` | effective batch / wall time of the window |
| ``accum/noise_scale`` | with ``noise_scale=True``: B_simple = tr(Sigma) / abs(G)^2, samples (or tokens) |
| ``accum/noise_grad_sq``, ``accum/noise_trace`` | its two smoothed estimates: abs(G)^2 and tr(Sigma) |
| ``accum/noise_scale_to_batch`` | the noise scale over the window's batch, same unit (above 1: a larger batch pays) |
| ``accum/noise_measurements`` | the effective number of measured windows behind the estimate |
| ``accum/noise_scale_low``, ``accum/noise_scale_high`` | with ``adaptive=True``: the bounds its next decision acts on |
| ``accum/window_samples``, ``accum/window_tokens`` | with ``normalize_by="sample"`` or ``"token"``: items in the
  window, all ranks |
| ``accum/tokens_seen`` | with ``unit="token"``: loss-bearing tokens consumed by all ranks, the schedule's position |
| ``accum/memory_allocated_mb`` | CUDA: memory allocated after the step |
| ``accum/memory_reserved_mb`` | CUDA: memory reserved by the caching allocator |
| ``accum/memory_peak_mb`` | CUDA: the peak allocated since the process started or the user's last
  ``torch.cuda.reset_peak_memory_stats`` (never reset here: the user's own peak measurement stays true) |
| ``accum/memory_rss_mb`` | CPU: the process's resident memory |
"""

from __future__ import annotations

import os
import re
import resource
import sys
from collections.abc import Iterable
from dataclasses import dataclass

import torch

_MB = 2**20


@dataclass(frozen=True)
class StepRecord:
    """What one optimizer step looked like, as the callback saw it."""

    factor: int
    micro_steps_in_window: int
    micro_batch_size: int | None
    world_size: int
    samples_seen: int
    optimizer_steps: int
    micro_steps: int
    window_loss: float | None
    seconds: float


def step_metrics(record: StepRecord) -> dict[str, float]:
    """The ``accum/...`` metrics of one optimizer step (keys whose value is unknown are left out).

    Example::

        >>> record = StepRecord(8, 8, 4, 2, 640, 10, 80, 2.5, 0.5)
        >>> step_metrics(record)["accum/effective_batch_size"], step_metrics(record)["accum/samples_per_second"]
        (64.0, 128.0)
    """
    metrics = {
        "accum/factor": float(record.factor),
        "accum/world_size": float(record.world_size),
        "accum/optimizer_steps": float(record.optimizer_steps),
        "accum/micro_steps": float(record.micro_steps),
    }
    if record.micro_batch_size is not None:
        effective = record.micro_batch_size * record.micro_steps_in_window * record.world_size
        metrics["accum/micro_batch_size"] = float(record.micro_batch_size)
        metrics["accum/effective_batch_size"] = float(effective)
        metrics["accum/samples_seen"] = float(record.samples_seen)
        if record.seconds > 0:
            metrics["accum/samples_per_second"] = effective / record.seconds
    if record.window_loss is not None:
        metrics["accum/window_loss"] = record.window_loss
    return metrics


def memory_metrics(device: torch.device) -> dict[str, float]:
    """Memory in MiB: CUDA allocated, reserved and peak allocated on a CUDA device, else the process RSS.

    The CUDA peak is ``torch.cuda.max_memory_allocated``, read and never reset: the peak statistic is the process's
    (and the user's, who may be measuring a fit with it), not this callback's.
    """
    if device.type == "cuda":
        return {
            "accum/memory_allocated_mb": torch.cuda.memory_allocated(device) / _MB,
            "accum/memory_reserved_mb": torch.cuda.memory_reserved(device) / _MB,
            "accum/memory_peak_mb": torch.cuda.max_memory_allocated(device) / _MB,
        }
    return {"accum/memory_rss_mb": resident_bytes() / _MB}


_STATM: list[int] = []  # [pid, file descriptor of /proc/<pid>/statm], opened once per process


def resident_bytes() -> int:
    """This process's resident memory in bytes (Linux; elsewhere its peak, the best the standard library offers).

    ``/proc/<pid>/statm`` is opened once per process and read again from its start at each call (an ``open`` at every
    logged step cost more than the read); a forked child opens its own.
    """
    try:
        pid = os.getpid()
        if not _STATM or _STATM[0] != pid:
            _STATM[:] = [pid, os.open(f"/proc/{pid}/statm", os.O_RDONLY)]
        return int(os.pread(_STATM[1], 128, 0).split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return peak_resident_bytes()


def peak_resident_bytes() -> int:
    """This process's peak resident memory in bytes since it started (``ru_maxrss``)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def tensorboard_layout(logged: Iterable[str] | None = None) -> dict[str, dict[str, list]]:
    r"""The "Custom Scalars" dashboard: one chart per quantity, or per set of quantities of the same unit and scale.

    Each pattern is anchored (TensorBoard matches chart patterns with ``re.match``, a prefix match), so a chart draws
    exactly the tags meant for it: ``accum/lr`` is not ``accum/lr_scale``. Quantities whose ranges may differ by more
    than about 10x (samples seen and optimizer steps, |G|^2 and tr(Sigma), the noise scale early in training and the
    batch) get charts of their own; the noise scale is compared with the batch as their ratio. Given the tags a run
    ``logged``, only the charts that draw at least one of them are kept.

    Example::

        >>> tensorboard_layout()["learning rate"]["lr as used"]
        ['Multiline', ['^accum/lr$']]
    """
    layout = {
        "accumulation": {
            "factor": ["Multiline", [r"^accum/factor$"]],
            "effective batch": ["Multiline", [r"^accum/effective_batch_size$"]],
            "items in the window": ["Multiline", [r"^accum/window_(samples|tokens)$"]],
            "coupled batch (cached)": ["Multiline", [r"^accum/coupled_batch$"]],
            "chunk (cached)": ["Multiline", [r"^accum/chunk_size$"]],
        },
        "learning rate": {
            "lr as used": ["Multiline", [r"^accum/lr$"]],
            "lr as used, per param group": ["Multiline", [r"^accum/lr_group_\d+$"]],
            "lr scale": ["Multiline", [r"^accum/lr_scale$"]],
            "beta2 as used": ["Multiline", [r"^accum/beta2$"]],
        },
        "loss and speed": {
            "window loss": ["Multiline", [r"^accum/window_loss$"]],
            "throughput (samples/s)": ["Multiline", [r"^accum/samples_per_second$"]],
        },
        "progress": {
            "samples seen": ["Multiline", [r"^accum/samples_seen$"]],
            "optimizer steps": ["Multiline", [r"^accum/optimizer_steps$"]],
            "micro-steps": ["Multiline", [r"^accum/micro_steps$"]],
        },
        "memory": {
            "memory (MiB)": ["Multiline", [r"^accum/memory_(allocated|reserved|peak|rss)_mb$"]],
        },
        "noise scale": {
            "critical batch (noise scale, with adaptive growth's bounds)": [
                "Multiline",
                [r"^accum/noise_scale(_low|_high)?$"],
            ],
            "noise scale / effective batch (above 1: a larger batch pays)": [
                "Multiline",
                [r"^accum/noise_scale_to_batch$"],
            ],
            "|G|^2": ["Multiline", [r"^accum/noise_grad_sq$"]],
            "tr(Sigma)": ["Multiline", [r"^accum/noise_trace$"]],
            "measurements behind the estimate": ["Multiline", [r"^accum/noise_measurements$"]],
        },
    }
    if logged is None:
        return layout
    tags = list(logged)
    kept = {
        category: {
            title: chart
            for title, chart in charts.items()
            if any(re.match(pattern, tag) for pattern in chart[1] for tag in tags)
        }
        for category, charts in layout.items()
    }
    return {category: charts for category, charts in kept.items() if charts}


def batch_summary(micro_batch_size: int | None, factor: int, world_size: int) -> str:
    """How the effective batch comes about, for the run's summary line.

    Example::

        >>> batch_summary(4, 8, 2)
        'micro 4 x factor 8 x world 2 = 64 samples'
    """
    if micro_batch_size is None:
        return f"factor {factor} x world {world_size} = {factor * world_size} micro-batches"
    effective = micro_batch_size * factor * world_size
    return f"micro {micro_batch_size} x factor {factor} x world {world_size} = {effective} samples"


def split_summary(rows: int | None) -> str:
    """How loader batches are split into micro-batches (``None``: ``"auto"``, before any out-of-memory error).

    Example::

        >>> split_summary(4)
        'each loader batch split into micro-batches of 4 rows'
    """
    if rows is None:
        return "loader batches split when they run out of memory (micro_batch_size='auto')"
    return f"each loader batch split into micro-batches of {rows} rows"
