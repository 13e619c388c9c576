"""The server partition on a dummy store and dummy connections, on a deterministic Clock.

``DummyStore`` implements IStorePartition in memory: appends wait until the
test commits or fails them (or commit at once with ``auto_commit``), reads
never go past the high-water mark, listeners hear of every commit.
``DummyConnection`` records what the partition sends.
"""

import gc

import pytest
from twisted.internet import defer
from twisted.internet.task import Clock
from twisted.logger import globalLogPublisher
from zope.interface import implementer
from zope.interface.verify import verifyObject

from waltz.interfaces import IStorePartition
from waltz.metrics import Registry
from waltz.protocols.client_messages import (
    CLIENT_CODEC, AppendRequest, FeedData, FeedRequest, FeedSuspended, FlushRequest, FlushResponse, HighWaterMarkRequest,
    HighWaterMarkResponse, LockFailure, MountRequest, MountResponse, MountState, TransactionDataRequest,
    TransactionDataResponse)
from waltz.protocols.locks import lock_hash
from waltz.protocols.values import Record, ReqId
from waltz.server.caches import FeedCache, TransactionDataCache
from waltz.server import partition as partition_module
from waltz.server.partition import (
    AppendTaskState, ClientConnection, PartitionClosed, PartitionMetrics, PartitionSettings, PartitionState,
    ServerPartition)
from waltz.protocols.read_gate import MAX_READS_IN_FLIGHT, ReadGate
from waltz.server.store.partition import AppendFailed, AppendFateUnknown, PartitionNotOwned

PID = 3
GEN = 7


@implementer(IStorePartition)
class DummyStore:
    """An in-memory store partition; the test decides when appends commit or fail."""

    def __init__(self, records=0, healthy=True, auto_commit=False, partition_id=PID):
        self.partition_id = partition_id
        self.records = [Record.create(i, ReqId(99, 1, partition_id, i), 1000 + i, b"old-%d" % i)
                        for i in range(records)]
        self.high_water_mark = records - 1
        self.healthy = healthy
        self.auto_commit = auto_commit
        self.pending = []          # (req_id, header, data, checksum, deferred)
        self.listeners = []
        self.lost_listeners = []
        self.lost = None
        self.header_reads = []
        self.record_reads = []
        self.fail_reads = None
        self.closed = False

    # IStorePartition
    def append(self, req_id, header, data, checksum):
        d = defer.Deferred()
        self.pending.append((req_id, header, data, checksum, d))
        if self.auto_commit:
            self.commit()
        return d

    def flush(self):
        return defer.succeed(self.high_water_mark)

    def get_record(self, transaction_id):
        self.record_reads.append(transaction_id)
        if self.fail_reads:
            return defer.fail(self.fail_reads)
        if 0 <= transaction_id <= self.high_water_mark:
            return defer.succeed(self.records[transaction_id])
        return defer.succeed(None)

    def get_records(self, transaction_id, max_records):
        if self.fail_reads:
            return defer.fail(self.fail_reads)
        end = min(self.high_water_mark + 1, transaction_id + max_records)
        return defer.succeed(tuple(self.records[transaction_id:end]))

    def get_headers(self, transaction_id, max_records):
        self.header_reads.append((transaction_id, max_records))
        if self.fail_reads:
            return defer.fail(self.fail_reads)
        end = min(self.high_water_mark + 1, transaction_id + max_records)
        return defer.succeed(tuple(r.record_header for r in self.records[transaction_id:end]))

    def add_listener(self, listener):
        self.listeners.append(listener)

    def add_lost_listener(self, listener):
        self.lost_listeners.append(listener)

    def close(self):
        self.closed = True
        pending, self.pending = self.pending, []
        for *_, d in pending:
            d.errback(AppendFateUnknown("closed"))
        return defer.succeed(None)

    # test controls
    def commit(self, count=None):
        """Commit the ``count`` oldest pending appends (all by default), then tell the listeners."""
        count = len(self.pending) if count is None else count
        batch, self.pending = self.pending[:count], self.pending[count:]
        for req_id, header, data, checksum, d in batch:
            self.high_water_mark += 1
            self.records.append(Record(self.high_water_mark, req_id, header, data, checksum))
            d.callback(self.high_water_mark)
        self.notify()

    def fail(self, count=1, error=AppendFailed):
        batch, self.pending = self.pending[:count], self.pending[count:]
        for *_, d in batch:
            d.errback(error("test failure"))

    def notify(self):
        for listener in list(self.listeners):
            listener(self.high_water_mark)

    def become_healthy(self):
        self.healthy = True
        self.notify()


@implementer(ClientConnection)
class DummyConnection:
    """Records what is sent to it; ``writable`` and ``closed`` are set by the test."""

    def __init__(self, name="conn"):
        self.name = name
        self.sent = []
        self.writable = True
        self.closed = False
        self.data_reads = ReadGate(self)

    def run_data_read(self, read):
        return self.data_reads.run(read)

    def sendMessage(self, message):
        assert not self.closed, "sent %r on a closed connection" % (message,)
        self.sent.append(message)

    def sendPayloads(self, payloads):
        for payload in payloads:
            self.sendMessage(CLIENT_CODEC.decode(payload, CLIENT_CODEC.versions[-1]))

    def of(self, kind):
        return [m for m in self.sent if isinstance(m, kind)]

    def take(self):
        sent, self.sent = self.sent, []
        return sent

    def __repr__(self):
        return "<DummyConnection %s>" % self.name


def rid(seq, client=1, generation=GEN, partition=PID):
    return ReqId(client, generation, partition, seq)


