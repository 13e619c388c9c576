"""Server membership against the real ZooKeeper: several ``ServerMembership`` objects in this
process, each on its own ZooKeeper session, over one test cluster (4 partitions); and, on dummies,
how the server opens and closes partitions as its assignment changes."""

import random

import pytest
import pytest_twisted
from kazoo.client import KazooClient
from kazoo.exceptions import ConnectionLoss
from twisted.internet import defer, reactor, task
from twisted.internet.task import Clock
from twisted.python.failure import Failure

from tests.conftest import TEST_PARTITIONS, zk_client_for
from waltz.server.assignment import partitions_of
from waltz.server.membership import InvalidPartitions, MembershipState, ServerMembership
from waltz.server.service import ServerPartitions
from waltz.zk.metadata import ClusterMetadata


async def until(condition, what, timeout=20.0):
    """Poll ``condition()`` on the reactor until it holds; fail naming ``what`` after ``timeout``."""
    deadline = reactor.seconds() + timeout
    while not condition():
        if reactor.seconds() > deadline:
            raise AssertionError("timed out after %.0f s waiting for %s" % (timeout, what))
        await task.deferLater(reactor, 0.02, lambda: None)


class Servers:
    """Starts memberships on sessions of their own; records what each is told; stops them all."""

    def __init__(self, zookeeper, root):
        self.zookeeper = zookeeper
        self.root = root
        self.started = []   # (membership, client)
        self.reports = {}   # membership -> list of {partition: generation}

    async def start(self, port, preferred=(), seed=0, on_assignment=None):
        client = zk_client_for(self.zookeeper)
        await client.connect()
        reports = []
        membership = ServerMembership(ClusterMetadata(client, self.root), "127.0.0.1", port,
                                      on_assignment or reports.append, preferred, reactor=reactor,
                                      rng=random.Random(seed), retry_interval=0.05)
        self.started.append((membership, client))
        self.reports[membership] = reports
        await membership.start()
        return membership

    def client(self, membership):
        return dict(self.started)[membership]

    async def kill(self, membership):
        """End the membership's ZooKeeper session as a crash would (no clean unregister)."""
        await self.client(membership).close()

    async def expire(self, membership):
        """Expire the session from outside: another client attaches to it and closes it."""
        session_id, password = self.client(membership).kazoo.client_id

        def expire(_kazoo):
            thief = KazooClient(hosts=self.zookeeper.connect_string, client_id=(session_id, password))
            thief.start(5)
            thief.stop()
            thief.close()
        await self.client(membership).run_blocking(expire)

    async def stop(self):
        for membership, client in reversed(self.started):
            await membership.stop()
            if client.connected:
                await client.close()


@pytest_twisted.async_yield_fixture
async def servers(zookeeper, cluster_root, cluster_metadata):
    """A :class:`Servers` on the test's cluster; every membership and session is stopped after."""
    group = Servers(zookeeper, cluster_root)
    yield group
    await group.stop()


async def stored_assignment(cluster_metadata):
    versioned = await cluster_metadata.partition_assignment()
    return versioned.value, versioned.stat


async def settled(cluster_metadata, memberships, what):
    """Wait until the stored assignment is current, covers every partition, and every membership
    has adopted it; returns it."""
    state = {}

    async def check():
        value, stat = await stored_assignment(cluster_metadata)
        state["value"] = value
        return (value.cversion == stat.cversion
                and sorted(i.partition_id for _, infos in value.servers for i in infos) == list(range(TEST_PARTITIONS))
                and {s for s, _ in value.servers} == {m.server_id for m in memberships}
                and all(m.partitions == partitions_of(value, m.server_id) for m in memberships))

    deadline = reactor.seconds() + 20
    while not await check():
        if reactor.seconds() > deadline:
            raise AssertionError("timed out waiting for %s; stored %r; members %r" % (
                what, state.get("value"), [(m.server_id, m.state, m.partitions) for m in memberships]))
        await task.deferLater(reactor, 0.02, lambda: None)
    return state["value"]


@pytest_twisted.ensureDeferred
async def test_a_lone_server_gets_every_partition_at_generation_one(servers, cluster_metadata):
    a = await servers.start(5001)
    value = await settled(cluster_metadata, [a], "server 1 to hold everything")
    assert a.state is MembershipState.MEMBER
    assert a.server_id == 1 and a.is_coordinator
    assert a.partitions == {pid: 1 for pid in range(TEST_PARTITIONS)}
    assert servers.reports[a][-1] == a.partitions
    descriptors = await cluster_metadata.server_descriptors()
    assert [d for _, d in descriptors] == [a.descriptor]
    assert (descriptors[0][1].host, descriptors[0][1].port) == ("127.0.0.1", 5001)
    assert value.num_partitions == TEST_PARTITIONS


