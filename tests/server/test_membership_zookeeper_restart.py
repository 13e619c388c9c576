"""Server membership across a ZooKeeper killed (SIGKILL) and restarted: a private ZooKeeper, several
``ServerMembership`` objects on sessions of their own (4 s, the shortest ZooKeeper's default tick allows),
one of them through a TCP proxy the test can cut, as a server whose reconnect hangs would be.

After the restart every membership's partitions must be its part of the assignment stored in ZooKeeper,
and a server whose session ZooKeeper expired must have given its partitions up by the time another server
holds them (no partition stays open on two servers)."""

import random

import pytest_twisted
from twisted.internet import reactor, task, threads
from twisted.protocols import portforward

from tests.conftest import TEST_PARTITIONS, zk_client_for
from waltz.server.assignment import partitions_of
from waltz.server.membership import MembershipState, ServerMembership
from waltz.zk.bridge import ZooKeeperClient
from waltz.zk.metadata import ClusterMetadata

SESSION_MS = 4000
ROOT = "/waltz_restart"


async def sleep(seconds):
    await task.deferLater(reactor, seconds, lambda: None)


async def until(condition, what, timeout=30.0):
    deadline = reactor.seconds() + timeout
    while not condition():
        if reactor.seconds() > deadline:
            raise AssertionError("timed out after %.0f s waiting for %s" % (timeout, what))
        await sleep(0.02)


class CuttableProxy:
    """A TCP forwarder to ZooKeeper on a port of its own; :meth:`cut` drops its connections and refuses
    new ones until :meth:`mend`; :meth:`silence` keeps them open and drops every byte both ways (a
    network that loses packets: no reset, the client notices only when a heartbeat goes unanswered)."""

    def __init__(self, zookeeper):
        self.zookeeper = zookeeper
        self.port = None
        self.number = 0
        self.connections = []
        self.silent = False

    def silence(self):
        self.silent = True

    def _factory(self):
        proxy = self
        host, port = self.zookeeper.connect_string.split(":")

        class Client(portforward.ProxyClient):
            def dataReceived(self, data):
                if not proxy.silent:
                    super().dataReceived(data)

        class ClientFactory(portforward.ProxyClientFactory):
            protocol = Client

        class Server(portforward.ProxyServer):
            clientProtocolFactory = ClientFactory

            def connectionMade(self):
                proxy.connections.append(self)
                super().connectionMade()

            def dataReceived(self, data):
                if not proxy.silent:
                    super().dataReceived(data)

        factory = portforward.ProxyFactory(host, int(port))
        factory.protocol = Server
        factory.noisy = False
        return factory

    def listen(self):
        self.port = reactor.listenTCP(self.number, self._factory(), interface="127.0.0.1")
        self.number = self.port.getHost().port

    @property
    def connect_string(self):
        return "127.0.0.1:%d" % self.number

    async def cut(self):
        await self.port.stopListening()
        for connection in self.connections:
            connection.transport.abortConnection()
            if connection.peer is not None:
                connection.peer.transport.abortConnection()
        self.connections = []

    def mend(self):
        self.listen()

    async def close(self):
        if self.port is not None and self.port.connected:
            await self.port.stopListening()
        for connection in self.connections:
            connection.transport.abortConnection()