def append(seq, client_hwm=-1, data=b"data", header=0, client=1, generation=GEN, **locks):
    return AppendRequest.create(rid(seq, client, generation), client_hwm, header or seq, data + b"-%d" % seq,
                                **locks)


class Harness:
    def __init__(self, records=0, settings=None, healthy=True, auto_commit=False, store=None, **kwargs):
        self.clock = Clock()
        self.store = store or DummyStore(records, healthy=healthy, auto_commit=auto_commit)
        self.registry = Registry()
        self.metrics = PartitionMetrics(self.registry)
        self.partition = ServerPartition(PID, GEN, self.store, settings or PartitionSettings(), self.clock,
                                         metrics=self.metrics, **kwargs)
        self.started = self.partition.start()

    def handle(self, connection, message):
        return self.partition.handle(connection, message)

    def mount(self, connection, client_hwm=-1, seq_num=1, client=1, generation=GEN, mount_seq=0):
        request = MountRequest(rid(mount_seq, client, generation), client_hwm, seq_num)
        self.handle(connection, request)
        self.run()
        return request

    def run(self):
        """Let every scheduled feed turn run."""
        for _ in range(1000):
            if not self.clock.getDelayedCalls():
                return
            calls = [c for c in self.clock.getDelayedCalls() if c.getTime() <= self.clock.seconds()]
            if not calls:
                return
            self.clock.advance(0)
        raise AssertionError("feed turns never stop")

    def counter(self, name, *labels):
        return self.registry.get(name).value(*labels)


def feed_ids(connection):
    return [m.transaction_id for m in connection.of(FeedData)]


@pytest.fixture
def h():
    return Harness()


@pytest.fixture(autouse=True)
def no_logged_failures():
    """Fail a test that logs an unexpected failure (an error in a callback, an unhandled Deferred error)."""
    events = []
    globalLogPublisher.addObserver(events.append)
    yield events
    gc.collect()
    globalLogPublisher.removeObserver(events.append)
    failures = [e for e in events if "log_failure" in e and not e.get("expected_failure")]
    assert failures == [], [f["log_failure"].getTraceback() for f in failures]


# -- start and close --------------------------------------------------------------------------

def test_dummies_implement_the_interfaces():
    verifyObject(IStorePartition, DummyStore())
    verifyObject(ClientConnection, DummyConnection())


def test_start_waits_for_a_writing_store_and_initialises_the_lock_table_at_its_hwm():
    h = Harness(records=5, healthy=False)
    fired = []
    h.started.addCallback(fired.append)
    assert h.partition.state is PartitionState.STARTING and not fired
    conn = DummyConnection()
    h.mount(conn)
    assert conn.sent == [MountResponse(rid(0), MountState.NOT_READY)]
    h.store.become_healthy()
    assert fired == [h.partition] and h.partition.state is PartitionState.SERVING
    assert h.partition.high_water_mark == 4
    assert h.partition.locks.lock_estimate(lock_hash("a", 1)) == 4
    assert h.partition.healthy


def test_close_stops_everything_and_pending_mounts_get_not_ready():
    h = Harness()
    conn = DummyConnection()
    h.mount(conn)
    h.handle(conn, append(1))
    other = DummyConnection("other")
    h.handle(other, MountRequest(rid(0, client=2), -1, 1))           # waits behind the in-flight append
    h.handle(conn, FlushRequest(rid(2)))
    assert other.sent == []
    closed = h.partition.close()
    assert closed.called and h.store.closed
    assert other.sent == [MountResponse(rid(0, client=2), MountState.NOT_READY)]
    assert conn.of(FlushResponse) == []
    assert h.partition.state is PartitionState.CLOSED
    h.handle(conn, MountRequest(rid(5), -1, 2))
    assert conn.sent[-1] == MountResponse(rid(5), MountState.NOT_READY)
    h.handle(conn, TransactionDataRequest(rid(6), 0))
    assert not conn.sent[-1].ok


def test_close_answers_not_ready_to_a_mount_whose_catch_up_was_under_way():
    # Only mounts still waiting at their barrier were answered: one whose catch-up had started lost its
    # READY with the feed, and its client waited in MOUNTING for ever.
    h = Harness(records=5000)
    conn = DummyConnection()
    h.handle(conn, MountRequest(rid(0), -1, 1))
    conn.writable = False                   # a slow reader: the catch-up is under way
    h.run()
    assert h.partition.feeds.feed_of(conn) is not None and conn.of(MountResponse) == []
    h.partition.close()
    h.run()
    assert conn.of(MountResponse) == [MountResponse(rid(0), MountState.NOT_READY)]


def test_closing_leaves_the_shared_caches_alone():
    # Committed entries never change: they age out. Dropping them meant walking every key of the
    # server-wide caches on the reactor (0.4 s per partition with a full data cache).
    h = Harness()
    conn = DummyConnection()
    h.mount(conn)
    h.handle(conn, append(1))
    h.store.commit()
    h.run()
    assert h.partition.data_cache.get(PID, 0) is not None
    h.partition.close()
    assert h.partition.data_cache.get(PID, 0).data == b"data-1"
    assert h.partition.feed_cache.get(PID, 0) is not None


def test_start_fails_when_closed_first():
    h = Harness(healthy=False)
    failures = []
    h.started.addErrback(failures.append)
    h.partition.close()
    assert failures[0].check(PartitionClosed)


# -- append, commit, feed ---------------------------------------------------------------------