@pytest_twisted.ensureDeferred
async def test_two_servers_split_and_the_lowest_id_coordinates(servers, cluster_metadata):
    a = await servers.start(5001)
    await settled(cluster_metadata, [a], "server 1 alone")
    written_by_a = a.assignments_written
    b = await servers.start(5002, seed=1)
    value = await settled(cluster_metadata, [a, b], "the split")
    assert (a.server_id, b.server_id) == (1, 2)
    assert a.is_coordinator and not b.is_coordinator
    assert a.assignments_written > written_by_a and b.assignments_written == 0
    assert len(a.partitions) == len(b.partitions) == TEST_PARTITIONS // 2
    # a kept its partitions at generation 1; the ones that moved to b are at 2
    assert set(a.partitions.values()) == {1}
    assert set(b.partitions.values()) == {2}
    assert value == (await stored_assignment(cluster_metadata))[0]


@pytest_twisted.ensureDeferred
async def test_killing_a_session_moves_its_partitions_with_bumped_generations(servers, cluster_metadata):
    a = await servers.start(5001)
    b = await servers.start(5002, seed=1)
    await settled(cluster_metadata, [a, b], "the split")
    before_a, before_b = dict(a.partitions), dict(b.partitions)

    await servers.kill(a)  # the coordinator dies: b takes over
    await settled(cluster_metadata, [b], "b to take everything")
    assert b.is_coordinator and b.assignments_written >= 1
    assert b.partitions == {**before_b, **{pid: g + 1 for pid, g in before_a.items()}}
    assert servers.reports[b][-1] == b.partitions


@pytest_twisted.ensureDeferred
async def test_a_non_coordinator_leaving_is_handled_by_the_coordinator(servers, cluster_metadata):
    a = await servers.start(5001)
    b = await servers.start(5002, seed=1)
    await settled(cluster_metadata, [a, b], "the split")
    before_a, before_b = dict(a.partitions), dict(b.partitions)
    await servers.kill(b)
    await settled(cluster_metadata, [a], "a to take everything back")
    assert a.partitions == {**before_a, **{pid: g + 1 for pid, g in before_b.items()}}


@pytest_twisted.ensureDeferred
async def test_after_session_expiry_the_server_registers_again_with_the_same_id(servers, cluster_metadata):
    a = await servers.start(5001)
    b = await servers.start(5002, seed=1)
    await settled(cluster_metadata, [a, b], "the split")
    old_znode, old_session = b.znode, servers.client(b).session_id

    await servers.expire(b)
    await until(lambda: servers.client(b).session_id not in (None, old_session)
                and b.state is MembershipState.MEMBER and b.znode not in (None, old_znode),
                "b to register again in a new session")
    value = await settled(cluster_metadata, [a, b], "the split after b came back")
    assert b.server_id == 2
    assert len(b.partitions) == TEST_PARTITIONS // 2
    descriptors = await cluster_metadata.server_descriptors()
    assert sorted(d.server_id for _, d in descriptors) == [1, 2], "exactly one descriptor per server"
    # b's partitions went to a (+1) while it was away, and whatever came back to b moved again (+1)
    assert min(g for _, infos in value.servers for g in [i.generation for i in infos]) >= 1
    assert all(g >= 2 for g in b.partitions.values())


@pytest_twisted.ensureDeferred
async def test_preferred_partitions_are_claimed_and_released(servers, cluster_metadata):
    a = await servers.start(5001)
    b = await servers.start(5002, seed=1)
    await settled(cluster_metadata, [a, b], "the split")
    wanted = sorted(a.partitions)[:1]
    assert await b.add_preferred_partitions(wanted) is True
    await until(lambda: wanted[0] in b.partitions, "b to get its preferred partition %d" % wanted[0])
    await settled(cluster_metadata, [a, b], "the rebalanced split")
    descriptors = dict((d.server_id, d) for _, d in await cluster_metadata.server_descriptors())
    assert descriptors[2].preferred_partitions == tuple(wanted)
    assert len(descriptors) == 2
    assert await b.remove_preferred_partitions(wanted) is True
    await until(lambda: b.descriptor.preferred_partitions == (), "b to drop its preference")
    with pytest.raises(InvalidPartitions, match="not in 0..3"):
        await b.add_preferred_partitions([TEST_PARTITIONS])


@pytest_twisted.ensureDeferred
async def test_preferred_partition_changes_made_at_once_are_all_kept(servers, cluster_metadata):
    # Before: each change computed its set before waiting for the one in flight, so changes queued behind
    # it overwrote each other (all reporting success): adding 0, 1 and 2 at once left (0, 2).
    a = await servers.start(5001)
    await settled(cluster_metadata, [a], "a alone")
    results = await defer.gatherResults([a.add_preferred_partitions([0]), a.add_preferred_partitions([1]),
                                         a.add_preferred_partitions([2]), a.remove_preferred_partitions([0])])
    assert results == [True] * 4
    descriptors = dict((d.server_id, d) for _, d in await cluster_metadata.server_descriptors())
    assert a.preferred_partitions == (1, 2) and descriptors[a.server_id].preferred_partitions == (1, 2)


@pytest_twisted.ensureDeferred
async def test_preferred_partition_given_at_start(servers, cluster_metadata):
    a = await servers.start(5001)
    await settled(cluster_metadata, [a], "a alone")
    b = await servers.start(5002, preferred=(3,), seed=1)
    await settled(cluster_metadata, [a, b], "the split")
    assert 3 in b.partitions and b.partitions[3] == 2


