"""``waltz storage`` run as a subprocess against a real cluster: ZooKeeper, ``waltz cluster
create/add-storage/assign`` and ``twistd waltz-storage`` daemons on 127.0.0.1.

What each command did is checked on the node itself (its admin port, its
files), not only through the command's own output.
"""

import os
import socket

import attr
import pytest
import pytest_twisted
from twisted.internet import threads

from tests.cli.helpers import ok, refused
from tests.integration.conftest import StorageClients, daemons, start_storage  # noqa: F401 (fixtures)
from tests.storage.test_storage_node import records
from waltz.local.ports import free_port
from waltz.protocols import admin_messages as am
from waltz.protocols import storage_messages as sm
from waltz.zk.metadata import ClusterMetadata
from waltz.zk.znodes import UNRESOLVED, PartitionMetadata, ReplicaId, ReplicaState

pytestmark = pytest.mark.integration

PARTITIONS = 4


@attr.s(auto_attribs=True)
class Node:
    """A storage node of the test cluster: its daemon (maybe not started) and connect string."""

    daemon: object

    @property
    def storage(self):
        return "127.0.0.1:%d" % self.daemon.config["storage.port"]

    def partition_dir(self, partition_id):
        return os.path.join(self.daemon.config["storage.directory"], str(partition_id))


@pytest.fixture
def conn(zookeeper, cluster_root):
    """The connection flags for this test's cluster root."""
    return ["--zookeeper", zookeeper.connect_string, "--root", cluster_root]


@pytest.fixture
def cluster(conn):
    """A cluster with PARTITIONS partitions created by ``waltz cluster create``."""
    ok("cluster", "create", "--name", "cli", "--partitions", str(PARTITIONS), *conn)
    return conn


@pytest.fixture
def add_node(cluster, start_storage):
    """``add_node(name, partitions="0-3", start=True)``: a storage node added to group 0 with
    ``waltz cluster add-storage``, given ``partitions`` in ZooKeeper, and started."""
    def add(name, partitions=None, start=True, admin_port=None):
        node = Node(start_storage(name, start=False))
        admin_port = admin_port or node.daemon.config["storage.admin.port"]
        ok("cluster", "add-storage", "--storage", node.storage, "--admin-port", str(admin_port), "--group", "0",
           *cluster)
        if partitions:
            ok("cluster", "assign", "--storage", node.storage, "--partitions", partitions, *cluster)
        if start:
            node.daemon.start()
        return node
    return add


@pytest_twisted.async_yield_fixture
async def clients(zk_client, cluster_root, cluster):
    """Connections to the nodes' ports (a :class:`StorageClients` for the CLI-made cluster)."""
    params = await ClusterMetadata(zk_client, cluster_root).store_params()
    storage_clients = StorageClients(params)
    yield storage_clients
    storage_clients.close()


async def node_status(clients, node):
    """``((partition id, online), ...)`` as the node's admin port reports it."""
    admin = await clients.admin(node.daemon)
    return (await admin.request(am.AssignedPartitionStatusRequest(0))).partition_status


def cli(*args):
    """Run ``ok`` off the reactor thread (the test's reactor keeps serving its connections)."""
    return threads.deferToThread(ok, *args)


def cli_refused(*args):
    return threads.deferToThread(refused, *args)


# --- list and sync-partitions ---------------------------------------------------------------------------


def test_list_reports_partitions_status_and_unreachable_nodes(add_node, cluster):
    a = add_node("a", partitions="0-3")
    b = add_node("b", partitions="1", start=False)
    out = ok("storage", "list", *cluster)
    assert "storage nodes of %s (cluster key " % cluster[-1] in out and "4 partitions):" in out
    assert ("  %s (admin port %d): reachable; assigned partitions: none; ZooKeeper assigns 0-3 "
            "(out of sync: run sync-partitions)\n" % (a.storage, a.daemon.config["storage.admin.port"])) in out
    unreachable = [line for line in out.splitlines() if line.startswith("  %s " % b.storage)]
    assert len(unreachable) == 1 and unreachable[0].startswith(
        "  %s (admin port %d): UNREACHABLE: admin port 127.0.0.1:%d is unreachable: " % (
            b.storage, b.daemon.config["storage.admin.port"], b.daemon.config["storage.admin.port"]))
    assert unreachable[0].endswith("; ZooKeeper assigns 1")

    assert ok("storage", "sync-partitions", "--storage", a.storage, *cluster) == "%s: assigned 0-3\n" % a.storage
    ok("storage", "availability", "--storage", a.storage, "--partitions", "2", "--offline", *cluster)
    out = ok("storage", "list", *cluster)
    assert ("reachable; assigned partitions: 0 online, 1 online, 2 offline, 3 online; ZooKeeper assigns 0-3\n"
            in out)