def test_append_commit_feed_in_order_with_the_original_req_ids(h):
    a, b = DummyConnection("a"), DummyConnection("b")
    h.mount(a, client=1)
    h.mount(b, client=2)
    assert a.take() == [MountResponse(rid(0, 1), MountState.READY)]
    assert b.take() == [MountResponse(rid(0, 2), MountState.READY)]
    h.handle(a, FeedRequest(rid(0, 1), -1))
    h.handle(b, FeedRequest(rid(0, 2), -1))
    h.handle(a, append(1, client=1))
    h.handle(b, append(1, client=2))
    h.handle(a, append(2, client=1))
    assert len(h.store.pending) == 3
    h.store.commit()
    h.run()
    expected = [FeedData(rid(1, 1), 0, 1), FeedData(rid(1, 2), 1, 1), FeedData(rid(2, 1), 2, 2)]
    assert a.of(FeedData) == expected and b.of(FeedData) == expected
    assert h.partition.high_water_mark == 2
    assert h.counter("waltz_server_committed_appends_total", PID) == 3
    assert h.counter("waltz_server_feed_items_total", PID) == 6


def test_failed_appends_send_nothing_and_release_their_locks(h):
    conn = DummyConnection()
    h.mount(conn)
    conn.take()
    lock = lock_hash("account", 1)
    h.handle(conn, append(1, write_locks=[lock]))
    h.store.fail(error=AppendFailed)
    h.handle(conn, append(2, write_locks=[lock]))
    assert len(h.store.pending) == 1           # not held back: the failed append left no in-flight lock
    h.store.fail(error=AppendFateUnknown)
    h.run()
    assert conn.sent == []
    assert h.partition.locks.held == 0
    assert h.partition.locks.lock_estimate(lock) == -1


def test_lock_failure_carries_the_estimate(h):
    conn = DummyConnection()
    h.mount(conn)
    lock = lock_hash("account", 1)
    h.handle(conn, append(1, write_locks=[lock]))
    h.handle(conn, append(2, write_locks=[lock_hash("account", 2)]))
    h.store.commit()
    conn.take()
    # Client at hwm 0 has seen transaction 0 (which wrote the lock): fine.
    h.handle(conn, append(3, client_hwm=0, write_locks=[lock]))
    assert len(h.store.pending) == 1
    h.store.commit()
    # Client still at hwm 1 has not seen transaction 2: lock failure with the estimate 2.
    h.handle(conn, append(4, client_hwm=1, write_locks=[lock], data=b"stale"))
    assert conn.of(LockFailure) == [LockFailure(rid(4), 2)]
    assert h.store.pending == []
    assert h.counter("waltz_server_lock_failures_total", PID) == 1


def test_a_store_reporting_an_id_already_committed_closes_the_partition_instead_of_feeding_it(h):
    a = DummyConnection("a")
    h.mount(a, client=1)
    h.handle(a, FeedRequest(rid(0, 1), -1))
    h.handle(a, append(1, client=1))
    h.handle(a, append(2, client=1))
    h.store.commit(1)
    h.run()
    *_, second = h.store.pending[0]
    h.store.pending = []
    second.callback(0)                          # a store bug: transaction 0 again
    h.run()
    assert [m.transaction_id for m in a.of(FeedData)] == [0]
    assert h.partition.state is PartitionState.CLOSED
    assert h.partition.feed_cache.get(PID, 0).req_id == rid(1, 1)


def test_an_in_flight_conflict_waits_for_the_commit_then_fails(h):
    conn = DummyConnection()
    h.mount(conn)
    conn.take()
    lock = lock_hash("account", 1)
    h.handle(conn, append(1, client_hwm=-1, write_locks=[lock]))
    released = h.handle(conn, append(2, client_hwm=-1, read_locks=[lock]))
    unrelated = h.handle(conn, append(3, client_hwm=-1, write_locks=[lock_hash("account", 9)]))
    # The reader cannot be decided while the writer is in flight, and later appends keep their order.
    assert len(h.store.pending) == 1
    assert h.partition.append_state is AppendTaskState.WAITING_FOR_LOCKS
    assert isinstance(released, defer.Deferred) and not released.called and not unrelated.called
    h.store.commit()
    assert released.called and unrelated.called
    assert conn.of(LockFailure) == [LockFailure(rid(2), 0)]
    assert [p[0] for p in h.store.pending] == [rid(3)]


def test_an_in_flight_conflict_passes_when_the_writer_fails(h):
    conn = DummyConnection()
    h.mount(conn)
    conn.take()
    lock = lock_hash("account", 1)
    h.handle(conn, append(1, write_locks=[lock]))
    h.handle(conn, append(2, write_locks=[lock]))
    assert len(h.store.pending) == 1
    h.store.fail()
    assert [p[0] for p in h.store.pending] == [rid(2)]
    assert conn.of(LockFailure) == []


def test_generation_fencing_drops_appends_silently(h):
    conn = DummyConnection()
    h.mount(conn)
    conn.take()
    assert h.handle(conn, append(1, generation=GEN - 1)) is None
    assert h.handle(conn, append(2, generation=GEN + 1)) is None
    assert h.store.pending == [] and conn.sent == []
    assert h.counter("waltz_server_dropped_appends_total", PID, "generation") == 2


def test_appends_from_an_unmounted_connection_are_dropped(h):
    conn = DummyConnection()
    h.handle(conn, append(1))
    h.handle(conn, FeedRequest(rid(0), -1))
    h.run()
    assert h.store.pending == [] and conn.sent == []
    assert h.counter("waltz_server_dropped_appends_total", PID, "not-mounted") == 1


# -- flush and high-water mark ----------------------------------------------------------------

def mounted_with_two_appends_then_a_flush(h):
    """A mounted connection that sent appends 1 and 2 (still with the store), then FlushRequest 3."""
    conn = DummyConnection()
    h.mount(conn)
    conn.take()
    h.handle(conn, append(1))
    h.handle(conn, append(2))
    h.handle(conn, FlushRequest(rid(3)))
    return conn


