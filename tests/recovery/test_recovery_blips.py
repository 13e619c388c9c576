"""Recovery over real replica sessions whose storage connections drop and come back (on a Clock): votes
stand, voters bind again, joins and catch-ups go on, a storage refusing requests does not hold up the
vote, and a closed session leaves nothing running."""

from twisted.internet import defer
from twisted.internet.task import Clock

from tests.recovery.connections import FakeConnection, FakeStorage, replica_session
from tests.recovery.test_recovery_manager import metadata_with
from tests.server.store.test_store_session import DummyMetadata, DummyReplica, records
from waltz.recovery.manager import RecoveryManager
from waltz.server.store.replica import ReplicaUnavailable
from waltz.server.store.session import StoreSession
from waltz.zk.znodes import UNRESOLVED


def cluster(logs, session_id=2):
    """Storages holding ``logs`` (storage -> records), last in session 1, behind connections not open yet."""
    stores = {storage: FakeStorage(list(log), (1, -1, -1)) for storage, log in logs.items()}
    connections = {storage: FakeConnection(store) for storage, store in stores.items()}
    replicas = {storage: replica_session(storage, session_id, conn) for storage, conn in connections.items()}
    return stores, connections, replicas


def members(*storages):
    metadata = DummyMetadata()
    metadata.value = metadata_with(*((storage, 1, UNRESOLVED) for storage in storages))
    return metadata


def advance(clock, seconds, step=0.5):
    for _ in range(int(seconds / step)):
        clock.advance(step)


def test_a_top_voter_whose_connection_blipped_is_read_from_to_raise_a_lagging_vote():
    full = records(0, 11)
    stores, connections, replicas = cluster({"a:1": full, "b:1": full, "c:1": full[:6]})
    metadata = members("a:1", "b:1", "c:1")
    clock = Clock()
    manager = RecoveryManager(0, metadata.value, replicas, metadata, clock, retry_interval=0.5)
    result = manager.run()
    connections["a:1"].open()
    assert manager.recoveries["a:1"].vote == 10
    connections["a:1"].drop()            # a blip: a storage restart, a request timeout...
    connections["a:1"].open()            # ...and its connection is back at once
    connections["c:1"].open()            # c votes 5, b is down: undecidable until c copies 6..10 from a
    advance(clock, 5)
    assert result.called and manager.high_water_mark == 10      # before the fix: undecidable for ever
    assert len(stores["c:1"].log) == 11


def test_replicas_catching_up_find_ushers_again_after_a_blip_of_every_connection():
    full = records(0, 1001)
    # a, b, c took part in session 1; d is new: 4 assigned, quorum 3
    stores, connections, replicas = cluster({"a:1": full, "b:1": full, "c:1": full[:6], "d:1": []})
    stores["d:1"].last_session = (-1, -1, -1)
    metadata = members("a:1", "b:1", "c:1")
    clock = Clock()
    manager = RecoveryManager(0, metadata.value, replicas, metadata, clock, retry_interval=0.5)
    result = manager.run()
    connections["a:1"].open()
    connections["b:1"].open()
    connections["c:1"].open(hold=True)   # their catch-up appends wait
    connections["d:1"].open(hold=True)
    assert manager.high_water_mark == 1000 and manager._recovered == {"a:1", "b:1"}
    for connection in connections.values():     # the server's network blips
        connection.drop()
    for connection in connections.values():
        connection.open()
    advance(clock, 10)
    assert result.called, "catch-ups waited for ever for ushers whose storages were connected"
    assert len(stores["c:1"].log) == len(stores["d:1"].log) == 1001


def test_a_replica_joining_after_a_blip_binds_again_and_joins():
    metadata = DummyMetadata()
    metadata.value = metadata.value.__class__(1, 1, metadata.value.replica_states)
    clock = Clock()
    connection = FakeConnection(FakeStorage([]))
    replicas = {storage: DummyReplica(storage, 1, []) for storage in ("a:1", "b:1")}
    replicas["c:1"] = replica_session("c:1", 1, connection)
    session = StoreSession(0, metadata.value, replicas, metadata, clock, recovery_retry_interval=0.5)
    session.start()
    assert set(session.joined) == {"a:1", "b:1"}
    for first in range(0, 3000, 100):
        session.write(records(first, 100))
    connection.open(hold=True)   # c recovers in the background, then copies 0..2999 to join
    clock.advance(0)
    connection.drop()            # a blip during the copy
    connection.open()
    advance(clock, 40, step=1)
    assert "c:1" in session.joined, "every retry of the join failed: 'storage c:1 is not connected'"


def test_a_member_that_refuses_every_request_does_not_hold_up_raising_the_votes():
    five = ("a:1", "b:1", "c:1", "d:1", "e:1")
    full = records(0, 21)
    logs = {"a:1": list(full), "b:1": list(full), "c:1": full[:16], "d:1": list(full), "e:1": full[:10]}
    replicas = {storage: DummyReplica(storage, 2, log) for storage, log in logs.items()}
    for replica in replicas.values():
        replica.last_session = (1, -1, -1)
    replicas["d:1"].connected = False
    replicas["d:1"].when_connected = lambda: defer.Deferred()       # d is down
    replicas["e:1"].last_session_info = lambda: defer.fail(RuntimeError(
        "partition 0 is not assigned to this storage node"))          # e is up, and refuses
    metadata = members(*five)
    clock = Clock()
    manager = RecoveryManager(0, metadata.value, replicas, metadata, clock, retry_interval=0.5)
    result = manager.run()
    advance(clock, 10)
    assert result.called and manager.high_water_mark == 20        # a, b, c once c copied 16..20


class HeldReads(DummyReplica):
    """Like a replica session: requests fail once closed; reads wait until the test answers them."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.held = []

    def append(self, batch):
        if not self.connected:
            return defer.fail(ReplicaUnavailable("closed"))
        return super().append(batch)

    def get_records(self, transaction_id, max_records):
        if not self.connected:
            return defer.fail(ReplicaUnavailable("closed"))
        d = defer.Deferred()
        self.held.append((d, tuple(self.log[transaction_id:transaction_id + max_records])))
        return d


def test_a_catch_up_read_answered_after_the_session_closed_leaves_no_timer_running():
    full = records(0, 2000)
    logs = {"a:1": list(full), "b:1": list(full), "c:1": list(full[:10])}
    metadata = members(*logs)
    clock = Clock()
    replicas = {storage: HeldReads(storage, 2, log) for storage, log in logs.items()}
    for replica in replicas.values():
        replica.last_session = (1, -1, -1)
    session = StoreSession(0, metadata.value, replicas, metadata, clock)
    assert session.start().called                    # a and b decide 1999; c catches up in the background
    held, answer = (replicas["a:1"].held or replicas["b:1"].held).pop()
    session.close("checkpoint")
    held.callback(answer)                            # the storage answers a read sent before the close
    advance(clock, 5)
    assert clock.getDelayedCalls() == [], "the closed session's usher timer ran for ever"
