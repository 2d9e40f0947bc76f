#!/usr/bin/env bash
# The GPU suite (benchmarks/gpu/suite.py says what it measures and how its sizes fit 8 minutes on an H100):
#
#   bash benchmarks/gpu/run.sh OUTDIR            # on a CUDA machine
#   bash benchmarks/gpu/run.sh --dry [OUTDIR]    # tiny sizes on any machine, under a minute on 2 CPU cores
#
# The project runs from this working tree (PYTHONPATH), installed or not; the interpreter is $PYTHON, else the
# repository's .venv, else python3.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
python="${PYTHON:-}"
if [ -z "$python" ]; then
    if [ -x "$root/.venv/bin/python" ]; then python="$root/.venv/bin/python"; else python=python3; fi
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export PYTORCH_NVML_BASED_CUDA_CHECK=1  # torch.cuda.is_available() without a CUDA context (--dry forks its parts)
exec "$python" "$root/benchmarks/gpu/suite.py" "$@"