def test_flush_answers_once_every_earlier_append_settled(h):
    conn = mounted_with_two_appends_then_a_flush(h)
    later = h.handle(conn, append(4))
    assert conn.sent == [] and len(h.store.pending) == 2
    assert h.partition.append_state is AppendTaskState.WAITING_FOR_DRAIN
    assert isinstance(later, defer.Deferred) and not later.called
    h.store.commit(1)
    assert conn.sent == []
    h.store.fail(1)
    assert conn.sent == [FlushResponse(rid(3), 0)]
    assert later.called and [p[0] for p in h.store.pending] == [rid(4)]


def test_flush_with_nothing_pending_answers_at_once_and_hwm_request(h):
    conn = DummyConnection()
    h.handle(conn, FlushRequest(rid(1)))
    h.handle(conn, HighWaterMarkRequest(rid(2)))
    assert conn.sent == [FlushResponse(rid(1), -1), HighWaterMarkResponse(rid(2), -1)]


def test_hwm_request_before_start_waits_for_it():
    h = Harness(records=3, healthy=False)
    conn = DummyConnection()
    h.handle(conn, HighWaterMarkRequest(rid(1)))
    assert conn.sent == []
    h.store.become_healthy()
    assert conn.sent == [HighWaterMarkResponse(rid(1), 2)]


# -- mount --------------------------------------------------------------------------------------

def test_mount_streams_everything_after_the_client_hwm_then_ready():
    h = Harness(records=5)
    conn = DummyConnection()
    h.mount(conn, client_hwm=1)
    assert feed_ids(conn) == [2, 3, 4]
    assert conn.of(FeedData)[0] == FeedData(ReqId(99, 1, PID, 2), 2, 1002)
    assert conn.sent[-1] == MountResponse(rid(0), MountState.READY)
    assert h.partition.is_mounted(conn, 1)


def test_mount_waits_for_pending_appends_so_the_client_sees_them_before_ready(h):
    conn = DummyConnection()
    h.mount(conn)
    conn.take()
    h.handle(conn, append(1))
    new = DummyConnection("new")
    h.handle(new, MountRequest(rid(10), -1, 2))          # the client reconnects
    h.run()
    assert new.sent == []
    h.store.commit()
    h.run()
    assert new.sent == [FeedData(rid(1), 0, 1), MountResponse(rid(10), MountState.READY)]


def test_mount_of_a_client_ahead_is_client_ahead():
    h = Harness(records=2)
    conn = DummyConnection()
    h.mount(conn, client_hwm=5)
    assert conn.sent == [MountResponse(rid(0), MountState.CLIENT_AHEAD)]
    assert h.counter("waltz_server_mounts_total", PID, "CLIENT_AHEAD") == 1


def test_mount_with_another_generation_is_not_ready(h):
    conn = DummyConnection()
    h.mount(conn, generation=GEN + 1)
    assert conn.sent == [MountResponse(rid(0, generation=GEN + 1), MountState.NOT_READY)]
    assert not h.partition.is_mounted(conn, 1)


def test_a_stale_connection_is_replaced_only_by_a_higher_generation_and_seq_num():
    h = Harness(records=1)
    old, new, stale = DummyConnection("old"), DummyConnection("new"), DummyConnection("stale")
    h.mount(old, client_hwm=0, seq_num=5)
    h.handle(old, FeedRequest(rid(0), 0))
    h.mount(stale, client_hwm=0, seq_num=4)
    assert stale.sent == [] and h.partition.is_mounted(old, 1)
    h.mount(new, client_hwm=0, seq_num=6)
    assert new.sent == [MountResponse(rid(0), MountState.READY)]
    assert h.partition.is_mounted(new, 1) and not h.partition.is_mounted(old, 1)
    # The old connection no longer gets the feed, and its appends are dropped.
    old.take()
    h.handle(old, append(1))
    assert h.store.pending == []
    h.handle(new, FeedRequest(rid(0), 0))
    h.handle(new, append(2))
    h.store.commit()
    h.run()
    assert old.sent == [] and feed_ids(new) == [1]
    # The old connection closing does not unmount the new one (PR #167).
    old.closed = True
    h.partition.connection_closed(old)
    assert h.partition.is_mounted(new, 1)
    new.closed = True
    h.partition.connection_closed(new)
    assert h.partition.mounted_clients == {}


def test_an_older_connection_cannot_take_back_a_mount_released_by_a_newer_one():
    h = Harness(records=1)
    old, new, newest = DummyConnection("old"), DummyConnection("new"), DummyConnection("newest")
    h.mount(old, client_hwm=0, seq_num=5)
    h.mount(new, client_hwm=0, seq_num=6)
    new.closed = True
    h.partition.connection_closed(new)
    assert h.partition.mounted_clients == {}
    old.take()
    h.mount(old, client_hwm=0, seq_num=5, mount_seq=1)
    assert old.sent == [] and not h.partition.is_mounted(old, 1)
    # Its appends are still dropped; a newer connection mounts, and another client is not fenced.
    h.handle(old, append(1))
    assert h.store.pending == []
    h.mount(newest, client_hwm=0, seq_num=7)
    assert newest.sent == [MountResponse(rid(0), MountState.READY)] and h.partition.is_mounted(newest, 1)
    other = DummyConnection("other")
    h.mount(other, client_hwm=0, seq_num=1, client=2)
    assert h.partition.is_mounted(other, 2)


