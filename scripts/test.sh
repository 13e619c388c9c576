#!/usr/bin/env bash
# Sets everything up (see bootstrap.sh) and runs the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh --spark
# Every test has its own timeout; this bounds the whole run too (a hang outside any test), then kills.
# Two pytest-xdist workers, each taking whole files (a module's fixtures stay on one worker): the integration
# tests mostly wait for processes, so two workers take about a third less time, even on two cores. Each worker
# gives its daemons ports of its own (tests/conftest.py). WALTZ_TEST_WORKERS=0 runs every test in this process.
exec timeout --kill-after=60 2700 .venv/bin/python -m pytest -n "${WALTZ_TEST_WORKERS:-2}" --dist loadfile "$@"
