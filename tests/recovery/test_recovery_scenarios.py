"""Recovery scenarios: real ZooKeeper, storage nodes over real loopback sockets, the real store layer.

Each storage node is a real :class:`StorageNode` with its storage-protocol
port on 127.0.0.1, in this process (so a test can stop it, restart it on the
same directory and port, or plant records directly into one replica). The
server side is the real :class:`Store` / :class:`StorePartition` /
:class:`StoreSession` / recovery. Every scenario asserts the resolved
high-water mark, the record bytes on every replica and the partition metadata
in ZooKeeper.
"""

import shutil

import pytest
import pytest_twisted
from twisted.internet import defer, endpoints, reactor, task

from waltz.protocols import storage_messages as sm
from waltz.protocols.values import Record, ReqId, checksum
from waltz.server.store.partition import AppendFailed, AppendFateUnknown, PartitionNotOwned

from waltz.server.store.store import Store
from waltz.storage.handlers import NodeFactory, StorageServerProtocol
from waltz.storage.node import StorageNode
from waltz.zk.znodes import UNRESOLVED

PARTITION = 0
GROUP = 0


class LocalStorage:
    """A storage node served on a fixed loopback port that can be stopped and restarted."""

    def __init__(self, directory, params):
        self.directory = directory
        self.params = params
        self.node = None
        self.listening = None
        self.port = None
        self.connections = []

    @property
    def name(self):
        return "127.0.0.1:%d" % self.port

    @defer.inlineCallbacks
    def start(self):
        self.node = StorageNode(self.directory, reactor, segment_size_threshold=2048)
        yield self.node.open(self.params.key, self.params.num_partitions)
        factory = _TrackingFactory(self)
        endpoint = endpoints.TCP4ServerEndpoint(reactor, self.port or 0, interface="127.0.0.1")
        self.listening = yield endpoint.listen(factory)
        self.port = self.listening.getHost().port
        return self

    @defer.inlineCallbacks
    def stop(self):
        yield self.listening.stopListening()
        for proto in list(self.connections):
            proto.transport.abortConnection()
        yield self.node.close()
        self.node = None

    def records(self, partition=PARTITION):
        """Every record of the partition, read straight from the files (after the node's queue)."""
        log = self.node.partitions[partition].log
        return self.node.partitions[partition].worker.submit(lambda: tuple(log.read_records(0, 10 ** 6)))

    def plant(self, session_id, records, partition=PARTITION):
        """Append records directly to this replica (an uncommitted tail the server never acknowledged)."""
        return self.node.partition(partition).handle(sm.AppendRequest(session_id, 0, partition, tuple(records),
                                                                      False))


class _TrackingFactory(NodeFactory):
    def __init__(self, storage):
        super().__init__(StorageServerProtocol, storage.node)
        self.storage = storage

    def buildProtocol(self, addr):
        proto = super().buildProtocol(addr)
        self.storage.connections.append(proto)
        return proto


class Scenario:
    def __init__(self, metadata, tmp_path):
        self.metadata = metadata
        self.tmp_path = tmp_path
        self.storages = []
        self.stores = []
        self.params = None

    @defer.inlineCallbacks
    def add_storages(self, count, assign=True):
        if self.params is None:
            self.params = yield self.metadata.store_params()
        added = []
        for _ in range(count):
            storage = LocalStorage(str(self.tmp_path / ("storage%d" % len(self.storages))), self.params)
            yield storage.start()
            yield storage.node.assign([PARTITION], True)
            self.storages.append(storage)
            added.append(storage)
            yield self.metadata.edit_topology(lambda t, p, s=storage: t.add_storage(s.name, 1, GROUP))
            if assign:
                yield self.assign(storage)
        return added

    def assign(self, storage):
        return self.metadata.edit_topology(
            lambda t, p: t.assign(storage.name, [PARTITION], p.num_partitions))

    def unassign(self, storage):
        return self.metadata.edit_topology(lambda t, p: t.unassign(storage.name, [PARTITION]))

    @defer.inlineCallbacks
    def open_store(self, generation=1):
        store = Store(self.metadata, reactor, max_batch_size=7, initial_retry=0.05, max_retry=0.2,
                      recovery_retry_interval=0.05)
        yield store.start()
        self.stores.append(store)
        return store.partition(PARTITION, generation)

    @defer.inlineCallbacks
    def close_stores(self):
        for store in self.stores:
            yield store.stop()
        self.stores = []

    @defer.inlineCallbacks
    def stop(self):
        yield self.close_stores()
        for storage in self.storages:
            if storage.node is not None:
                yield storage.stop()