@pytest_twisted.ensureDeferred
async def test_sync_partitions_pushes_the_zookeeper_assignment(add_node, cluster, clients, cluster_root, zk_client):
    a = add_node("a", partitions="0-3")
    b = add_node("b", partitions="2-3")
    admin_b = await clients.admin(b.daemon)
    await admin_b.request(am.PartitionAssignmentRequest(0, (0,), True, False))  # not in ZooKeeper
    out = await cli("storage", "sync-partitions", *cluster)
    assert sorted(out.splitlines()) == sorted(["%s: assigned 0-3" % a.storage,
                                               "%s: assigned 2-3; unassigned 0 (files kept)" % b.storage])
    assert await node_status(clients, a) == ((0, True), (1, True), (2, True), (3, True))
    assert await node_status(clients, b) == ((2, True), (3, True))
    assert os.path.isdir(b.partition_dir(0))

    await cli("cluster", "unassign", "--storage", b.storage, "--partitions", "3", *cluster)
    assert await cli("storage", "sync-partitions", "--storage", b.storage, *cluster) == (
        "%s: unassigned 3 (files kept)\n" % b.storage)
    assert await node_status(clients, b) == ((2, True),)
    assert os.path.isdir(b.partition_dir(3))
    assert await cli("storage", "sync-partitions", *cluster) == "".join(sorted(
        ["%s: in sync (partitions 0-3)\n" % a.storage, "%s: in sync (partitions 2)\n" % b.storage]))

    # A partition whose last store session still counts the node's replica stays on the node: the next
    # session's recovery asks it for its vote (unassigned there, it could not answer, and the vote could wait
    # for ever). Once a session went on without it, the next sync unassigns it.
    await cli("cluster", "unassign", "--storage", b.storage, "--partitions", "2", *cluster)
    metadata = ClusterMetadata(zk_client, cluster_root)
    member = ReplicaState(ReplicaId(2, b.storage), 3, UNRESOLVED)
    await metadata.update_partition_metadata(2, lambda m: PartitionMetadata(1, 3, (member,)))
    assert await cli("storage", "sync-partitions", "--storage", b.storage, *cluster) == (
        "%s: kept 2: their last store session still counts this replica, and the next one needs its vote; run "
        "sync-partitions again once a server has opened a new session of each\n" % b.storage)
    assert await node_status(clients, b) == ((2, True),)
    await metadata.update_partition_metadata(2, lambda m: PartitionMetadata(1, 4, ()))
    assert await cli("storage", "sync-partitions", "--storage", b.storage, *cluster) == (
        "%s: unassigned 2 (files kept)\n" % b.storage)


def test_sync_partitions_reports_an_unreachable_node_and_syncs_the_others(add_node, cluster):
    a = add_node("a", partitions="0-3")
    b = add_node("b", partitions="0", start=False)
    result_line = refused("storage", "sync-partitions", "--timeout", "5", *cluster)
    assert result_line == "waltz: error: could not sync 1 of 2 storage nodes: %s" % b.storage
    out = ok("storage", "list", *cluster)
    assert "assigned partitions: 0 online, 1 online, 2 online, 3 online; ZooKeeper assigns 0-3\n" in out