@pytest_twisted.ensureDeferred
async def test_stop_unregisters_so_the_others_take_over_at_once(servers, cluster_metadata):
    a = await servers.start(5001)
    b = await servers.start(5002, seed=1)
    await settled(cluster_metadata, [a, b], "the split")
    await a.stop()
    assert a.state is MembershipState.STOPPED
    await settled(cluster_metadata, [b], "b to take everything after a stopped cleanly")


# --- the registration repairs itself; ZooKeeper calls of unknown outcome -------------------------------


async def descriptors_of(cluster_metadata, server_id):
    """The ``(znode name, ServerDescriptor)`` pairs of ``server_id`` now in ZooKeeper."""
    return [(name, d) for name, d in await cluster_metadata.server_descriptors() if d.server_id == server_id]


async def until_registered_once(cluster_metadata, membership, what):
    """Wait until ZooKeeper holds exactly one descriptor of ``membership``: its znode, its content."""
    deadline = reactor.seconds() + 10
    while True:
        found = await descriptors_of(cluster_metadata, membership.server_id)
        if [(membership.cluster.paths.server_descriptors + "/" + name, d) for name, d in found] == \
                [(membership.znode, membership.descriptor)]:
            return found[0][1]
        if reactor.seconds() > deadline:
            raise AssertionError("timed out waiting for %s: ZooKeeper has %r, the server thinks %r %r"
                                 % (what, found, membership.znode, membership.descriptor))
        await task.deferLater(reactor, 0.05, lambda: None)


def lose_next_commit_reply(membership, applied):
    """The next multi-op of ``membership`` fails with ConnectionLoss, after it was applied or not."""
    zk = membership.cluster.zk
    real = zk.transaction

    def transaction():
        del zk.transaction          # once
        txn = real()
        if applied:
            commit = txn.commit
            txn.commit = lambda: commit().addCallback(lambda _: defer.fail(ConnectionLoss()))
        else:
            txn.commit = lambda: defer.fail(ConnectionLoss())
        return txn
    zk.transaction = transaction


@pytest_twisted.ensureDeferred
async def test_a_descriptor_created_without_hearing_of_it_is_removed(servers, cluster_metadata):
    # A create whose reply was lost: the znode exists in the session, the server does not know it.
    a = await servers.start(5001)
    await settled(cluster_metadata, [a], "a alone")
    orphan = await ClusterMetadata(servers.client(a), cluster_metadata.paths.root).register_server(a.descriptor)
    # (Not counted here: the server may have noticed and repaired it already; a race the test used to lose.)
    await until_registered_once(cluster_metadata, a, "the orphan descriptor to go")
    assert a.znode != orphan and not await servers.client(a).exists(orphan)
    await settled(cluster_metadata, [a], "a alone again")


@pytest_twisted.ensureDeferred
async def test_a_failed_preferred_partitions_change_changes_nothing_and_can_be_retried(servers, cluster_metadata):
    a = await servers.start(5001)
    await settled(cluster_metadata, [a], "a alone")
    lose_next_commit_reply(a, applied=False)
    with pytest.raises(ConnectionLoss):
        await a.add_preferred_partitions([1])
    assert a.preferred_partitions == ()
    assert await a.add_preferred_partitions([1]) is True
    assert (await until_registered_once(cluster_metadata, a, "the retried change")).preferred_partitions == (1,)


@pytest_twisted.ensureDeferred
async def test_a_preferred_partitions_change_whose_reply_was_lost_is_undone(servers, cluster_metadata):
    a = await servers.start(5001)
    await settled(cluster_metadata, [a], "a alone")
    lose_next_commit_reply(a, applied=True)     # ZooKeeper made the change; the server did not hear of it
    with pytest.raises(ConnectionLoss):
        await a.add_preferred_partitions([1])
    assert a.preferred_partitions == ()
    registered = await until_registered_once(cluster_metadata, a, "the registration to match the server again")
    assert registered.preferred_partitions == ()
    assert await a.add_preferred_partitions([2]) is True       # and later changes work
    assert (await until_registered_once(cluster_metadata, a, "the next change")).preferred_partitions == (2,)


@pytest_twisted.ensureDeferred
async def test_stop_during_start_leaves_no_descriptor_and_no_partitions(zookeeper, cluster_root, cluster_metadata):
    client = zk_client_for(zookeeper)
    await client.connect()
    try:
        reports = []
        membership = ServerMembership(ClusterMetadata(client, cluster_root), "127.0.0.1", 5001, reports.append,
                                      reactor=reactor, retry_interval=0.05)
        started = membership.start()
        await membership.stop()            # SIGTERM while starting
        await started
        await task.deferLater(reactor, 0.5, lambda: None)
        assert membership.state is MembershipState.STOPPED and membership.znode is None
        assert await cluster_metadata.server_descriptors() == () and reports == []
    finally:
        await client.close()


