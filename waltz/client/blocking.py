"""A blocking facade over :class:`~waltz.client.client.WaltzClient`, for scripts and Spark executors.

:class:`BlockingWaltzClient` is not a second client: it runs the same ``WaltzClient``
on the reactor, in a daemon thread it starts when no reactor runs yet
(:func:`ensure_reactor_running`), and turns each call into a blocking one. It must
not be used from the reactor thread itself, for instance from a transaction context's
``execute`` (that would deadlock: every call raises :class:`RuntimeError` there instead).

Application callbacks written for blocking code (plain functions that may do
blocking I/O) are run by :class:`ThreadedCallbacks` in one worker thread, in order;
their :class:`BlockingTransaction` has a blocking ``get_data()``. Callbacks that
already return Deferreds (such as :class:`~waltz.client.dbapi.DbApiClientCallbacks`,
marked ``runs_on_reactor = True``) are used as they are. Transaction contexts'
methods always run on the reactor thread and must be quick.
"""

import inspect
import queue
import threading
import time

import attr
from twisted.internet import defer
from twisted.logger import Logger
from twisted.python import threadable
from twisted.python.failure import Failure
from zope.interface import implementer

from waltz.client.api import IWaltzClientCallbacks, deserialize
from waltz.client.client import WaltzClient
from waltz.client.workers import WorkerThread

log = Logger()

_start_lock = threading.Lock()
#: How often a blocked caller checks that the reactor still runs (it would never answer once stopped).
_REACTOR_CHECK_SECONDS = 0.5


def _refuse_reactor_thread(reactor):
    """Raise when called on the running reactor's own thread: waiting there for the reactor would
    freeze it (until the timeout, or for ever)."""
    if reactor.running and threadable.isInIOThread():
        raise RuntimeError("BlockingWaltzClient cannot be used on the reactor thread (from a transaction "
                           "context, a hook or a callback running on it); use WaltzClient there")


class ReactorStoppedError(RuntimeError):
    """The reactor has stopped (a Twisted reactor cannot be started again): nothing can answer."""


def _stopped(reactor) -> bool:
    """True once ``reactor`` has run and stopped."""
    return not reactor.running and getattr(reactor, "_startedBefore", False)


def _refuse_stopped(reactor):
    if _stopped(reactor):
        raise ReactorStoppedError("the Twisted reactor has stopped and cannot be started again; "
                                  "use the Waltz client before the reactor stops (at interpreter exit)")


