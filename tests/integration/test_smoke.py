"""The smoke test with faults in its CI setting: 20,000 transactions, storages, servers and ZooKeeper killed."""

import re
import subprocess
import sys

import pytest


@pytest.mark.timeout(420)
def test_smoke_with_faults_finds_no_anomaly():
    result = subprocess.run([sys.executable, "-m", "waltz.cli.main", "smoke", "--transactions", "20000",
                             "--fault-interval", "2"],
                            capture_output=True, text=True, timeout=400)
    report = result.stdout
    assert result.returncode == 0, report[-4000:] + result.stderr[-2000:]
    assert "anomalies: 0" in report
    assert re.search(r"throughput: \d+ transactions/s \(20000 committed", report), report
    faults = int(re.search(r"faults injected: (\d+)", report).group(1))
    assert faults >= 6, report   # every kind of process was killed at least once
    for kind in ("storage-0", "server-0", "zookeeper"):
        assert kind + " killed and restarted" in report