# --- add-partition, remove-partition, availability -------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_add_and_remove_partitions(add_node, cluster, clients):
    a = add_node("a")
    assert await cli("storage", "add-partition", "--storage", a.storage, "--partitions", "0-1,3", *cluster) == (
        "assigned partitions 0-1,3 on storage node %s\n" % a.storage)
    assert await node_status(clients, a) == ((0, True), (1, True), (3, True))

    assert await cli("storage", "remove-partition", "-s", a.storage, "-p", "1", *cluster) == (
        "unassigned partitions 1 on storage node %s\n" % a.storage)
    assert os.path.isdir(a.partition_dir(1))
    assert await cli("storage", "remove-partition", "-s", a.storage, "-p", "3", "--delete-files", *cluster) == (
        "unassigned partitions 3 on storage node %s and deleted their files\n" % a.storage)
    assert not os.path.exists(a.partition_dir(3))
    assert await node_status(clients, a) == ((0, True),)


def test_remove_partition_refuses_to_delete_files_zookeeper_still_assigns_to_the_node(cluster, cluster_root):
    # Nothing runs on these ports: the refusal comes before the node is asked, and --force goes on to ask it.
    node = "127.0.0.1:%d" % free_port()
    ok("cluster", "add-storage", "--storage", node, "--admin-port", str(free_port()), "--group", "0", *cluster)
    ok("cluster", "assign", "--storage", node, "--partitions", "1-2", *cluster)
    assert refused("storage", "remove-partition", "-s", node, "-p", "0-2", "--delete-files", *cluster) == (
        "waltz: error: refusing to delete the files of partitions 1-2 on storage node %s: %s/store/assignment still "
        "assigns them to it; run 'waltz cluster unassign' first (or use --force)" % (node, cluster_root))
    for args in (["-p", "0-2", "--delete-files", "--force"], ["-p", "1"], ["-p", "0", "--delete-files"]):
        assert " is unreachable: " in refused("storage", "remove-partition", "-s", node, *args, "--timeout", "2",
                                              *cluster)


@pytest_twisted.ensureDeferred
async def test_remove_partition_refuses_to_delete_files_a_last_session_still_counts_on(cluster, cluster_root,
                                                                                     zk_client):
    # Unassigned, but partition 1's last session recorded the node's replica as a member (unresolved): it may
    # hold acknowledged transactions another replica lacks. Partition 2 resolved it (a later session went on
    # without it), and partition 0 never had a session.
    node = "127.0.0.1:%d" % free_port()
    await cli("cluster", "add-storage", "--storage", node, "--admin-port", str(free_port()), "--group", "0", *cluster)
    metadata = ClusterMetadata(zk_client, cluster_root)
    for pid, closing_mark in ((1, UNRESOLVED), (2, 41)):
        state = ReplicaState(ReplicaId(pid, node), 3, closing_mark)
        await metadata.update_partition_metadata(pid, lambda m, s=state: PartitionMetadata(1, 3, (s,)))
    line = await cli_refused("storage", "remove-partition", "-s", node, "-p", "0-2", "--delete-files", *cluster)
    assert line == (
        "waltz: error: refusing to delete the files of partitions 1 on storage node %s: their last store session "
        "(%s/store/partition/<id>) still counts its replica as a member, and recovery may need its vote and data; "
        "wait until a server has opened a new session of each without it (or use --force)" % (node, cluster_root))
    for args in (["-p", "0-2", "--delete-files", "--force"], ["-p", "0,2", "--delete-files"]):
        assert " is unreachable: " in await cli_refused("storage", "remove-partition", "-s", node, *args,
                                                        "--timeout", "2", *cluster)