@pytest_twisted.async_yield_fixture
async def scenario(cluster_metadata, tmp_path):
    s = Scenario(cluster_metadata, tmp_path)
    yield s
    await s.stop()


def req(n):
    return ReqId(7, 1, PARTITION, n)


def payload(n):
    return ("txn-%d" % n).encode() * (1 + n % 5)


def append_all(partition, numbers):
    return defer.gatherResults([partition.append(req(n), n, payload(n), checksum(payload(n))) for n in numbers])


async def until(condition, timeout=10.0, interval=0.02):
    """Poll ``condition()`` (may return a Deferred) until true; fail after ``timeout`` seconds."""
    waited = 0.0
    while True:
        value = condition()
        if isinstance(value, defer.Deferred):
            value = await value
        if value:
            return value
        if waited >= timeout:
            raise AssertionError("condition not met within %.1f s: %r" % (timeout, condition))
        await task.deferLater(reactor, interval, lambda: None)
        waited += interval


async def writing(partition, timeout=10.0):
    await until(lambda: partition.healthy, timeout)
    return partition.session


async def all_joined(scenario, partition, storages=None, timeout=15.0):
    """Wait until every (given, running) storage has joined the session and holds the high-water mark."""
    def joined():
        running = [s for s in (storages or scenario.storages) if s.node]
        session = partition.session
        return (partition.healthy and {s.name for s in running} <= set(session.joined)
                and all(s.node.partitions[PARTITION].log.max_transaction_id == partition.high_water_mark
                        for s in running))
    await until(joined, timeout)


async def assert_replicas_hold(scenario, numbers, storages=None):
    """Every (given) replica holds exactly the transactions ``numbers`` (as payloads), byte for byte."""
    expected = [(t, payload(n)) for t, n in enumerate(numbers)]
    for storage in storages or scenario.storages:
        records = await storage.records()
        assert [(r.transaction_id, r.data) for r in records] == expected, storage.name
        assert all(r.is_valid() for r in records)


async def replica_states(scenario):
    versioned = await scenario.metadata.partition_metadata(PARTITION)
    metadata = versioned.value
    return metadata, {state.replica_id.storage: (state.session_id, state.closing_high_water_mark)
                      for state in metadata.replica_states}


@pytest_twisted.ensureDeferred
async def test_clean_start_writes_to_all_replicas_and_records_them_in_zookeeper(scenario):
    await scenario.add_storages(3)
    partition = await scenario.open_store()
    ids = await append_all(partition, range(10))
    assert ids == list(range(10)) and partition.high_water_mark == 9
    await until(lambda: all(len(s.node.partitions[PARTITION].log.read_records(0, 100)) == 10
                            for s in scenario.storages))
    await all_joined(scenario, partition)
    await assert_replicas_hold(scenario, range(10))
    metadata, states = await replica_states(scenario)
    assert metadata.generation == 1
    assert states == {s.name: (metadata.session_id, UNRESOLVED) for s in scenario.storages}
    # Reads come from a joined replica and never go past the high-water mark.
    assert [r.data for r in await partition.get_records(0, 100)] == [payload(n) for n in range(10)]
    assert [h.transaction_id for h in await partition.get_headers(5, 3)] == [5, 6, 7]
    assert (await partition.get_record(9)).data == payload(9) and await partition.get_record(10) is None
    first = scenario.storages[0]
    await first.stop()
    await until(lambda: partition.healthy and first.name not in partition.session.joined)
    assert [r.transaction_id for r in await partition.get_records(8, 5)] == [8, 9]
    await first.start()
    await until(lambda: partition.healthy and first.name in partition.session.joined)
    metadata, states = await replica_states(scenario)
    assert states == {s.name: (metadata.session_id, UNRESOLVED) for s in scenario.storages}


