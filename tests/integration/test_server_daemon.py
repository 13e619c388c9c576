"""The ``twistd waltz-server`` daemon as a real process, with real storage daemons (LocalCluster):
registration, assignment, health and metrics, two servers splitting the partitions, kill -9 and
SIGTERM of one of them, ZooKeeper going away, and bad configs.

ZooKeeper is the session's real server (tests/conftest.py) except in the test that stops it;
every daemon is stopped by its pid when the test ends.
"""

import os
import signal
import socket
import subprocess

import pytest
import pytest_twisted
from twisted.internet import endpoints, protocol, reactor, task, threads

from waltz.local.cluster import LocalCluster
from waltz.local.daemons import local_server
from waltz.local.ports import port_in_use
from waltz.protocols import client_messages as cm
from waltz.protocols.base import IDLE_TIMEOUT, KEEPALIVE_INTERVAL
from tests.protocols.recording import RecordingClient
from waltz.protocols.values import ReqId

pytestmark = pytest.mark.integration

PARTITIONS = 4
#: The shortest session ZooKeeper grants at tickTime 2000: a killed server's znode goes in ~4-6 s.
SESSION_TIMEOUT_MS = 4000


# --- fixtures and helpers ----------------------------------------------------------------------------


@pytest_twisted.async_fixture
async def cluster(local_clusters):
    """A cluster of PARTITIONS partitions on two storage daemons (every partition on both)."""
    return await local_clusters(PARTITIONS, 2)


@pytest.fixture
def start_server(tmp_path, daemons):
    """``await start_server(cluster, name="server", start=True, **overrides)`` -> a server
    :class:`LocalDaemon`, run in ``tmp_path/name``, stopped by pid after the test."""
    async def make(local, name="server", start=True, **overrides):
        overrides.setdefault("zookeeper.sessionTimeout", SESSION_TIMEOUT_MS)
        overrides.setdefault("storage.maxRetryInterval", 1000)
        daemon = local_server(str(tmp_path / name), local.connect_string, local.root, **overrides)
        daemons.append(daemon)
        if start:
            await threads.deferToThread(daemon.start)
        return daemon
    return make


async def eventually(check, what, timeout=30.0):
    """Call the async ``check()`` until it returns something true, and return that; fail naming
    ``what`` (and the last value seen) after ``timeout`` seconds."""
    deadline = reactor.seconds() + timeout
    last = None
    while True:
        last = await check()
        if last and not isinstance(last, Unmet):
            return last
        if reactor.seconds() > deadline:
            raise AssertionError("timed out after %.0f s waiting for %s; last seen: %r" % (timeout, what, last))
        await task.deferLater(reactor, 0.1, lambda: None)


class Unmet:
    """A falsy result that still says what was seen (for the timeout message)."""

    def __init__(self, seen):
        self.seen = seen

    def __bool__(self):
        return False

    def __repr__(self):
        return repr(self.seen)


def server_id_of(local, daemon):
    """The id of ``daemon`` in ZooKeeper, found by its port (None until it registered)."""
    async def find():
        descriptors = await local.metadata.server_descriptors()
        ids = [d.server_id for _, d in descriptors if d.port == daemon.config["server.port"]]
        return ids[0] if ids else None
    return find


async def current_assignment(local, expected_servers):
    """The stored assignment once it is current (cversion) and names exactly ``expected_servers``."""
    async def check():
        versioned = await local.metadata.partition_assignment()
        value = versioned.value
        servers = {server_id for server_id, _ in value.servers}
        complete = sorted(i.partition_id for _, infos in value.servers for i in infos) == list(range(PARTITIONS))
        ok = value.cversion == versioned.stat.cversion and servers == set(expected_servers) and complete
        return value if ok else Unmet(value)
    return await eventually(check, "an assignment to servers %s" % sorted(expected_servers))


def generations(assignment, server_id):
    return {info.partition_id: info.generation for info in assignment.partitions_for(server_id)}


