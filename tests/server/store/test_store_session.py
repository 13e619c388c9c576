"""Store session and store partition on dummy replicas: recovery states, quorum, abstention, settling.

The replicas here are in-memory dummies implementing IReplicaSession whose
appends the test acknowledges or fails one by one, so every quorum decision
is deterministic. The real thing over sockets is in tests/recovery.
"""

import gc

import pytest
from twisted.internet import defer
from twisted.logger import LogLevel, globalLogPublisher
from twisted.internet.task import Clock
from zope.interface import implementer
from zope.interface.verify import verifyClass, verifyObject

from waltz.interfaces import IPartitionMetadataStore, IReplicaSession, IStorePartition
from waltz.metrics import Registry
from waltz.protocols.values import Record, ReqId, checksum
from waltz.recovery.manager import RecoveryAborted
from waltz.recovery.replica_reads import NoReplicaCouldRead
from waltz.server.store.metrics import StoreMetrics
from waltz.server.store.partition import AppendFailed, StorePartition
from waltz.server.store.replica import ReplicaSession
from waltz.server.store.session import SessionClosed, SessionState, StoreSession
from waltz.server.store.store import ZooKeeperPartitionMetadata
from waltz.zk.znodes import EMPTY_PARTITION_METADATA, UNRESOLVED, ReplicaId

STORAGES = ("a:1", "b:1", "c:1")


@implementer(IReplicaSession)
class DummyReplica:
    """An in-memory replica. With ``manual`` set, appends wait for :meth:`ack` / :meth:`fail`."""

    def __init__(self, storage, session_id, log=None, manual=False):
        self.replica_id = ReplicaId(0, storage)
        self.session_id = session_id
        self.connected = True
        self.log = log if log is not None else []
        self.last_session = (-1, -1, -1)
        self.manual = manual
        self.pending = []
        self.calls = []
        self.read_error = None     # set: reads fail with it
        self._disconnect = []

    def when_connected(self):
        return defer.succeed(self)

    def on_disconnect(self, callback):
        self._disconnect.append(callback)

    def close(self):
        self.connected = False

    def last_session_info(self):
        return defer.succeed(self.last_session)

    def max_transaction_id(self):
        return defer.succeed(len(self.log) - 1)

    def truncate(self, transaction_id):
        self.calls.append(("truncate", transaction_id))
        del self.log[transaction_id + 1:]
        return defer.succeed(len(self.log) - 1)

    def set_low_water_mark(self, low_water_mark):
        self.calls.append(("set_low_water_mark", low_water_mark))
        self.last_session = (self.session_id, low_water_mark, len(self.log) - 1)
        return defer.succeed(None)

    def append(self, records):
        self.calls.append(("append", tuple(r.transaction_id for r in records)))
        if not self.manual:
            self.log.extend(records)
            return defer.succeed(None)
        d = defer.Deferred()
        self.pending.append((records, d))
        return d

    def ack(self):
        records, d = self.pending.pop(0)
        self.log.extend(records)
        d.callback(None)

    def fail(self):
        _, d = self.pending.pop(0)
        d.errback(OSError("disk on fire"))

    def get_records(self, transaction_id, max_records):
        self.calls.append(("get_records", transaction_id))
        if self.read_error is not None:
            return defer.fail(self.read_error)
        return defer.succeed(tuple(self.log[transaction_id:transaction_id + max_records]))

    def get_headers(self, transaction_id, max_records):
        return defer.succeed(tuple(r.record_header for r in self.log[transaction_id:transaction_id + max_records]))


@implementer(IPartitionMetadataStore)
class DummyMetadata:
    def __init__(self):
        self.value = EMPTY_PARTITION_METADATA
        self.writes = 0
        self.failing_updates = 0   # the next updates that fail (a lost ZooKeeper connection)
        self.update_failure = ConnectionError("ZooKeeper connection lost")

    def read(self, partition_id):
        return defer.succeed(self.value)

    def update(self, partition_id, change):
        if self.failing_updates:
            self.failing_updates -= 1
            return defer.fail(self.update_failure)
        self.value = change(self.value)
        self.writes += 1
        return defer.succeed(self.value)


