#!/usr/bin/env bash
# Sets everything up (see bootstrap.sh) and runs the main job: a local Waltz cluster (ZooKeeper, three
# storage daemons, two servers; `waltz dev up`) and the bank demo on it (`waltz demo`: several application
# instances moving money under optimistic locks while a storage and a server are killed and restarted, then
# the checks that nothing was lost, duplicated or overdrawn), and the cluster's state afterwards
# (`waltz dev status`). Everything lives under ./.waltz-dev (or $WALTZ_RUN_DIR); stop it with
# `.venv/bin/waltz dev down`. Extra arguments go to `waltz demo` (e.g. --duration 30; see docs/demo.md).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
RUN_DIR="${WALTZ_RUN_DIR:-.waltz-dev}"
ZK_PORT="${WALTZ_ZK_PORT:-42181}"
waltz=.venv/bin/waltz
dev=(--run-dir "$RUN_DIR" --zookeeper-port "$ZK_PORT")

$waltz dev up "${dev[@]}"
echo
$waltz demo "${dev[@]}" "$@"
echo
$waltz dev status "${dev[@]}"
echo
echo "demo: done; the cluster keeps running. Stop it with: $waltz dev down --run-dir $RUN_DIR"
