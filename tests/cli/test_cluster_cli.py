"""``waltz cluster`` run as a subprocess against the real ZooKeeper: output, refusals, exit codes."""

import os
import time

import pytest
from kazoo.client import KazooClient

from tests.cli.helpers import ok, refused
from waltz.local.ports import free_port
from waltz.zk.znodes import ClusterPaths, ReplicaAssignments, ServerDescriptor

A, B, C = "127.0.0.1:55280", "127.0.0.1:55290", "127.0.0.1:55300"


@pytest.fixture
def conn(zookeeper, cluster_root):
    """The connection flags for this test's cluster root."""
    return ["--zookeeper", zookeeper.connect_string, "--root", cluster_root]


@pytest.fixture
def cluster(conn):
    """A created cluster with 6 partitions and storage nodes A, B (group 0) and C (group 1)."""
    ok("cluster", "create", "--name", "demo", "--partitions", "6", *conn)
    for storage, group in ((A, 0), (B, 0), (C, 1)):
        ok("cluster", "add-storage", "--storage", storage, "--admin-port", "55281", "--group", str(group), *conn)
    return conn


def read_znode(zookeeper, path, cls):
    client = KazooClient(hosts=zookeeper.connect_string)
    client.start(5)
    try:
        return cls.decode(client.get(path)[0], path)
    finally:
        client.stop()
        client.close()


def test_create_and_show(conn, cluster_root):
    out = ok("cluster", "create", "-n", "demo", "-p", "4", *conn)
    assert out.startswith("created cluster 'demo' at %s with 4 partitions (cluster key " % cluster_root)
    key = out.rsplit(" ", 1)[1].rstrip(")\n")
    shown = ok("cluster", "show", *conn)
    assert "  name: demo\n  partitions: 4\n  cluster key: %s\n" % key in shown
    assert "storage nodes (0):\npartitions without a replica: 0-3\n" in shown
    assert "  3: generation -1, store session -1\n" in shown


def test_create_refuses_an_existing_cluster(conn, cluster_root):
    ok("cluster", "create", "-n", "demo", "-p", "4", *conn)
    assert refused("cluster", "create", "-n", "other", "-p", "2", *conn) == (
        "waltz: error: cluster root %s already exists" % cluster_root)


def test_auto_assign_and_show(cluster, zookeeper, cluster_root):
    assert ok("cluster", "auto-assign", "--group", "0", *cluster) == (
        "assigned every partition to group 0, round-robin\n")
    shown = ok("cluster", "show", *cluster)
    assert "  %s  group 0  admin port 55281  partitions 0,2,4\n" % A in shown
    assert "  %s  group 0  admin port 55281  partitions 1,3,5\n" % B in shown
    assert "  %s  group 1  admin port 55281  partitions -\n" % C in shown
    assert "partitions without a replica: -\n" in shown
    stored = read_znode(zookeeper, ClusterPaths(cluster_root).assignment, ReplicaAssignments)
    assert stored == ReplicaAssignments({A: (0, 2, 4), B: (1, 3, 5), C: ()})
    assert "already hold partitions" in refused("cluster", "auto-assign", "-g", "0", *cluster)


def test_assign_unassign_and_their_refusals(cluster):
    assert ok("cluster", "assign", "-s", C, "-p", "0-2,5", *cluster) == "assigned partitions 0-2,5 to %s\n" % C
    assert "waltz: error: partition 7 does not exist (the cluster has 6)" == refused(
        "cluster", "assign", "-s", A, "-p", "0-7", *cluster)
    # A malformed list is an argument error (status 2, as argparse's own), found before ZooKeeper is asked.
    assert "argument --partitions/-p: bad partition list 'x': 'x' is not a partition id or a range like 0-3" in refused(
        "cluster", "assign", "-s", A, "-p", "x", *cluster, code=2)
    assert "bad partition list '1,,2': '1,,2' has an empty item" in refused(
        "cluster", "assign", "-s", A, "-p", "1,,2", *cluster, code=2)
    assert ("bad partition list '0-99999999': 99999999 is not a partition id (a cluster has at most 10000 "
            "partitions)") in refused("cluster", "assign", "-s", A, "-p", "0-99999999", *cluster, code=2)
    assert "unknown storage node 10.9.9.9:1" in refused("cluster", "assign", "-s", "10.9.9.9:1", "-p", "0", *cluster)
    # C is group 1's only replica of partition 5.
    assert refused("cluster", "unassign", "-s", C, "-p", "5", *cluster) == (
        "waltz: error: unassigning would leave group 1 without a replica of partitions 5; "
        "assign them to another storage node of the group first")


def test_remove_storage_refusal_then_success(cluster):
    ok("cluster", "assign", "-s", A, "-p", "3", *cluster)
    assert refused("cluster", "remove-storage", "-s", A, *cluster) == (
        "waltz: error: storage node %s still holds partitions 3; unassign them first" % A)
    assert ok("cluster", "remove-storage", "-s", B, *cluster) == "removed storage node %s\n" % B
    assert "storage nodes (2):" in ok("cluster", "show", *cluster)
    assert "already exists" in refused("cluster", "add-storage", "-s", A, "-a", "1", "-g", "0", *cluster)


