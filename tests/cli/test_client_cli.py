"""``waltz client high-water-mark`` as a process against a real local cluster (``waltz dev``)."""

import re
import subprocess
import sys
import textwrap
import time

import pytest

from tests.cli.helpers import refused, waltz
from waltz.local.ports import free_port

APPEND = textwrap.dedent("""
    import sys
    from waltz.client import TransactionContext, WaltzClientCallbacks
    from waltz.client.blocking import BlockingWaltzClient

    class Nothing(WaltzClientCallbacks):
        def get_client_high_water_mark(self, partition_id):
            return -1
        def apply_transaction(self, transaction):
            pass
        def uncaught_exception(self, partition_id, transaction_id, exception):
            pass

    class Append(TransactionContext):
        def partition_id(self, num_partitions):
            return 2
        def execute(self, builder):
            builder.set_transaction_data(b"x")
            return True

    client = BlockingWaltzClient(Nothing(), {"zookeeper.connectString": sys.argv[1], "cluster.root": "/waltz_cluster"})
    for _ in range(3):
        assert client.execute(Append()).committed
    client.close()
""")


@pytest.mark.timeout(300)
def test_high_water_marks_follow_the_log(dev_cluster):
    dev, _ = dev_cluster
    conn = ["--zookeeper", dev, "--root", "/waltz_cluster"]
    before = waltz("client", "high-water-mark", *conn)
    assert before.returncode == 0, before.stderr
    assert re.findall(r"^partition (\d): high-water mark (-?\d+)$", before.stdout, re.M) == \
        [("0", "-1"), ("1", "-1"), ("2", "-1"), ("3", "-1")]
    appended = subprocess.run([sys.executable, "-c", APPEND, dev], capture_output=True, text=True, timeout=120)
    assert appended.returncode == 0, appended.stderr
    after = waltz("client", "high-water-mark", *conn, "--partitions", "2-3")
    assert after.returncode == 0, after.stderr
    assert after.stdout.splitlines() == ["partition 2: high-water mark 2", "partition 3: high-water mark -1"]
    assert "partition 9 does not exist" in refused("client", "high-water-mark", *conn, "--partitions", "9")


def test_no_cluster_is_a_one_line_error():
    line = refused("client", "high-water-mark", "--zookeeper", "127.0.0.1:%d" % free_port(), "--root", "/nowhere",
                   "--timeout", "3", "--connect-timeout", "2000")
    assert "waltz: error:" in line


def test_unanswered_partitions_are_named_on_timeout(serverless_cluster):
    line = refused("client", "high-water-mark", *serverless_cluster, "--partitions", "1-2", "--timeout", "1")
    assert line == ("waltz: error: no high-water mark within 1.0 s for partition(s) 1, 2: not served, or their "
                    "server does not answer")


def test_the_connect_timeout_reaches_the_client():
    started = time.monotonic()
    line = refused("client", "high-water-mark", "--zookeeper", "127.0.0.1:%d" % free_port(), "--root", "/nowhere",
                   "--connect-timeout", "300", "--timeout", "20")
    assert "cannot connect to ZooKeeper at 127.0.0.1:" in line and "within 300 ms" in line
    assert time.monotonic() - started < 10
