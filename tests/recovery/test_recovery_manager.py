"""The recovery manager on in-memory replicas and a Clock: who votes, and waiting for a replica to copy from."""

from twisted.internet import defer
from twisted.internet.task import Clock

from tests.server.store.test_store_session import DummyMetadata, DummyReplica, records
from waltz.recovery.manager import RecoveryAborted, RecoveryManager, SessionFenced, departing_voters, electorate_of
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


def wiped_member(logs, clock=None):
    """Session 1's members ``logs`` (storage -> records); c forgot the session (its data was wiped and it
    was assigned back, or restored from an old copy): its storage reports no session at all."""
    metadata = DummyMetadata()
    metadata.value = metadata_with(*((s, 1, UNRESOLVED) for s in logs))
    replicas = {s: DummyReplica(s, 2, log) for s, log in logs.items()}
    for storage, replica in replicas.items():
        replica.last_session = (1, -1, -1) if storage != "c:1" else (-1, -1, -1)
    return RecoveryManager(0, metadata.value, replicas, metadata, clock or Clock(), retry_interval=0.5)


def test_a_member_that_forgot_its_session_does_not_vote_away_acknowledged_transactions():
    # 0..20 were acknowledged on a and c (quorum 2 of 3); b fell behind at 15. Counted as voting -1, the
    # wiped c made 15 the closing mark and a was cut back to it: 16..20 lost.
    full = records(0, 21)
    logs = {"a:1": list(full), "b:1": list(full[:16]), "c:1": []}
    clock = Clock()
    manager = wiped_member(logs, clock)
    result = manager.run()
    assert not result.called, "undecidable without c: c may have held 16..20 (it did)"
    assert manager.recoveries["c:1"].vote is None and manager.recoveries["c:1"].abstains
    # No vote can come any more: b copies 16..20 from a and votes 20, which decides it (seed 000).
    clock.advance(0.5)
    assert result.called and result.result.high_water_mark == 20
    assert all([r.transaction_id for r in log] == list(range(21)) for log in logs.values())
    assert clock.getDelayedCalls() == []


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


def three_members(logs, manual=()):
    """Session 1's members a, b, c with ``logs``; b's storage is unreachable until its gate fires."""
    metadata = DummyMetadata()
    metadata.value = metadata_with(*((s, 1, UNRESOLVED) for s in ("a:1", "b:1", "c:1")))
    replicas = {s: DummyReplica(s, 2, logs[s], manual=s in manual) for s in ("a:1", "b:1", "c:1")}
    for replica in replicas.values():
        replica.last_session = (1, -1, -1)
    gate = defer.Deferred()
    replicas["b:1"].connected = False
    replicas["b:1"].when_connected = lambda: gate.addCallback(lambda _: replicas["b:1"])
    return metadata, replicas, gate


def open_gate(replica, gate):
    replica.connected = True
    gate.callback(None)


def test_an_undecidable_vote_is_decided_once_the_replica_behind_copies_from_the_one_ahead():
    # Seed 000's example: a holds 0..10, c 0..5, b (unreachable) maybe more: 10 may be on b, so it is
    # undecidable. c copies 6..10 from a and votes 10: a and c now hold 10, a quorum.
    full = records(0, 16)
    logs = {"a:1": full[:11], "b:1": list(full), "c:1": full[:6]}
    metadata, replicas, gate = three_members(logs)
    clock = Clock()
    manager = RecoveryManager(0, metadata.value, replicas, metadata, clock, retry_interval=0.5)
    result = manager.run()
    assert result.called and result.result.high_water_mark == 10
    assert [r.transaction_id for r in logs["c:1"]] == list(range(11))
    assert ("get_records", 6) in replicas["a:1"].calls
    states = {s.replica_id.storage: (s.session_id, s.closing_high_water_mark) for s in metadata.value.replica_states}
    assert states == {"a:1": (2, UNRESOLVED), "c:1": (2, UNRESOLVED), "b:1": (1, 10)}
    open_gate(replicas["b:1"], gate)           # b comes back with 0..15: cut back to the decided 10
    assert [r.transaction_id for r in logs["b:1"]] == list(range(11))
    assert clock.getDelayedCalls() == []