class Harness:
    """Builds sessions over dummy replicas that keep their logs across sessions."""

    def __init__(self, manual=False):
        self.clock = Clock()
        self.metadata = DummyMetadata()
        self.logs = {s: [] for s in STORAGES}
        self.last_sessions = {s: (-1, -1, -1) for s in STORAGES}
        self.manual = manual
        self.sessions = []
        self.registry = Registry()
        self.metrics = StoreMetrics(self.registry)

    def new_session(self, partition_id=0, generation=1, on_close=None):
        current = self.metadata.value
        self.metadata.value = current.__class__(generation, current.session_id + 1, current.replica_states)
        replicas = {}
        for storage in STORAGES:
            replica = DummyReplica(storage, self.metadata.value.session_id, self.logs[storage], self.manual)
            replica.last_session = self.last_sessions[storage]
            replicas[storage] = replica
        session = StoreSession(partition_id, self.metadata.value, replicas, self.metadata, self.clock, on_close,
                               self.metrics)
        session.replicas_by_name = replicas
        self.sessions.append(session)
        return session

    def factory(self, partition_id, generation, on_close):
        if self.sessions:
            for storage, replica in self.sessions[-1].replicas_by_name.items():
                self.last_sessions[storage] = replica.last_session
        return defer.succeed(self.new_session(partition_id, generation, on_close))


def records(first, count):
    return [Record.create(t, ReqId(1, 1, 0, t), 0, b"r%d" % t) for t in range(first, first + count)]


def test_interfaces_are_implemented():
    assert verifyClass(IReplicaSession, ReplicaSession)
    assert verifyClass(IStorePartition, StorePartition)
    assert verifyClass(IPartitionMetadataStore, ZooKeeperPartitionMetadata)
    assert verifyObject(IReplicaSession, DummyReplica("a:1", 1))


def test_recovery_goes_through_named_states_and_records_them():
    h = Harness()
    session = h.new_session()
    result = session.start()
    assert result.called and result.result.high_water_mark == -1
    assert session.state is SessionState.WRITING and set(session.joined) == set(STORAGES)
    text = h.registry.prometheus_text()
    for state in ("voting", "resolved", "updating-metadata", "complete"):
        assert 'waltz_server_recovery_transitions_total{partition="0",state="%s"} 1' % state in text
    for state in ("waiting-for-connection", "reading-session-info", "voted", "setting-low-water-mark",
                  "recovered"):
        assert 'waltz_server_replica_recovery_transitions_total{partition="0",state="%s"} 3' % state in text
    assert {s.replica_id.storage: (s.session_id, s.closing_high_water_mark)
            for s in h.metadata.value.replica_states} == {s: (session.session_id, UNRESOLVED) for s in STORAGES}


def started(h):
    session = h.new_session()
    session.start()
    assert session.state is SessionState.WRITING
    return session


def test_batch_commits_exactly_at_quorum():
    h = Harness(manual=True)
    session = started(h)
    a, b, c = (session.replicas_by_name[s] for s in STORAGES)
    committed = session.write(records(0, 3))
    a.ack()
    assert not committed.called
    c.ack()
    assert committed.result == 2
    b.ack()  # the late one changes nothing
    assert session.state is SessionState.WRITING


def test_batch_sizes_are_counted():
    h = Harness()
    session = started(h)
    session.write(records(0, 3))
    session.write(records(3, 1))
    text = h.registry.prometheus_text()
    assert 'waltz_server_store_batch_transactions_count{partition="0"} 2' in text
    assert 'waltz_server_store_batch_transactions_sum{partition="0"} 4' in text


def test_replica_failing_after_quorum_commits_then_closes_the_session():
    h = Harness(manual=True)
    closed = []
    session = h.new_session(on_close=lambda s, reason: closed.append(reason))
    session.start()
    a, b, c = (session.replicas_by_name[s] for s in STORAGES)
    committed = session.write(records(0, 1))
    a.ack()
    c.fail()   # c abstains: the batch can still commit with b
    assert session.state is SessionState.WRITING and not session.writable
    b.ack()
    assert committed.result == 0
    assert session.state is SessionState.CLOSED and "c:1 failed an append" in closed[0]


def test_a_replica_whose_batches_in_flight_all_fail_is_logged_once():
    # A lost connection fails every batch in flight to it: one warning per batch (64 per partition at most).
    h = Harness(manual=True)
    session = started(h)
    a, b, c = (session.replicas_by_name[s] for s in STORAGES)
    writes = [session.write(records(n, 1)) for n in range(3)]
    seen = []
    globalLogPublisher.addObserver(seen.append)
    try:
        for _ in writes:
            a.ack()
            b.ack()
            c.fail()
    finally:
        globalLogPublisher.removeObserver(seen.append)
    assert [w.result for w in writes] == [0, 1, 2]
    assert len([e for e in seen if "append to {storage} failed" in e.get("log_format", "")]) == 1


def test_without_quorum_the_batch_fails_with_session_closed():
    h = Harness(manual=True)
    session = started(h)
    a, b, c = (session.replicas_by_name[s] for s in STORAGES)
    committed = session.write(records(0, 1))
    a.fail()
    b.fail()
    assert session.state is SessionState.CLOSED
    with pytest.raises(SessionClosed):
        committed.result.raiseException()
    committed.addErrback(lambda f: None)
    later = []
    session.write(records(0, 1)).addErrback(lambda f: later.append(f.trap(SessionClosed)))
    assert later == [SessionClosed]