@pytest_twisted.ensureDeferred
async def test_an_assignment_the_server_failed_to_apply_is_applied_again(servers, cluster_metadata):
    a = await servers.start(5001)
    await settled(cluster_metadata, [a], "a alone")
    applied = []

    def on_assignment(partitions):
        if not applied:
            applied.append("failed")
            raise RuntimeError("opening a partition failed")
        applied.append(partitions)
    b = await servers.start(5002, seed=1, on_assignment=on_assignment)
    await until(lambda: len(applied) > 1, "the assignment to be applied again", timeout=10)
    await settled(cluster_metadata, [a, b], "the split")
    assert applied[-1] == b.partitions and len(b.partitions) == TEST_PARTITIONS // 2


@pytest_twisted.ensureDeferred
async def test_a_child_that_is_not_a_descriptor_does_not_stop_reconciling(servers, cluster_metadata, zookeeper):
    a = await servers.start(5001)
    await settled(cluster_metadata, [a], "a alone")
    stray = cluster_metadata.paths.server_descriptors + "/stray"
    await servers.client(a).create(stray, b"not a descriptor")
    try:
        b = await servers.start(5002, seed=1)
        await settled(cluster_metadata, [a, b], "the split with a stray znode among the descriptors")
    finally:
        await servers.client(a).delete(stray)


# --- what the server does with its assignment (waltz/server/service.py) ------------------------------


class DummyStorePartition:
    """A store partition that is never lost."""

    def __init__(self, partition_id, generation):
        self.key = ("store", partition_id, generation)
        self.lost = None

    def add_lost_listener(self, listener):
        pass


class DummyStore:
    """Records the store partitions handed out and closed."""

    def __init__(self):
        self.opened, self.closed = [], []

    def partition(self, partition_id, generation):
        self.opened.append((partition_id, generation))
        return DummyStorePartition(partition_id, generation)

    def close_partition(self, partition_id):
        self.closed.append(partition_id)
        return defer.succeed(None)


class DummyPartition:
    def __init__(self, partition_id, generation, store):
        self.partition_id, self.generation, self.store = partition_id, generation, store
        self.started = defer.Deferred()
        self.closed = False
        self.healthy = False

    def start(self):
        return self.started

    def close(self):
        self.closed = True


def test_server_partitions_follow_the_assignment():
    store, made = DummyStore(), []

    def factory(partition_id, generation, store_partition):
        made.append(DummyPartition(partition_id, generation, store_partition))
        return made[-1]
    partitions = ServerPartitions(store, factory)

    partitions.assign({0: 1, 1: 1})
    first, second = made
    assert store.opened == [(0, 1), (1, 1)] and first.store.key == ("store", 0, 1)
    assert partitions.partition(0) is None, "not ready before start() fired"
    assert partitions.problems() == ["partition 0 (generation 1): the store is not writing",
                                     "partition 1 (generation 1): the store is not writing"]
    first.started.callback(first)
    first.healthy = True
    assert partitions.partition(0) is first and partitions.partition(1) is None
    second.started.errback(RuntimeError("generation 1 is stale"))
    assert partitions.problems() == ["partition 1 (generation 1) failed to start: generation 1 is stale"]

    partitions.assign({0: 1, 1: 2, 2: 1})  # 1 at a new generation, 2 new, 0 unchanged
    assert second.closed and not first.closed and store.closed == [1]
    assert store.opened[2:] == [(1, 2), (2, 1)]
    assert partitions.partition(0) is first and partitions.partition(1) is None
    assert [p.generation for p in made[2:]] == [2, 1]

    partitions.assign({2: 1})  # 0 and 1 move away
    assert first.closed and made[2].closed and not made[3].closed
    assert sorted(store.closed) == [0, 1, 1]
    assert partitions.partition(0) is None and sorted(partitions.opened) == [2]


class _UnreachableAssignment:
    """Cluster metadata whose assignment reads fail (a transient ZooKeeper error), over a connected client."""

    class zk:
        session_timeout_ms = 30000
        connected = True
        session_id = 2

        @staticmethod
        def add_state_listener(listener):
            pass

    def __init__(self):
        self.reads = 0

    def partition_assignment(self):
        self.reads += 1
        return defer.fail(RuntimeError("transient ZooKeeper error"))


def test_a_pending_rejoin_retry_does_not_stand_in_for_a_reconcile_retry():
    # The rejoin failed while connected (a retry is pending); a CONNECTED event then re-registered at once,
    # and the reconcile that followed failed. Its retry used to be dropped because the rejoin's timer was
    # active: the server held no partitions until some other watch event.
    clock = Clock()
    cluster = _UnreachableAssignment()
    membership = ServerMembership(cluster, "127.0.0.1", 1, lambda partitions: None, reactor=clock)
    membership.server_id = 1
    membership.state = MembershipState.REJOINING
    membership._rejoin_failed(Failure(RuntimeError("register failed")))
    membership.state = MembershipState.MEMBER
    membership.request_reconcile()
    assert cluster.reads == 1
    clock.advance(membership.retry_interval)
    assert cluster.reads == 2
    membership.stop()
    assert clock.getDelayedCalls() == []