class Cluster:
    """The memberships, each with what it was last told to hold."""

    def __init__(self, zookeeper):
        self.zookeeper = zookeeper
        self.started = []       # (membership, zk client)
        self.holding = {}       # membership -> {partition: generation} it was last told to hold
        self.reports = {}       # membership -> every on_assignment call
        self.admin = None

    async def create(self):
        self.admin = zk_client_for(self.zookeeper)
        await self.admin.connect()
        self.metadata = ClusterMetadata(self.admin, ROOT)
        await self.metadata.create_cluster("restart", TEST_PARTITIONS)

    async def start(self, port, connect_string=None, seed=0):
        client = ZooKeeperClient(connect_string or self.zookeeper.connect_string, session_timeout_ms=SESSION_MS,
                                 connect_timeout_ms=5000)
        await client.connect()
        membership = None
        reports = []

        def told(partitions):
            reports.append(dict(partitions))
            self.holding[membership] = dict(partitions)

        membership = ServerMembership(ClusterMetadata(client, ROOT), "127.0.0.1", port, told, reactor=reactor,
                                      rng=random.Random(seed), retry_interval=0.05)
        self.holding[membership] = {}
        self.reports[membership] = reports
        self.started.append((membership, client))
        await membership.start()
        return membership

    def held_twice(self):
        """Partitions that two memberships hold at once."""
        seen, twice = {}, set()
        for membership, partitions in self.holding.items():
            if membership.state is MembershipState.STOPPED:
                continue
            for pid in partitions:
                if pid in seen:
                    twice.add(pid)
                seen[pid] = membership
        return twice

    async def stored(self):
        versioned = await self.metadata.partition_assignment()
        return versioned.value, versioned.stat

    async def settled(self, memberships, what, timeout=40.0):
        """Wait until the stored assignment is current, gives every partition to exactly the live
        ``memberships``, and each holds exactly its part of it."""
        deadline = reactor.seconds() + timeout
        state = {}
        while True:
            try:
                value, stat = await self.stored()
                state["value"] = value
                done = (value.cversion == stat.cversion
                        and sorted(i.partition_id for _, infos in value.servers for i in infos)
                        == list(range(TEST_PARTITIONS))
                        and {s for s, _ in value.servers} == {m.server_id for m in memberships}
                        and all(self.holding[m] == partitions_of(value, m.server_id) for m in memberships))
            except Exception as exc:   # ZooKeeper still coming back
                state["error"] = exc
                done = False
            if done:
                assert not self.held_twice()
                return value
            if reactor.seconds() > deadline:
                raise AssertionError("timed out waiting for %s; stored %r; holding %r; %r" % (
                    what, state.get("value"), [(m.server_id, m.state.value, self.holding[m]) for m in memberships],
                    state.get("error")))
            await sleep(0.05)

    async def stop(self):
        # Close every client, connected or not: a kazoo client left reconnecting keeps the process alive.
        for membership, client in reversed(self.started):
            await membership.stop()
            await client.close()
        if self.admin is not None:
            await self.admin.close()


@pytest_twisted.async_yield_fixture
async def cluster(private_zookeeper):
    await threads.deferToThread(private_zookeeper.start)
    group = Cluster(private_zookeeper)
    await group.create()
    yield group
    await group.stop()


@pytest_twisted.async_yield_fixture
async def proxy(cluster):
    """A :class:`CuttableProxy` to the cluster's ZooKeeper, closed after the test."""
    forwarder = CuttableProxy(cluster.zookeeper)
    forwarder.listen()
    yield forwarder
    await forwarder.close()


async def restart(zookeeper, down=1.5):
    await threads.deferToThread(zookeeper.kill)
    await sleep(down)
    await threads.deferToThread(zookeeper.start)


@pytest_twisted.ensureDeferred
async def test_after_a_restart_every_server_follows_the_stored_assignment(cluster):
    a = await cluster.start(5001)
    b = await cluster.start(5002, seed=1)
    before = await cluster.settled([a, b], "the split")
    await restart(cluster.zookeeper)
    await until(lambda: a.cluster.zk.connected and b.cluster.zk.connected, "both to reconnect")
    assert await cluster.settled([a, b], "the split after the restart") == before
    # Watches work again: a server joining or leaving after the restart is seen by both.
    c = await cluster.start(5003, seed=2)
    await cluster.settled([a, b, c], "three servers after the restart")
    await c.stop()
    await cluster.settled([a, b], "c gone again")


@pytest_twisted.ensureDeferred
async def test_zookeeper_down_longer_than_the_session_timeout_the_servers_give_their_partitions_up(cluster):
    a = await cluster.start(5001)
    b = await cluster.start(5002, seed=1)
    await cluster.settled([a, b], "the split")
    await threads.deferToThread(cluster.zookeeper.kill)
    await until(lambda: not a.partitions and not b.partitions, "the servers to give their partitions up",
                timeout=SESSION_MS / 1000.0 + 5)
    assert cluster.reports[a][-1] == {} and cluster.reports[b][-1] == {}
    await threads.deferToThread(cluster.zookeeper.start)
    await cluster.settled([a, b], "the servers to take their partitions back")