def test_unsettled_batch_is_settled_by_the_next_recovery_and_nothing_is_reported_twice():
    h = Harness(manual=True)
    partition = StorePartition(0, 1, h.factory, h.clock, max_batch_size=2, max_batches_in_flight=1)
    partition.open()
    outcomes = {}
    appends = [partition.append(ReqId(1, 1, 0, 0), 0, b"d0", checksum(b"d0"))]
    h.clock.advance(0)      # the turn ends: append 0 goes out alone
    appends += [partition.append(ReqId(1, 1, 0, n), 0, b"d%d" % n, checksum(b"d%d" % n)) for n in range(1, 4)]
    for n, d in enumerate(appends):
        d.addBoth(lambda result, n=n: outcomes.setdefault(n, []).append(result))
    first = h.sessions[0]
    a, b, c = (first.replicas_by_name[s] for s in STORAGES)
    # Append 0 is in flight (1-3 queued behind it); it reaches a only, then b and c fail.
    a.ack()
    b.fail()
    c.fail()
    assert first.state is SessionState.CLOSED and outcomes == {}
    h.clock.advance(0)  # the partition starts the next session; recovery: a holds 0, b and c nothing
    second = h.sessions[1]
    assert second.recovery.state.value == "complete" and partition.high_water_mark == -1
    # Only a held it: not on a quorum, so not committed; the queued appends go to the new session.
    assert isinstance(outcomes[0][0].value, AppendFailed) and len(outcomes[0]) == 1
    assert h.logs["a:1"] == []  # the dirty record was truncated
    for _ in range(2):  # batch [1, 2], then [3]
        for replica in second.replicas_by_name.values():
            replica.ack()
    assert outcomes[1] == [0] and outcomes[2] == [1] and outcomes[3] == [2]
    assert all(len(v) == 1 for v in outcomes.values())


def test_unsettled_batch_on_a_quorum_is_reported_committed():
    h = Harness(manual=True)
    partition = StorePartition(0, 1, h.factory, h.clock, max_batch_size=5)
    partition.open()
    d = partition.append(ReqId(1, 1, 0, 0), 0, b"x", checksum(b"x"))
    h.clock.advance(0)
    first = h.sessions[0]
    a, b, c = (first.replicas_by_name[s] for s in STORAGES)
    a.ack()
    first.close("server lost track of b's answer")   # b stored it but the ack was lost
    b.ack()
    assert not d.called
    h.clock.advance(0)
    assert d.result == 0 and partition.high_water_mark == 0


def test_a_failed_recovery_starts_one_new_session_and_never_replaces_a_live_one():
    h = Harness(manual=True)
    h.metadata.failing_updates = 1     # the first recovery's metadata write fails
    partition = StorePartition(0, 1, h.factory, h.clock, max_batch_size=1, retry_interval=0.5)
    partition.open()
    first = h.sessions[0]
    assert first.state is SessionState.CLOSED
    h.clock.advance(0)
    second = h.sessions[1]
    assert second.state is SessionState.WRITING and partition.session is second
    d = partition.append(ReqId(1, 1, 0, 0), 0, b"x", checksum(b"x"))
    h.clock.advance(0.5)               # when the failed recovery's own retry comes due
    assert len(h.sessions) == 2 and partition.session is second and partition.sessions_started == 2
    for replica in second.replicas_by_name.values():
        replica.ack()
    assert d.result == 0 and partition.high_water_mark == 0


def test_a_metadata_update_failing_without_a_message_is_named_by_its_type():
    # kazoo's ConnectionLoss has no message: the log said "metadata update failed: ; retrying in 0.5 s".
    from kazoo.exceptions import ConnectionLoss
    h = Harness(manual=True)
    h.metadata.failing_updates = 1
    h.metadata.update_failure = ConnectionLoss()
    partition = StorePartition(0, 1, h.factory, h.clock, max_batch_size=1, retry_interval=0.5)
    partition.open()
    assert "metadata update failed: ConnectionLoss" in h.sessions[0].close_reason


def test_a_batch_not_sent_to_a_replica_that_fell_behind_does_not_wait_for_it():
    h = Harness(manual=True)
    session = started(h)
    session.max_outstanding_batches = 2
    a, b, c = (session.replicas_by_name[s] for s in STORAGES)
    for n in range(2):
        session.write(records(n, 1))
        b.ack()
        c.ack()                                # committed on b and c; a is slow: 2 outstanding
    last = session.write(records(2, 1))        # not sent to a, which fell behind: close after this batch
    assert len(a.pending) == 2 and len(b.pending) == len(c.pending) == 1 and not session.writable
    b.fail()                                   # now only c can still ack it: 1 of the 2 needed
    assert session.state is SessionState.CLOSED
    assert last.called and isinstance(last.result.value, SessionClosed)
    last.addErrback(lambda f: None)