def test_released_mount_keys_are_kept_for_a_bounded_number_of_clients(monkeypatch):
    monkeypatch.setattr(partition_module, "RELEASED_MOUNTS_KEPT", 2)
    h = Harness(records=1)
    old = DummyConnection("old")
    h.mount(old, client_hwm=0, seq_num=5)
    for client in (1, 2, 3):
        conn = DummyConnection("c%d" % client)
        h.mount(conn, client_hwm=0, seq_num=6, client=client)
        conn.closed = True
        h.partition.connection_closed(conn)
    # Client 1's floor, the oldest, was forgotten: its old connection may mount again.
    h.mount(old, client_hwm=0, seq_num=5, mount_seq=1)
    assert h.partition.is_mounted(old, 1)


def test_a_remount_on_the_same_connection_with_the_same_key_is_accepted():
    h = Harness(records=2)
    conn = DummyConnection()
    h.mount(conn, client_hwm=1, seq_num=3)
    h.mount(conn, client_hwm=1, seq_num=3, mount_seq=1)
    assert conn.of(MountResponse) == [MountResponse(rid(0), MountState.READY),
                                      MountResponse(rid(1), MountState.READY)]


def test_a_mount_replaced_on_its_connection_by_a_newer_key_before_it_completed_gets_no_answer():
    # Both waited behind the same append; the older one got READY (or CLIENT_AHEAD) too.
    h = Harness(records=3)
    conn = DummyConnection()
    h.mount(conn, client_hwm=2, seq_num=1)
    h.handle(conn, append(1, client_hwm=2))
    h.run()
    conn.take()
    h.handle(conn, MountRequest(rid(5), 3, 2))     # key (GEN, 2), nothing to catch up once the append commits
    h.handle(conn, MountRequest(rid(6), 3, 3))     # key (GEN, 3), on the same connection
    h.store.commit()
    h.run()
    assert conn.of(MountResponse) == [MountResponse(rid(6), MountState.READY)]


def test_a_mount_replaced_by_one_on_another_connection_gets_no_answer_when_the_partition_closes():
    # docs/protocol.md, "Mounts": a superseded mount gets no answer. Closing answered it NOT_READY anyway.
    h = Harness(records=1)
    first = DummyConnection("first")
    h.mount(first, client_hwm=0, seq_num=1)
    h.handle(first, append(1, client_hwm=0))          # the store holds it: later mounts wait behind it
    old, new = DummyConnection("old"), DummyConnection("new")
    h.handle(old, MountRequest(rid(5), 0, 2))          # key (GEN, 2)
    h.handle(new, MountRequest(rid(6), 0, 3))          # key (GEN, 3): replaces it before it completed
    h.run()
    h.partition.close()
    h.run()
    assert new.of(MountResponse) == [MountResponse(rid(6), MountState.NOT_READY)]
    assert old.of(MountResponse) == []


def test_a_feed_request_of_an_earlier_mount_does_not_replace_the_mount_catch_up():
    h = Harness(records=5)
    conn = DummyConnection()
    h.handle(conn, MountRequest(rid(10), -1, 1))   # the client's new mount on its connection, 5 behind
    h.handle(conn, FeedRequest(rid(1), -1))        # sent for its earlier mount, before it remounted
    h.run()
    assert feed_ids(conn) == [0, 1, 2, 3, 4]
    assert conn.sent[-1] == MountResponse(rid(10), MountState.READY)


def test_a_feed_request_of_the_current_mount_before_ready_is_dropped():
    h = Harness(records=5)
    conn = DummyConnection()
    h.handle(conn, MountRequest(rid(10), -1, 1))
    h.handle(conn, FeedRequest(rid(10), -1))       # READY not sent yet: the catch-up still owes it
    h.run()
    assert feed_ids(conn) == [0, 1, 2, 3, 4]
    assert conn.sent[-1] == MountResponse(rid(10), MountState.READY)
    conn.take()
    h.handle(conn, FeedRequest(rid(10), 4))        # after READY it is taken
    h.handle(conn, append(1, client_hwm=4))
    h.store.commit()
    h.run()
    assert feed_ids(conn) == [5]


@pytest.mark.parametrize("error", [AppendFateUnknown, PartitionNotOwned])
def test_a_lost_store_closes_the_partition_before_any_flush_or_mount_is_answered(h, error):
    conn = mounted_with_two_appends_then_a_flush(h)
    again = DummyConnection("remount")
    h.handle(again, MountRequest(rid(4), -1, 2))   # the client remounting meanwhile
    h.store.fail(1, error)
    h.run()
    # Answering now with this server's high-water mark would tell the client its appends failed,
    # while the next owner may find them committed: the client would retry them (duplicates).
    assert conn.of(FlushResponse) == [] and again.of(MountResponse) == [
        MountResponse(rid(4), MountState.NOT_READY)]
    assert h.partition.state is PartitionState.CLOSED and h.store.closed
    h.handle(conn, FlushRequest(rid(5)))
    assert conn.of(FlushResponse) == []


# -- feed credit and scheduling -----------------------------------------------------------------

def test_feed_credit_is_at_least_min_fetch_size_then_feed_suspended():
    h = Harness(records=10, settings=PartitionSettings(min_fetch_size=3, realtime_threshold=50))
    conn = DummyConnection()
    h.mount(conn, client_hwm=9)
    conn.take()
    feed = FeedRequest(rid(0), 9)
    h.handle(conn, feed)
    h.run()
    assert conn.sent == []                          # waiting for commits: credit 3
    for seq in range(1, 6):
        h.handle(conn, append(seq, client_hwm=9))
    h.store.commit()
    h.run()
    assert feed_ids(conn) == [10, 11, 12]
    assert conn.sent[-1] == FeedSuspended(rid(0))
    conn.take()
    h.handle(conn, FeedRequest(rid(0), 12))
    h.run()
    assert feed_ids(conn) == [13, 14]
    assert conn.of(FeedSuspended) == []


