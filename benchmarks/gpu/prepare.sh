#!/usr/bin/env bash
# Before a run on a lent GPU machine with no network (this workplace's `device` tool): put in .whl/ the wheels of what
# the project needs and that machine lacks (jsonargparse, at the version constraints.txt pins; it is pure Python),
# and keep .whl/ out of git. Then call the tool with carry [".whl"] and the command
#
#     SUITE_COMMIT=<commit> bash benchmarks/gpu/device.sh
#
# (timeout_s 540: the suite ends within 8 minutes).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
pin=$(grep -E '^jsonargparse==' constraints.txt)
python3 -m pip download -q --no-deps --only-binary=:all: -d .whl "$pin"
ls .whl
