#!/usr/bin/env bash
# On a lent GPU machine (run by this workplace's `device` tool from the repository root; see prepare.sh): install the
# carried wheels, run the suite, and leave in $OUT what comes back (at most 8 files): results.md, results.json and
# parts.tgz (each part's tables, JSON and log), whatever the suite's outcome. Then, here:
# python benchmarks/gpu/to_docs.py <the folder the files came back in>.
set -uo pipefail
if compgen -G ".whl/*.whl" >/dev/null; then
    if ! python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl; then
        for wheel in .whl/*.whl; do python3 -m zipfile -e "$wheel" /tmp/site; done  # a wheel is a zip
    fi
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
# the parts' budgets add up to 450 s; the call's own limit (timeout_s 540) must leave time to copy what was written
timeout -k 10 500 bash benchmarks/gpu/run.sh /tmp/gpu-suite
status=$?
cp /tmp/gpu-suite/results.md /tmp/gpu-suite/results.json "$OUT"/ 2>/dev/null
tar czf "$OUT/parts.tgz" -C /tmp/gpu-suite parts 2>/dev/null
exit $status