class _OneSessionCluster:
    """A cluster whose ZooKeeper reads the test answers by hand (on a Clock): for the order of events
    around a session's end, which the real ZooKeeper cannot be made to interleave at will."""

    def __init__(self, assignment):
        from types import SimpleNamespace
        from waltz.zk.znodes import ClusterPaths
        self.zk = SimpleNamespace(session_timeout_ms=30000, session_id=111, connected=True,
                                  add_state_listener=lambda listener: None, transaction=self._transaction,
                                  sync=self._sync, exists=self._exists)
        self.paths = ClusterPaths("/c")
        self.assignment = assignment
        self.descriptor_reads = []
        self.multi_ops = []
        self.syncs = []
        self.exists_calls = 0

    def partition_assignment(self):
        from types import SimpleNamespace
        from waltz.zk.metadata import Versioned
        return defer.succeed(Versioned(self.assignment, SimpleNamespace(cversion=self.assignment.cversion,
                                                                        version=3)))

    def versioned_server_descriptors(self):
        d = defer.Deferred()
        self.descriptor_reads.append(d)
        return d

    def register_server(self, descriptor):
        return defer.succeed("/c/serverDescriptors/s_0009")

    def _transaction(self):
        cluster = self

        class Transaction:
            def delete(self, path):
                return self

            def create(self, *args, **kwargs):
                return self

            def commit(self):
                d = defer.Deferred()
                cluster.multi_ops.append(d)
                return d
        return Transaction()

    def _sync(self, path):
        d = defer.Deferred()
        self.syncs.append(d)
        return d

    def _exists(self, path):
        self.exists_calls += 1
        return defer.succeed(True)     # a follower cut off from the leader still answers reads


def _member_of(cluster, clock, reports):
    membership = ServerMembership(cluster, "h", 1, reports.append, reactor=clock)
    membership.server_id, membership.num_partitions, membership.znode = 1, 2, "/c/serverDescriptors/s_0001"
    membership.state = MembershipState.MEMBER
    membership.partitions = {0: 5, 1: 5}
    return membership


def _descriptors(session, preferred=()):
    from types import SimpleNamespace
    from waltz.zk.metadata import Versioned
    from waltz.zk.znodes import ServerDescriptor
    return (("s_0001", Versioned(ServerDescriptor(1, "h", 1, tuple(preferred)),
                                 SimpleNamespace(ephemeralOwner=session))),)


def _assignment():
    from waltz.zk.znodes import PartitionAssignment
    return PartitionAssignment(7, 2, {1: [(0, 5), (1, 5)]})


def test_a_reconcile_pass_read_before_an_expiry_does_not_act_after_it():
    # The pass read the assignment in session 111; the descriptors' answer came after the session expired
    # and the server registered again in session 222: the old assignment used to be adopted again.
    from waltz.zk.bridge import SessionState
    clock, reports = Clock(), []
    cluster = _OneSessionCluster(_assignment())
    membership = _member_of(cluster, clock, reports)
    membership.request_reconcile()
    membership._session_changed(SessionState.EXPIRED)
    cluster.zk.session_id = 222
    membership._session_changed(SessionState.CONNECTED)
    assert membership.state is MembershipState.MEMBER and reports == [{}]
    cluster.descriptor_reads[0].callback(_descriptors(111))
    assert reports == [{}]
    assert len(cluster.descriptor_reads) == 2        # a pass of the new session reads again


def test_a_reconcile_pass_waiting_for_the_registration_does_not_act_after_an_expiry():
    # A preferred-partitions change holds the registration lock; the pass waits for it to check the
    # registration; the session expires meanwhile and the change fails: the pass used to adopt what it
    # had read, reopening the partitions just given up.
    from kazoo.exceptions import SessionExpiredError
    from waltz.zk.bridge import SessionState
    clock, reports = Clock(), []
    cluster = _OneSessionCluster(_assignment())
    membership = _member_of(cluster, clock, reports)
    change = membership.set_preferred_partitions([0])
    membership.request_reconcile()
    cluster.descriptor_reads[0].callback(_descriptors(111))     # not the new content: waits for the lock
    membership._session_changed(SessionState.EXPIRED)
    assert reports == [{}] and membership.state is MembershipState.REJOINING
    cluster.multi_ops[0].errback(SessionExpiredError())
    change.addErrback(lambda failure: None)
    assert reports == [{}]


def test_a_zookeeper_client_lost_for_good_gives_the_partitions_up():
    from waltz.zk.bridge import SessionState
    clock, reports = Clock(), []
    membership = _member_of(_OneSessionCluster(_assignment()), clock, reports)
    membership._session_changed(SessionState.SUSPENDED)
    membership._session_changed(SessionState.LOST)
    assert reports == [{}] and membership.partitions == {}


def test_contact_is_counted_from_syncs_with_the_leader_not_from_reads():
    clock, reports = Clock(), []
    cluster = _OneSessionCluster(_assignment())
    membership = _member_of(cluster, clock, reports)
    clock.advance(10)
    membership._probe()
    assert cluster.exists_calls == 0 and len(cluster.syncs) == 1
    assert membership._last_contact is None          # no answer from the leader yet
    clock.advance(3)
    cluster.syncs[0].callback("/c")
    assert membership._last_contact == 10            # when the sync was sent