def test_a_replica_that_left_is_not_read_from_while_the_batches_in_flight_settle():
    h = Harness(manual=True)
    session = started(h)
    session.max_outstanding_batches = 2
    a, b, c = (session.replicas_by_name[s] for s in STORAGES)
    assert session.readers() == [a, b, c]
    for n in range(2):
        session.write(records(n, 1))
        b.ack()
        c.ack()                                # committed on b and c; a is slow: 2 outstanding
    last = session.write(records(2, 1))        # not sent to a, which fell behind: it leaves after this batch
    assert session.state is SessionState.WRITING
    assert session.readers() == [b, c]          # a lacks committed batches: never read from it
    b.ack()
    c.ack()
    assert last.called and session.state is SessionState.CLOSED


class JoiningReplica(DummyReplica):
    """A replica whose connection (hence its recovery) comes when the test calls :meth:`connect`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._connected = defer.Deferred()

    def when_connected(self):
        d = defer.Deferred()
        self._connected.addCallback(lambda _: d.callback(self))
        return d

    def connect(self):
        self._connected.callback(None)


def test_replicas_joining_at_once_are_admitted_only_with_no_batch_in_flight():
    storages = ("a:1", "b:1", "c:1", "d:1", "e:1")
    metadata = DummyMetadata()
    metadata.value = metadata.value.__class__(1, 1, metadata.value.replica_states)
    replicas = {s: (JoiningReplica if s in ("d:1", "e:1") else DummyReplica)(s, 1, [], True) for s in storages}
    session = StoreSession(0, metadata.value, replicas, metadata, Clock())
    session.start()
    assert session.state is SessionState.WRITING and set(session.joined) == {"a:1", "b:1", "c:1"}
    batch = session.write(records(0, 1))
    replicas["d:1"].connect()                  # d recovers and holds new batches until batch 0 settles
    replicas["e:1"].connect()                  # so does e, which must not ride on d's hold
    assert set(session.joined) == {"a:1", "b:1", "c:1"} and not session.writable
    replicas["a:1"].ack()
    replicas["b:1"].fail()                     # the session will close once batch 0 settles...
    replicas["c:1"].ack()                      # ...and it does: 2 acks of the 3 it was sent to, quorum 3 of 5
    assert batch.called and isinstance(batch.result.value, SessionClosed)
    batch.addErrback(lambda f: None)
    assert session.state is SessionState.CLOSED


def test_joins_admitted_one_after_the_other_get_every_batch_after_they_join():
    storages = ("a:1", "b:1", "c:1", "d:1", "e:1")
    metadata = DummyMetadata()
    metadata.value = metadata.value.__class__(1, 1, metadata.value.replica_states)
    replicas = {s: (JoiningReplica if s in ("d:1", "e:1") else DummyReplica)(s, 1, []) for s in storages}
    session = StoreSession(0, metadata.value, replicas, metadata, Clock())
    session.start()
    session.write(records(0, 2))
    replicas["d:1"].connect()
    replicas["e:1"].connect()
    assert set(session.joined) == set(storages) and session.writable
    session.write(records(2, 1))
    assert all([r.transaction_id for r in replica.log] == [0, 1, 2] for replica in replicas.values())


class FlakyJoiningReplica(JoiningReplica):
    """A joining replica whose first ``failures`` appends fail (a connection blip during its copy)."""

    failures = 2

    def append(self, records_):
        if self.failures:
            self.failures -= 1
            return defer.fail(ConnectionError("blip"))
        return super().append(records_)


def session_with_a_flaky_join():
    """A writing session of a and b with 5 transactions; c recovers now and its join's copy fails twice."""
    metadata = DummyMetadata()
    metadata.value = metadata.value.__class__(1, 1, metadata.value.replica_states)
    replicas = {s: DummyReplica(s, 1, []) for s in ("a:1", "b:1")}
    replicas["c:1"] = FlakyJoiningReplica("c:1", 1, [])
    clock = Clock()
    session = StoreSession(0, metadata.value, replicas, metadata, clock, recovery_retry_interval=0.5)
    session.start()
    session.write(records(0, 5))
    replicas["c:1"].connect()
    return session, replicas, clock


