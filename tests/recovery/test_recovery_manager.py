"""The recovery manager on in-memory replicas and a Clock: who votes, and waiting for a replica to copy from."""

from twisted.internet import defer
from twisted.internet.task import Clock

from tests.server.store.test_store_session import DummyMetadata, DummyReplica, records
from waltz.recovery.manager import RecoveryAborted, RecoveryManager, electorate_of
from waltz.zk.znodes import UNRESOLVED, PartitionMetadata, ReplicaId, ReplicaState

FIVE = ("a:1", "b:1", "c:1", "d:1", "e:1")


def metadata_with(*states):
    """Partition metadata at session 2 with ``(storage, session id, closing mark)`` replica states."""
    return PartitionMetadata(1, 2, tuple(ReplicaState(ReplicaId(0, s), sid, mark) for s, sid, mark in states))


def test_the_electorate_is_the_last_writing_session_whatever_the_assignment():
    metadata = metadata_with(("a:1", 1, UNRESOLVED), ("b:1", 1, UNRESOLVED), ("c:1", 0, 50), ("x:1", 1, UNRESOLVED))
    # c was resolved at an earlier mark, d is new, x is no longer assigned but took part in session 1.
    assert electorate_of(metadata, {"a:1", "b:1", "c:1", "d:1"}) == {"a:1", "b:1", "x:1"}
    # A partition that never had a session: every assigned replica votes.
    assert electorate_of(metadata_with(), {"a:1", "b:1"}) == {"a:1", "b:1"}


def test_a_new_replica_does_not_vote_and_is_brought_to_the_resolved_mark():
    committed = records(0, 101)
    logs = {"a:1": list(committed), "b:1": list(committed), "c:1": list(committed[:51]), "d:1": []}
    metadata = DummyMetadata()
    metadata.value = metadata_with(("a:1", 1, UNRESOLVED), ("b:1", 1, UNRESOLVED), ("c:1", 0, 50))
    replicas = {s: DummyReplica(s, 2, log) for s, log in logs.items()}
    replicas["a:1"].last_session = replicas["b:1"].last_session = (1, 50, 50)
    replicas["c:1"].last_session = (0, 20, 20)
    manager = RecoveryManager(0, metadata.value, replicas, metadata, Clock())
    result = manager.run()
    assert result.called and result.result.high_water_mark == 100
    assert manager.recoveries["d:1"].vote is None and manager.recoveries["c:1"].vote is None
    assert all(len(log) == 101 for log in logs.values())


def test_replicas_waiting_for_one_to_copy_from_share_one_retry_timer():
    metadata = DummyMetadata()
    metadata.value = metadata_with(*((s, 1, UNRESOLVED) for s in FIVE))
    clock = Clock()
    full = records(0, 11)
    replicas = {s: DummyReplica(s, 2, list(full) if s in ("a:1", "b:1", "c:1") else list(full[:5])) for s in FIVE}
    for replica in replicas.values():
        replica.last_session = (1, -1, -1)
    for s in ("a:1", "b:1", "c:1"):       # their recoveries do not finish: the resolved mark has no quorum yet
        replicas[s].set_low_water_mark = lambda mark: defer.Deferred()
    gates = {s: defer.Deferred() for s in ("d:1", "e:1")}
    for s, gate in gates.items():
        replicas[s].when_connected = lambda gate=gate, replica=replicas[s]: gate.addCallback(lambda _: replica)
    manager = RecoveryManager(0, metadata.value, replicas, metadata, clock, retry_interval=0.5)
    result = manager.run()
    assert manager.high_water_mark == 10  # a, b, c decide
    for s in ("a:1", "b:1", "c:1"):
        replicas[s].connected = False      # the server loses them before d and e copy
    for gate in gates.values():
        gate.callback(None)                # d and e wait for a replica to copy 5..10 from
    timers = []
    for _ in range(12):
        clock.advance(0.5)
        timers.append(len(clock.getDelayedCalls()))
    assert max(timers) == 1, timers       # not 2, 4, 8, ... (one per waiter, each waking every waiter)
    replicas["a:1"].connected = True
    clock.advance(0.5)
    assert len(replicas["d:1"].log) == len(replicas["e:1"].log) == 11
    manager.stop()
    assert clock.getDelayedCalls() == []
    assert isinstance(result.result.value, RecoveryAborted)    # stopped before a, b and c recovered
    result.addErrback(lambda f: None)


def wiped_member(logs):
    """Session 1's members ``logs`` (storage -> records); c forgot the session (its data was wiped and it
    was assigned back, or restored from an old copy): its storage reports no session at all."""
    metadata = DummyMetadata()
    metadata.value = metadata_with(*((s, 1, UNRESOLVED) for s in logs))
    replicas = {s: DummyReplica(s, 2, log) for s, log in logs.items()}
    for storage, replica in replicas.items():
        replica.last_session = (1, -1, -1) if storage != "c:1" else (-1, -1, -1)
    return RecoveryManager(0, metadata.value, replicas, metadata, Clock())


def test_a_member_that_forgot_its_session_does_not_vote_away_acknowledged_transactions():
    # 0..20 were acknowledged on a and c (quorum 2 of 3); b fell behind at 15. Counted as voting -1, the
    # wiped c made 15 the closing mark and a was cut back to it: 16..20 lost.
    full = records(0, 21)
    logs = {"a:1": list(full), "b:1": list(full[:16]), "c:1": []}
    manager = wiped_member(logs)
    result = manager.run()
    assert not result.called, "undecidable without c: c may have held 16..20 (it did)"
    assert manager.recoveries["c:1"].vote is None and manager.recoveries["c:1"].abstains
    assert len(logs["a:1"]) == 21


def test_a_member_that_forgot_its_session_is_caught_up_once_the_others_decide():
    full = records(0, 21)
    logs = {"a:1": list(full), "b:1": list(full), "c:1": []}
    manager = wiped_member(logs)
    result = manager.run()
    assert result.called and result.result.high_water_mark == 20
    assert [r.transaction_id for r in logs["c:1"]] == list(range(21))


def test_a_lagging_replica_is_caught_up_from_the_next_usher_when_one_fails_the_read():
    # a's disk fails reads (or returns a record that fails its checksum): c copies from b instead of
    # failing its catch-up again and again while a is the first replica holding the records.
    full = records(0, 21)
    logs = {"a:1": list(full), "b:1": list(full), "c:1": list(full[:5])}
    metadata = DummyMetadata()
    metadata.value = metadata_with(*((s, 1, UNRESOLVED) for s in logs))
    replicas = {s: DummyReplica(s, 2, log) for s, log in logs.items()}
    for replica in replicas.values():
        replica.last_session = (1, -1, -1)
    replicas["a:1"].read_error = OSError("I/O error reading segment 0")
    manager = RecoveryManager(0, metadata.value, replicas, metadata, Clock())
    result = manager.run()
    assert result.called and result.result.high_water_mark == 20
    assert [r.transaction_id for r in logs["c:1"]] == list(range(21))
    assert ("get_records", 5) in replicas["a:1"].calls     # asked first, failed, and b served the copy
