"""The per-partition disk worker: ordering, group commit, durability before acknowledgement."""

import threading

import pytest
import pytest_twisted
from twisted.internet import defer, reactor, threads

from tests.storage.test_segment import make_records, open_log
from waltz.storage import segment as segment_module
from waltz.storage.errors import SyncFailed
from waltz.storage.worker import PartitionWorker, WorkerFailed, WorkerStopped


class Disk:
    """Records the order of writes, reads and syncs; sync can be held open by the test."""

    def __init__(self):
        self.events = []
        self.sync_entered = threading.Event()
        self.release = threading.Event()
        self.release.set()
        self.fail_sync = False

    def write(self, value):
        if value == "bad":
            raise ValueError("gap in transaction ids")
        self.events.append(("write", value))
        return value

    def read(self, value):
        self.events.append(("read", value))
        return value

    def sync(self):
        self.sync_entered.set()
        assert self.release.wait(10)
        if self.fail_sync:
            raise OSError(5, "Input/output error")
        self.events.append(("sync",))


@pytest.fixture
def disk():
    return Disk()


@pytest.fixture
def commits():
    return []


@pytest.fixture
def worker(disk, commits):
    w = PartitionWorker("p0", reactor, disk.sync, lambda n, s: commits.append(n))
    w.start()
    yield w
    disk.release.set()
    w.stop()


@pytest_twisted.ensureDeferred
async def test_jobs_run_in_arrival_order_and_reads_wait_for_prior_writes_to_sync(worker, disk):
    results = await defer.gatherResults([
        worker.submit_write(disk.write, 1), worker.submit_write(disk.write, 2),
        worker.submit(disk.read, "r"), worker.submit_write(disk.write, 3)])
    assert results == [1, 2, "r", 3]
    # The read forced the first two writes to be synced before it ran.
    assert disk.events.index(("read", "r")) > disk.events.index(("sync",)) > disk.events.index(("write", 2))
    assert disk.events[-1] == ("sync",)


@pytest_twisted.ensureDeferred
async def test_appends_arriving_during_a_sync_share_the_next_one(worker, disk, commits):
    disk.release.clear()
    first = worker.submit_write(disk.write, "a")
    assert await threads.deferToThread(disk.sync_entered.wait, 10)
    rest = [worker.submit_write(disk.write, i) for i in range(4)]
    # The first sync is still running: nothing may be acknowledged yet.
    assert not first.called and not any(d.called for d in rest)
    disk.release.set()
    assert await first == "a"
    assert await defer.gatherResults(rest) == [0, 1, 2, 3]
    assert commits == [1, 4]
    assert disk.events.count(("sync",)) == 2


@pytest_twisted.ensureDeferred
async def test_a_rejected_write_fails_alone(worker, disk):
    good = worker.submit_write(disk.write, "ok")
    bad = worker.submit_write(disk.write, "bad")
    after = worker.submit_write(disk.write, "after")
    assert await good == "ok"
    with pytest.raises(ValueError, match="gap"):
        await bad
    assert await after == "after"


@pytest_twisted.ensureDeferred
async def test_answers_come_in_the_order_of_the_writes_a_refused_one_after_the_synced_ones_before_it(worker, disk):
    disk.release.clear()
    blocker = worker.submit_write(disk.write, "first")       # holds the worker in its sync
    assert await threads.deferToThread(disk.sync_entered.wait, 10)
    answered = []
    jobs = [worker.submit_write(disk.write, value) for value in ("ok", "bad", "after")]
    for value, d in zip(("ok", "bad", "after"), jobs):
        d.addBoth(lambda result, value=value: answered.append(value))
    disk.release.set()                                        # the three now run as one batch
    await blocker
    await defer.DeferredList(jobs)
    assert answered == ["ok", "bad", "after"]
    # "ok" was synced before the refusal of "bad" was answered; "after" had a sync of its own
    assert disk.events[-4:] == [("write", "ok"), ("sync",), ("write", "after"), ("sync",)]


@pytest_twisted.ensureDeferred
async def test_failed_sync_fails_its_writes_and_every_later_job(worker, disk):
    disk.fail_sync = True
    with pytest.raises(OSError):
        await worker.submit_write(disk.write, 1)
    disk.fail_sync = False
    with pytest.raises(WorkerFailed):
        await worker.submit(disk.read, "r")
    with pytest.raises(WorkerFailed):
        await worker.submit_write(disk.write, 2)
    assert ("read", "r") not in disk.events


@pytest_twisted.ensureDeferred
async def test_a_cleanup_job_runs_even_after_a_failed_sync(worker, disk):
    # Closing a partition whose sync failed must still close its files (they stayed open until the
    # process exited, and a reassignment opened a second log on the same files).
    disk.fail_sync = True
    with pytest.raises(OSError):
        await worker.submit_write(disk.write, 1)
    assert await worker.submit_cleanup(disk.read, "close") == "close"
    assert disk.events[-1] == ("read", "close")


class ReactorCallsHeld:
    """Keeps what threads ask the reactor to call until :meth:`run` (a reactor busy elsewhere)."""

    def __init__(self):
        self.calls = []

    def callFromThread(self, function, *args):
        self.calls.append((function, args))

    def run(self):
        for function, args in self.calls:
            function(*args)


def test_stopping_a_worker_after_its_thread_ended_fires_once():
    worker = PartitionWorker("p0", ReactorCallsHeld(), lambda: None)
    assert worker.stop().called                  # never started: nothing to wait for
    held = ReactorCallsHeld()
    worker = PartitionWorker("p1", held, lambda: None)
    worker.start()
    stopped = worker.stop()
    worker._thread.join(10)
    assert worker.stop() is stopped and not stopped.called     # its thread's notice is still on its way
    held.run()                                   # (fired it a second time: AlreadyCalledError)
    assert stopped.called


@pytest_twisted.ensureDeferred
async def test_an_append_written_before_a_failed_fdatasync_is_never_acknowledged(tmp_path, monkeypatch):
    log = open_log(tmp_path)
    log.append(make_records(0, 996))
    log.sync()
    real_datasync, failures = segment_module.datasync, []

    def datasync_failing_once(fd):   # the error is reported once; the next fdatasync returns 0
        if not failures:
            failures.append(fd)
            raise OSError(5, "Input/output error")
        real_datasync(fd)

    monkeypatch.setattr(segment_module, "datasync", datasync_failing_once)
    worker = PartitionWorker("p0", reactor, log.sync)
    first = worker.submit_write(log.append, make_records(996, 3))     # written, to be synced by the batch
    crossing = worker.submit_write(log.append, make_records(999, 3))  # its checkpoint sync before 1000 fails
    worker.start()                                                     # both in one batch
    try:
        for d in (first, crossing):
            with pytest.raises((SyncFailed, WorkerFailed)):
                await d
        with pytest.raises((SyncFailed, WorkerFailed)):
            await worker.submit_write(log.append, make_records(999, 1))
    finally:
        await worker.stop()
        log.close()


@pytest_twisted.ensureDeferred
async def test_stop_runs_queued_jobs_then_refuses_new_ones(worker, disk):
    pending = [worker.submit_write(disk.write, i) for i in range(3)]
    await worker.stop()
    assert await defer.gatherResults(pending) == [0, 1, 2]
    with pytest.raises(WorkerStopped):
        await worker.submit(disk.read, "late")