def test_a_join_that_failed_is_tried_again_with_backoff_until_it_joins():
    session, replicas, clock = session_with_a_flaky_join()   # tried again in 0.5 s, then 1 s
    assert set(session.joined) == {"a:1", "b:1"}
    clock.advance(0.5)
    assert set(session.joined) == {"a:1", "b:1"} and replicas["c:1"].failures == 0
    clock.advance(0.9)
    assert set(session.joined) == {"a:1", "b:1"}
    clock.advance(0.1)
    assert set(session.joined) == {"a:1", "b:1", "c:1"}
    session.write(records(5, 1))
    assert [r.transaction_id for r in replicas["c:1"].log] == list(range(6))
    assert clock.getDelayedCalls() == []


def test_closing_the_session_cancels_a_join_retry():
    session, _, clock = session_with_a_flaky_join()
    assert len(clock.getDelayedCalls()) == 1
    session.close("test")
    assert clock.getDelayedCalls() == []


def test_closing_the_session_cancels_a_replica_recovery_retry_and_abandons_the_replica():
    # A replica whose recovery step failed waits retry_interval before trying again: a session closed meanwhile
    # left that timer behind.
    h = Harness()
    session = h.new_session()
    session.replicas_by_name["c:1"].last_session_info = lambda: defer.fail(OSError("storage refuses"))
    session.start()
    assert len(h.clock.getDelayedCalls()) == 1
    session.close("test")
    assert h.clock.getDelayedCalls() == []
    assert session.recovery.recoveries["c:1"].state.value == "abandoned"


def test_a_recovery_stopped_before_it_ran_leaves_no_unhandled_error():
    # A store partition closed while ZooKeeper creates its session closes that session unstarted, which stops a
    # recovery nobody had run: its failed completion was never listened to, and was logged as an unhandled
    # error when collected (here Twisted's start-up log buffer may keep it alive: the check is best effort). A
    # recovery run after all fails at once, saying it was stopped.
    h = Harness()
    session = h.new_session()
    events = []
    globalLogPublisher.addObserver(events.append)
    try:
        session.close("closed before it started")
        assert session.state is SessionState.CLOSED
        late = session.recovery.run()
        assert isinstance(late.result.value, RecoveryAborted) and "stopped before it ran" in str(late.result.value)
        late.addErrback(lambda _: None)
        del session, late, h
        gc.collect()
    finally:
        globalLogPublisher.removeObserver(events.append)
    assert [e for e in events if "log_failure" in e] == []


def test_checkpoint_interval_starts_a_new_session():
    h = Harness()
    partition = StorePartition(0, 1, h.factory, h.clock, max_batch_size=1, checkpoint_interval=3)
    partition.open()
    for n in range(4):
        partition.append(ReqId(1, 1, 0, n), 0, b"x", checksum(b"x"))
        h.clock.advance(0)
    assert partition.high_water_mark == 3
    assert partition.sessions_started == 2
    assert h.sessions[0].close_reason.startswith("checkpoint")


def test_pipelined_batches_commit_in_order():
    h = Harness(manual=True)
    partition = StorePartition(0, 1, h.factory, h.clock, max_batch_size=1, max_batches_in_flight=3)
    partition.open()
    results = [partition.append(ReqId(1, 1, 0, n), 0, b"x", checksum(b"x")) for n in range(4)]
    session = h.sessions[0]
    a, b, c = (session.replicas_by_name[s] for s in STORAGES)
    assert session.batches_in_flight == 3 and len(a.pending) == 3   # the fourth waits for a free slot
    for _ in range(3):
        a.ack()
    assert not any(d.called for d in results)                       # one replica is not a quorum
    b.ack()
    assert [d.called for d in results] == [True, False, False, False]
    assert len(a.pending) == 1 and a.calls[-1] == ("append", (3,))  # the freed slot sent the fourth
    b.ack()
    b.ack()
    assert [d.result for d in results[:3]] == [0, 1, 2] and partition.high_water_mark == 2
    a.ack()
    c.ack()
    assert results[3].called is False   # c acked batch 0 only: batch 3 has a's ack alone
    b.ack()
    assert results[3].result == 3


def test_a_flush_waits_for_the_appends_queued_before_it_not_for_those_after():
    # Before: it fired only once queue and pipeline were empty at the same moment, so a steady stream of appends
    # starved it while the appends queued before it had long committed.
    h = Harness(manual=True)
    partition = StorePartition(0, 1, h.factory, h.clock, max_batch_size=1, max_batches_in_flight=2)
    partition.open()
    append = lambda n: partition.append(ReqId(1, 1, 0, n), 0, b"x", checksum(b"x"))   # noqa: E731
    before = [append(n) for n in range(3)]
    flushed = partition.flush()
    session = h.sessions[0]
    a, b, _c = (session.replicas_by_name[s] for s in STORAGES)
    for n in range(3, 8):
        append(n)                       # the stream goes on: one more queued for each one acked
        a.ack()
        b.ack()
        h.clock.advance(0)
        if n == 4:
            assert not flushed.called and [d.called for d in before] == [True, True, False]
    assert all(d.called for d in before) and flushed.result == 2 and partition.high_water_mark == 4
    assert partition.flush().called is False


