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


def test_a_stopped_pool_opens_no_connection():
    # A session whose creation was under way when the server stopped opened connections, reconnecting for
    # ever, after the pool had stopped.
    import pytest
    from waltz.server.store.replica import ReplicaUnavailable, StorageConnectionPool
    pool = StorageConnectionPool(sm.OpenRequest.create(None, 1), MemoryReactorClock())
    pool.stop()
    with pytest.raises(ReplicaUnavailable, match="stopped"):
        pool.connection("127.0.0.1:1")
    assert pool.connections == {}


def test_a_connection_lost_before_its_handshake_logs_no_unhandled_error():
    import gc
    from twisted.internet import error
    from twisted.logger import globalLogPublisher
    from twisted.python import failure
    from waltz.server.store.replica import _PooledStorageProtocol
    seen = []
    observer = lambda event: seen.append(event.get("log_format") or "")   # noqa: E731
    globalLogPublisher.addObserver(observer)
    try:
        proto = _PooledStorageProtocol()
        proto.owner = StorageConnection("127.0.0.1:1", sm.OpenRequest.create(None, 1), MemoryReactorClock())
        proto.connectionLost(failure.Failure(error.ConnectionDone()))   # the node closed during the Hello
        del proto
        gc.collect()
    finally:
        globalLogPublisher.removeObserver(observer)
    assert [s for s in seen if "Unhandled error in Deferred" in s] == []


def _pool(wanted):
    from waltz.server.store.replica import StorageConnectionPool
    return StorageConnectionPool(sm.OpenRequest.create(None, 1), MemoryReactorClock(), wanted=lambda: set(wanted))


def test_a_node_no_longer_assigned_is_disconnected_once_its_last_replica_session_closes():
    # A server reconnected for ever, logging every attempt, to each storage node removed from the assignment.
    wanted = {"127.0.0.1:1", "127.0.0.1:2"}
    pool = _pool(wanted)
    first, second = pool.connection("127.0.0.1:1"), pool.connection("127.0.0.1:2")
    sessions = [ReplicaSession(ReplicaId(0, "127.0.0.1:2"), n, second) for n in (1, 2)]
    wanted.discard("127.0.0.1:2")
    pool.release_unwanted()
    assert pool.connections == {"127.0.0.1:1": first, "127.0.0.1:2": second}      # still used
    assert second._service.running
    sessions[0].close()
    assert pool.connections["127.0.0.1:2"] is second
    sessions[1].close()                                                            # its last user
    assert pool.connections == {"127.0.0.1:1": first} and not second._service.running
    ReplicaSession(ReplicaId(0, "127.0.0.1:1"), 3, first).close()                 # still assigned: kept
    assert pool.connections == {"127.0.0.1:1": first} and first._service.running
    again = pool.connection("127.0.0.1:2")                                         # asked again: a new one
    assert again is not second and again._service.running


def test_a_node_no_longer_assigned_that_no_session_uses_is_disconnected_at_the_assignment_change():
    wanted = {"127.0.0.1:1"}
    pool = _pool(wanted)
    conn = pool.connection("127.0.0.1:1")          # e.g. a connectivity check: no replica session
    pool.release_unwanted()
    assert pool.connections == {"127.0.0.1:1": conn}
    wanted.clear()
    pool.release_unwanted()
    assert pool.connections == {} and not conn._service.running
