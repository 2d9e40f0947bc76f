"""The GPU suite: seven measurements on one CUDA device, each in a process of its own under its own time budget.

    bash benchmarks/gpu/run.sh OUTDIR              # on a CUDA machine: about 5 minutes on an H100, 7.5 at most
    bash benchmarks/gpu/run.sh --dry [OUTDIR]      # tiny sizes on any machine (CUDA-only parts say "skipped")

Writes ``OUTDIR/results.md`` (the environment, each part's outcome and tables) and ``OUTDIR/results.json``, and each
part's own ``.md``, ``.json`` and ``.log`` under ``OUTDIR/parts/``. A part that fails or runs past its budget is
reported as such, with the rows it finished, and the others still run. Exit status 0 when every part ran (or was
skipped for want of CUDA) and every check in its tables held. ``python benchmarks/gpu/to_docs.py OUTDIR`` then puts
a real run's tables into docs/benchmarks.md and benchmarks/results/gpu/.

Sizes, argued for an H100 (80 GB); each budget includes the part's own start (a fresh interpreter: torch, Lightning,
the CUDA context, about 10 s):

- exactness (50 s): 14 fits and 20 plain-PyTorch loops of small MLPs (8 optimizer steps each, well under a second
  each on any GPU), then 8 one-step fits for the bf16 ulps: about 25 s.
- oom (50 s): a 17M-parameter MLP, 4 loader batches of 16384 rows (about 0.3 TFLOP a batch), twice, plus two
  out-of-memory retries and a 1024-row probe: about 15 s.
- fsdp (45 s): 4 fits of 16 micro-steps of a small MLP after one NCCL initialisation: about 20 s.
- memory_metrics (35 s): one fit of 12 micro-steps: about 15 s.
- coupled_memory (30 s): a dual encoder (two towers of 20M parameters, width 4096) with InfoNCE, at batches of 4096
  and 16384 rows, as one big batch and through ``cached`` in chunks of 512 and 4096: about 15 steps for memory and
  exactness and up to 6 rounds of 5 steps for time, each a tenth of a second or less in float32: about 15 s.
- experiment (160 s): GPT-2 small, a micro-batch of 8 x 1024 tokens is about 7 TFLOP forward and backward (6 x 124M
  parameters x 8192 tokens, plus attention): well under a second, about 0.1 s at TF32 and 0.05 s in bf16. Per
  precision 3 steps x (1 + 2 + 4 + 8 + 16) = 93 accumulated micro-steps, the big batches that fit (about 20
  micro-steps' worth; the first out-of-memory error ends the rest) and 18 model builds and Trainer starts of about
  2 s: about 60 s for both precisions. Rows that would start past the budget are reported as not run.
- overhead (80 s): 4 configurations, a warm-up fit each and up to 7 rounds: the MLP at a few ms a micro-step (about
  25 s), GPT-2 small at 8 x 256 tokens in bf16 (about 15 ms a micro-step, 48 micro-steps and 1.5 s of start a fit:
  about 70 s). Rounds stop at the budget: fewer rounds, never a killed part.

The budgets add up to 450 s; the suite itself (environment, reports) takes a few seconds more, so it ends within 8
minutes even if every part runs to its budget.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import importlib.util
import json
import multiprocessing
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE), str(HERE.parent), str(ROOT / "examples")]

PARTS: dict[str, float] = {  # name: budget in seconds (see above); the cheap, decisive checks first
    "exactness": 50,
    "oom": 50,
    "fsdp": 45,
    "memory_metrics": 35,
    "coupled_memory": 30,
    "experiment": 160,
    "overhead": 80,
}


def _child(name: str, argv: list[str], log: str) -> None:
    """Run one part in this (child) process, its output into ``log``; leave without the interpreter's teardown."""
    with open(log, "w") as handle:
        os.dup2(handle.fileno(), 1)
        os.dup2(handle.fileno(), 2)
    code = 0
    try:
        importlib.import_module(name).main(argv)
    except BaseException:  # noqa: BLE001 (whatever it was, it is reported in the part's log and exit status)
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # gloo and NCCL can abort in C++ teardown after a clean run; every result is written by now


def run_part(name: str, budget: float, out: Path, dry: bool, context: Any) -> dict[str, Any]:
    """Run part ``name`` under ``budget`` seconds; its outcome, time and report."""
    parts = out / "parts"
    argv = ["--out", str(parts), "--budget", str(budget), "--started", str(time.time()), *(["--dry"] if dry else [])]
    log = parts / f"{name}.log"
    started = time.monotonic()
    process = context.Process(target=_child, args=(name, argv, str(log)), name=f"gpu-suite-{name}")
    process.start()
    process.join(budget)
    timed_out = process.is_alive()
    if timed_out:
        process.kill()
        process.join()
    seconds = time.monotonic() - started
    path = parts / f"{name}.json"
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):  # never written (it died at its start), or unreadable
        report = None
    status = report["status"] if report else "no report"
    if timed_out:
        status = f"timed out after {budget:.0f} s"
    elif process.exitcode != 0:
        tail = log.read_text().strip().splitlines()[-1:] if log.exists() else []
        status = f"failed (exit {process.exitcode}): {tail[0][:200] if tail else 'no output'}"
    return {"status": status, "seconds": seconds, "budget": budget, "report": report}


def checks_failed(report: dict[str, Any] | None) -> list[str]:
    """The rows of a report whose check did not hold (a row with ``passed: false``)."""
    if not report:
        return []
    return [
        f"{report['title']}: {' / '.join(cells[:2])}"
        for table in report["tables"].values()
        for cells, row in zip(table["cells"], table["rows"], strict=True)
        if row.get("passed") is False
    ]


