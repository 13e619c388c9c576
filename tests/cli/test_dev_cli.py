"""``waltz dev up | status | down`` as processes: a real local cluster, idempotent, stopped by pid."""

import os
import re

import pytest

from tests.cli.helpers import refused, waltz
from waltz.local.daemons import free_port
from waltz.local.devcluster import DevCluster


@pytest.fixture
def dev(tmp_path):
    """Arguments for a dev cluster of this test's own; whatever it started is stopped afterwards."""
    args = ["--run-dir", str(tmp_path / "dev"), "--zookeeper-port", str(free_port())]
    yield args
    waltz("dev", "down", *args, timeout=120)


def pids_of(run_dir):
    """Pids of processes whose command line mentions ``run_dir``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open("/proc/%s/cmdline" % entry, "rb") as stream:
                    if run_dir.encode() in stream.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found


@pytest.mark.timeout(240)
def test_up_status_up_again_and_down(dev):
    first = waltz("dev", "up", *dev, timeout=180)
    assert first.returncode == 0, first.stderr
    for name in ("zookeeper", "storage-0", "storage-1", "storage-2", "server-0", "server-1"):
        assert re.search(r"^%s\s+started" % name, first.stdout, re.M), first.stdout
    again = waltz("dev", "up", *dev, timeout=120)
    assert again.returncode == 0 and "started" not in again.stdout, again.stdout
    assert again.stdout.count(" running") == 6

    status = waltz("dev", "status", *dev, timeout=120)
    assert status.returncode == 0, status.stderr
    assert len(re.findall(r"^  (storage|server)-\d\s+\d+\s+healthy", status.stdout, re.M)) == 5, status.stdout
    partitions = re.findall(r"^  (\d): server 127\.0\.0\.1:\d+ \(id \d+\), generation \d+, high-water mark -1$",
                            status.stdout, re.M)
    assert partitions == ["0", "1", "2", "3"], status.stdout
    replicas = re.findall(r"^  127\.0\.0\.1:\d+  0: -1, 1: -1, 2: -1, 3: -1$", status.stdout, re.M)
    assert len(replicas) == 3, status.stdout

    run_dir = dev[1]
    cluster = DevCluster(run_dir)
    recorded = [d.pid for _, d in cluster.daemons()] + [cluster.zookeeper.pid]
    assert set(recorded) <= set(pids_of(run_dir))
    down = waltz("dev", "down", *dev, timeout=120)
    assert down.returncode == 0 and down.stdout.count("stopped") == 6, down.stdout
    assert pids_of(run_dir) == []


def test_status_without_a_cluster_says_so(dev):
    result = waltz("dev", "status", *dev)
    assert result.returncode == 3
    assert "ZooKeeper is not running" in result.stdout


def test_bad_arguments_are_one_line_errors(dev):
    assert "invalid int value" in refused("dev", "up", "--zookeeper-port", "many", code=2)
