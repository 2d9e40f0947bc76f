"""Planning a run before it starts: which micro-batch and factor reach a global batch, and what they cost per epoch.

Pure: no Lightning import. :func:`plan` lists every valid configuration for a target global batch on a number of
devices, with its forward passes and optimizer updates per epoch and its scaled learning rate, and explains
divisibility problems with the nearest valid choices. The ``lightning-accum plan`` command (:mod:`lightning_accum.cli`)
prints it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_accum.core.scaling import LRScaling, check_rule, lr_scale
from lightning_accum.core.schedule import check_int, nearest_valid_batch_sizes


@dataclass(frozen=True)
class PlanRow:
    """One valid configuration.

    Attributes:
        micro_batch: Samples per micro-batch on one device.
        factor: Micro-batches accumulated per optimizer step.
        effective_batch: ``micro_batch x factor x devices``: the global batch of one optimizer step.
        forward_passes_per_epoch: Micro-batches each device runs in one epoch (a sampler pads the dataset to a
            multiple of the device count, as ``DistributedSampler`` does).
        updates_per_epoch: Optimizer steps per epoch; the last window holds the micro-batches that are left.
        lr: The learning rate the optimizer uses: ``base_lr`` scaled by the rule from ``base_batch`` to the
            effective batch (``None`` without a base learning rate).
    """

    micro_batch: int
    factor: int
    effective_batch: int
    forward_passes_per_epoch: int
    updates_per_epoch: int
    lr: float | None


@dataclass(frozen=True)
class Plan:
    """The valid configurations, largest micro-batch first, and why others are not valid."""

    rows: tuple[PlanRow, ...]
    problems: tuple[str, ...]
    dataset_size: int | None = None


def plan(
    global_batch: int,
    devices: int = 1,
    micro_batches: Sequence[int] | None = None,
    dataset_size: int | None = None,
    base_lr: float | None = None,
    base_batch: int | None = None,
    rule: LRScaling = "none",
    max_micro_batch: int | None = None,
) -> Plan:
    """The configurations that reach ``global_batch`` on ``devices`` devices.

    Args:
        global_batch: The wanted effective batch, all devices together.
        devices: Devices (ranks) in data parallel.
        micro_batches: The micro-batch sizes to consider; by default every size that divides
            ``global_batch / devices`` (up to ``max_micro_batch``).
        dataset_size: Samples in the training set, for the per-epoch columns.
        base_lr: The learning rate tuned at ``base_batch``.
        base_batch: The global batch at which ``base_lr`` was tuned (by default ``global_batch``).
        rule: ``"none"``, ``"linear"`` or ``"sqrt"``.
        max_micro_batch: The largest micro-batch that fits in memory (for example from a probe).

    Raises:
        TypeError: If an integer argument is not an integer.
        ValueError: If an argument is out of range or ``rule`` is unknown.

    Example::

        >>> result = plan(100, devices=16)
        >>> result.rows
        ()
        >>> print(result.problems[0])
        global batch 100 is not a multiple of 16 devices: the nearest valid global batches are 96 or 112
    """
    check_int("global_batch", global_batch, minimum=1)
    check_int("devices", devices, minimum=1)
    check_rule(rule)
    if dataset_size is not None:
        check_int("dataset_size", dataset_size, minimum=1)
    if max_micro_batch is not None:
        check_int("max_micro_batch", max_micro_batch, minimum=1)
    if base_batch is not None:
        check_int("base_batch", base_batch, minimum=1)
    problems: list[str] = []
    if global_batch % devices:
        nearest = " or ".join(str(size) for size in nearest_valid_batch_sizes(global_batch, devices))
        problems.append(
            f"global batch {global_batch} is not a multiple of {devices} devices: the nearest valid global batches"
            f" are {nearest}"
        )
        return Plan((), tuple(problems), dataset_size)
    per_device = global_batch // devices
    if micro_batches is None:
        candidates = [size for size in range(per_device, 0, -1) if per_device % size == 0]
    else:
        candidates = sorted({check_int("micro_batch", size, minimum=1) for size in micro_batches}, reverse=True)
    rows = []
    for micro in candidates:
        if max_micro_batch is not None and micro > max_micro_batch:
            continue
        if per_device % micro:
            nearest = " or ".join(str(size) for size in nearest_valid_batch_sizes(global_batch, micro * devices))
            problems.append(
                f"micro-batch {micro}: global batch {global_batch} is not a multiple of micro-batch x devices ="
                f" {micro * devices}; with micro-batch {micro} the nearest valid global batches are {nearest}"
            )
            continue
        factor = per_device // micro
        passes = updates = 0
        if dataset_size is not None:
            passes = math.ceil(math.ceil(dataset_size / devices) / micro)
            updates = math.ceil(passes / factor)
        lr = None
        if base_lr is not None:
            lr = base_lr * lr_scale(rule, global_batch, base_batch or global_batch)
        rows.append(PlanRow(micro, factor, global_batch, passes, updates, lr))
    if not rows and max_micro_batch is not None and not problems:
        problems.append(f"no micro-batch of at most {max_micro_batch} divides {per_device} samples per device")
    return Plan(tuple(rows), tuple(problems), dataset_size)


def plan_table(result: Plan) -> str:
    """The plan as a Markdown table, followed by its problems.

    Example::

        >>> print(plan_table(plan(64, devices=2, micro_batches=[8, 32], dataset_size=1000)))
        | micro-batch | factor | effective batch | forward passes / epoch | updates / epoch | lr |
        | ---: | ---: | ---: | ---: | ---: | ---: |
        | 32 | 1 | 64 | 16 | 16 | - |
        | 8 | 4 | 64 | 63 | 16 | - |
    """
    lines = [
        "| micro-batch | factor | effective batch | forward passes / epoch | updates / epoch | lr |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in result.rows:
        passes = str(row.forward_passes_per_epoch) if result.dataset_size is not None else "-"
        updates = str(row.updates_per_epoch) if result.dataset_size is not None else "-"
        lr = f"{row.lr:.4g}" if row.lr is not None else "-"
        lines.append(f"| {row.micro_batch} | {row.factor} | {row.effective_batch} | {passes} | {updates} | {lr} |")
    text = "\n".join(lines) if result.rows else "no valid configuration"
    if result.problems:
        text += "\n\n" + "\n".join(f"- {problem}" for problem in result.problems)
    return text
