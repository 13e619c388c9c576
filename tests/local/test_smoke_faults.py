"""The smoke run's fault loop: a failure of its own ends the run at once instead of going unnoticed."""

from twisted.internet import defer

from waltz.local.smoke import unless_failed_first


def outcome(d):
    results = []
    d.addBoth(results.append)
    return results


def test_a_fault_loop_failing_first_ends_the_wait_at_once():
    # Before: the loop's Deferred was not watched; a restart that failed stopped the faults silently and the
    # run waited for its producers until its timeout (30 minutes by default).
    producing, loop = defer.Deferred(), defer.Deferred()
    waited = outcome(unless_failed_first(producing, loop))
    loop.errback(RuntimeError("storage-1 did not start"))
    assert len(waited) == 1 and waited[0].check(RuntimeError)
    producing.callback(None)            # later outcomes change nothing
    assert len(waited) == 1


def test_the_producers_outcome_otherwise_and_a_later_loop_failure_stays_for_stop():
    producing, loop = defer.Deferred(), defer.Deferred()
    waited = outcome(unless_failed_first(producing, loop))
    producing.callback(["done"])
    assert waited == [["done"]]
    loop.errback(RuntimeError("late"))
    stopped = outcome(loop)             # what FaultInjector.stop() returns
    assert stopped[0].check(RuntimeError)