def test_no_vote_is_raised_while_a_connected_member_may_still_vote():
    full = records(0, 11)
    logs = {"a:1": list(full), "b:1": list(full), "c:1": full[:6]}
    metadata, replicas, gate = three_members(logs)
    replicas["b:1"].connected = True           # connected, but its session info is slow to come
    slow = defer.Deferred()
    replicas["b:1"].last_session_info = lambda: slow
    clock = Clock()
    manager = RecoveryManager(0, metadata.value, replicas, metadata, clock, retry_interval=0.5)
    result = manager.run()
    gate.callback(None)
    clock.advance(2)
    assert not result.called and len(logs["c:1"]) == 6    # b's vote (10, it turns out) may decide without copying
    slow.callback((1, -1, -1))
    assert result.called and result.result.high_water_mark == 10
    assert clock.getDelayedCalls() == []


def test_a_resolution_during_the_copy_raising_a_vote_settles_after_it():
    # c copies 6..10 from a (its appends wait for the test); meanwhile b returns with 0..5: the vote is
    # decided at 5 (a alone holds 6..10). c settles after its copy ends: cut back to 5, like a.
    full = records(0, 11)
    logs = {"a:1": list(full), "b:1": full[:6], "c:1": full[:6]}
    metadata, replicas, gate = three_members(logs, manual=("c:1",))
    clock = Clock()
    manager = RecoveryManager(0, metadata.value, replicas, metadata, clock, retry_interval=0.5)
    result = manager.run()
    assert manager.recoveries["c:1"].raising and replicas["c:1"].pending
    open_gate(replicas["b:1"], gate)
    assert result.result.high_water_mark == 5 and result.result.recovered == {"a:1", "b:1"}
    assert manager.recoveries["c:1"].state.value == "raising-vote"
    background = result.result.background["c:1"]
    assert not background.called
    replicas["c:1"].ack()                       # the copy ends; c re-reads what it holds and truncates to 5
    assert background.result == "c:1"
    assert all([r.transaction_id for r in log] == list(range(6)) for log in logs.values())
    assert replicas["c:1"].calls[-2:] == [("truncate", 5), ("set_low_water_mark", 5)]
    assert clock.getDelayedCalls() == []


def test_a_copy_raising_a_vote_that_fails_is_tried_again():
    full = records(0, 11)
    logs = {"a:1": list(full), "b:1": [], "c:1": full[:6]}
    metadata, replicas, _ = three_members(logs)
    replicas["a:1"].read_error = OSError("I/O error")
    clock = Clock()
    manager = RecoveryManager(0, metadata.value, replicas, metadata, clock, retry_interval=0.5)
    result = manager.run()
    assert not result.called and manager.recoveries["c:1"].state.value == "voted"
    replicas["a:1"].read_error = None
    clock.advance(0.5)
    assert result.called and result.result.high_water_mark == 10
    assert clock.getDelayedCalls() == []


def test_a_replica_that_kept_less_than_asked_when_truncated_is_caught_up():
    # b holds a dirty 21..25; truncated to the decided 20, its storage keeps only 0..14 (it found damage
    # below the cut). It used to be recorded as recovered at 20 while holding 0..14.
    full = records(0, 26)
    logs = {"a:1": full[:21], "b:1": list(full), "c:1": full[:21]}
    metadata, replicas, gate = three_members(logs)
    open_gate(replicas["b:1"], gate)
    b = replicas["b:1"]

    def damaged_truncate(transaction_id):
        b.calls.append(("truncate", transaction_id))
        del b.log[15:]
        return defer.succeed(len(b.log) - 1)
    b.truncate = damaged_truncate
    manager = RecoveryManager(0, metadata.value, replicas, metadata, Clock(), retry_interval=0.5)
    result = manager.run()
    assert result.called and result.result.high_water_mark == 20
    assert [r.transaction_id for r in logs["b:1"]] == list(range(21))
    assert b.calls[-1] == ("set_low_water_mark", 20)