async def http(daemon, path):
    return await threads.deferToThread(daemon.http_get, path)


def metric(text, name):
    """The value of an unlabelled metric in Prometheus text (None if absent)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


async def healthy_with(daemon, partitions):
    """Wait until ``/health`` says healthy and ``/metrics`` counts ``partitions`` ready partitions."""
    async def check():
        status, body = await http(daemon, "/health")
        _, metrics = await http(daemon, "/metrics")
        ready = metric(metrics, "waltz_server_ready_partitions")
        return (status, body) if status == 200 and ready == partitions else Unmet((status, body, ready))
    return await eventually(check, "%s to be healthy with %d ready partitions" % (daemon.run_dir, partitions))


# --- one server --------------------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_a_server_registers_gets_every_partition_and_turns_healthy(cluster, start_server):
    daemon = await start_server(cluster)
    server_id = await eventually(server_id_of(cluster, daemon), "the server to register")
    descriptors = dict((d.server_id, d) for _, d in await cluster.metadata.server_descriptors())
    assert (descriptors[server_id].host, descriptors[server_id].port) == ("127.0.0.1", daemon.config["server.port"])
    assignment = await current_assignment(cluster, {server_id})
    assert generations(assignment, server_id) == {pid: 1 for pid in range(PARTITIONS)}

    status, body = await healthy_with(daemon, PARTITIONS)
    assert body == "healthy\n"
    assert await http(daemon, "/ping") == (200, "pong\n")
    status, metrics = await http(daemon, "/metrics")
    assert status == 200
    assert metric(metrics, "waltz_server_id") == server_id
    assert metric(metrics, "waltz_server_partitions") == PARTITIONS
    assert metric(metrics, "waltz_server_zookeeper_connected") == 1
    assert metric(metrics, "waltz_server_coordinator") == 1
    assert 'waltz_server_partition_generation{partition="3"} 1' in metrics
    assert "# TYPE waltz_server_recovery_transitions_total counter" in metrics
    assert port_in_use("127.0.0.1", daemon.config["server.port"])


class WireClient(RecordingClient):
    """A bare ``L`` connection that records what it receives."""

    async def expect(self, kind, timeout=15.0):
        """The first received message of class ``kind`` (removed from :attr:`received`)."""
        async def find():
            found = [m for m in self.received if isinstance(m, kind)]
            if found:
                self.received.remove(found[0])
            return found[0] if found else Unmet([type(m).__name__ for m in self.received])
        return await eventually(find, "a %s" % kind.__name__, timeout)


async def connect(daemon):
    endpoint = endpoints.TCP4ClientEndpoint(reactor, "127.0.0.1", daemon.config["server.port"], timeout=5)
    return await endpoint.connect(protocol.Factory.forProtocol(WireClient))


@pytest_twisted.ensureDeferred
async def test_smoke_append_and_server_requests_over_the_client_port(cluster, start_server):
    daemon = await start_server(cluster)
    server_id = await eventually(server_id_of(cluster, daemon), "the server to register")
    generation = generations(await current_assignment(cluster, {server_id}), server_id)[0]
    await healthy_with(daemon, PARTITIONS)
    client = await connect(daemon)
    try:
        def rid(seq, partition=0):
            return ReqId(77, generation, partition, seq)
        client.sendMessage(cm.MountRequest(rid(0), -1, 1))
        assert await client.expect(cm.MountResponse) == cm.MountResponse(rid(0), cm.MountState.READY)
        client.sendMessage(cm.FeedRequest(rid(0), -1))
        client.sendMessage(cm.AppendRequest.create(rid(1), -1, 42, b"smoke"))
        assert await client.expect(cm.FeedData) == cm.FeedData(rid(1), 0, 42)

        client.sendMessage(cm.MountRequest(rid(2, partition=PARTITIONS), -1, 1))
        assert (await client.expect(cm.MountResponse)).state is cm.MountState.NOT_READY

        client.sendMessage(cm.ServerPartitionsAssignmentRequest(rid(3)))
        assert (await client.expect(cm.ServerPartitionsAssignmentResponse)).partition_ids == tuple(range(PARTITIONS))
        client.sendMessage(cm.PartitionsHealthRequest(rid(4)))
        health = (await client.expect(cm.PartitionsHealthResponse)).partition_health
        assert health == tuple((pid, True) for pid in range(PARTITIONS))
        client.sendMessage(cm.CheckStorageConnectivityRequest(rid(5)))
        connectivity = (await client.expect(cm.CheckStorageConnectivityResponse)).connectivity
        assert sorted(connectivity) == sorted((cluster.storage_name(s), True) for s in cluster.storages)
        client.sendMessage(cm.AddPreferredPartitionRequest(rid(6), (PARTITIONS,)))
        assert (await client.expect(cm.AddPreferredPartitionResponse)).result is False
        client.sendMessage(cm.AddPreferredPartitionRequest(rid(7), (1,)))
        assert (await client.expect(cm.AddPreferredPartitionResponse)).result is True
        descriptors = await cluster.metadata.server_descriptors()
        assert [d.preferred_partitions for _, d in descriptors] == [(1,)]
    finally:
        client.transport.loseConnection()


@pytest_twisted.ensureDeferred
async def test_a_storage_that_stops_answering_is_disconnected_then_rejoins(cluster, start_server):
    """A stopped storage process (SIGSTOP: its host hung, or its network cut without a reset) keeps its
    TCP connections open and says nothing. The server's liveness check closes its connection to it
    within the idle timeout (TCP alone would not notice for minutes, or ever on an idle connection),
    and the connection comes back once the storage runs again."""
    daemon = await start_server(cluster)
    server_id = await eventually(server_id_of(cluster, daemon), "the server to register")
    generation = generations(await current_assignment(cluster, {server_id}), server_id)[0]
    await healthy_with(daemon, PARTITIONS)
    client = await connect(daemon)
    stopped = cluster.storages[1]
    name = cluster.storage_name(stopped)
    sequence = iter(range(1, 10 ** 6))

    def connected_is(expected):
        async def check():
            client.sendMessage(cm.CheckStorageConnectivityRequest(ReqId(78, generation, 0, next(sequence))))
            seen = dict((await client.expect(cm.CheckStorageConnectivityResponse)).connectivity)
            return True if seen.get(name) is expected else Unmet(seen)
        return check

    try:
        assert await connected_is(True)()
        os.kill(stopped.pid, signal.SIGSTOP)
        stopped_at = reactor.seconds()
        await eventually(connected_is(False), "the server to drop the stopped storage",
                         timeout=IDLE_TIMEOUT + 2 * KEEPALIVE_INTERVAL + 20)
        assert reactor.seconds() - stopped_at >= IDLE_TIMEOUT - KEEPALIVE_INTERVAL
        os.kill(stopped.pid, signal.SIGCONT)
        await eventually(connected_is(True), "the server to reconnect to the storage", timeout=60)
    finally:
        os.kill(stopped.pid, signal.SIGCONT)
        client.transport.loseConnection()


# --- two servers -------------------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_two_servers_split_and_kill_9_moves_partitions_with_bumped_generations(cluster, start_server):
    first = await start_server(cluster, "first")
    first_id = await eventually(server_id_of(cluster, first), "the first server to register")
    await healthy_with(first, PARTITIONS)
    second = await start_server(cluster, "second")
    second_id = await eventually(server_id_of(cluster, second), "the second server to register")
    split = await current_assignment(cluster, {first_id, second_id})
    kept, moved = generations(split, first_id), generations(split, second_id)
    assert len(kept) == len(moved) == PARTITIONS // 2
    assert set(kept.values()) == {1} and set(moved.values()) == {2}, "only moved partitions bump"
    await healthy_with(first, PARTITIONS // 2)
    await healthy_with(second, PARTITIONS // 2)

    first.kill()  # the coordinator dies without unregistering: its session times out
    alone = await current_assignment(cluster, {second_id})
    assert generations(alone, second_id) == {**moved, **{pid: g + 1 for pid, g in kept.items()}}
    await healthy_with(second, PARTITIONS)
    _, metrics = await http(second, "/metrics")
    assert metric(metrics, "waltz_server_coordinator") == 1
    for pid, generation in generations(alone, second_id).items():
        assert 'waltz_server_partition_generation{partition="%d"} %d' % (pid, generation) in metrics


@pytest_twisted.ensureDeferred
async def test_sigterm_unregisters_and_the_other_server_takes_over(cluster, start_server):
    first = await start_server(cluster, "first", **{"zookeeper.sessionTimeout": 60000})
    first_id = await eventually(server_id_of(cluster, first), "the first server to register")
    second = await start_server(cluster, "second")
    second_id = await eventually(server_id_of(cluster, second), "the second server to register")
    await current_assignment(cluster, {first_id, second_id})
    # With a 60 s session, only the clean unregister can move the partitions within the deadline.
    assert await threads.deferToThread(first.stop) == -signal.SIGTERM
    started = reactor.seconds()
    alone = await current_assignment(cluster, {second_id})
    assert reactor.seconds() - started < 30
    assert sorted(generations(alone, second_id)) == list(range(PARTITIONS))
    assert not port_in_use("127.0.0.1", first.config["server.port"])
    await healthy_with(second, PARTITIONS)


# --- ZooKeeper going away ------------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_health_reports_zookeeper_lost_and_recovers(tmp_path, cluster_root, start_server):
    local = LocalCluster(str(tmp_path / "cluster"), num_partitions=1, num_storages=1, root=cluster_root)
    try:
        await local.start(reactor)
        daemon = await start_server(local, **{"zookeeper.sessionTimeout": 20000})
        await healthy_with(daemon, 1)
        await local.zk_client.close()
        local.zk_client = None
        await threads.deferToThread(local.zookeeper.stop)

        async def unhealthy():
            status, body = await http(daemon, "/health")
            return body if status == 503 and "ZooKeeper session suspended" in body else Unmet((status, body))
        await eventually(unhealthy, "/health to report the lost ZooKeeper")

        await threads.deferToThread(local.zookeeper.start)
        await healthy_with(daemon, 1)
    finally:
        await local.stop()


# --- bad configs -----------------------------------------------------------------------------------------

BAD_CONFIGS = {
    "unknown key": (lambda c: c.update({"server.bogus": 1}), "server.bogus"),
    "bad port": (lambda c: c.update({"server.port": 70000}), "server.port"),
    "same ports": (lambda c: c.update({"server.http.port": c["server.port"]}), "server.http.port"),
    "missing root": (lambda c: c.pop("cluster.root"), "cluster.root"),
    "bad connect string": (lambda c: c.update({"zookeeper.connectString": "nohost"}), "zookeeper.connectString"),
    "fetch size": (lambda c: c.update({"server.minFetchSize": 2000}), "server.minFetchSize"),
    "preferred": (lambda c: c.update({"server.preferredPartitions": ["x"]}), "server.preferredPartitions"),
    "retry": (lambda c: c.update({"storage.initialRetryInterval": 0}), "storage.initialRetryInterval"),
    "fractional partition": (lambda c: c.update({"server.preferredPartitions": [1.9]}), "server.preferredPartitions"),
    "zero fetch size": (lambda c: c.update({"server.minFetchSize": 0}), "server.minFetchSize"),
    "lock table": (lambda c: c.update({"server.optimisticLockTableSize": 2 ** 31}), "server.optimisticLockTableSize"),
    "frame size": (lambda c: c.update({"server.maxFrameSize": 1}), "server.maxFrameSize"),
    "bind address": (lambda c: c.update({"server.bindAddress": "not an address"}), "server.bindAddress"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config_exits_non_zero_naming_the_key_and_binds_nothing(tmp_path, zookeeper, cluster_root, case):
    change, key = BAD_CONFIGS[case]
    daemon = local_server(str(tmp_path / "server"), zookeeper.connect_string, cluster_root)
    ports = (daemon.config["server.port"], daemon.config["server.http.port"])
    change(daemon.config)
    daemon.write_config()
    result = subprocess.run(daemon.command(), capture_output=True, text=True, timeout=30,
                            stdin=subprocess.DEVNULL, cwd=daemon.run_dir)
    assert result.returncode == 1
    # One line on stderr naming the key; not twistd's usage text, which takes a bad file for a bad command line.
    [line] = result.stderr.splitlines()
    assert line.startswith("waltz-server: ") and "'%s'" % key in line, line
    assert "Usage" not in result.stdout + result.stderr
    for port in ports:
        assert not port_in_use("127.0.0.1", port), "port %d is bound" % port


def test_missing_cluster_exits_with_status_1_and_stays_unbound(tmp_path, zookeeper, cluster_root, daemons):
    daemon = local_server(str(tmp_path / "server"), zookeeper.connect_string, cluster_root)
    daemons.append(daemon)
    daemon.write_config()
    result = subprocess.run(daemon.command(), capture_output=True, text=True, timeout=60,
                            stdin=subprocess.DEVNULL, cwd=daemon.run_dir)
    assert result.returncode == 1
    with open(daemon.log_path, encoding="utf-8") as log:
        text = log.read()
    # One line says why (an operator's problem, not a bug): it was logged twice, the second time with a traceback.
    assert text.count("no Waltz cluster at %s" % cluster_root) == 1 and "Traceback" not in text, text
    assert not port_in_use("127.0.0.1", daemon.config["server.port"])


@pytest_twisted.ensureDeferred
async def test_client_port_in_use_exits_with_status_1_without_registering(tmp_path, zookeeper, cluster_root,
                                                                         cluster_metadata, daemons):
    daemon = local_server(str(tmp_path / "server"), zookeeper.connect_string, cluster_root)
    daemons.append(daemon)
    daemon.write_config()
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", daemon.config["server.port"]))
        squatter.listen()
        result = await threads.deferToThread(
            subprocess.run, daemon.command(), capture_output=True, text=True, timeout=60,
            stdin=subprocess.DEVNULL, cwd=daemon.run_dir)
    assert result.returncode == 1
    with open(daemon.log_path, encoding="utf-8") as log:
        assert "Couldn't listen on 127.0.0.1:%d" % daemon.config["server.port"] in log.read()
    assert not port_in_use("127.0.0.1", daemon.config["server.http.port"])
    assert await cluster_metadata.server_descriptors() == ()


@pytest_twisted.ensureDeferred
async def test_preferred_partition_outside_the_cluster_exits_naming_the_key(tmp_path, zookeeper, cluster_root,
                                                                           cluster_metadata, daemons):
    daemon = local_server(str(tmp_path / "server"), zookeeper.connect_string, cluster_root,
                          **{"server.preferredPartitions": [1, 9]})
    daemons.append(daemon)
    daemon.write_config()
    result = await threads.deferToThread(
        subprocess.run, daemon.command(), capture_output=True, text=True, timeout=60,
        stdin=subprocess.DEVNULL, cwd=daemon.run_dir)
    assert result.returncode == 1
    with open(daemon.log_path, encoding="utf-8") as log:
        text = log.read()
    assert "config key 'server.preferredPartitions': partition ids [9] are not in 0..3" in text
    assert "starting on" not in text, "a port was bound before the config was found bad"
    assert await cluster_metadata.server_descriptors() == ()
