"""The smoke run: a failure of its fault loop ends the run at once instead of going unnoticed; the producers go
on until the faults wanted were injected."""

from twisted.internet import defer
from twisted.internet.task import Clock

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


class _Client:
    """Executes every context when the test commits it."""

    def __init__(self):
        self.pending = []

    def execute(self, context):
        self.pending.append(defer.Deferred())
        return self.pending[-1]

    def commit_all(self, clock):
        from types import SimpleNamespace
        pending, self.pending = self.pending, []
        for d in pending:
            d.callback(SimpleNamespace(committed=True))
        clock.advance(0)                # the producer starts the next ones


def test_producers_go_on_past_their_quota_while_fewer_faults_than_wanted_were_injected():
    # Before: a fast machine committed the CI run's 8,000 transactions before the faults that run checks for.
    import random

    from waltz.local.smoke import Producer, SmokeReport, SmokeSettings, _faults_wanted
    clock, client, report = Clock(), _Client(), SmokeReport()
    settings = SmokeSettings(inflight=2, min_faults=2)
    producer = Producer(clock, client, settings, 5, random.Random(1), report, [],
                        more_wanted=lambda: _faults_wanted(settings, report))
    producer.start()
    for _ in range(4):
        client.commit_all(clock)
    assert producer.committed == 8 and not producer.done.called and len(client.pending) == 2
    report.faults.extend(["storage-0 killed and restarted", "server-0 killed and restarted"])
    client.commit_all(clock)
    assert producer.committed == 10 and producer.done.called and client.pending == []
    assert not _faults_wanted(SmokeSettings(faults=False, min_faults=2), SmokeReport())
