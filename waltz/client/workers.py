"""One worker thread, for callbacks that block (database calls, an application's blocking callbacks).

:class:`WorkerThread` is a one-thread Twisted ``ThreadPool`` that

* runs its thread as a daemon, so a script that forgets ``close()`` still exits (what was
  being applied then is applied again after restart: the client high-water mark only
  moves with an applied transaction);
* can be stopped from its own thread (a callback that closes the client): the stop then
  happens in a helper thread instead of joining itself.
"""

import threading

from twisted.internet import defer, threads
from twisted.python.threadpool import ThreadPool


def _daemon_thread(*args, **kwargs):
    return threading.Thread(*args, daemon=True, **kwargs)


class WorkerThread:
    """A started one-thread pool called ``name``; :meth:`run` returns Deferreds fired on the reactor."""

    def __init__(self, reactor, name):
        self._reactor = reactor
        self._pool = ThreadPool(1, 1, name=name)
        self._pool.threadFactory = _daemon_thread
        self._pool.start()
        self._stopping = False
        self._stopper = None            # the thread stopping the pool, once stop() was called
        self._stopper_lock = threading.Lock()

    def run(self, function, *args):
        """Run ``function(*args)`` in the worker thread; a Deferred of its result (a failure once the
        worker is stopping or stopped: a stopped pool takes the call and never runs it)."""
        if self._stopping:
            return defer.fail(self._stopped_error())
        return threads.deferToThreadPool(self._reactor, self._pool, self._unless_stopping, function, *args)

    def _unless_stopping(self, function, *args):
        # A stopping pool still runs the calls queued before: those fail instead.
        if self._stopping:
            raise self._stopped_error()
        return function(*args)

    def _stopped_error(self):
        return RuntimeError("the %s thread is stopped" % self._pool.name)

    def in_worker(self) -> bool:
        """True when called from the worker thread itself."""
        return threading.current_thread() in self._pool.threads

    def stop(self, timeout=None):
        """Stop the thread once its current call returns; no later call runs. Blocks until then, at
        most ``timeout`` seconds (None: no limit; :class:`TimeoutError` after it, the thread being
        left to finish its call), unless called from the thread itself, which cannot wait for itself.
        Every call waits so, a call made after the worker itself asked to stop included."""
        self._stopping = True
        with self._stopper_lock:
            if self._stopper is None:
                self._stopper = threading.Thread(target=self._pool.stop, name="%s-stop" % self._pool.name,
                                                 daemon=True)
                self._stopper.start()
            stopper = self._stopper
        if self.in_worker():
            return
        stopper.join(timeout)
        if stopper.is_alive():
            raise TimeoutError("the %s thread did not finish its current call within %s s"
                               % (self._pool.name, timeout))
