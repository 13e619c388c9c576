"""The demo runner's waits: a timeout says what did not happen, and the first failure comes out unwrapped."""

import pytest
from twisted.internet import defer, task

from waltz.demo.runner import InstanceError, InstanceProcess, _all, _last_progress, _with_timeout


def outcome(d):
    results = []
    d.addBoth(results.append)
    return results


def test_a_wait_that_expires_says_what_did_not_happen():
    clock = task.Clock()
    events = [defer.Deferred(), defer.Deferred()]
    waited = outcome(_with_timeout(clock, _all(events), 30, "the instances did not all join the cluster"))
    events[0].callback("a")
    clock.advance(29)
    assert waited == []
    clock.advance(1)
    with pytest.raises(InstanceError, match="the instances did not all join the cluster within 30 s"):
        waited[0].raiseException()
    events[1].errback(RuntimeError("late"))         # a late outcome is ignored, not reported as unhandled


def test_a_wait_gives_the_results_or_the_first_failure_itself():
    clock = task.Clock()
    events = [defer.Deferred(), defer.Deferred()]
    waited = outcome(_with_timeout(clock, _all(events), 30, "x"))
    events[1].callback(2)
    events[0].callback(1)
    assert waited == [[1, 2]] and clock.getDelayedCalls() == []
    events = [defer.Deferred(), defer.Deferred()]
    waited = outcome(_with_timeout(clock, _all(events), 30, "x"))
    events[0].errback(InstanceError("instance-0 exited (status 1)"))
    assert isinstance(waited[0].value, InstanceError) and str(waited[0].value) == "instance-0 exited (status 1)"
    events[1].callback(None)


def test_a_wait_with_progress_counts_its_deadline_from_the_last_progress():
    clock = task.Clock()
    last = [None]
    event = defer.Deferred()
    waited = outcome(_with_timeout(clock, event, 30, "the instances did not all join the cluster", lambda: last[0]))
    for _ in range(10):                 # 200 s of steady progress, far beyond 30 s
        clock.advance(20)
        last[0] = clock.seconds()
    assert waited == []
    clock.advance(29)
    assert waited == []
    clock.advance(1)
    with pytest.raises(InstanceError, match=r"did not all join the cluster \(no progress for 30 s\)"):
        waited[0].raiseException()
    assert clock.getDelayedCalls() == []


def test_a_wait_with_progress_still_expires_when_nothing_ever_progresses():
    clock = task.Clock()
    waited = outcome(_with_timeout(clock, defer.Deferred(), 30, "x", lambda: None))
    clock.advance(30)
    with pytest.raises(InstanceError, match=r"x \(no progress for 30 s\)"):
        waited[0].raiseException()


def test_only_a_catching_up_event_with_more_applied_counts_as_progress(tmp_path):
    clock = task.Clock()
    process = InstanceProcess("instance-0", str(tmp_path / "instance.log"), clock)
    clock.advance(5)
    process.outReceived(b'{"event": "catching_up", "applied": 0}\n')
    assert (process.applied, process.progressed_at) == (0, 5)
    clock.advance(5)
    process.outReceived(b'{"event": "catching_up", "applied": 0}\n{"event": "catching_up", "applied": "9"}\n')
    assert (process.applied, process.progressed_at) == (0, 5)
    clock.advance(5)
    process.outReceived(b'{"event": "catching_up", "applied": 40}\n')
    assert (process.applied, process.progressed_at) == (40, 15)
    assert process.stats == {} and not process.events["started"].called
    last = _last_progress([process, InstanceProcess("instance-1", str(tmp_path / "other.log"), clock)])
    assert last() == 15