@pytest_twisted.ensureDeferred
async def test_clean_restart_and_idempotent_recovery(scenario):
    await scenario.add_storages(3)
    partition = await scenario.open_store()
    await append_all(partition, range(12))
    await all_joined(scenario, partition)
    await scenario.close_stores()
    for _ in range(2):  # recovering twice changes nothing but the session id
        partition = await scenario.open_store()
        session = await writing(partition)
        await all_joined(scenario, partition)
        assert partition.high_water_mark == 11 and session.low_water_mark == 11
        await all_joined(scenario, partition)
        await assert_replicas_hold(scenario, range(12))
        metadata, states = await replica_states(scenario)
        assert states == {s.name: (session.session_id, UNRESOLVED) for s in scenario.storages}
        await scenario.close_stores()
    partition = await scenario.open_store()
    assert await append_all(partition, [12, 13]) == [12, 13]


@pytest_twisted.ensureDeferred
async def test_dirty_tail_on_one_replica_is_truncated(scenario):
    a, b, c = await scenario.add_storages(3)
    partition = await scenario.open_store()
    await append_all(partition, range(8))
    await all_joined(scenario, partition)
    session_id = partition.session.session_id
    await scenario.close_stores()
    # Replica a got three more transactions that never reached a quorum.
    await a.plant(session_id, [Record.create(t, req(t), 0, b"dirty") for t in (8, 9, 10)])
    partition = await scenario.open_store()
    await writing(partition)
    assert partition.high_water_mark == 7
    await all_joined(scenario, partition)
    await assert_replicas_hold(scenario, range(8))
    assert await append_all(partition, [20]) == [8]
    await until(lambda: len(a.node.partitions[PARTITION].log.read_records(0, 100)) == 9)
    await all_joined(scenario, partition)
    await assert_replicas_hold(scenario, list(range(8)) + [20])


@pytest_twisted.ensureDeferred
async def test_tail_on_a_quorum_is_committed(scenario):
    a, b, c = await scenario.add_storages(3)
    partition = await scenario.open_store()
    await append_all(partition, range(5))
    await all_joined(scenario, partition)
    session_id = partition.session.session_id
    await scenario.close_stores()
    tail = [Record.create(t, req(t), t, payload(t)) for t in (5, 6)]
    await a.plant(session_id, tail)
    await b.plant(session_id, tail)
    partition = await scenario.open_store()
    await writing(partition)
    assert partition.high_water_mark == 6
    await until(lambda: c.node.partitions[PARTITION].log.max_transaction_id == 6)  # c caught up
    await all_joined(scenario, partition)
    await assert_replicas_hold(scenario, range(7))


@pytest_twisted.ensureDeferred
async def test_stale_snapshot_is_truncated_to_its_own_low_water_mark_and_caught_up(scenario):
    a, b, c = await scenario.add_storages(3)
    partition = await scenario.open_store()
    await append_all(partition, range(6))
    await all_joined(scenario, partition)
    await scenario.close_stores()
    partition = await scenario.open_store()  # session 2 starts with low-water mark 5 on every replica
    await all_joined(scenario, partition)
    await scenario.close_stores()
    await c.stop()
    snapshot = str(scenario.tmp_path / "snapshot")
    shutil.copytree(c.directory, snapshot)
    await c.start()
    partition = await scenario.open_store()
    await append_all(partition, range(6, 15))
    await all_joined(scenario, partition)
    await scenario.close_stores()
    await c.stop()
    shutil.rmtree(c.directory)
    shutil.copytree(snapshot, c.directory)  # c comes back from the old snapshot
    await c.start()
    partition = await scenario.open_store()
    await writing(partition)
    assert partition.high_water_mark == 14
    await until(lambda: c.node.partitions[PARTITION].log.max_transaction_id == 14)
    await all_joined(scenario, partition)
    await assert_replicas_hold(scenario, range(15))