def environment(dry: bool) -> dict[str, Any]:
    """The machine and the software: device, driver, CUDA, torch, Lightning, transformers, Python, commit.

    The device comes from ``nvidia-smi``, not from ``torch.cuda``: this process initialises no CUDA context, so the
    parts forked from it (``--dry``) can.
    """
    import lightning
    import torch

    try:
        import transformers

        transformers_version = transformers.__version__
    except ImportError:
        transformers_version = "not installed"
    gpu = _command(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader,nounits"])
    name, driver, mib = (gpu.split(", ") + ["", "", ""])[:3] if gpu else ("", "", "")
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "mode": "dry (tiny sizes)" if dry else "full",
        "device": name or f"no CUDA device ({platform.processor() or 'CPU'})",
        "memory_gib": round(float(mib) / 1024, 1) if mib.strip().isdigit() else None,
        "driver": driver or None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "transformers": transformers_version,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "commit": os.environ.get("SUITE_COMMIT") or _commit(),
    }


def _commit() -> str | None:
    """The checkout's commit, with ``+changes`` where the working tree differs from it."""
    commit = _command(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"])
    if commit and _command(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"]):
        commit += "+changes"
    return commit


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _command(command: list[str]) -> str | None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip().splitlines()[0] if done.stdout.strip() else None


def markdown(env: dict[str, Any], results: dict[str, dict[str, Any]], failed: list[str]) -> str:
    """The whole run as Markdown: the environment, one line per part, each part's tables."""
    device = env["device"] + (f", {env['memory_gib']} GiB" if env["memory_gib"] else "")
    lines = [
        f"Run of {env['date']} ({env['mode']}): {device}, driver {env['driver'] or '-'}, CUDA {env['cuda'] or '-'},"
        f" torch {env['torch']}, lightning {env['lightning']}, transformers {env['transformers']}, Python"
        f" {env['python']}, {env['cpus']} CPUs, commit {env['commit'] or 'unknown'}.",
        "",
        "| part | outcome | seconds | budget |",
        "| --- | --- | ---: | ---: |",
    ]
    lines += [f"| {name} | {r['status']} | {r['seconds']:.0f} | {r['budget']:.0f} |" for name, r in results.items()]
    lines += ["", f"Checks that did not hold: {'; '.join(failed)}." if failed else "Every check held.", ""]
    for name, result in results.items():
        path = Path(result["report_path"])
        if path.exists():
            lines += [path.read_text().rstrip(), ""]
        else:
            lines += [f"### {name}", "", f"No report: {result['status']}.", ""]
    return "\n".join(lines)


def write(out: Path, results: dict[str, dict[str, Any]], dry: bool) -> list[str]:
    """``results.md`` and ``results.json`` for the parts run so far; the checks that did not hold."""
    failed = [line for result in results.values() for line in checks_failed(result["report"])]
    env = environment(dry)
    (out / "results.md").write_text(markdown(env, results, failed))
    (out / "results.json").write_text(json.dumps({"environment": env, "parts": results}, indent=2, default=str))
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, nargs="?", help="default: benchmarks/results/gpu-run (gpu-dry with --dry)")
    parser.add_argument("--dry", action="store_true", help="tiny sizes, any machine: checks the scripts, not the GPU")
    parser.add_argument("--only", nargs="+", choices=list(PARTS), help="run only these parts")
    parser.add_argument(
        "--budget", nargs="+", default=[], metavar="PART=SECONDS", help="override a part's budget (for tests)"
    )
    args = parser.parse_args(argv)
    missing = [name for name in ("torch", "lightning", "jsonargparse") if not _importable(name)]
    if missing:
        print(
            f"gpu suite: {', '.join(missing)} cannot be imported here, and lightning_accum needs"
            f" {'it' if len(missing) == 1 else 'them'} (on a machine with no network, carry the wheels: see"
            " benchmarks/gpu/prepare.sh)",
            file=sys.stderr,
        )
        return 2
    out = args.out or ROOT / "benchmarks" / "results" / ("gpu-dry" if args.dry else "gpu-run")
    (out / "parts").mkdir(parents=True, exist_ok=True)
    budgets = {name: PARTS[name] for name in args.only or PARTS}
    for override in args.budget:
        name, _, seconds = override.partition("=")
        if name not in budgets or not seconds:
            parser.error(f"--budget {override!r}: expected PART=SECONDS with PART one of {', '.join(budgets)}")
        budgets[name] = float(seconds)
    if args.dry:
        # tiny sizes: the parts fork from this process, which pays the imports once (no CUDA is touched here
        # before the fork); a full run starts each part in a fresh interpreter, as a user's job starts
        import lightning.pytorch  # noqa: F401

        import lightning_accum  # noqa: F401

        with contextlib.suppress(ImportError):
            import transformers.models.gpt2  # noqa: F401

        context = multiprocessing.get_context("fork")
    else:
        context = multiprocessing.get_context("spawn")
    results: dict[str, dict[str, Any]] = {}
    for name, budget in budgets.items():
        print(f"gpu suite: {name} (budget {budget:.0f} s) ...", flush=True)
        result = run_part(name, budget, out, args.dry, context)
        result["report_path"] = str(out / "parts" / f"{name}.md")
        results[name] = result
        print(f"gpu suite: {name}: {result['status']} in {result['seconds']:.1f} s", flush=True)
        failed = write(out, results, args.dry)  # after every part: a run cut short still leaves what it measured
    ran = all(r["status"] == "ok" or r["status"].startswith("skipped") for r in results.values())
    print(
        f"gpu suite: wrote {out / 'results.md'}; {'every part ran' if ran else 'a part did not finish'};"
        f" {'every check held' if not failed else f'{len(failed)} checks did not hold'}",
        flush=True,
    )
    return 0 if ran and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
