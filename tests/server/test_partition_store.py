"""The server partition over the real StorePartition (quorum writes, recovery) on dummy replicas."""

from waltz.protocols.client_messages import (
    AppendRequest, FeedData, FeedRequest, FlushRequest, FlushResponse, LockFailure, MountRequest, MountResponse,
    MountState)
from waltz.protocols.locks import lock_hash
from waltz.protocols.values import ReqId
from waltz.server.partition import PartitionSettings, PartitionState, ServerPartition
from waltz.server.store.partition import StorePartition

from tests.server.store.test_store_session import STORAGES, Harness as StoreHarness
from tests.server.test_partition import DummyConnection

GEN = 1


def rid(seq, client=1):
    return ReqId(client, GEN, 0, seq)


class Setup:
    def __init__(self, manual=False):
        self.replicas = StoreHarness(manual=manual)
        self.clock = self.replicas.clock
        self.store = StorePartition(0, GEN, self.replicas.factory, self.clock)
        self.partition = ServerPartition(0, GEN, self.store, PartitionSettings(), self.clock)
        self.started = self.partition.start()
        self.store.open()
        self.clock.advance(0)
        self.conn = DummyConnection()
        self.partition.handle(self.conn, MountRequest(rid(0), -1, 1))
        self.clock.advance(0)
        self.partition.handle(self.conn, FeedRequest(rid(0), -1))

    def append(self, seq, client_hwm=-1, **locks):
        return self.partition.handle(self.conn, AppendRequest.create(rid(seq), client_hwm, seq, b"t%d" % seq,
                                                                     **locks))

    def ack(self, storages=STORAGES[:2]):
        self.clock.advance(0)       # the reactor turn ends: the appends queued in it go to the replicas
        session = self.replicas.sessions[-1]
        for storage in storages:
            session.replicas_by_name[storage].ack()
        self.clock.advance(0)


def test_serves_once_the_store_recovered_and_commits_reach_the_feed():
    s = Setup()
    assert s.started.called and s.partition.state is PartitionState.SERVING
    assert s.conn.sent == [MountResponse(rid(0), MountState.READY)]
    lock = lock_hash("account", 7)
    s.append(1, write_locks=[lock])
    s.append(2)
    s.clock.advance(0)
    s.append(3, client_hwm=-1, write_locks=[lock])
    s.partition.handle(s.conn, FlushRequest(rid(4)))
    s.clock.advance(0)
    assert s.conn.sent[1:] == [FeedData(rid(1), 0, 1), FeedData(rid(2), 1, 2), LockFailure(rid(3), 0),
                               FlushResponse(rid(4), 1)]
    assert all(len(s.replicas.logs[storage]) == 2 for storage in STORAGES)


def test_an_append_lost_with_its_session_fails_silently_and_the_next_commits():
    s = Setup(manual=True)
    s.append(1)
    s.clock.advance(0)                        # the turn ends: the append goes to the replicas
    s.partition.handle(s.conn, FlushRequest(rid(2)))
    s.replicas.sessions[-1].close("test: replica lost")
    s.clock.advance(0)                        # a new session recovers: the append never reached a quorum
    assert s.conn.sent[1:] == [FlushResponse(rid(2), -1)]
    assert s.partition.locks.held == 0
    s.append(3)
    s.ack()
    assert s.conn.sent[-1] == FeedData(rid(3), 0, 3)
    assert s.partition.high_water_mark == 0 and s.store.high_water_mark == 0


def test_closing_the_partition_closes_the_store():
    s = Setup()
    s.partition.close()
    assert s.store.closed and s.partition.state is PartitionState.CLOSED
    assert s.append(9) is None


def test_a_closed_partition_no_longer_reports_its_high_water_mark():
    s = Setup()
    s.append(1)
    s.clock.advance(0)
    gauge = s.partition.metrics.high_water_mark
    assert gauge.snapshot() == {'{partition="0"}': 0}
    s.partition.close()
    assert gauge.snapshot() == {}


def test_an_append_released_while_a_recovery_settles_is_numbered_after_the_recovered_mark():
    # #1 (txn 0) reached a and b but its session died before the quorum was seen; the next recovery resolves
    # 0 and reports #1 committed. That releases #2 (waiting for capacity), which used to be numbered from the
    # old mark: txn 0 again, reported committed in the caches and the feed while the storages hold #1.
    setup = Setup(manual=True)
    setup.partition.settings = PartitionSettings(max_pending_appends=1)
    setup.append(1)
    setup.append(2)
    setup.clock.advance(0)
    first = setup.replicas.sessions[0]
    a, b, _ = (first.replicas_by_name[s] for s in STORAGES)
    a.ack()
    first.close("b's ack lost")
    b.ack()
    setup.clock.advance(0)
    second = setup.replicas.sessions[1]
    sent = [call[1] for call in second.replicas_by_name[STORAGES[0]].calls if call[0] == "append"]
    assert sent == [(1,)]
    setup.ack()
    setup.clock.advance(0)
    assert [(m.transaction_id, m.req_id.seq_num) for m in setup.conn.of(FeedData)] == [(0, 1), (1, 2)]