def test_a_raise_that_failed_half_way_goes_on_from_what_the_replica_holds():
    # c copied 6..8 of 6..10, then the read failed: the next raise copies 9..10, not 6..10 again (a real
    # storage refuses records it already holds, and the partition stayed undecidable).
    full = records(0, 11)
    logs = {"a:1": list(full), "b:1": [], "c:1": full[:6]}
    metadata, replicas, _ = three_members(logs)
    a = replicas["a:1"]
    served = []

    def get_records(first, count):
        if served:
            return defer.fail(OSError("I/O error"))
        served.append(first)
        return defer.succeed(tuple(full[first:first + 3]))
    a.get_records = get_records
    c = replicas["c:1"]
    appended = []
    real_append = c.append

    def append(batch):
        if batch[0].transaction_id != len(c.log):
            return defer.fail(ValueError("transaction %d does not follow %d" % (batch[0].transaction_id,
                                                                                len(c.log) - 1)))
        appended.append(tuple(r.transaction_id for r in batch))
        return real_append(batch)
    c.append = append
    clock = Clock()
    manager = RecoveryManager(0, metadata.value, replicas, metadata, clock, retry_interval=0.5)
    result = manager.run()
    assert not result.called and appended == [(6, 7, 8)]
    del a.get_records                               # a serves reads again
    clock.advance(0.5)
    assert result.called and result.result.high_water_mark == 10
    assert appended == [(6, 7, 8), (9, 10)]
    assert [r.transaction_id for r in logs["c:1"]] == list(range(11))


def refusing_members(metadata):
    """Session 2's recovery over a, b, c, whose storages refuse every request of session 2."""
    replicas = {s: DummyReplica(s, 2, records(0, 5)) for s in ("a:1", "b:1", "c:1")}
    for replica in replicas.values():
        replica.last_session_info = lambda: defer.fail(RuntimeError("session 2 is fenced: partition 0 is in session 3"))
    return RecoveryManager(0, metadata_with(*((s, 1, UNRESOLVED) for s in replicas)), replicas, metadata, Clock(),
                           retry_interval=0.5)


def test_a_recovery_fenced_by_a_newer_session_stops_instead_of_retrying_forever():
    # Another server took the partition over (session 3) before this recovery's first request reached the
    # storages: they refuse session 2 from then on, and its steps never get to the metadata write.
    metadata = DummyMetadata()
    metadata.value = PartitionMetadata(2, 3, ())
    manager = refusing_members(metadata)
    result = manager.run()
    assert result.called and isinstance(result.result.value, SessionFenced)
    assert "partition 0 is in session 3" in str(result.result.value)
    assert set(manager.replica_states().values()) == {"abandoned"}
    assert manager.reactor.getDelayedCalls() == []
    result.addErrback(lambda f: None)


def test_a_refused_step_is_retried_while_the_session_is_still_current_or_the_metadata_unreadable():
    metadata = DummyMetadata()
    metadata.value = metadata_with()                      # session 2: still this recovery's own
    manager = refusing_members(metadata)
    result = manager.run()
    manager.reactor.advance(0.5)
    assert not result.called and set(manager.replica_states().values()) == {"reading-session-info"}
    metadata.read = lambda partition_id: defer.fail(ConnectionError("ZooKeeper connection lost"))
    manager.reactor.advance(0.5)
    assert not result.called and manager.reactor.getDelayedCalls()
    metadata.read = lambda partition_id: defer.succeed(PartitionMetadata(2, 3, ()))
    manager.reactor.advance(0.5)                          # the next refusal reads again, and finds session 3
    assert result.called and isinstance(result.result.value, SessionFenced)
    result.addErrback(lambda f: None)


# --- departing voters: members of the last session that the assignment dropped ----------------------------


def replaced_single_replica(old_log, new_log):
    """Session 1 had old:1 alone, then new:1 joined it; the assignment now has new:1 only (docs/operations.md,
    "Replacing a storage node", on a partition with one replica). The electorate is {old, new}: quorum 2."""
    metadata = DummyMetadata()
    metadata.value = metadata_with(("old:1", 1, UNRESOLVED), ("new:1", 1, UNRESOLVED))
    old, new = DummyReplica("old:1", 2, old_log), DummyReplica("new:1", 2, new_log)
    old.last_session = new.last_session = (1, -1, -1)
    return metadata, old, new


