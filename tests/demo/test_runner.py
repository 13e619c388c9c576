"""The demo runner's waits: a timeout says what did not happen, and the first failure comes out unwrapped."""

import pytest
from twisted.internet import defer, task

from waltz.demo.runner import InstanceError, _all, _with_timeout


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