def ensure_reactor_running(reactor, timeout=30.0):
    """Make sure ``reactor`` runs, starting it in a daemon thread if needed; refuse the reactor thread
    and a reactor that has stopped."""
    with _start_lock:
        if reactor.running:
            _refuse_reactor_thread(reactor)
            return
        _refuse_stopped(reactor)
        started = threading.Event()
        failures = []

        def run():
            try:
                reactor.run(installSignalHandlers=False)
            except BaseException as exc:
                failures.append(exc)
        reactor.callWhenRunning(started.set)
        thread = threading.Thread(target=run, name="waltz-reactor", daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout
        while not started.wait(min(_REACTOR_CHECK_SECONDS, max(0.0, deadline - time.monotonic()))):
            if failures:
                raise RuntimeError("the reactor failed to start: %r" % (failures[0],)) from failures[0]
            if time.monotonic() >= deadline:
                raise RuntimeError("the reactor did not start within %s s" % timeout)


def call_blocking(reactor, function, *args, timeout=None, cancel_on_timeout=False, **kwargs):
    """Run ``function`` on the reactor thread and wait for its (possibly Deferred) result.

    Raises the function's exception, or :class:`TimeoutError` after ``timeout`` seconds
    (the call itself goes on, unless ``cancel_on_timeout``: its Deferred is then cancelled),
    :class:`RuntimeError` on the reactor thread itself, or :class:`ReactorStoppedError` when the
    reactor has stopped (before the call or while it waited).
    """
    _refuse_reactor_thread(reactor)
    _refuse_stopped(reactor)
    results = queue.Queue()
    calls = []

    def run():
        calls.append(defer.maybeDeferred(function, *args, **kwargs).addBoth(results.put))
    reactor.callFromThread(run)
    result = _wait_for_answer(reactor, results, timeout)
    if result is _NO_ANSWER:
        if cancel_on_timeout:   # after run(): callFromThread keeps the order
            reactor.callFromThread(lambda: calls[0].cancel())
        raise TimeoutError("no answer from the Waltz client within %s s" % timeout)
    if isinstance(result, Failure):
        result.raiseException()
    return result


_NO_ANSWER = object()


def _wait_for_answer(reactor, results, timeout):
    """The first item of ``results``, or ``_NO_ANSWER`` after ``timeout`` seconds (None: no limit);
    :class:`ReactorStoppedError` if the reactor stops meanwhile."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        wait = _REACTOR_CHECK_SECONDS
        if deadline is not None:
            wait = min(wait, deadline - time.monotonic())
            if wait <= 0:   # one last look: an answer that came at the deadline is the answer, not a timeout
                try:
                    return results.get_nowait()
                except queue.Empty:
                    return _NO_ANSWER
        try:
            return results.get(timeout=wait)
        except queue.Empty:
            if _stopped(reactor) and results.empty():   # (an answer put just before it stopped counts)
                _refuse_stopped(reactor)


@attr.s(frozen=True, slots=True)
class BlockingTransaction:
    """A :class:`~waltz.client.api.Transaction` for callbacks running in a worker thread."""

    transaction = attr.ib()
    reactor = attr.ib(repr=False)
    #: Bounds :meth:`get_data` unless it is given its own timeout (the facade's ``timeout``).
    timeout = attr.ib(default=None, repr=False)

    @property
    def partition_id(self):
        return self.transaction.partition_id

    @property
    def transaction_id(self):
        return self.transaction.transaction_id

    @property
    def header(self):
        return self.transaction.header

    @property
    def req_id(self):
        return self.transaction.req_id

    def get_data(self, serializer=None, timeout=None):
        """The transaction's data (deserialized by ``serializer`` when given, in the calling thread: the
        application's decoding never runs on the reactor); blocks, at most ``timeout`` seconds (default:
        the facade's)."""
        data = call_blocking(self.reactor, self.transaction.get_data, None,
                             timeout=timeout if timeout is not None else self.timeout)
        return deserialize(data, serializer)


def _not_deferred(callback, *args):
    """``callback(*args)`` in the worker thread; :class:`TypeError` if it returned a Deferred or an awaitable
    (the coroutine of an ``async def`` callback, closed unrun). A callback run there must block until it is
    done: a Deferred would count the transaction applied before it fired, and its failure would be lost; a
    coroutine would count it applied without running at all (callbacks that return Deferreds or are
    ``async def`` run on the reactor: ``runs_on_reactor``)."""
    result = callback(*args)
    if isinstance(result, defer.Deferred) or inspect.isawaitable(result):
        if inspect.iscoroutine(result):
            result.close()
        raise TypeError("%s returned %s from the callbacks' worker thread: block until done instead "
                        "(or set runs_on_reactor on callbacks that return Deferreds or are async def)"
                        % (getattr(callback, "__qualname__", callback),
                           "a Deferred" if isinstance(result, defer.Deferred) else "an awaitable"))
    return result


@implementer(IWaltzClientCallbacks)
class ThreadedCallbacks:
    """Runs blocking application callbacks in one worker thread, one call at a time."""

    def __init__(self, callbacks, reactor, timeout=None):
        self._callbacks = callbacks
        self._reactor = reactor
        self._timeout = timeout
        self._worker = WorkerThread(reactor, "waltz-callbacks")

    def get_client_high_water_mark(self, partition_id):
        return self._worker.run(_not_deferred, self._callbacks.get_client_high_water_mark, partition_id)

    def apply_transaction(self, transaction):
        return self._worker.run(_not_deferred, self._callbacks.apply_transaction,
                                BlockingTransaction(transaction, self._reactor, self._timeout))

    def uncaught_exception(self, partition_id, transaction_id, exception):
        self._worker.run(self._callbacks.uncaught_exception, partition_id, transaction_id,
                         exception).addErrback(_log_uncaught_exception_failure, partition_id, transaction_id,
                                               exception)

    def stop(self, timeout=None):
        """Stop the worker thread (from any thread, the worker included); waits at most ``timeout``
        seconds (None: no limit) for the callback it is running (see :meth:`WorkerThread.stop`)."""
        self._worker.stop(timeout)


def _log_uncaught_exception_failure(failure, partition_id, transaction_id, exception):
    """Nothing else can be told when reporting a failure fails: log both."""
    log.failure("partition {pid} transaction {txn}: uncaught_exception could not report {error!r}", failure,
                pid=partition_id, txn=transaction_id, error=exception)


@implementer(IWaltzClientCallbacks)
class ReadOnlyCallbacks:
    """Callbacks of a client that only reads ranges (``read_transactions``) and never mounts: it has
    applied nothing and applies nothing."""

    runs_on_reactor = True

    def get_client_high_water_mark(self, partition_id):
        return -1

    def apply_transaction(self, transaction):
        raise RuntimeError("a read-only client does not apply transactions (partition %d transaction %d)"
                           % (transaction.partition_id, transaction.transaction_id))

    def uncaught_exception(self, partition_id, transaction_id, exception):
        """Nothing: the client logs it."""


class BlockingWaltzClient:
    """Blocking calls on a :class:`WaltzClient` running on the reactor (see the module docstring).

    ``threaded_callbacks``: run the callbacks in a worker thread (default: unless the
    callbacks say ``runs_on_reactor = True``). ``timeout`` (seconds, None: wait forever)
    bounds every call, including the client's start-up; a start-up that fails is then closed, which is
    bounded by ``timeout`` again, and starting the reactor thread (when none runs) by 30 s. Other keyword
    arguments go to ``WaltzClient``.
    """

    def __init__(self, callbacks, config, reactor=None, *, timeout=60.0, threaded_callbacks=None, **client_kwargs):
        if reactor is None:
            from twisted.internet import reactor
        self._reactor = reactor
        self.timeout = timeout
        self.client = None
        self._closed = False
        self._threaded = None
        ensure_reactor_running(reactor)
        if threaded_callbacks is None:
            threaded_callbacks = not getattr(callbacks, "runs_on_reactor", False)
        try:
            if threaded_callbacks:
                self._threaded = ThreadedCallbacks(callbacks, reactor, timeout)
            self._call(self._start_client, self._threaded or callbacks, config, client_kwargs)
        except BaseException:
            # A bad config, a start-up failure or a timeout: nothing may outlive the constructor (a
            # client still starting on the reactor is closed by close(), which runs after it there).
            self.close()
            raise

    def _start_client(self, callbacks, config, client_kwargs):
        """On the reactor thread: create the client (unless closed meanwhile) and wait for it to start."""
        if self._closed:
            raise RuntimeError("the blocking Waltz client was closed while starting")
        self.client = WaltzClient(callbacks, config, self._reactor, **client_kwargs)
        return self.client.when_started()

    @classmethod
    def for_reading(cls, config, reactor=None, *, timeout=60.0):
        """A client for reading ranges only (Spark executors, tools): ``client.autoMount`` off, so it mounts
        no partition and applies nothing; ``config`` is a mapping of config keys."""
        config = dict(config)
        config["client.autoMount"] = False
        return cls(ReadOnlyCallbacks(), config, reactor, timeout=timeout)

    def _call(self, function, *args, **kwargs):
        return call_blocking(self._reactor, function, *args, timeout=self.timeout, **kwargs)

    @property
    def client_id(self) -> int:
        return self.client.client_id

    @property
    def num_partitions(self) -> int:
        return self.client.num_partitions

    def execute(self, context, timeout=None):
        """Execute a transaction context; returns its :class:`~waltz.client.api.ExecutionResult`."""
        return call_blocking(self._reactor, self.client.execute, context, timeout=timeout or self.timeout)

    def when_applied(self, partition_id, transaction_id):
        """Block until this client has applied ``transaction_id`` of the partition."""
        return self._call(self.client.when_applied, partition_id, transaction_id)

    def flush(self, partition_id=None):
        return self._call(self.client.flush, partition_id)

    def high_water_mark(self, partition_id) -> int:
        return self._call(self.client.high_water_mark, partition_id)

    def high_water_marks(self, partition_ids=None) -> dict:
        """``{partition id: high-water mark}`` of ``partition_ids`` (default: every partition); raises
        :class:`~waltz.client.errors.HighWaterMarkTimeout` naming the partitions without an answer
        within ``timeout``."""
        inner = self.timeout
        outer = None if inner is None else inner + 5.0   # the client's own timeout names the partitions
        return call_blocking(self._reactor, self.client.high_water_marks, partition_ids, inner, timeout=outer)

    def get_transaction_data(self, partition_id, transaction_id) -> bytes:
        return self._call(self.client.get_transaction_data, partition_id, transaction_id)

    def read_transactions(self, partition_id, start, end=None, headers=None, include_data=True, committed=False):
        """The :class:`~waltz.client.api.TransactionRecord` list of ``start..end`` (see
        ``WaltzClient.read_transactions``). A read that times out is cancelled: reads of a partition run
        one at a time, and the next one would otherwise wait for it."""
        return call_blocking(self._reactor, self.client.read_transactions, partition_id, start, end, headers,
                             include_data, committed, timeout=self.timeout, cancel_on_timeout=True)

    def set_partitions(self, partition_ids):
        return self._call(self.client.set_partitions, partition_ids)

    def client_high_water_mark(self, partition_id) -> int:
        return self._call(self.client.client_high_water_mark, partition_id)

    def close(self):
        """Close the client (and the callbacks' worker thread); may be called from any thread but the
        reactor's, including from a callback running in the worker thread.

        Waits at most ``timeout`` for the client to close, then at most ``timeout`` for a callback
        still running in the worker thread (:class:`TimeoutError`: the daemon thread is left to finish
        it; no later callback runs)."""
        _refuse_reactor_thread(self._reactor)   # before anything: refused means nothing was stopped
        try:
            self._call(self._close_client)
        finally:
            if self._threaded is not None:
                # (Kept: a close() made while a callback that called close() itself still runs must wait too.)
                self._threaded.stop(self.timeout)

    def _close_client(self):
        """On the reactor thread, after any start queued before: close the client if it exists."""
        self._closed = True
        return self.client.close() if self.client is not None else None

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()
