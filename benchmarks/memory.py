"""Peak memory of micro-batch b with factor k against one batch of b x k, without accumulation.

    python benchmarks/memory.py                    # factors 1 4 8 16, writes memory.json and a table

The measurement is the classic accumulation experiment of ``examples/accumulation_experiment.py`` (each run in a
fresh process; CUDA: peak allocated, CPU: growth of the peak resident memory during ``fit``); this script runs it with
the benchmark's settings and keeps its numbers under ``benchmarks/results``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from accumulation_experiment import main as experiment  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    results = experiment(["--factors", "1", "4", "8", "16", "--out", str(args.out / "memory")])
    rows = [
        {key: row[key] for key in ("factor", "accumulate", "effective_batch_size", "peak_memory_mib", "device")}
        for row in results
    ]
    (args.out / "memory.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