async def split_with_a_behind(proxy, cluster):
    """Servers a (reaching ZooKeeper through ``proxy``) and b (directly), settled; ``(a, b, a's partitions)``."""
    a = await cluster.start(5001, connect_string=proxy.connect_string)
    b = await cluster.start(5002, seed=1)
    await cluster.settled([a, b], "the split")
    return a, b, dict(a.partitions)


async def takes_over_without_overlap(cluster, a, b, a_had):
    """Wait until ``b`` holds every partition, checking every 10 ms that no partition is held by both; then
    ``a`` must hold none and ``b`` the ones ``a`` had (``a_had``) at their next generation."""
    violations = []

    def check():
        twice = cluster.held_twice()
        if twice:
            violations.append((reactor.seconds(), sorted(twice)))
    checker = task.LoopingCall(check)
    checker.start(0.01)
    try:
        await until(lambda: sorted(b.partitions) == list(range(TEST_PARTITIONS)),
                    "b to take every partition", timeout=SESSION_MS / 1000.0 + 20)
        await sleep(0.2)
    finally:
        checker.stop()
    assert a.partitions == {} and cluster.reports[a][-1] == {}, \
        "a still serves %r after its session expired" % (a.partitions,)
    assert not violations, "partitions open on both servers: %r" % violations[:3]
    assert all(b.partitions[pid] == generation + 1 for pid, generation in a_had.items())


@pytest_twisted.ensureDeferred
async def test_a_server_that_cannot_reconnect_after_the_restart_gives_up_before_the_other_takes_over(cluster, proxy):
    a, b, a_had = await split_with_a_behind(proxy, cluster)
    assert a_had and a.is_coordinator

    # ZooKeeper dies; when it is back, b reconnects but a cannot (its reconnect hangs, say).
    await threads.deferToThread(cluster.zookeeper.kill)
    await proxy.cut()
    await sleep(1.5)
    await threads.deferToThread(cluster.zookeeper.start)

    # ZooKeeper expires a's session and b, the coordinator now, takes every partition.
    await takes_over_without_overlap(cluster, a, b, a_had)

    # a's connection comes back: it learns of the expiry, registers again and gets a share.
    proxy.mend()
    await until(lambda: a.state is MembershipState.MEMBER and a.znode is not None and a.partitions,
                "a to register again and get partitions", timeout=30)
    await cluster.settled([a, b], "the split after a came back")


@pytest_twisted.ensureDeferred
async def test_a_server_cut_off_silently_gives_up_before_the_other_takes_over(cluster, proxy):
    # No reset: kazoo notices only when a heartbeat goes unanswered, up to 2/3 of the session timeout
    # after the last reply. The server must still give its partitions up before ZooKeeper expires the
    # session and the coordinator moves them.
    a, b, a_had = await split_with_a_behind(proxy, cluster)
    proxy.silence()
    await takes_over_without_overlap(cluster, a, b, a_had)


@pytest_twisted.ensureDeferred
async def test_a_short_loss_of_zookeeper_changes_nothing(cluster, proxy):
    # A blip (a ZooKeeper restart, a dropped connection) well within the session timeout must not make
    # the server give its partitions up: it keeps them, at the same generations, and no recovery runs.
    a, b, a_had = await split_with_a_behind(proxy, cluster)
    reports_before = len(cluster.reports[a])
    # Cut right after a probe was answered: the give-up counts from the last answered probe (up to a sixth of
    # the timeout before the cut otherwise), and kazoo takes up to its 1 s back-off to reconnect after the mend.
    # Without both margins the blip plus the reconnect could pass 0.8 of the timeout on a loaded machine.
    asked = reactor.seconds()
    await until(lambda: a._last_contact is not None and a._last_contact >= asked, "a probe to be answered")
    await proxy.cut()                       # a reset: the loss is noticed at once
    await until(lambda: not a.cluster.zk.connected, "a to notice the loss")
    await sleep(SESSION_MS / 1000.0 * 0.3)  # longer than a quarter of the timeout, well short of 0.8 of it
    proxy.mend()
    await until(lambda: a.cluster.zk.connected, "a to reconnect", timeout=10)
    await sleep(0.5)
    assert cluster.reports[a][reports_before:] == [], "a gave its partitions up during a short blip"
    assert a.partitions == a_had