def test_feed_credit_covers_the_whole_gap_when_it_is_larger():
    h = Harness(records=300, settings=PartitionSettings(min_fetch_size=3, realtime_threshold=50))
    conn = DummyConnection()
    h.mount(conn, client_hwm=299)
    conn.take()
    h.handle(conn, FeedRequest(rid(0), 9))
    h.run()
    assert feed_ids(conn) == list(range(10, 300))
    assert conn.sent[-1] == FeedSuspended(rid(0))


def test_feeds_stop_while_the_connection_is_not_writable_and_resume_after():
    h = Harness(records=200)
    conn = DummyConnection()
    h.mount(conn, client_hwm=199)
    conn.take()
    h.handle(conn, FeedRequest(rid(0), -1))
    conn.writable = False
    h.run()
    assert conn.sent == []
    conn.writable = True
    h.partition.connection_writable(conn)
    h.run()
    assert feed_ids(conn) == list(range(200))


class ThrottledConnection(DummyConnection):
    """Becomes unwritable after ``capacity`` messages, like a transport whose buffer filled."""

    def __init__(self, capacity):
        super().__init__("throttled")
        self.capacity = capacity

    def sendMessage(self, message):
        super().sendMessage(message)
        if len(self.sent) >= self.capacity:
            self.writable = False


def test_a_feed_pauses_after_the_run_that_filled_the_transport():
    h = Harness(records=100)
    conn = ThrottledConnection(capacity=10)
    h.handle(conn, MountRequest(rid(0), -1, 1))
    h.run()
    assert feed_ids(conn) == list(range(64))     # the first read's run went out in one write, then nothing
    assert h.store.header_reads == [(0, 64)]
    conn.capacity = 1000
    conn.writable = True
    h.partition.connection_writable(conn)
    h.run()
    assert feed_ids(conn) == list(range(100))
    assert conn.sent[-1] == MountResponse(rid(0), MountState.READY)


def test_realtime_feeds_are_served_before_catch_up_feeds():
    h = Harness(records=3000, settings=PartitionSettings(min_fetch_size=10, realtime_threshold=100))
    h.partition.feeds.items_per_turn = 50
    behind, current = DummyConnection("behind"), DummyConnection("current")
    h.mount(behind, client_hwm=2999, client=1)
    h.mount(current, client_hwm=2999, client=2)
    behind.take(), current.take()
    # Everything is cached, so the catch-up feed could be served at once too.
    h.partition.feed_cache.add_all(PID, [r.record_header for r in h.store.records])
    order = []
    for conn in (behind, current):
        conn.sendMessage = (lambda c: lambda m: (order.append(c.name), c.sent.append(m)))(conn)
    h.handle(behind, FeedRequest(rid(0, 1), -1))        # catch-up: 3000 behind
    h.handle(current, FeedRequest(rid(0, 2), 2999))     # realtime: waiting for new commits
    h.handle(current, append(1, client_hwm=2999, client=2))
    h.store.commit()
    h.clock.advance(0)
    assert order[0] == "current"
    h.run()
    # The catch-up feed's credit was the 3000 transactions behind at the time of its request.
    assert feed_ids(behind) == list(range(3000)) and behind.sent[-1] == FeedSuspended(rid(0, 1))
    assert feed_ids(current) == [3000]


def test_catch_up_feeds_take_turns_in_fifo_order():
    h = Harness(records=400, settings=PartitionSettings(min_fetch_size=10, realtime_threshold=100))
    first, second = DummyConnection("first"), DummyConnection("second")
    h.mount(first, client_hwm=399, client=1)
    h.mount(second, client_hwm=399, client=2)
    first.take(), second.take()
    order = []
    for conn in (first, second):
        conn.sendMessage = (lambda c: lambda m: (order.append(c.name), c.sent.append(m)))(conn)
    h.handle(first, FeedRequest(rid(0, 1), -1))
    h.handle(second, FeedRequest(rid(0, 2), -1))
    h.run()
    assert feed_ids(first) == feed_ids(second) == list(range(400))
    switches = sum(1 for x, y in zip(order, order[1:]) if x != y)
    assert order[0] == "first" and switches > 4


def test_catch_up_reads_blocks_from_the_store_into_the_feed_cache_and_retries_failed_reads():
    h = Harness(records=130)
    h.store.fail_reads = RuntimeError("no replica")
    conn = DummyConnection()
    h.mount(conn, client_hwm=-1)
    assert conn.sent == []
    h.store.fail_reads = None
    h.clock.advance(0.5)
    h.run()
    assert feed_ids(conn) == list(range(130))
    assert h.store.header_reads[-3:] == [(0, 64), (64, 64), (128, 64)]
    # A second client is served from the cache.
    reads = len(h.store.header_reads)
    other = DummyConnection("other")
    h.mount(other, client=2, client_hwm=-1)
    assert feed_ids(other) == list(range(130)) and len(h.store.header_reads) == reads
    assert h.counter("waltz_server_cache_lookups_total", "feed", "hit") == 130
    assert h.counter("waltz_server_cache_lookups_total", "feed", "miss") == 130


def test_a_feed_stops_when_its_connection_closes(h):
    conn = DummyConnection()
    h.mount(conn)
    h.handle(conn, FeedRequest(rid(0), -1))
    conn.closed = True
    h.partition.connection_closed(conn)
    other = DummyConnection("other")
    h.mount(other, client=2)
    h.handle(other, append(1, client=2))
    h.store.commit()
    h.run()                                      # sending on a closed DummyConnection would assert
    assert h.partition.feeds.feeds == []


