#!/usr/bin/env bash
# Sets everything up (see bootstrap.sh) and runs the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh --spark
# Every test has its own timeout; this bounds the whole run too (a hang outside any test), then kills.
exec timeout --kill-after=60 2700 .venv/bin/python -m pytest "$@"
