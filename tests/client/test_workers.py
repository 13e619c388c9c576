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