def test_a_turns_appends_make_one_batch_partial_batches_wait_for_the_one_in_flight_full_ones_pipeline():
    h = Harness(manual=True)
    partition = StorePartition(0, 1, h.factory, h.clock, max_batch_size=3, max_batches_in_flight=4)
    partition.open()
    a, b, c = (h.sessions[0].replicas_by_name[s] for s in STORAGES)
    sent = lambda: [call[1] for call in a.calls if call[0] == "append"]    # noqa: E731
    first = partition.append(ReqId(1, 1, 0, 0), 0, b"x", checksum(b"x"))
    assert sent() == []                      # not alone: the rest of this reactor turn may join it
    h.clock.advance(0)
    assert sent() == [(0,)] and h.clock.getDelayedCalls() == []
    results = [first] + [partition.append(ReqId(1, 1, 0, n), 0, b"x", checksum(b"x")) for n in range(1, 9)]
    # Full batches go at once and pipeline; the partial one (7, 8) waits for those in flight, even once
    # the turn ended.
    assert sent() == [(0,), (1, 2, 3), (4, 5, 6)]
    h.clock.advance(0)
    assert sent() == [(0,), (1, 2, 3), (4, 5, 6)]
    for replica in (a, b):
        for _ in range(3):
            replica.ack()
    assert [d.called for d in results] == [True] * 7 + [False] * 2
    assert a.calls[-1] == ("append", (7, 8))   # nothing in flight any more: the partial batch goes
    a.ack()
    b.ack()
    assert [d.result for d in results[7:]] == [7, 8]


def test_closing_cancels_the_cut_of_the_turns_appends():
    h = Harness(manual=True)
    partition = StorePartition(0, 1, h.factory, h.clock)
    partition.open()
    d = partition.append(ReqId(1, 1, 0, 0), 0, b"x", checksum(b"x"))
    d.addErrback(lambda f: None)
    assert len(h.clock.getDelayedCalls()) == 1
    partition.close()
    assert h.clock.getDelayedCalls() == []


def test_a_batch_stops_short_of_the_storages_frame_limit():
    # 100 appends of 3 MiB would make one 300 MiB storage request, over every frame limit: the
    # storage would close the connection, and the retry after recovery would do the same for ever.
    h = Harness(manual=True)
    partition = StorePartition(0, 1, h.factory, h.clock, max_batch_size=100, max_batches_in_flight=1)
    partition.open()
    big = b"x" * (3 * 2 ** 20)
    results = [partition.append(ReqId(1, 1, 0, 0), 0, big, checksum(big))]
    h.clock.advance(0)
    results += [partition.append(ReqId(1, 1, 0, n), 0, big, checksum(big)) for n in range(1, 5)]
    a, b, c = (h.sessions[0].replicas_by_name[s] for s in STORAGES)
    sent = [call[1] for call in a.calls if call[0] == "append"]
    assert sent == [(0,)]                      # the first went alone (its turn ended before the others)
    a.ack(), b.ack()
    assert [call[1] for call in a.calls if call[0] == "append"][-1] == (1, 2)    # 6 MiB: a third is over 8
    a.ack(), b.ack()
    a.ack(), b.ack()
    assert [call[1] for call in a.calls if call[0] == "append"][1:] == [(1, 2), (3, 4)]
    assert [d.result for d in results] == [0, 1, 2, 3, 4]
    huge = b"y" * (10 * 2 ** 20)             # one transaction over the batch limit still goes, alone
    last = partition.append(ReqId(1, 1, 0, 9), 0, huge, checksum(huge))
    h.clock.advance(0)
    assert a.calls[-1] == ("append", (5,))
    a.ack(), b.ack()
    assert last.result == 5


class CorruptingReplica(DummyReplica):
    """Stores what it is sent, but hands back transaction ``bad`` with data that fails its checksum."""

    bad = 1

    def get_records(self, transaction_id, max_records):
        return super().get_records(transaction_id, max_records).addCallback(
            lambda got: tuple(r if r.transaction_id != self.bad else Record(r.transaction_id, r.req_id, r.header,
                                                                           b"rot", r.checksum) for r in got))


def partition_with_committed(h, count):
    partition = StorePartition(0, 1, h.factory, h.clock)
    partition.open()
    done = [partition.append(ReqId(1, 1, 0, n), 0, b"r%d" % n, checksum(b"r%d" % n)) for n in range(count)]
    h.clock.advance(0)
    assert [d.result for d in done] == list(range(count))
    return partition, [h.sessions[-1].replicas_by_name[s] for s in STORAGES]


