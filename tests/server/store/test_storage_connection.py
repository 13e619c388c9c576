"""The server's connection to one storage node, and a replica session over it: waiting for it to open."""

from twisted.internet import defer
from twisted.internet.testing import MemoryReactorClock

from waltz.protocols import storage_messages as sm
from waltz.server.store.replica import ReplicaSession, StorageConnection
from waltz.zk.znodes import ReplicaId


def test_a_timed_out_wait_for_a_node_that_stays_down_is_forgotten():
    # /health probes (CheckStorageConnectivity) time out while a node is down; each one used to
    # leave its waiter behind for good.
    clock = MemoryReactorClock()
    conn = StorageConnection("127.0.0.1:1", sm.OpenRequest.create(None, 1), clock)   # never started: down
    waits = [conn.when_open() for _ in range(3)]
    for d in waits:
        d.addTimeout(5, clock)
        d.addErrback(lambda failure: failure.trap(defer.TimeoutError))
    assert len(conn._waiters) == 3
    clock.advance(5)
    assert all(d.called for d in waits) and conn._waiters == []


def test_closing_a_replica_session_forgets_its_wait_for_a_node_that_stays_down():
    # Every new store session of every partition waits for the down node once; closed sessions' waits
    # used to stay until the node came back.
    clock = MemoryReactorClock()
    conn = StorageConnection("127.0.0.1:1", sm.OpenRequest.create(None, 1), clock)   # never started: down
    sessions = [ReplicaSession(ReplicaId(0, "127.0.0.1:1"), n, conn) for n in range(3)]
    waits = [session.when_connected() for session in sessions]
    assert len(conn._waiters) == 3
    for session, d in zip(sessions, waits):
        session.close()
        assert isinstance(d.result.value, defer.CancelledError)
        d.addErrback(lambda failure: None)
    assert conn._waiters == [] and conn._close_listeners == []


def test_a_replica_session_binds_when_its_node_opens():
    clock = MemoryReactorClock()
    conn = StorageConnection("127.0.0.1:1", sm.OpenRequest.create(None, 1), clock)
    session = ReplicaSession(ReplicaId(0, "127.0.0.1:1"), 1, conn)
    d = session.when_connected()
    protocol = FakeProtocol()
    conn._opened(protocol)
    assert d.result is session and session.connected and conn._waiters == [] and session._waiters == []


class FakeProtocol:
    closed = False
