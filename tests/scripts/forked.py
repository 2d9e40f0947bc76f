"""Run Python scripts as processes forked from one interpreter that has already imported the heavy modules they share.

    python tests/scripts/forked.py SPEC.json

``SPEC.json`` holds ``preload`` (module names, imported once here), ``jobs`` (name -> ``[SCRIPT, ARG, ...]``),
``cwd``, ``out`` (a folder) and ``parallel`` (jobs running at once). Each job runs in a process of its own, forked
after the imports, as ``python SCRIPT ARG ...`` would run it: ``sys.argv`` and ``sys.path[0]`` set so, the script
executed as ``__main__``, an uncaught exception printed by ``sys.excepthook`` with exit status 1, ``SystemExit``
turned into the status as the interpreter turns it. Its stdout and stderr go, combined in the order written, to
``out/<name>.txt``; ``out/returncodes.json`` maps each name to its status as ``subprocess`` reports it (-9: killed
by SIGKILL). Exit-time handlers do not run. A fresh interpreter spends seconds importing torch and Lightning
(tests/helpers.py: :func:`run_forked`, its one caller); this one pays that once for every job.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys
from pathlib import Path


def _status(code: object) -> int:
    """The exit status the interpreter gives ``SystemExit(code)``, printing a code that is not an integer."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _child(argv: list[str], output: Path) -> None:
    descriptor = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(descriptor, 1)
    os.dup2(descriptor, 2)
    os.close(descriptor)
    sys.argv = list(argv)
    sys.path[0] = str(Path(argv[0]).resolve().parent)
    status = 0
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exit_:
        status = _status(exit_.code)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _returncode(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    for module in spec["preload"]:
        importlib.import_module(module)
    out = Path(spec["out"])
    os.chdir(spec["cwd"])
    waiting = list(spec["jobs"].items())
    running: dict[int, str] = {}
    returncodes: dict[str, int] = {}
    while waiting or running:
        while waiting and len(running) < spec["parallel"]:
            name, argv = waiting.pop(0)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                try:
                    _child(argv, out / f"{name}.txt")
                finally:
                    os._exit(1)  # only if the child could not even start its script
            running[pid] = name
        pid, status = os.wait()
        returncodes[running.pop(pid)] = _returncode(status)
        (out / "returncodes.json").write_text(json.dumps(returncodes))  # so far: a job that hangs has none


if __name__ == "__main__":
    main()
