"""The transaction monitor, high-water mark gates and submissions."""

from twisted.internet.task import Clock

from tests.client.fakes import RecordingContext
from waltz.client.api import Outcome
from waltz.client.monitor import HighWaterMarkGates, Submission, TransactionMonitor
from waltz.protocols.values import ReqId


def rid(seq):
    return ReqId(1, 1, 0, seq)


def monitor_with(*seqs, capacity=10):
    clock = Clock()
    monitor = TransactionMonitor(capacity, clock)
    subs = {}
    for seq in seqs:
        subs[seq] = Submission(RecordingContext(), 0)
        monitor.register(rid(seq), subs[seq])
    return clock, monitor, subs


def test_own_commit_settles_it_and_fails_every_older_one():
    _, monitor, subs = monitor_with(1, 2, 3, 4)
    committed, failed = monitor.committed(rid(3))
    assert committed is subs[3] and failed == [subs[1], subs[2]]
    assert list(monitor._pending) == [rid(4)]
    assert monitor.committed(ReqId(9, 1, 0, 3)) == (None, [])     # another client's transaction


def test_abort_flush_and_fail_all():
    _, monitor, subs = monitor_with(1, 2, 3)
    monitor.flush_sent(rid(3))
    monitor.register(rid(4), Submission(RecordingContext(), 0))
    assert monitor.abort(rid(2)) is subs[2] and monitor.abort(rid(2)) is None
    assert monitor.flush(rid(3)) == [subs[1], subs[3]]
    assert monitor.flush(rid(3)) == []                        # answered already
    assert monitor.flush(rid(4)) == []                        # no FLUSH named it
    assert len(monitor.fail_all()) == 1 and len(monitor) == 0


def test_a_flush_settles_what_was_sent_before_it_even_when_its_req_id_ended_first():
    # FLUSH(3) was sent; 3 then failed its lock check (LOCK_FAILURE before the flush response). 1 and 2,
    # sent before the FLUSH, are still pending and were answered by it: they failed.
    _, monitor, subs = monitor_with(1, 2, 3)
    monitor.flush_sent(rid(3))
    assert monitor.abort(rid(3)) is subs[3]
    assert monitor.flush(rid(3)) == [subs[1], subs[2]]


def test_a_flush_does_not_settle_an_older_req_id_sent_after_it():
    # An execute that returned a Deferred got ReqId 2 but was sent after FLUSH(3): the server's answer to
    # the FLUSH says nothing about it (failing it would run the context again while 2 commits).
    _, monitor, subs = monitor_with(1, 3)
    monitor.flush_sent(rid(3))
    late = Submission(RecordingContext(), 0)
    monitor.register(rid(2), late)
    assert monitor.flush(rid(3)) == [subs[1], subs[3]]
    assert list(monitor._pending) == [rid(2)]


def test_capacity_and_last_req_id():
    _, monitor, _ = monitor_with(1, 2, capacity=2)
    assert not monitor.has_capacity and monitor.last_req_id == rid(2)
    monitor.abort(rid(2))
    assert monitor.has_capacity and monitor.last_req_id == rid(1)


def test_when_settled_waits_for_what_was_pending():
    _, monitor, _ = monitor_with(1, 2)
    d = monitor.when_settled()
    monitor.register(rid(3), Submission(RecordingContext(), 0))
    monitor.abort(rid(1))
    assert not d.called
    monitor.committed(rid(2))
    assert d.called and len(monitor) == 1


def test_when_settled_fires_at_the_end_of_the_outermost_settling_block():
    # Before, it fired inside committed(): a flush's callback ran before the settled submissions' results.
    clock, monitor, subs = monitor_with(1, 2)
    d = monitor.when_settled()
    with monitor.settling():
        with monitor.settling():
            committed, failed = monitor.committed(rid(2))
            committed.committed(7)
        assert not d.called and subs[2].context.events[-1] == ("completion", True)
    assert d.called
    clock.advance(3)
    with monitor.settling():                # nothing settled: no progress recorded
        pass
    assert monitor.last_progress == 0


def test_progress_time_moves_with_registrations_and_settlements():
    clock, monitor, _ = monitor_with(1)
    clock.advance(5)
    assert monitor.last_progress == 0
    monitor.abort(rid(1))
    assert monitor.last_progress == 5


def test_gates_release_in_transaction_order_up_to_the_mark():
    gates, ran = HighWaterMarkGates(), []
    for txn in (5, 2, 9, 2):
        gates.wait(txn, lambda txn=txn: ran.append(txn))
    gates.release(4)
    assert ran == [2, 2] and len(gates) == 2
    gates.release(9)
    assert ran == [2, 2, 5, 9]


def test_a_submission_ends_once_and_survives_failing_hooks():
    class Broken(RecordingContext):
        def on_completion(self, result):
            raise RuntimeError("hook bug")
    submission = Submission(Broken(), 0)
    submission.committed(3)
    submission.failed(ValueError())        # logged, ignored
    assert submission.result.result.outcome is Outcome.COMMITTED
    assert (submission.result.result.partition_id, submission.result.result.transaction_id) == (0, 3)


def test_expiry_is_measured_from_the_context_creation_time():
    context = RecordingContext()
    submission = Submission(context, 0)
    assert not submission.is_expired(100, 10)          # no creation time yet
    context.creation_time = 50
    assert not submission.is_expired(59.9, 10) and submission.is_expired(60, 10)
    assert not submission.is_expired(1e9, None)
