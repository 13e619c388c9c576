"""The smoke test with faults in its CI setting: 8,000 transactions, storages, servers and ZooKeeper killed
(each kind at least once; the longer runs are `waltz smoke --transactions N`, see docs/cli.md)."""

import os
import re
import subprocess
import sys

import pytest

from waltz.local.daemons import stop_recorded_processes


@pytest.mark.timeout(420)
def test_smoke_with_faults_finds_no_anomaly(tmp_path):
    # The smoke run keeps its cluster under a temporary directory: here, so that whatever a run stopped
    # by the timeout left behind is found and stopped, by pid.
    # --min-faults: on a fast machine 8,000 transactions took 6.5 s, and only one fault had been injected.
    process = subprocess.Popen([sys.executable, "-m", "waltz.cli.main", "smoke", "--transactions", "8000",
                                "--fault-interval", "2", "--min-faults", "4"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE,
                               text=True, env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        try:
            report, errors = process.communicate(timeout=380)
        except subprocess.TimeoutExpired:
            process.terminate()     # the command stops its cluster on SIGTERM
            report, errors = process.communicate(timeout=20)
            raise
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        stop_recorded_processes(str(tmp_path))
    assert process.returncode == 0, report[-4000:] + errors[-2000:]
    assert "anomalies: 0" in report
    committed = int(re.search(r"throughput: \d+ transactions/s \((\d+) committed", report).group(1))
    assert committed >= 8000, report
    faults = int(re.search(r"faults injected: (\d+)", report).group(1))
    assert faults >= 4, report   # every kind of process was killed at least once (storage-0, server-0, storage-1, zookeeper)
    for kind in ("storage-0", "server-0", "zookeeper"):
        assert kind + " killed and restarted" in report
