"""Fixtures for the ``waltz`` command tests: a running local cluster, and a cluster that only exists in
ZooKeeper."""

import pytest

from tests.cli.helpers import ok, waltz
from waltz.local.daemons import stop_recorded_processes
from waltz.local.ports import free_port


@pytest.fixture
def dev_cluster(tmp_path):
    """A ``waltz dev`` cluster of this test's own: fires with (connect string, run-dir args); stopped afterwards."""
    port = free_port()
    run_dir = tmp_path / "dev"
    args = ["--run-dir", str(run_dir), "--zookeeper-port", str(port)]
    try:
        up = waltz("dev", "up", *args, timeout=180)
        assert up.returncode == 0, up.stderr
        yield "127.0.0.1:%d" % port, args
    finally:
        stop_dev_cluster(run_dir, args)


def stop_dev_cluster(run_dir, args):
    """``waltz dev down``, then, whatever it did (a ``dev up`` that failed half-way, a ``down`` that failed
    or timed out), every process recorded under ``run_dir``, by pid."""
    try:
        waltz("dev", "down", *args, timeout=120)
    finally:
        stop_recorded_processes(str(run_dir))


@pytest.fixture
def serverless_cluster(zookeeper, cluster_root):
    """The connection flags of a cluster of 4 partitions created in the session's ZooKeeper, with no server
    (and no storage node): a client joins it, but no partition is served."""
    conn = ["--zookeeper", zookeeper.connect_string, "--root", cluster_root]
    ok("cluster", "create", "--name", "serverless", "--partitions", "4", *conn)
    return conn
