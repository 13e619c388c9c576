#!/usr/bin/env bash
# Sets everything up (see bootstrap.sh) and runs the main job: a local ZooKeeper, a Waltz cluster
# created in it, and the cluster shown. Everything lives under ./.waltz-dev (or $WALTZ_RUN_DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
RUN_DIR="${WALTZ_RUN_DIR:-.waltz-dev}"
ZK_PORT="${WALTZ_ZK_PORT:-42181}"
waltz=.venv/bin/waltz
conn=(--zookeeper "127.0.0.1:$ZK_PORT" --root /waltz_cluster)

$waltz zookeeper start --run-dir "$RUN_DIR/zookeeper" --port "$ZK_PORT"
if ! $waltz cluster show "${conn[@]}" >/dev/null 2>&1; then
  $waltz cluster create "${conn[@]}" --name demo --partitions 4
fi
$waltz cluster show "${conn[@]}"
echo
echo "demo: ZooKeeper is running on 127.0.0.1:$ZK_PORT; stop it with: $waltz zookeeper stop --run-dir $RUN_DIR/zookeeper"
