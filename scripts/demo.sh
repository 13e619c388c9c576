#!/usr/bin/env bash
# Sets everything up (see bootstrap.sh) and runs the main job: a local Waltz cluster (ZooKeeper, three
# storage daemons, two servers; `waltz dev up`) and the bank demo on it (`waltz demo`: several application
# instances moving money under optimistic locks while a storage and a server are killed and restarted, then
# the checks that nothing was lost, duplicated or overdrawn), the Spark ledger job that rebuilds every balance
# from the log and compares it with an instance's database, and the cluster's state (`waltz dev status`).
# Everything lives under ./.waltz-dev (or $WALTZ_RUN_DIR); stop it with `.venv/bin/waltz dev down`.
# Extra arguments go to `waltz demo` (e.g. --duration 30; see docs/demo.md). WALTZ_TLS=1 makes a new cluster
# speak mutual TLS on every port (`waltz dev up --tls`; a run directory made so keeps it).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh --spark
RUN_DIR="${WALTZ_RUN_DIR:-.waltz-dev}"
ZK_PORT="${WALTZ_ZK_PORT:-42181}"
waltz=.venv/bin/waltz
dev=(--run-dir "$RUN_DIR" --zookeeper-port "$ZK_PORT")

tls=()
if [ "${WALTZ_TLS:-0}" = 1 ]; then tls=(--tls); fi
$waltz dev up "${dev[@]}" "${tls[@]}"
echo
$waltz demo "${dev[@]}" "$@"
echo
# The derived-data step: a Spark job rebuilds every balance from the log and compares it with the database of
# the last run's first instance (docs/spark.md, "The ledger job").
last_run="$(ls -d "$RUN_DIR"/demo/run-* | sort -V | tail -1)"
echo "demo: the Spark ledger job rebuilds every balance from the log and compares with $last_run/instance-0/bank.db"
.venv/bin/python -m waltz.spark.jobs.ledger --client-config "$RUN_DIR/client.yaml" \
  --headers 101,102,103 --compare-sqlite "$last_run/instance-0/bank.db" 2> "$RUN_DIR/ledger-job.log" \
  || { echo "demo: the ledger job failed; its log: $RUN_DIR/ledger-job.log"; exit 1; }
echo
$waltz dev status "${dev[@]}"
echo
echo "demo: done; the cluster keeps running. Stop it with: $waltz dev down --run-dir $RUN_DIR"