# -- transaction data ---------------------------------------------------------------------------

def test_transaction_data_from_the_cache_after_commit(h):
    conn = DummyConnection()
    h.mount(conn)
    h.handle(conn, append(1, data=b"payload"))
    h.store.commit()
    rpc = DummyConnection("rpc")
    assert h.handle(rpc, TransactionDataRequest(rid(9), 0)) is None
    assert rpc.sent == [TransactionDataResponse.success(rid(9), 0, b"payload-1")]
    assert h.store.record_reads == []
    assert h.counter("waltz_server_cache_lookups_total", "transaction-data", "hit") == 1


def test_transaction_data_from_the_store_then_cached():
    h = Harness(records=3)
    rpc = DummyConnection("rpc")
    h.handle(rpc, TransactionDataRequest(rid(9), 1))
    h.handle(rpc, TransactionDataRequest(rid(10), 1))
    assert rpc.sent == [TransactionDataResponse.success(rid(9), 1, b"old-1"),
                        TransactionDataResponse.success(rid(10), 1, b"old-1")]
    assert h.store.record_reads == [1]


def test_transaction_data_failures_are_answered_with_a_reason():
    h = Harness(records=3)
    rpc = DummyConnection("rpc")
    h.handle(rpc, TransactionDataRequest(rid(1), 7))
    h.store.fail_reads = RuntimeError("no readable replica")
    h.handle(rpc, TransactionDataRequest(rid(2), 0))
    h.store.fail_reads = None
    h.store.records[2] = Record(2, rid(0), 0, b"rotten", 12345)
    h.handle(rpc, TransactionDataRequest(rid(3), 2))
    assert [m.ok for m in rpc.sent] == [False, False, False]
    assert "not committed" in rpc.sent[0].error
    assert "no readable replica" in rpc.sent[1].error
    assert "checksum" in rpc.sent[2].error


# -- back pressure --------------------------------------------------------------------------------

def test_appends_over_the_pending_cap_return_unfired_deferreds_until_the_store_catches_up():
    h = Harness(settings=PartitionSettings(max_pending_appends=2))
    conn = DummyConnection()
    h.mount(conn)
    results = [h.handle(conn, append(seq)) for seq in range(1, 6)]
    assert results[:2] == [None, None]
    assert all(isinstance(d, defer.Deferred) and not d.called for d in results[2:])
    assert h.partition.append_state is AppendTaskState.WAITING_FOR_CAPACITY
    assert len(h.store.pending) == 2 and h.partition.pending_appends == 5
    h.store.commit(1)
    assert results[2].called and not results[3].called
    h.store.commit()
    h.store.commit()
    assert all(d.called for d in results[2:])
    assert h.partition.high_water_mark == 4


def test_shared_caches_and_settings_validation():
    feed_cache, data_cache = FeedCache(1 << 20), TransactionDataCache(1 << 20)
    h = Harness(feed_cache=feed_cache, data_cache=data_cache, auto_commit=True)
    conn = DummyConnection()
    h.mount(conn)
    h.handle(conn, append(1, data=b"x"))
    assert data_cache.get(PID, 0).data == b"x-1" and feed_cache.get(PID, 0).transaction_id == 0
    h.partition.close()
    assert data_cache.get(PID, 0).data == b"x-1"            # committed entries age out, see below
    with pytest.raises(ValueError):
        PartitionSettings(min_fetch_size=1000, realtime_threshold=1000)
    with pytest.raises(ValueError):
        PartitionSettings(feed_cache_size=10)
    with pytest.raises(ValueError):
        PartitionSettings(max_pending_appends=0)
    with pytest.raises(ValueError, match="min_fetch_size"):
        PartitionSettings(min_fetch_size=0)     # an idle feed would get no credit, ask again at once, ...


def test_commits_the_partition_did_not_make_raise_the_lock_table(h):
    conn = DummyConnection()
    h.mount(conn)
    conn.take()
    h.store.records.append(Record.create(0, rid(50, client=9), 0, b"foreign"))
    h.store.high_water_mark = 0
    h.store.notify()
    assert h.partition.high_water_mark == 0
    h.handle(conn, append(1, client_hwm=-1, write_locks=[lock_hash("any", 1)]))
    assert conn.of(LockFailure) == [LockFailure(rid(1), 0)]


def test_data_requests_tell_the_client_when_to_look_again_or_ask_again():
    from waltz.protocols.client_messages import (
        RETRY_LATER_MARK, TransactionDataBatchRequest, TransactionDataBatchResponse, TransactionDataResponse)
    h = Harness(records=3, healthy=False)
    rpc = DummyConnection("rpc")
    h.handle(rpc, TransactionDataBatchRequest(rid(1), [0, 1]))
    [starting] = rpc.take()
    assert isinstance(starting, TransactionDataBatchResponse) and not starting.ok
    assert "is not served here" in starting.error    # still starting: its high-water mark is not known yet
    h.store.become_healthy()
    h.store.fail_reads = RuntimeError("no readable replica right now")
    h.handle(rpc, TransactionDataRequest(rid(2), 1))
    h.run()
    h.handle(rpc, TransactionDataBatchRequest(rid(3), [1, 2]))
    h.run()
    transient, batch = rpc.take()
    assert isinstance(transient, TransactionDataResponse) and isinstance(batch, TransactionDataBatchResponse)
    for response in (transient, batch):
        assert not response.ok
        assert RETRY_LATER_MARK in response.error and "no readable replica right now" in response.error