@pytest_twisted.ensureDeferred
async def test_one_replica_down_during_recovery_recovers_in_the_background(scenario):
    a, b, c = await scenario.add_storages(3)
    partition = await scenario.open_store()
    await append_all(partition, range(4))
    await all_joined(scenario, partition)
    await scenario.close_stores()
    await c.stop()
    partition = await scenario.open_store()
    session = await writing(partition)
    assert set(session.joined) == {a.name, b.name}
    await append_all(partition, range(4, 9))
    metadata, states = await replica_states(scenario)
    assert states[c.name][1] == 3  # c missed the session: its closing high-water mark is resolved
    await c.start()
    # c recovers in the background, catches up and joins the running session.
    await until(lambda: partition.session is not None and c.name in partition.session.joined, 15)
    await append_all(partition, [9])
    await until(lambda: c.node.partitions[PARTITION].log.max_transaction_id == 9)
    await all_joined(scenario, partition)
    await assert_replicas_hold(scenario, range(10))
    metadata, states = await replica_states(scenario)
    assert states == {s.name: (partition.session.session_id, UNRESOLVED) for s in scenario.storages}


@pytest_twisted.ensureDeferred
async def test_two_replicas_down_is_undecidable_until_the_one_back_copies_from_the_one_ahead(scenario):
    a, b, c = await scenario.add_storages(3)
    partition = await scenario.open_store()
    await append_all(partition, range(3))
    await all_joined(scenario, partition)
    session_id = partition.session.session_id
    await scenario.close_stores()
    await a.plant(session_id, [Record.create(3, req(3), 3, payload(3))])  # a holds 3; did b?
    await b.stop()
    await c.stop()
    partition = await scenario.open_store()
    pending = partition.append(req(50), 0, payload(50), checksum(payload(50)))
    await until(lambda: partition.session is not None
                and partition.session.recovery.state.value == "undecidable")
    assert not partition.healthy and not pending.called
    # c has 0..2: votes {3, 2} with b offline, and 3 could be on b. Seed 000: it becomes decidable when c
    # catches up with a. c copies 3 from a and votes 3; a and c hold it, a quorum.
    await c.start()
    await writing(partition, 15)
    assert partition.session.recovery.high_water_mark == 3
    assert await pending == 4
    await b.start()  # b has 0..2: it is caught up and joins
    await all_joined(scenario, partition)
    await assert_replicas_hold(scenario, [0, 1, 2, 3, 50], [a, b, c])


@pytest_twisted.ensureDeferred
async def test_replica_added_removed_and_replaced(scenario):
    a, b, c = await scenario.add_storages(3)
    partition = await scenario.open_store()
    await append_all(partition, range(5))
    (d,) = await scenario.add_storages(1)   # added: the session re-opens and d catches up
    await until(lambda: partition.session is not None and d.name in partition.session.joined, 15)
    await append_all(partition, [5])
    await until(lambda: d.node.partitions[PARTITION].log.max_transaction_id == 5)
    await all_joined(scenario, partition)
    await assert_replicas_hold(scenario, range(6))
    metadata, states = await replica_states(scenario)
    assert set(states) == {a.name, b.name, c.name, d.name}
    await scenario.unassign(a)               # removed
    await until(lambda: partition.session is not None and partition.healthy
                and set(partition.session.replicas) == {b.name, c.name, d.name}, 15)
    await append_all(partition, [6])
    metadata, states = await replica_states(scenario)
    assert set(states) == {b.name, c.name, d.name}
    (e,) = await scenario.add_storages(1, assign=False)   # replaced: b out, e in, in one change
    await scenario.metadata.edit_topology(
        lambda t, p: t.assign(e.name, [PARTITION], p.num_partitions).unassign(b.name, [PARTITION]))
    await until(lambda: partition.session is not None and partition.healthy
                and set(partition.session.replicas) == set(partition.session.joined) == {c.name, d.name, e.name},
                15)
    await append_all(partition, [7])
    await until(lambda: e.node.partitions[PARTITION].log.max_transaction_id == 7)
    await all_joined(scenario, partition, [c, d, e])
    await assert_replicas_hold(scenario, range(8), [c, d, e])
    metadata, states = await replica_states(scenario)
    assert states == {s.name: (partition.session.session_id, UNRESOLVED) for s in (c, d, e)}


