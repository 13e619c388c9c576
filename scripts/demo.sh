#!/usr/bin/env bash
# Sets everything up (see bootstrap.sh) and runs the main job: a local Waltz cluster (ZooKeeper, three
# storage daemons, two servers; `waltz dev up`), the bank example of docs/client.md run against it, and the
# cluster's state afterwards (`waltz dev status`). Everything lives under ./.waltz-dev (or $WALTZ_RUN_DIR);
# stop it with `.venv/bin/waltz dev down`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
RUN_DIR="${WALTZ_RUN_DIR:-.waltz-dev}"
ZK_PORT="${WALTZ_ZK_PORT:-42181}"
waltz=.venv/bin/waltz
dev=(--run-dir "$RUN_DIR" --zookeeper-port "$ZK_PORT")

$waltz dev up "${dev[@]}"
echo
echo "demo: running the bank example of docs/client.md against the cluster"
.venv/bin/python - "$RUN_DIR" "$ZK_PORT" <<'PY'
import os, re, sys
run_dir, port = sys.argv[1], sys.argv[2]
text = open("docs/client.md", encoding="utf-8").read()
[code] = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if b.startswith("# bank.py")]
with open(os.path.join(run_dir, "bank.py"), "w") as f:
    f.write(code)
with open(os.path.join(run_dir, "client.yaml"), "w") as f:
    f.write("zookeeper.connectString: 127.0.0.1:%s\ncluster.root: /waltz_cluster\n" % port)
PY
rm -f "$RUN_DIR/bank.db"
.venv/bin/python "$RUN_DIR/bank.py" "$RUN_DIR/client.yaml" "$RUN_DIR/bank.db"
echo
$waltz dev status "${dev[@]}"
echo
echo "demo: done; the cluster keeps running. Stop it with: $waltz dev down --run-dir $RUN_DIR"
