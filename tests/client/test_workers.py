"""WorkerThread: a one-thread pool whose calls fire on the reactor."""

import pytest
import pytest_twisted
from twisted.internet import reactor

from waltz.client.workers import WorkerThread


@pytest_twisted.ensureDeferred
async def test_a_call_after_stop_fails_at_once_instead_of_never_firing():
    worker = WorkerThread(reactor, "waltz-test-worker")
    assert await worker.run(lambda x: x + 1, 1) == 2
    worker.stop()
    late = worker.run(lambda: 3)
    assert late.called
    with pytest.raises(RuntimeError, match="the waltz-test-worker thread is stopped"):
        await late


@pytest_twisted.ensureDeferred
async def test_calls_queued_behind_a_stuck_one_do_not_run_once_stop_gave_up_waiting():
    # A stopping thread pool still runs what was queued: an apply queued behind a stuck callback ran after
    # close() had given up waiting and raised.
    import threading

    from twisted.internet import threads
    worker = WorkerThread(reactor, "waltz-test-worker")
    started, release, ran = threading.Event(), threading.Event(), []

    def stuck_call():
        started.set()
        return release.wait(30)
    stuck = worker.run(stuck_call)
    queued = worker.run(ran.append, "queued")
    await threads.deferToThread(started.wait, 30)
    with pytest.raises(TimeoutError, match="did not finish its current call within 0.2 s"):
        await threads.deferToThread(worker.stop, 0.2)
    release.set()
    assert await stuck is True
    with pytest.raises(RuntimeError, match="the waltz-test-worker thread is stopped"):
        await queued
    assert ran == []
