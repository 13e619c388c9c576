"""The server's connection to one storage node: waiting for it to open."""

from twisted.internet import defer
from twisted.internet.testing import MemoryReactorClock

from waltz.protocols import storage_messages as sm
from waltz.server.store.replica import StorageConnection


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
