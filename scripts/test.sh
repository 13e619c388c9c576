#!/usr/bin/env bash
# Sets everything up (see bootstrap.sh) and runs the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh --spark
exec .venv/bin/python -m pytest "$@"
