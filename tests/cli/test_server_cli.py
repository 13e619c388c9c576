"""``waltz server list`` as a process against a real local cluster (``waltz dev``)."""

import os
import re
import signal

import pytest

from tests.cli.helpers import waltz
from waltz.local.devcluster import DevCluster


@pytest.mark.timeout(300)
def test_list_shows_servers_partitions_and_an_unreachable_server(dev_cluster):
    connect, args = dev_cluster
    conn = ["--zookeeper", connect, "--root", "/waltz_cluster"]
    listed = waltz("server", "list", *conn)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.startswith("2 live server(s)")
    assert len(re.findall(r"^server \d+ at 127\.0\.0\.1:\d+: reachable$", listed.stdout, re.M)) == 2
    partitions = re.findall(r"^  partition (\d): generation \d+, healthy$", listed.stdout, re.M)
    assert sorted(partitions) == ["0", "1", "2", "3"], listed.stdout
    # A server killed with -9 keeps its descriptor until its ZooKeeper session expires: it shows as unreachable.
    DevCluster(args[1]).daemon("server", 0).kill()
    listed = waltz("server", "list", *conn, "--timeout", "2")
    assert listed.returncode == 0, listed.stderr
    assert "UNREACHABLE" in listed.stdout and ": reachable" in listed.stdout, listed.stdout
    # A hung server (stopped: connections accepted, nothing answered) is named so, within the timeout. Its reason
    # was printed as "(2.0, 'Deferred')".
    hung = DevCluster(args[1]).daemon("server", 1)
    os.kill(hung.pid, signal.SIGSTOP)
    try:
        listed = waltz("server", "list", *conn, "--timeout", "1")
    finally:
        os.kill(hung.pid, signal.SIGCONT)
    assert listed.returncode == 0, listed.stderr
    assert re.search(r"^server \d+ at 127\.0\.0\.1:\d+: UNREACHABLE \(did not answer within 1 s\)$",
                     listed.stdout, re.M), listed.stdout