def test_unanswered_probes_give_the_partitions_up_while_still_connected_and_a_fresh_answer_brings_them_back():
    # A follower cut off from the leader keeps answering pings (kazoo stays connected, no SUSPENDED) but
    # never a sync: the leader may expire the session. Before, the give-up counted only while disconnected.
    clock, reports = Clock(), []
    cluster = _OneSessionCluster(_assignment())
    membership = _member_of(cluster, clock, reports)
    membership._contact(clock.seconds())
    membership._prober.start(membership.probe_interval, now=False)
    while clock.seconds() + membership.probe_interval < membership.give_up_after:
        clock.advance(membership.probe_interval)
    assert reports == []
    clock.advance(membership.probe_interval)            # the first probe at or past 0.8 T: before T
    assert clock.seconds() < cluster.zk.session_timeout_ms / 1000.0
    assert reports == [{}] and membership.partitions == {}
    [first_probe] = cluster.syncs
    # A late answer to the first probe proves contact only when it was sent, long ago: taking the partitions
    # back would give them up again at the next probe.
    first_probe.callback("/c")
    assert membership.given_up_while_connected is not None and cluster.descriptor_reads == []
    # A reconcile pass meanwhile (a retry, a watch) reads through that follower: it gives nothing back.
    membership.request_reconcile()
    cluster.descriptor_reads.pop().callback(_descriptors(111))
    assert membership.partitions == {} and reports == [{}]
    clock.advance(membership.probe_interval)            # a new probe, answered at once
    cluster.syncs[-1].callback("/c")
    assert membership.given_up_while_connected is None
    cluster.descriptor_reads.pop().callback(_descriptors(111))
    assert membership.partitions == {0: 5, 1: 5} and reports == [{}, {0: 5, 1: 5}]
    membership.stop()


def _member_holding_nothing_in_contact_now():
    """``(clock, reports, cluster, membership)``: a member that just joined (holding nothing), in contact now."""
    clock, reports = Clock(), []
    cluster = _OneSessionCluster(_assignment())
    membership = _member_of(cluster, clock, reports)
    membership.partitions = {}
    membership._contact(clock.seconds())
    return clock, reports, cluster, membership


def test_a_server_holding_nothing_takes_no_partition_on_once_its_contact_is_older_than_the_give_up_time():
    # Connected to a follower cut off from the leader, holding nothing yet (just joined): reads through
    # that follower still succeed, and the assignment they give is stale (the leader expired the session).
    clock, reports, cluster, membership = _member_holding_nothing_in_contact_now()
    clock.advance(membership.give_up_after)             # no probe answered since (none ran yet)
    membership.request_reconcile()
    cluster.descriptor_reads.pop().callback(_descriptors(111))
    assert membership.partitions == {} and reports == []
    assert membership.given_up_while_connected is not None
    membership._probe()
    cluster.syncs[-1].callback("/c")                    # the leader answers: the assignment applies
    cluster.descriptor_reads.pop().callback(_descriptors(111))
    assert membership.partitions == {0: 5, 1: 5} and reports == [{0: 5, 1: 5}]
    membership.stop()


def test_a_reply_handed_over_after_a_disconnect_takes_no_partition_on_once_the_contact_is_too_old():
    # Disconnected and holding nothing, the give-up timer has nothing to give up; a read reply that reaches the
    # reactor only after the give-up time (the session may be expiring) took the assignment's partitions on.
    clock, reports, cluster, membership = _member_holding_nothing_in_contact_now()
    membership.request_reconcile()
    cluster.zk.connected = False
    clock.advance(membership.give_up_after)
    cluster.descriptor_reads.pop().callback(_descriptors(111))
    assert membership.partitions == {} and reports == []
    cluster.zk.connected = True                         # reconnected: contact again, the next pass applies it
    membership._contact(clock.seconds())
    membership.request_reconcile()
    cluster.descriptor_reads.pop().callback(_descriptors(111))
    assert membership.partitions == {0: 5, 1: 5} and reports == [{0: 5, 1: 5}]
    membership.stop()


def test_health_reports_partitions_given_up_for_unanswered_probes_until_a_probe_is_answered():
    from types import SimpleNamespace

    from waltz.config import build_config
    from waltz.server.config import SERVER_KEYS
    from waltz.server.service import WaltzServerService
    from waltz.zk.bridge import SessionState
    clock, reports = Clock(), []
    cluster = _OneSessionCluster(_assignment())
    membership = _member_of(cluster, clock, reports)
    config = build_config({"zookeeper.connectString": "127.0.0.1:2181", "cluster.root": "/c"}, SERVER_KEYS)
    service = WaltzServerService(config, clock, partition_factory=lambda *a: None, clock=clock.seconds)
    service.membership = membership
    service.partitions = SimpleNamespace(problems=lambda: [])      # holds nothing now
    service._zookeeper_state_changed(SessionState.CONNECTED)
    membership._contact(clock.seconds())
    membership._prober.start(membership.probe_interval, now=False)
    assert service.problems() == []
    clock.advance(membership.give_up_after + membership.probe_interval)
    assert reports == [{}]
    # Before: healthy, although the server held nothing and its clients got NOT_READY.
    [problem] = service.problems()
    assert problem.startswith("partitions given up (none taken on): no ZooKeeper probe answered")
    clock.advance(membership.probe_interval)
    cluster.syncs[-1].callback("/c")                    # a fresh answer
    assert service.problems() == []
    membership.stop()