@pytest_twisted.ensureDeferred
async def test_a_replica_added_while_another_is_down_does_not_outvote_what_a_quorum_acknowledged(scenario):
    a, b, c = await scenario.add_storages(3)
    partition = await scenario.open_store()
    await append_all(partition, range(5))
    await c.stop()                           # the next session writes on a and b alone: 2 of 3
    assert await append_all(partition, range(5, 21)) == list(range(5, 21))
    (d,) = await scenario.add_storages(1)   # a new session over a, b, c, d, with c still down
    # Only a and b took part in the last session: they decide (at 20) without c. Counting the vote
    # over the new assignment (quorum 3 of 4) would wait for c, which holds only 0..4, and d, which
    # holds nothing, and resolve at 4: acknowledged transactions 5..20 would be truncated.
    await until(lambda: partition.healthy and set(partition.session.replicas) == {s.name for s in (a, b, c, d)}, 15)
    assert partition.high_water_mark == 20
    await c.start()
    await append_all(partition, [21])
    await all_joined(scenario, partition)
    await assert_replicas_hold(scenario, range(22))


@pytest_twisted.ensureDeferred
async def test_second_session_fences_the_first(scenario):
    await scenario.add_storages(3)
    old = await scenario.open_store(generation=1)
    told = []
    old.add_lost_listener(told.append)
    await append_all(old, range(3))
    new = await scenario.open_store(generation=2)   # another server takes the partition over
    await writing(new)
    assert await append_all(new, [3]) == [3]
    with pytest.raises((AppendFailed, AppendFateUnknown, PartitionNotOwned)):
        await old.append(req(99), 0, b"stale", checksum(b"stale"))
    await until(lambda: old.lost is not None)
    assert "generation 1" in old.lost and told == [old.lost], "its lost listeners are told once"
    await all_joined(scenario, new)
    await assert_replicas_hold(scenario, range(4))
    metadata, _ = await replica_states(scenario)
    assert metadata.generation == 2 and metadata.session_id == new.session.session_id


@pytest_twisted.ensureDeferred
async def test_storage_failure_while_writing_settles_every_append_once(scenario):
    a, b, c = await scenario.add_storages(3)
    partition = await scenario.open_store()
    results = append_all(partition, range(30))
    await until(lambda: partition.high_water_mark >= 5)
    await c.stop()
    ids = await results
    assert sorted(ids) == list(range(30)) and ids == sorted(ids)
    await append_all(partition, range(30, 35))
    await c.start()
    await until(lambda: c.node is not None and PARTITION in c.node.partitions
                and c.node.partitions[PARTITION].log.max_transaction_id == 34, 15)
    await all_joined(scenario, partition)
    await assert_replicas_hold(scenario, range(35))


@pytest_twisted.ensureDeferred
async def test_several_replicas_added_and_removed_at_once(scenario):
    a, b, c = await scenario.add_storages(3)
    partition = await scenario.open_store()
    await append_all(partition, range(6))
    d, e = await scenario.add_storages(2, assign=False)
    await scenario.metadata.edit_topology(   # seed 000 example 2: two replicas added in one change
        lambda t, p: t.assign(d.name, [PARTITION], p.num_partitions).assign(e.name, [PARTITION], p.num_partitions))
    await all_joined(scenario, partition)
    assert set(partition.session.replicas) == {s.name for s in (a, b, c, d, e)} and partition.session.quorum == 3
    await append_all(partition, [6])
    await all_joined(scenario, partition)
    await assert_replicas_hold(scenario, range(7))
    await scenario.metadata.edit_topology(   # example 4: two replicas removed in one change
        lambda t, p: t.unassign(c.name, [PARTITION]).unassign(d.name, [PARTITION]))
    await until(lambda: partition.healthy and set(partition.session.replicas) == {a.name, b.name, e.name})
    await append_all(partition, [7])
    await all_joined(scenario, partition, [a, b, e])
    await assert_replicas_hold(scenario, range(8), [a, b, e])
    metadata, states = await replica_states(scenario)
    assert states == {s.name: (partition.session.session_id, UNRESOLVED) for s in (a, b, e)}