def test_a_member_the_assignment_dropped_is_asked_for_its_vote_and_left_as_it_is():
    # Before: a dropped member counted as not voting, and one vote of the two needed never came: the partition
    # could not write again until the old node was assigned back.
    committed = records(0, 21)
    metadata, old, new = replaced_single_replica(list(committed), list(committed))
    manager = RecoveryManager(0, metadata.value, {"new:1": new}, metadata, Clock(), departing={"old:1": old})
    result = manager.run()
    assert result.called and result.result.high_water_mark == 20
    assert result.result.recovered == {"new:1"} and result.result.background == {}
    assert manager.recoveries["old:1"].vote == 20
    assert manager.recoveries["old:1"].state.value == "released"
    assert old.calls == [] and len(old.log) == 21      # nothing written to the departing replica
    # The new session's metadata drops it: the next recovery's electorate is new:1 alone.
    assert [s.replica_id.storage for s in metadata.value.replica_states] == ["new:1"]


def three_member_session_losing_old(logs):
    """Session 1's members old, a and b (``logs``: storage -> records); the assignment now has a, b and new;
    b is unreachable. The electorate is {old, a, b}: quorum 2."""
    metadata = DummyMetadata()
    metadata.value = metadata_with(*((s, 1, UNRESOLVED) for s in ("old:1", "a:1", "b:1")))
    replicas = {s: DummyReplica(s, 2, logs.get(s, [])) for s in ("old:1", "a:1", "b:1", "new:1")}
    for s in ("old:1", "a:1", "b:1"):
        replicas[s].last_session = (1, -1, -1)
    replicas["b:1"].when_connected = lambda: defer.Deferred()
    replicas["b:1"].connected = False
    departing = {"old:1": replicas.pop("old:1")}
    manager = RecoveryManager(0, metadata.value, replicas, metadata, Clock(), departing=departing)
    return manager, replicas, departing["old:1"]


def test_a_departing_voter_holding_acknowledged_transactions_is_copied_from():
    # 21..30 were acknowledged by old and b; b is down. a copies them from old and votes 30.
    committed = records(0, 31)
    manager, replicas, old = three_member_session_losing_old({"old:1": list(committed), "a:1": committed[:21]})
    result = manager.run()
    assert result.called and result.result.high_water_mark == 30
    assert len(replicas["a:1"].log) == len(replicas["new:1"].log) == 31
    assert result.result.recovered == {"a:1", "new:1"}
    assert all(call[0] == "get_records" for call in old.calls)     # read from, never written to


def test_a_departing_voter_behind_raises_its_vote_and_a_lost_one_makes_the_vote_wait():
    committed = records(0, 31)
    manager, replicas, old = three_member_session_losing_old({"old:1": committed[:21], "a:1": list(committed)})
    result = manager.run()
    assert result.called and result.result.high_water_mark == 30
    assert len(old.log) == 31 and manager.recoveries["old:1"].state.value == "released"
    # A departing voter that cannot be reached counts as not voting: the vote waits, as documented.
    manager, replicas, old = three_member_session_losing_old({"old:1": list(committed), "a:1": committed[:21]})
    old.when_connected = lambda: defer.Deferred()
    old.connected = False
    result = manager.run()
    assert not result.called and manager.state.value == "undecidable"
    manager.stop()
    result.addErrback(lambda f: None)


def test_only_members_of_the_electorate_are_departing_voters():
    metadata = metadata_with(("a:1", 1, UNRESOLVED), ("b:1", 1, UNRESOLVED), ("c:1", 0, 50))
    assert departing_voters(metadata, {"b:1", "d:1"}) == {"a:1"}     # c was resolved: not asked
    assert departing_voters(metadata, {"a:1", "b:1"}) == frozenset()
    assert departing_voters(metadata_with(), {"a:1"}) == frozenset()  # never had a session