def test_a_reconcile_pass_that_fails_after_stop_arms_no_retry():
    # The service stops the membership and then closes its ZooKeeper client: the read a pass was waiting
    # for fails after stop(), and used to arm a retry timer on a stopped membership.
    clock, reports = Clock(), []
    cluster = _OneSessionCluster(_assignment())
    membership = _member_of(cluster, clock, reports)
    membership.request_reconcile()
    membership.stop()
    cluster.descriptor_reads[0].errback(RuntimeError("the ZooKeeper client is closed"))
    assert clock.getDelayedCalls() == []


def _member_whose_first_give_up_fails(clock, calls):
    """``(cluster, membership)``: a member in contact now, whose first ``on_assignment`` raises."""
    def on_assignment(partitions):
        calls.append(dict(partitions))
        if len(calls) == 1:
            raise RuntimeError("closing a partition failed")
    cluster = _OneSessionCluster(_assignment())
    membership = _member_of(cluster, clock, [])
    membership.on_assignment = on_assignment
    membership._contact(clock.seconds())
    return cluster, membership


def test_a_give_up_that_raises_is_tried_again_at_the_next_probe():
    # The failed give-up used to count the partitions as given up (a later one gave up nothing), and its
    # exception stopped the prober for good.
    clock, calls = Clock(), []
    cluster, membership = _member_whose_first_give_up_fails(clock, calls)
    membership._prober.start(membership.probe_interval, now=False)
    clock.advance(membership.give_up_after + membership.probe_interval)
    assert calls == [{}] and membership._prober.running
    clock.advance(membership.probe_interval)
    assert calls == [{}, {}] and membership.partitions == {}
    clock.advance(membership.probe_interval)
    assert calls == [{}, {}]                            # given up: nothing more to give up
    membership.stop()


def test_after_a_give_up_that_raised_the_session_expiry_gives_the_partitions_up():
    from waltz.zk.bridge import SessionState
    clock, calls = Clock(), []
    cluster, membership = _member_whose_first_give_up_fails(clock, calls)
    cluster.zk.connected = False
    membership._session_changed(SessionState.SUSPENDED)
    clock.advance(membership.give_up_after)             # disconnected too long: the give-up raises
    membership._session_changed(SessionState.EXPIRED)
    assert calls == [{}, {}] and membership.partitions == {}


def test_a_give_up_that_raised_while_disconnected_is_tried_again_at_the_next_probe():
    # The disconnected timer fires once, and the probes' check returned at once while disconnected:
    # partitions whose give-up raised stayed held for as long as ZooKeeper stayed unreachable.
    from waltz.zk.bridge import SessionState
    clock, calls = Clock(), []
    cluster, membership = _member_whose_first_give_up_fails(clock, calls)
    membership._prober.start(membership.probe_interval, now=False)
    cluster.zk.connected = False
    membership._session_changed(SessionState.SUSPENDED)
    clock.advance(membership.give_up_after)             # the disconnected timer: the give-up raises
    assert calls == [{}]
    clock.advance(membership.probe_interval)
    assert calls == [{}, {}] and membership.partitions == {}
    clock.advance(membership.probe_interval)
    assert calls == [{}, {}]
    membership.stop()


class _FlakyStore(DummyStore):
    """Opening partition 1 raises while ``failing``."""

    failing = True

    def partition(self, partition_id, generation):
        if partition_id == 1 and self.failing:
            raise RuntimeError("cannot open partition 1")
        return super().partition(partition_id, generation)


def _member_with_flaky_partitions(clock):
    """``(cluster, membership, partitions, store)``: server 1, assigned {0: 5, 1: 5}, opening partition 1
    fails until ``store.failing`` is cleared."""
    store = _FlakyStore()
    partitions = ServerPartitions(store, DummyPartition)
    cluster = _OneSessionCluster(_assignment())
    membership = _member_of(cluster, clock, [])
    membership.partitions = {}
    membership.on_assignment = partitions.assign
    membership.request_reconcile()
    cluster.descriptor_reads[0].callback(_descriptors(111))
    return cluster, membership, partitions, store


def test_an_assignment_applied_in_part_is_given_up_on_expiry_and_the_rest_is_reported():
    # Opening partition 1 raised while partition 0 opened: the membership recorded nothing held, and the
    # expiry's give-up skipped partition 0, which stayed open on this server.
    from waltz.zk.bridge import SessionState
    clock = Clock()
    cluster, membership, partitions, store = _member_with_flaky_partitions(clock)
    assert sorted(partitions.opened) == [0]
    assert partitions.problems() == ["partition 1 (generation 5) could not be opened: cannot open partition 1",
                                     "partition 0 (generation 5): the store is not writing"]
    membership._session_changed(SessionState.EXPIRED)
    assert partitions.opened == {} and partitions.problems() == []
    assert store.closed == [1, 0]                       # partition 1's store partition too, had it been made