@pytest_twisted.ensureDeferred
async def test_availability_and_max_transaction_id(add_node, cluster, clients):
    a = add_node("a", partitions="0-3")
    await cli("storage", "sync-partitions", *cluster)
    s = await clients.storage(a.daemon)
    await s.request(sm.SetLowWaterMarkRequest(5, 0, 1, -1, False))  # a server's store session 5 starts
    await s.request(sm.AppendRequest(5, 0, 1, records(0, 10, partition=1), False))
    assert await cli("storage", "max-transaction-id", "--storage", a.storage, "--partition", "1", *cluster) == "9\n"
    assert await cli("storage", "max-transaction-id", "--storage", a.storage, "--partition", "0", *cluster) == "-1\n"
    # asking did not fence out the server's session
    assert isinstance(await s.request(sm.AppendRequest(5, 0, 1, records(10, 1, partition=1), False)),
                      sm.SuccessResponse)

    assert await cli("storage", "availability", "-s", a.storage, "-p", "1-2", "--offline", *cluster) == (
        "partitions 1-2 on storage node %s are now offline\n" % a.storage)
    assert await node_status(clients, a) == ((0, True), (1, False), (2, False), (3, True))
    line = await cli_refused("storage", "max-transaction-id", "-s", a.storage, "-p", "1", *cluster)
    assert line.endswith("failed the request: waltz.storage.partition.PartitionRefused: partition 1 is not available")
    assert await cli("storage", "max-transaction-id", "-s", a.storage, "-p", "1", "--offline", *cluster) == "10\n"

    await cli("storage", "availability", "-s", a.storage, "-p", "1-2", "--online", *cluster)
    assert await node_status(clients, a) == ((0, True), (1, True), (2, True), (3, True))
    line = await cli_refused("storage", "max-transaction-id", "-s", a.storage, "-p", "1", "--offline", *cluster)
    assert line.endswith("partition 1 is available: offline requests are refused")


# --- errors ---------------------------------------------------------------------------------------------


def test_unknown_storage_node_and_bad_arguments_are_one_line_errors(add_node, cluster, cluster_root):
    a = add_node("a", partitions="0-3")
    assert refused("storage", "add-partition", "-s", "127.0.0.1:1", "-p", "0", *cluster) == (
        "waltz: error: storage node 127.0.0.1:1 is not in %s/store/connection (known: %s); add it with "
        "'waltz cluster add-storage'" % (cluster_root, a.storage))
    assert "partition 4 does not exist (the cluster has 4)" in refused(
        "storage", "add-partition", "-s", a.storage, "-p", "2-4", *cluster)
    # One partition id is called that, not a "partition list" (it was), and a malformed one is status 2.
    assert refused("storage", "max-transaction-id", "-s", a.storage, "-p", "9", *cluster) == (
        "waltz: error: partition 9 does not exist (the cluster has 4)")
    assert "argument --partition/-p: expected a partition id (0 or more), got '0-1'" in refused(
        "storage", "max-transaction-id", "-s", a.storage, "-p", "0-1", *cluster, code=2)
    assert "bad partition list '3-1': '3-1' is not a partition id or an increasing range" in refused(
        "storage", "add-partition", "-s", a.storage, "-p", "3-1", *cluster, code=2)
    assert "expected HOST:PORT" in refused("storage", "max-transaction-id", "-s", "nowhere", "-p", "0", *cluster)
    assert "one of the arguments --online --offline" in refused(
        "storage", "availability", "-s", a.storage, "-p", "0", *cluster, code=2)
    assert "no Waltz cluster at /nowhere" in refused("storage", "list", "--zookeeper", cluster[1],
                                                     "--root", "/nowhere")


def test_a_failure_response_from_the_node_is_a_one_line_error(add_node, cluster):
    a = add_node("a", partitions="0-3")
    line = refused("storage", "availability", "-s", a.storage, "-p", "2", "--offline", *cluster)
    assert line == ("waltz: error: storage node %s (admin port 127.0.0.1:%d) failed the request: "
                    "waltz.storage.partition.PartitionRefused: partition 2 is not assigned to this storage node"
                    % (a.storage, a.daemon.config["storage.admin.port"]))


def test_unreachable_and_silent_nodes_time_out_with_a_one_line_error(add_node, cluster):
    down = add_node("down", partitions="0-3", start=False)
    line = refused("storage", "add-partition", "-s", down.storage, "-p", "0", "--timeout", "5", *cluster)
    assert line.startswith("waltz: error: storage node %s (admin port 127.0.0.1:%d) is unreachable: "
                           % (down.storage, down.daemon.config["storage.admin.port"]))
    with socket.socket() as silent:  # accepts connections (the kernel's backlog) but never speaks
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        mute = add_node("mute", start=False, admin_port=port)
        assert refused("storage", "add-partition", "-s", mute.storage, "-p", "0", "--timeout", "1", *cluster) == (
            "waltz: error: storage node %s (admin port 127.0.0.1:%d) did not answer within 1 s"
            % (mute.storage, port))