def test_delete_is_refused_while_servers_are_registered(cluster, zookeeper, cluster_root):
    server = KazooClient(hosts=zookeeper.connect_string)
    server.start(5)
    try:
        server.create(ClusterPaths(cluster_root).server_descriptor_prefix,
                      ServerDescriptor(1, "127.0.0.1", 55180).encode(), ephemeral=True, sequence=True)
        assert "1 Waltz server(s) are registered" in refused("cluster", "delete", *cluster)
        assert "  s_0000000000  server 1 at 127.0.0.1:55180  preferred partitions -\n" in ok(
            "cluster", "show", *cluster)
        assert ok("cluster", "delete", "--force", *cluster) == "deleted cluster %s\n" % cluster_root
        assert server.exists(cluster_root) is None
    finally:
        server.stop()
        server.close()
    assert refused("cluster", "show", *cluster) == (
        "waltz: error: no Waltz cluster at %s: znode %s does not exist" % (cluster_root, cluster_root))


def test_edits_give_up_while_another_admin_holds_the_lock(cluster, zookeeper, cluster_root):
    admin = KazooClient(hosts=zookeeper.connect_string)
    admin.start(5)
    try:
        admin.create(ClusterPaths(cluster_root).admin_lock, ephemeral=True)
        assert refused("cluster", "assign", "-s", A, "-p", "0", "--lock-timeout", "0.3", *cluster) == (
            "waltz: error: lock %s/store/adminLock is still held by another session after 0.3 s" % cluster_root)
    finally:
        admin.stop()
        admin.close()
    ok("cluster", "assign", "-s", A, "-p", "0", "--lock-timeout", "5", *cluster)


def test_delete_without_servers(cluster, cluster_root):
    assert ok("cluster", "delete", *cluster) == "deleted cluster %s\n" % cluster_root
    assert "no Waltz cluster" in refused("cluster", "delete", *cluster)


def test_config_file_with_flags_overriding_it(zookeeper, cluster_root, tmp_path):
    config = tmp_path / "cli.yaml"
    config.write_text("zookeeper:\n  connectString: %s\ncluster.root: /not/this/one\n" % zookeeper.connect_string)
    ok("cluster", "create", "-n", "demo", "-p", "2", "-c", str(config), "--root", cluster_root)
    config.write_text("zookeeper.connectString: %s\ncluster.root: %s\n" % (zookeeper.connect_string, cluster_root))
    assert "  name: demo\n" in ok("cluster", "show", "-c", str(config))


def test_unreachable_zookeeper_fails_fast_in_one_line():
    started = time.monotonic()
    line = refused("cluster", "show", "--zookeeper", "127.0.0.1:%d" % free_port(), "--root", "/x",
                   "--connect-timeout", "300")
    assert "cannot connect to ZooKeeper at 127.0.0.1:" in line and "within 300 ms" in line
    assert time.monotonic() - started < 5


def test_a_config_file_with_a_misspelled_key_is_refused_and_daemon_configs_are_accepted(tmp_path):
    config = tmp_path / "cli.yaml"
    config.write_text("zookeeper.connectString: 127.0.0.1:1\ncluster.rooot: /x\n")
    assert "config key 'cluster.rooot' in %s is not a known key" % config in refused("cluster", "show", "-c", str(config))
    etc = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "etc")
    for shipped in ("server.yaml", "storage.yaml"):     # their own keys pass; only ZooKeeper is missing
        assert "cannot connect to ZooKeeper" in refused("cluster", "show", "-c", os.path.join(etc, shipped),
                                                        "--connect-timeout", "200",
                                                        "--zookeeper", "127.0.0.1:%d" % free_port())


@pytest.mark.parametrize("args, message, code", [
    (["--root", "/x"], "no zookeeper.connectString given: use --zookeeper", 1),
    (["--zookeeper", "127.0.0.1:1"], "no cluster.root given: use --root", 1),
    (["--zookeeper", "127.0.0.1:1", "--root", "x"], "argument --root: expected an absolute znode path", 2),
    (["--zookeeper", "nohost", "--root", "/x"], "argument --zookeeper: expected a ZooKeeper connect string", 2),
    (["-c", "/nonexistent/cli.yaml"], "cannot read config file /nonexistent/cli.yaml", 1),
])
def test_bad_connection_options(args, message, code):
    assert message in refused("cluster", "show", *args, code=code)


def test_a_bad_connection_value_in_a_config_file_names_its_key(tmp_path):
    config = tmp_path / "cli.yaml"
    config.write_text("zookeeper:\n  connectString: nohost\ncluster:\n  root: /x\n")
    assert "config key 'zookeeper.connectString'" in refused("cluster", "show", "-c", str(config))


@pytest.mark.parametrize("args", [
    ["cluster", "create", "-n", "x", "-p", "0", "--zookeeper", "127.0.0.1:1", "--root", "/x"],
    ["cluster", "add-storage", "-s", A, "-a", "1", "-g", "-1", "--zookeeper", "127.0.0.1:1", "--root", "/x"],
    ["cluster", "assign", "-s", A, "--zookeeper", "127.0.0.1:1", "--root", "/x"],
    ["cluster"],
])
def test_usage_errors_exit_2(args):
    refused(*args, code=2)


@pytest.mark.parametrize("data", [b"", b"another application's data"])
def test_delete_refuses_a_tree_that_is_not_a_waltz_cluster_even_with_force(zookeeper, cluster_root, data):
    other = KazooClient(hosts=zookeeper.connect_string)
    other.start(5)
    try:
        other.create(cluster_root, data, makepath=True)
        other.create(cluster_root + "/config/settings", b"x", makepath=True)
        conn = ["--zookeeper", zookeeper.connect_string, "--root", cluster_root]
        for force in (["--force"], []):
            line = refused("cluster", "delete", *force, *conn)
            assert line.startswith("waltz: error: refusing to delete %s: it is not a Waltz cluster root (znode %s "
                                   % (cluster_root, cluster_root)), line
        assert other.exists(cluster_root + "/config/settings") is not None
    finally:
        other.delete(cluster_root, recursive=True)
        other.stop()
        other.close()