def test_a_read_the_first_replica_fails_is_served_by_the_next_and_the_failing_one_is_asked_last():
    h = Harness()
    partition, (a, b, c) = partition_with_committed(h, 3)
    a.read_error = OSError("I/O error reading a segment")
    got = partition.get_records(0, 10)
    assert [r.data for r in got.result] == [b"r0", b"r1", b"r2"]
    assert ("get_records", 0) in a.calls and ("get_records", 0) in b.calls
    assert h.sessions[-1].readers() == [b, c, a]
    assert 'waltz_server_replica_read_failures_total{partition="0",storage="a:1"} 1' in h.registry.prometheus_text()
    a.calls.clear()
    assert partition.get_record(2).result.data == b"r2" and not a.calls    # b serves it: a is not asked


def test_a_record_failing_its_checksum_on_one_replica_is_read_from_another():
    h = Harness()
    partition, (a, b, c) = partition_with_committed(h, 3)
    a.__class__ = CorruptingReplica
    assert [r.data for r in partition.get_records(0, 3).result] == [b"r0", b"r1", b"r2"]
    assert h.sessions[-1].readers() == [b, c, a]


def test_a_read_no_replica_can_serve_fails_naming_each_replica():
    h = Harness()
    partition, replicas = partition_with_committed(h, 2)
    for n, replica in enumerate(replicas):
        replica.read_error = OSError("disk %d gone" % n)
    read = partition.get_records(0, 2)
    failure = read.result
    read.addErrback(lambda f: None)
    assert isinstance(failure.value, NoReplicaCouldRead)
    assert all(s in str(failure.value) and "disk %d gone" % n in str(failure.value) for n, s in enumerate(STORAGES))


def test_a_joining_replica_copies_from_the_next_replica_when_the_first_fails_the_read():
    session, replicas, clock = session_with_a_flaky_join()
    replicas["c:1"].failures = 0
    replicas["a:1"].read_error = OSError("I/O error")
    clock.advance(0.5)
    assert set(session.joined) == {"a:1", "b:1", "c:1"}
    assert [r.transaction_id for r in replicas["c:1"].log] == list(range(5))


def test_a_batch_sent_as_a_new_session_settles_is_numbered_after_the_recovered_mark():
    # With a metadata store that answers at once, a replica joined inside the session's start and its
    # writable listener made the partition send the queued append before it took the recovered mark:
    # transaction 1, committed, was numbered again for the next append.
    h = Harness(manual=True)
    partition = StorePartition(0, 1, h.factory, h.clock, max_batch_size=1, max_batches_in_flight=1)
    partition.open()
    first = partition.append(ReqId(1, 1, 0, 0), 0, b"x0", checksum(b"x0"))
    s0 = h.sessions[0]
    a, b, c = (s0.replicas_by_name[s] for s in STORAGES)
    a.ack(), b.ack()
    assert first.result == 0
    c.ack()
    second = partition.append(ReqId(1, 1, 0, 1), 0, b"x1", checksum(b"x1"))     # transaction 1
    a.ack()
    s0.close("test: b's ack is lost")
    b.ack(), c.ack()                       # it is on all three: the next recovery resolves 1
    partition.append(ReqId(1, 1, 0, 2), 0, b"x2", checksum(b"x2"))              # queued
    h.clock.advance(0)
    assert second.result == 1 and partition.high_water_mark == 1
    sent = [call[1] for r in h.sessions[1].replicas_by_name.values() for call in r.calls if call[0] == "append"]
    assert sent and all(ids == (2,) for ids in sent), sent


def test_closing_a_store_partition_cancels_its_session_restart():
    clock = Clock()
    partition = StorePartition(0, 1, lambda *args: defer.fail(ConnectionError("ZooKeeper connection lost")),
                               clock, retry_interval=0.5)
    partition.open()
    assert len(clock.getDelayedCalls()) == 1       # the retry
    partition.close()
    assert clock.getDelayedCalls() == []


def test_a_departing_voter_votes_then_is_let_go_when_the_session_writes():
    # Session 1 had old alone; new joined it; the assignment now has new only (the node was replaced).
    from waltz.zk.znodes import UNRESOLVED, PartitionMetadata, ReplicaId, ReplicaState
    metadata = DummyMetadata()
    metadata.value = PartitionMetadata(1, 2, tuple(ReplicaState(ReplicaId(0, s), 1, UNRESOLVED)
                                                   for s in ("old:1", "new:1")))
    old, new = DummyReplica("old:1", 2, records(0, 8)), DummyReplica("new:1", 2, records(0, 8))
    old.last_session = new.last_session = (1, -1, -1)
    session = StoreSession(0, metadata.value, {"new:1": new}, metadata, Clock(), departing={"old:1": old})
    session.start()
    assert session.state is SessionState.WRITING and session.high_water_mark == 7
    assert set(session.joined) == {"new:1"} and not old.connected and session.departing == {}
    session.write(records(8, 1))
    assert len(new.log) == 9 and len(old.log) == 8