class HeldReadStore(DummyStore):
    """Store reads answer when the test says, as a storage over the network does."""

    def __init__(self, records):
        super().__init__(records)
        self.held = []

    def get_records(self, transaction_id, max_records):
        d = defer.Deferred()
        self.held.append((d, tuple(self.records[transaction_id:transaction_id + max_records])))
        return d

    def get_record(self, transaction_id):
        d = defer.Deferred()
        self.held.append((d, self.records[transaction_id]))
        return d

    def answer(self, count):
        for d, result in [self.held.pop(0) for _ in range(count)]:
            d.callback(result)


def test_a_connection_runs_a_few_data_reads_at_a_time_and_none_while_it_is_not_writable():
    # A reader pipelines 256 data requests by default: every one started at once, a slow reader made the
    # server buffer every answer (4 MiB each) although it had stopped reading from the connection.
    from waltz.protocols.client_messages import TransactionDataBatchRequest, TransactionDataBatchResponse
    h = Harness(store=HeldReadStore(5))
    rpc = DummyConnection("rpc")
    count = MAX_READS_IN_FLIGHT + 32
    waits = [h.partition.handle(rpc, TransactionDataBatchRequest(rid(n), [0, 1, 2]))
             for n in range(count)]
    waits.append(h.partition.handle(rpc, TransactionDataRequest(rid(count), 4)))
    assert len(h.store.held) == MAX_READS_IN_FLIGHT
    assert all(isinstance(d, defer.Deferred) and not d.called for d in waits)   # inbound back pressure
    h.store.answer(1)
    assert len(rpc.of(TransactionDataBatchResponse)) == 1 and len(h.store.held) == MAX_READS_IN_FLIGHT
    rpc.writable = False                    # the client stopped reading
    h.store.answer(MAX_READS_IN_FLIGHT)
    assert h.store.held == [] and rpc.data_reads.waiting == count - MAX_READS_IN_FLIGHT
    rpc.writable = True
    rpc.data_reads.wake()
    while h.store.held:
        h.store.answer(len(h.store.held))
    assert len(rpc.of(TransactionDataBatchResponse)) == count and len(rpc.of(TransactionDataResponse)) == 1
    assert all(d.called for d in waits)


def test_data_reads_waiting_when_the_connection_closes_are_dropped():
    from waltz.protocols.client_messages import TransactionDataBatchRequest
    h = Harness(store=HeldReadStore(5))
    rpc = DummyConnection("rpc")
    waits = [h.partition.handle(rpc, TransactionDataBatchRequest(rid(n), [0]))
             for n in range(MAX_READS_IN_FLIGHT + 4)]
    rpc.closed = True
    rpc.data_reads.wake()
    assert all(d.called for d in waits[MAX_READS_IN_FLIGHT:])
    assert len(h.store.held) == MAX_READS_IN_FLIGHT       # the reads running end as they do


class OutageStore(HeldReadStore):
    """Reads are held (network) until ``outage`` is set; then they fail at once, as a store partition
    without a session (or with no replica connected) fails them."""

    outage = None

    def get_record(self, transaction_id):
        if self.outage is not None:
            return defer.fail(self.outage)
        return super().get_record(transaction_id)

    def fail_held(self):
        held, self.held = self.held, []
        for d, _ in held:
            d.errback(self.outage)


@pytest.mark.parametrize("count", [300, 600])
def test_data_reads_failing_at_once_in_an_outage_answer_every_waiting_request(count):
    # Before: each read that failed at once admitted the next one from inside the admission loop, a few
    # stack frames per waiting request: a few hundred waiting (two pipelining readers on one connection)
    # raised RecursionError, failed requests (closing the connection), left some unanswered and leaked
    # a running slot for good.
    h = Harness(store=OutageStore(5))
    rpc = DummyConnection("rpc")
    waits = [h.partition.handle(rpc, TransactionDataRequest(rid(n), n % 5)) for n in range(count)]
    assert len(h.store.held) == MAX_READS_IN_FLIGHT
    h.store.outage = Exception("partition %d has no store session right now" % PID)
    h.store.fail_held()
    failed = []
    for d in waits:
        d.addErrback(lambda f: failed.append(f.type.__name__))
    assert failed == []
    answers = rpc.of(TransactionDataResponse)
    assert len(answers) == count and not any(a.ok for a in answers)
    assert all(d.called for d in waits)
    assert rpc.data_reads.waiting == 0 and rpc.data_reads.running == 0


def test_a_connection_flooding_flushes_or_mounts_is_closed_and_a_repeated_mount_waits_once(h):
    # Before: each FLUSH (distinct ReqId) or repeated mount added a waiter at the barrier, without limit and
    # outside the back pressure, while an append was stuck with the store.
    from waltz.protocols.errors import ProtocolError
    from waltz.server.partition import MAX_WAITS_PER_CONNECTION
    conn = mounted_with_two_appends_then_a_flush(h)
    for seq in range(4, MAX_WAITS_PER_CONNECTION + 3):
        h.handle(conn, FlushRequest(rid(seq)))
    with pytest.raises(ProtocolError, match="more than %d flush or mount requests waiting" % MAX_WAITS_PER_CONNECTION):
        h.handle(conn, FlushRequest(rid(MAX_WAITS_PER_CONNECTION + 3)))
    other = DummyConnection("other")     # other connections are not affected
    h.handle(other, FlushRequest(rid(1, client=2)))
    remount = MountRequest(rid(0, client=3), -1, 1)
    for _ in range(5):
        h.handle(other, remount)
    h.store.commit()
    assert other.of(FlushResponse) == [FlushResponse(rid(1, client=2), 1)]
    h.run()
    assert other.of(MountResponse) == [MountResponse(rid(0, client=3), MountState.READY)]
