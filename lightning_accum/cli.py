r"""The ``lightning-accum`` command: ``plan`` a configuration before a run.

    lightning-accum plan --global-batch 512 --devices 8 --dataset-size 1000000 --base-lr 3e-4 --base-batch 256 \\
        --rule sqrt
    lightning-accum plan --global-batch 100 --devices 16          # explains: 96 or 112
    lightning-accum plan --global-batch 1024 --devices 2 --probe my_pkg.models:MyModule --memory-budget 8000

With ``--probe MODULE:CLASS`` the command instantiates the LightningModule (no arguments), builds micro-batches of
each candidate size from its ``example_input_array``, and measures the peak memory of one forward and backward in a
fresh process per size (CUDA: peak allocated; CPU: growth of the peak resident memory), then keeps the micro-batches
that fit ``--memory-budget`` MiB.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from lightning_accum.monitor import peak_resident_bytes, resident_bytes
from lightning_accum.plan import plan, plan_table

_MIB = 2**20


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit status (2 for a configuration with no valid plan).

    Example::

        lightning-accum plan --global-batch 100 --devices 16
    """
    parser = argparse.ArgumentParser(prog="lightning-accum", description="Plan gradient accumulation for Lightning")
    commands = parser.add_subparsers(dest="command", required=True)
    planner = commands.add_parser("plan", help="valid micro-batch / factor / LR configurations for a global batch")
    planner.add_argument("--global-batch", type=int, required=True, help="the effective batch, all devices together")
    planner.add_argument("--devices", type=int, default=1, help="devices (ranks) in data parallel")
    planner.add_argument("--micro-batch", type=int, nargs="+", help="micro-batch sizes to consider (default: all)")
    planner.add_argument("--dataset-size", type=int, help="training samples, for the per-epoch columns")
    planner.add_argument("--base-lr", type=float, help="the learning rate tuned at --base-batch")
    planner.add_argument("--base-batch", type=int, help="the global batch at which --base-lr was tuned")
    planner.add_argument("--rule", choices=["none", "linear", "sqrt"], default="none", help="LR scaling rule")
    planner.add_argument("--probe", metavar="MODULE:CLASS", help="measure peak memory per micro-batch on this model")
    planner.add_argument("--memory-budget", type=float, metavar="MIB", help="with --probe: memory per device, MiB")
    prober = commands.add_parser("_probe", help=argparse.SUPPRESS)
    prober.add_argument("target")
    prober.add_argument("micro_batch", type=int)
    args = parser.parse_args(argv)
    if args.command == "_probe":
        print(json.dumps({"peak_bytes": probe_once(args.target, args.micro_batch)}))
        return 0
    if (args.probe is None) != (args.memory_budget is None):
        parser.error("--probe and --memory-budget go together")
    max_micro_batch = None
    if args.probe is not None:
        per_device = args.global_batch // args.devices if args.global_batch % args.devices == 0 else 0
        candidates = args.micro_batch or [
            size for size in range(per_device, 0, -1) if per_device and not per_device % size
        ]
        max_micro_batch, measured = fit_budget(args.probe, candidates, args.memory_budget)
        for size, peak in measured:
            print(f"probe: micro-batch {size}: peak {peak / _MIB:.1f} MiB", file=sys.stderr)
        if max_micro_batch is None:
            print(f"no micro-batch fits {args.memory_budget:g} MiB", file=sys.stderr)
            return 2
    try:
        result = plan(
            args.global_batch,
            devices=args.devices,
            micro_batches=args.micro_batch,
            dataset_size=args.dataset_size,
            base_lr=args.base_lr,
            base_batch=args.base_batch,
            rule=args.rule,
            max_micro_batch=max_micro_batch,
        )
    except (TypeError, ValueError) as error:
        parser.error(str(error))
    print(plan_table(result))
    return 0 if result.rows else 2


def fit_budget(target: str, candidates: Sequence[int], budget_mib: float) -> tuple[int | None, list[tuple[int, int]]]:
    """The largest candidate micro-batch whose measured peak memory fits ``budget_mib``, and what was measured.

    Sizes are probed from the smallest up and the search stops at the first that does not fit.
    """
    measured: list[tuple[int, int]] = []
    best = None
    for size in sorted(set(candidates)):
        peak = probe_isolated(target, size)
        measured.append((size, peak))
        if peak > budget_mib * _MIB:
            break
        best = size
    return best, measured


def probe_isolated(target: str, micro_batch: int) -> int:
    """Peak memory, in bytes, of one forward and backward at ``micro_batch``, in a fresh Python process."""
    done = subprocess.run(
        [sys.executable, "-m", "lightning_accum.cli", "_probe", target, str(micro_batch)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"probing {target} at micro-batch {micro_batch} failed:\n{done.stderr[-3000:]}")
    return int(json.loads(done.stdout.strip().splitlines()[-1])["peak_bytes"])


def probe_once(target: str, micro_batch: int) -> int:
    """In this process: instantiate ``MODULE:CLASS``, run one forward and backward at ``micro_batch``, measure."""
    import torch

    module_name, _, class_name = target.partition(":")
    if not module_name or not class_name:
        raise ValueError(f"--probe takes MODULE:CLASS, got {target!r}")
    model = getattr(importlib.import_module(module_name), class_name)()
    example = getattr(model, "example_input_array", None)
    if example is None:
        raise ValueError(f"--probe needs `{class_name}.example_input_array` to build micro-batches, and it is not set")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = model.to(device)
    inputs = _resize(example, micro_batch, device)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = resident_bytes()
    output = model(*inputs) if isinstance(inputs, tuple) else model(inputs)
    _first_tensor(output).float().mean().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated() - before)
    return int(max(peak_resident_bytes() - before, 0))


def _resize(example: Any, size: int, device: Any) -> Any:
    import torch

    if isinstance(example, torch.Tensor):
        repeats = math.ceil(size / example.shape[0])
        return torch.cat([example] * repeats)[:size].to(device)
    if isinstance(example, (tuple, list)):
        return tuple(_resize(part, size, device) for part in example)
    if isinstance(example, dict):
        return {key: _resize(value, size, device) for key, value in example.items()}
    return example


def _first_tensor(output: Any) -> Any:
    import torch

    if isinstance(output, torch.Tensor):
        return output
    values = output.values() if isinstance(output, dict) else output
    for value in values:
        found = _first_tensor(value)
        if found is not None:
            return found
    raise ValueError("the model's output holds no tensor to backpropagate from")


if __name__ == "__main__":
    sys.exit(main())