class NeverConnecting(DummyReplica):
    """A departing voter whose node is down: its wait for a connection ends only when its session closes."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.waits = []

    def when_connected(self):
        self.waits.append(defer.Deferred())
        return self.waits[-1]

    def close(self):
        super().close()
        for wait in self.waits:
            if not wait.called:
                wait.cancel()


def test_a_departing_voter_that_never_answered_is_let_go_when_the_others_decide():
    # Before: its session closed when the recovery completed, and its recovery then retried (a log line and
    # a ZooKeeper read) every half second for as long as the session wrote.
    from waltz.zk.znodes import UNRESOLVED, PartitionMetadata, ReplicaId, ReplicaState
    metadata = DummyMetadata()
    metadata.value = PartitionMetadata(1, 2, tuple(ReplicaState(ReplicaId(0, s), 1, UNRESOLVED)
                                                   for s in ("old:1", "a:1", "b:1")))
    replicas = {s: DummyReplica(s, 2, records(0, 5)) for s in ("a:1", "b:1")}
    for replica in replicas.values():
        replica.last_session = (1, -1, -1)
    old = NeverConnecting("old:1", 2, records(0, 5))
    clock = Clock()
    session = StoreSession(0, metadata.value, replicas, metadata, clock, departing={"old:1": old},
                           recovery_retry_interval=0.5)
    session.start()
    assert session.state is SessionState.WRITING and session.high_water_mark == 4   # 2 of the 3 votes
    for _ in range(20):
        clock.advance(0.5)
    assert clock.getDelayedCalls() == []
    assert session.recovery.recoveries["old:1"].state.value == "released"


def test_a_replica_recovering_after_the_departing_voters_were_let_go_copies_from_the_recovered_ones():
    # The assignment moved {a, b, c} to {c, d, e} in one change: a and b decide 100, c and d catch up and the
    # session writes; a and b are let go. Before: e, back later, waited for ever for a voter holding the mark
    # to copy from (c voted 60, d not at all).
    from waltz.zk.znodes import UNRESOLVED, PartitionMetadata, ReplicaId, ReplicaState
    metadata = DummyMetadata()
    metadata.value = PartitionMetadata(1, 2, tuple(ReplicaState(ReplicaId(0, s), 1, UNRESOLVED)
                                                   for s in ("a:1", "b:1", "c:1")))
    departing = {s: DummyReplica(s, 2, records(0, 101)) for s in ("a:1", "b:1")}
    assigned = {"c:1": DummyReplica("c:1", 2, records(0, 61)), "d:1": DummyReplica("d:1", 2, []),
                "e:1": JoiningReplica("e:1", 2, [])}
    for replica in list(departing.values()) + [assigned["c:1"]]:
        replica.last_session = (1, -1, -1)
    clock = Clock()
    session = StoreSession(0, metadata.value, assigned, metadata, clock, departing=departing,
                           recovery_retry_interval=0.5)
    session.start()
    assert session.state is SessionState.WRITING and session.high_water_mark == 100
    assert set(session.joined) == {"c:1", "d:1"} and not any(r.connected for r in departing.values())
    assigned["e:1"].connect()
    clock.advance(0.5)
    assert len(assigned["e:1"].log) == 101 and set(session.joined) == {"c:1", "d:1", "e:1"}


def test_session_starts_that_keep_failing_back_off_and_log_each_reason_once():
    # A server started before its partitions had replicas logged a warning every half second per partition.
    clock, attempts, events = Clock(), [], []
    reasons = ["partition 0 has no replica assigned in ZooKeeper"] * 12 + ["ZooKeeper connection lost"]

    def failing_factory(*args):
        attempts.append(clock.seconds())
        return defer.fail(ConnectionError(reasons[min(len(attempts), len(reasons)) - 1]))
    partition = StorePartition(0, 1, failing_factory, clock, retry_interval=0.5)
    globalLogPublisher.addObserver(events.append)
    try:
        partition.open()
        while len(attempts) < 14:
            clock.advance(clock.getDelayedCalls()[0].getTime() - clock.seconds())
    finally:
        globalLogPublisher.removeObserver(events.append)
    gaps = [later - earlier for earlier, later in zip(attempts, attempts[1:])]
    assert gaps[:6] == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0] and set(gaps[6:]) == {8.0}
    warned = [e["failures"] for e in events if e.get("log_level") is LogLevel.warn and "failures" in e]
    assert warned == [1, 10, 13], "a reason when it changes, and every tenth failure in a row"
    partition.close()
