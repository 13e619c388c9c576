"""One disk thread per partition: jobs run in arrival order, writes are group-committed.

The reactor never touches a file. It submits jobs to the partition's
:class:`PartitionWorker` and gets a Deferred that fires on the reactor thread.

Group commit: the thread takes every job queued so far as one batch and runs
them in order. A *write* job (an append) only writes to the OS; before any
other job runs, and at the end of the batch, one ``sync`` makes every write
so far durable, and only then are the write jobs' results delivered. So all
appends that arrive while one ``fdatasync`` is running go out together in the
next one, and no append is acknowledged before it is on disk.

A failed ``sync`` fails every write it covered and poisons the worker: the
state of the file is unknown after a failed fdatasync, so every later job
fails too until the partition is reopened.
"""

import collections
import threading
import time

from twisted.internet import defer
from twisted.python.failure import Failure


class WorkerFailed(Exception):
    """The partition's disk worker stopped after an unrecoverable I/O error."""


class WorkerStopped(Exception):
    """The partition's disk worker was stopped; the job was not run."""


class _Job:
    __slots__ = ("fn", "args", "is_write", "after_failure", "deferred")

    def __init__(self, fn, args, is_write, after_failure=False):
        self.fn = fn
        self.args = args
        self.is_write = is_write
        self.after_failure = after_failure
        self.deferred = defer.Deferred()


class PartitionWorker:
    """Runs one partition's disk jobs on its own thread, in order, with group commit.

    ``sync`` is the callable that makes written data durable (the partition
    log's ``sync``); ``on_commit(records_jobs, seconds)`` is told, on the
    reactor thread, how many write jobs each sync covered and how long it took.
    """

    def __init__(self, name, reactor, sync, on_commit=None):
        self.name = name
        self._reactor = reactor
        self._sync = sync
        self._on_commit = on_commit
        self._queue = collections.deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._failure = None
        self._stopped = defer.Deferred()
        self._thread = threading.Thread(target=self._run, name="waltz-disk-%s" % name, daemon=True)

    @property
    def failure(self):
        """The error (a failed sync) that made the worker fail every job since, or None."""
        return self._failure

    def start(self):
        self._thread.start()

    def submit(self, fn, *args) -> defer.Deferred:
        """Run ``fn(*args)`` after every earlier job; fires with its result."""
        return self._enqueue(_Job(fn, args, False))

    def submit_cleanup(self, fn, *args) -> defer.Deferred:
        """Like :meth:`submit`, but ``fn`` runs even after a failed sync (closing files, which must not
        stay open however the worker ended)."""
        return self._enqueue(_Job(fn, args, False, after_failure=True))

    def submit_write(self, fn, *args) -> defer.Deferred:
        """Run ``fn(*args)`` in order; fires with its result once a sync made it durable."""
        return self._enqueue(_Job(fn, args, True))

    def _enqueue(self, job):
        with self._cond:
            if self._stopping:
                return defer.fail(WorkerStopped("disk worker of %s is stopped" % self.name))
            self._queue.append(job)
            self._cond.notify()
        return job.deferred

    @property
    def queued(self) -> int:
        return len(self._queue)

    def stop(self) -> defer.Deferred:
        """Run what is queued, then end the thread; fires when it has ended."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.ident is None:      # never started: no thread will say it ended
            self._fire_stopped()
        return self._stopped

    def _fire_stopped(self):
        if not self._stopped.called:
            self._stopped.callback(None)

    # -- the worker thread ---------------------------------------------------------

    def _run(self):
        try:
            while True:
                with self._cond:
                    while not self._queue and not self._stopping:
                        self._cond.wait()
                    if not self._queue and self._stopping:
                        break
                    batch = list(self._queue)
                    self._queue.clear()
                self._run_batch(batch)
        finally:
            self._reactor.callFromThread(self._fire_stopped)

    def _run_batch(self, batch):
        results = []        # (deferred, result-or-Failure), delivered together
        uncommitted = []    # write jobs' (deferred, result) awaiting a sync
        commits = []        # (write jobs covered, seconds) per sync
        for job in batch:
            if job.is_write:
                outcome = self._call(job)
                if not isinstance(outcome, Failure):
                    uncommitted.append((job.deferred, outcome))
                    continue
                # A refused write is answered in its turn, after the writes before it, which are synced first:
                # a peer reading the answers in order must not see a later append fail before an earlier one
                # succeeds.
                if uncommitted:
                    self._commit(uncommitted, results, commits)
                    uncommitted = []
                results.append((job.deferred, outcome))
                continue
            if uncommitted:
                self._commit(uncommitted, results, commits)
                uncommitted = []
            results.append((job.deferred, self._call(job)))
        if uncommitted:
            self._commit(uncommitted, results, commits)
        self._reactor.callFromThread(self._deliver, results, commits)

    def _call(self, job):
        if self._failure is not None and not job.after_failure:
            return Failure(WorkerFailed("disk worker of %s failed earlier: %s" % (self.name, self._failure)))
        try:
            return job.fn(*job.args)
        except BaseException:
            return Failure()

    def _commit(self, uncommitted, results, commits):
        started = time.monotonic()
        try:
            if self._failure is not None:
                raise WorkerFailed("disk worker of %s failed earlier: %s" % (self.name, self._failure))
            self._sync()
        except BaseException as exc:
            if self._failure is None:
                self._failure = exc
            failure = Failure()
            results.extend((d, failure) for d, _ in uncommitted)
            return
        commits.append((len(uncommitted), time.monotonic() - started))
        results.extend(uncommitted)

    def _deliver(self, results, commits):
        if self._on_commit is not None:
            for count, seconds in commits:
                self._on_commit(count, seconds)
        for deferred, outcome in results:
            if isinstance(outcome, Failure):
                deferred.errback(outcome)
            else:
                deferred.callback(outcome)