def test_a_partition_that_could_not_be_opened_is_opened_again_by_the_reconcile_retry():
    # Caught and recorded, the failure let the membership count the assignment as applied: the same
    # assignment never reached the partitions again, and partition 1 stayed unserved everywhere.
    clock = Clock()
    cluster, membership, partitions, store = _member_with_flaky_partitions(clock)
    assert sorted(partitions.opened) == [0]
    store.failing = False
    clock.advance(membership.retry_interval)            # the reconcile retry
    cluster.descriptor_reads[-1].callback(_descriptors(111))
    assert sorted(partitions.opened) == [0, 1] and membership.partitions == {0: 5, 1: 5}
    assert store.opened == [(0, 5), (1, 5)]             # partition 0 was not opened twice
    membership.stop()


def test_a_partition_that_keeps_failing_to_open_is_retried_after_doubling_delays_then_at_once_again():
    # Retried every half second for as long as the open failed: a busy loop, with a warning each time.
    clock = Clock()
    cluster, membership, partitions, store = _member_with_flaky_partitions(clock)
    delays = []
    for _ in range(7):
        before, reads = clock.seconds(), len(cluster.descriptor_reads)
        while len(cluster.descriptor_reads) == reads:     # the next retry's pass
            clock.advance(0.25)
        delays.append(clock.seconds() - before)
        cluster.descriptor_reads[-1].callback(_descriptors(111))
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert sorted(partitions.opened) == [0]
    store.failing = False
    clock.advance(8.0)
    cluster.descriptor_reads[-1].callback(_descriptors(111))
    assert sorted(partitions.opened) == [0, 1]
    store.failing = True                                # a later failure starts from the first delay again
    partitions.assign({0: 5})
    membership.partitions = {0: 5}
    membership.request_reconcile()
    cluster.descriptor_reads[-1].callback(_descriptors(111))
    reads = len(cluster.descriptor_reads)
    clock.advance(0.5)
    assert len(cluster.descriptor_reads) == reads + 1
    membership.stop()


def test_an_assignment_whose_application_raised_is_still_given_up_on_expiry():
    from waltz.zk.bridge import SessionState
    clock, calls = Clock(), []

    def on_assignment(partitions):
        calls.append(dict(partitions))
        if len(calls) == 1:
            raise RuntimeError("opened partition 0, then failed")
    cluster = _OneSessionCluster(_assignment())
    membership = _member_of(cluster, clock, [])
    membership.partitions = {}
    membership.on_assignment = on_assignment
    membership.request_reconcile()
    cluster.descriptor_reads[0].callback(_descriptors(111))
    assert calls == [{0: 5, 1: 5}] and membership.partitions == {}
    membership._session_changed(SessionState.EXPIRED)
    assert calls == [{0: 5, 1: 5}, {}]
    membership.stop()


def test_a_store_partition_that_fails_to_close_is_logged_not_left_in_a_deferred():
    from twisted.logger import globalLogPublisher

    class FailingClose(DummyStore):
        def close_partition(self, partition_id):
            return defer.fail(RuntimeError("the session would not close"))
    events = []
    globalLogPublisher.addObserver(events.append)
    try:
        partitions = ServerPartitions(FailingClose(), DummyPartition)
        partitions.assign({0: 1})
        partitions.assign({})                       # moved away: nobody waits for the close
    finally:
        globalLogPublisher.removeObserver(events.append)
    [logged] = [e for e in events if e.get("log_format") == "closing store partition {pid} failed"]
    assert logged["pid"] == 0 and logged["log_failure"].check(RuntimeError)


def test_an_error_about_bad_partition_ids_names_a_few_and_counts_the_rest():
    # One request with millions of bad ids made a log line of tens of megabytes.
    from waltz.server.membership import InvalidPartitions, check_partitions
    with pytest.raises(InvalidPartitions) as raised:
        check_partitions(list(range(4, 4000000)) + [9], 4)
    assert str(raised.value) == "partition ids [4, 5, 6, 7, 8, 9, 10, 11, 12, 13] and 3999986 more are not in 0..3"
    with pytest.raises(InvalidPartitions, match=r"^partition ids \[-1, 7\] are not in 0..3$"):
        check_partitions([7, -1, 0, 7], 4)


@pytest.mark.parametrize("negotiated_ms, give_up_after", [(None, 24.0), (30000, 24.0), (6000, 4.8), (60000, 24.0)])
def test_the_give_up_counts_with_the_negotiated_session_timeout_when_zookeeper_granted_a_shorter_one(
        negotiated_ms, give_up_after):
    # zookeeper.sessionTimeout 30 s; a ZooKeeper whose maxSessionTimeout is 6 s expires the session 6 s after it
    # last heard from it: counting 0.8 x 30 s, the server gave its partitions up 18 s after they could have moved.
    cluster = _OneSessionCluster(_assignment())
    cluster.zk.negotiated_session_timeout_ms = negotiated_ms
    membership = _member_of(cluster, Clock(), [])
    assert membership.give_up_after == pytest.approx(give_up_after)
    assert membership.probe_interval == pytest.approx(give_up_after / 0.8 / 6)
