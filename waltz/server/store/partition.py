"""The store partition: the proxy through which a server's partition reaches its replicas.

:class:`StorePartition` implements :class:`~waltz.interfaces.IStorePartition`.
It queues appends, batches them (up to ``storage.maxBatchSize``), assigns
their transaction ids, and hands them to the current
:class:`~waltz.server.store.session.StoreSession` (see :meth:`StorePartition._ready_to_send`
and :meth:`StorePartition.append` for when a batch is cut). When a session closes it
asks the session factory for a new one, whose recovery decides the fate of
the batch that was in flight: ids at or below the resolved high-water mark
were committed and are reported so; the others failed. Appends still queued
simply go to the next session. No append is reported twice or lost.

``storage.checkpointInterval``: once a session has committed that many
transactions past its low-water mark, it is closed and a new one started.
"""

import collections
import itertools

import attr
from twisted.internet import defer
from twisted.logger import Logger
from zope.interface import implementer

from waltz.interfaces import IStorePartition
from waltz.protocols.framing import MAX_BATCH_DATA_SIZE
from waltz.protocols.values import Record
from waltz.recovery.replica_reads import HEADERS, RECORDS
from waltz.server.store.session import SessionClosed, SessionState
from waltz.zk.errors import GenerationMismatchError


class AppendFailed(Exception):
    """The append is known not to be committed; the client may retry it."""


class AppendFateUnknown(Exception):
    """The partition closed before the append's fate was known; the client learns it from the feed."""


class PartitionNotOwned(Exception):
    """Another server owns the partition now (a newer generation started a session)."""


@attr.s(slots=True)
class PendingAppend:
    req_id = attr.ib()
    header = attr.ib()
    data = attr.ib()
    checksum = attr.ib()
    deferred = attr.ib(factory=defer.Deferred)
    transaction_id = attr.ib(default=None)

    def record(self):
        return Record(self.transaction_id, self.req_id, self.header, self.data, self.checksum)


#: The longest wait between two session starts of a partition whose starts keep failing, in seconds.
MAX_RESTART_DELAY = 8.0


@implementer(IStorePartition)
class StorePartition:
    """A replicated partition: appends, reads and the high-water mark across store sessions.

    ``session_factory(partition_id, generation, on_close)`` fires with a new,
    not yet started :class:`StoreSession`.
    """

    log = Logger()

    def __init__(self, partition_id, generation, session_factory, reactor, max_batch_size=100,
                 checkpoint_interval=250_000, retry_interval=0.5, max_batches_in_flight=4):
        self.partition_id = partition_id
        self.generation = generation
        self._session_factory = session_factory
        self.reactor = reactor
        self.max_batch_size = max_batch_size
        self.max_batches_in_flight = max_batches_in_flight
        self.checkpoint_interval = checkpoint_interval
        self.retry_interval = retry_interval
        self._start_failures = 0        # session starts failed in a row (the next one waits twice as long)
        self._last_start_failure = None  # why the last one failed, as logged
        self.high_water_mark = -1
        self.session = None
        self.closed = False
        self.lost = None
        self._queue = collections.deque()
        self._in_flight = collections.deque()   # batches handed to the session, oldest first
        self._unsettled = []          # batches whose session died before they committed
        self._listeners = []
        self._lost_listeners = []
        self._flush_waiters = []
        self._opening = None
        self._restart_call = None       # the DelayedCall that starts the next session, if one is due
        self._cut_call = None           # the DelayedCall that cuts the appends of this reactor turn
        self.sessions_started = 0

    # -- IStorePartition ---------------------------------------------------------------------

    @property
    def healthy(self):
        return self.session is not None and self.session.state is SessionState.WRITING and not self.closed

    def append(self, req_id, header, data, checksum):
        if self.closed or self.lost:
            return defer.fail(AppendFailed("partition %d is closed: %s" % (self.partition_id,
                                                                          self.lost or "closed")))
        pending = PendingAppend(req_id, header, bytes(data), checksum)
        self._queue.append(pending)
        if len(self._queue) >= self.max_batch_size:
            self._pump()
        elif self._cut_call is None:
            # The appends of one reactor turn arrive one by one (a read of a client connection carries
            # many); sending at the first would send it alone and hold the rest until it commits. Cut at
            # the next turn instead: what is written now goes out at the reactor's next poll anyway, so
            # waiting for the turn's end costs no latency.
            self._cut_call = self.reactor.callLater(0, self._cut)
        return pending.deferred

    def _cut(self):
        self._cut_call = None
        if not self.closed and not self.lost:
            self._pump()

    def flush(self):
        """Fires with the high-water mark once every append queued before the call is settled; appends queued
        after it do not hold it back (a steady stream of them starved it)."""
        before = collections.deque(p for p in itertools.chain(
            self._queue, itertools.chain.from_iterable(self._in_flight), itertools.chain.from_iterable(self._unsettled))
            if not p.deferred.called)
        if not before:
            return defer.succeed(self.high_water_mark)
        waiter = defer.Deferred()
        self._flush_waiters.append((before, waiter))
        return waiter

    def add_listener(self, listener):
        self._listeners.append(listener)

    def add_lost_listener(self, listener):
        """Call ``listener(reason)`` once, when the partition is lost (:attr:`lost`: another server opened a store
        session at a newer generation)."""
        self._lost_listeners.append(listener)

    def get_records(self, transaction_id, max_records):
        return self._read(RECORDS, transaction_id, max_records)

    def get_headers(self, transaction_id, max_records):
        return self._read(HEADERS, transaction_id, max_records)

    def get_record(self, transaction_id):
        d = self.get_records(transaction_id, 1)
        return d.addCallback(lambda records: records[0] if records else None)

    def _read(self, what, transaction_id, max_records):
        """Committed records from ``transaction_id`` on (at most ``max_records``), from whichever
        replica of the session serves them (see :mod:`waltz.recovery.replica_reads`)."""
        count = min(max_records, self.high_water_mark - transaction_id + 1)
        if count <= 0 or transaction_id < 0:
            return defer.succeed(())
        if self.session is None:
            return defer.fail(AppendFailed("partition %d has no store session right now" % self.partition_id))
        return self.session.read(what, transaction_id, count)

    # -- sessions ----------------------------------------------------------------------------

    def open(self):
        """Start the first store session; fires once it is writing (or keeps retrying)."""
        return self._start_session()

    def _start_session(self):
        # A failed recovery asks for a new session twice (its session closing, and its Deferred failing):
        # only one may start. A later request would replace a live session without closing it, and
        # strand the batches in flight in it.
        if self.closed or self.lost or self._opening is not None:
            return self._opening
        if self.session is not None and self.session.state is not SessionState.CLOSED:
            return None
        self._opening = d = self._session_factory(self.partition_id, self.generation, self._session_closed)
        d.addCallback(self._session_created)
        d.addErrback(self._session_failed)
        d.addBoth(self._opened)
        return d

    def _opened(self, result):
        self._opening = None
        return result

    def _session_created(self, session):
        if self.closed:
            session.close("store partition closed")
            return None
        self.session = session
        self.sessions_started += 1
        return session.start().addCallback(self._session_recovered, session)

    def _session_recovered(self, result, session):
        if session is not self.session or session.state is not SessionState.WRITING:
            return None
        # The mark first: settling reports appends, and their callbacks may append at once (an append task
        # released). Numbered from the old mark, such an append would reuse a committed transaction id.
        self._start_failures, self._last_start_failure = 0, None
        self.high_water_mark = max(self.high_water_mark, result.high_water_mark)
        self._settle(result.high_water_mark)
        self._notify()
        # Only now: a replica joining the session (which calls its writable listeners) must not make it
        # send before the mark above is taken, even when the join completes inside session.start().
        session.add_writable_listener(self._pump)
        self._pump()
        return None

    def _session_failed(self, failure):
        if failure.check(GenerationMismatchError):
            self._lose("generation %d is stale: %s" % (self.generation, failure.getErrorMessage()))
            return None
        if not self.closed:
            self._restart_later(self._start_failed_delay(failure.getErrorMessage()))
        return None

    def _start_failed_delay(self, reason):
        """How long to wait before the next session start after one failed for ``reason``: ``retry_interval``,
        doubling with each failure in a row up to :data:`MAX_RESTART_DELAY`. A partition that cannot start for
        good (no replica assigned yet) neither busy-loops nor floods the log: a reason is logged when it
        changes, and then every tenth failure."""
        self._start_failures += 1
        failures = self._start_failures
        delay = min(self.retry_interval * 2 ** min(failures - 1, 16), max(self.retry_interval, MAX_RESTART_DELAY))
        emit = self.log.warn if reason != self._last_start_failure or failures % 10 == 0 else self.log.debug
        emit("partition {pid}: store session could not start: {reason}; retrying in {delay:.1f} s ({failures} "
             "failed in a row)", pid=self.partition_id, reason=reason, delay=delay, failures=failures)
        self._last_start_failure = reason
        return delay

    def _restart_later(self, delay):
        """Start a new session after ``delay`` seconds, or sooner if that is due already (a failed
        recovery asks twice: its session closing asks at once, its Deferred failing after a delay)."""
        call = self._restart_call
        if call is not None and call.active():
            if call.getTime() <= self.reactor.seconds() + delay:
                return
            call.cancel()
        self._restart_call = self.reactor.callLater(delay, self._restart)

    def _restart(self):
        self._restart_call = None
        self._start_session()

    def _cancel_calls(self):
        """Cancel the pending session restart and cut (the partition closed or was lost)."""
        for call in (self._restart_call, self._cut_call):
            if call is not None and call.active():
                call.cancel()
        self._restart_call = self._cut_call = None

    def _session_closed(self, session, reason):
        if session is not self.session:
            return
        self.session = None
        self._unsettled.extend(self._in_flight)
        self._in_flight.clear()
        if not self.closed and not self.lost:
            self._restart_later(0)

    def _settle(self, high_water_mark):
        """Decide the batches whose session died: committed up to ``high_water_mark``, failed above."""
        unsettled, self._unsettled = self._unsettled, []
        for batch in unsettled:
            for pending in batch:
                if pending.transaction_id <= high_water_mark:
                    pending.deferred.callback(pending.transaction_id)
                else:
                    pending.deferred.errback(AppendFailed(
                        "transaction %d of partition %d was not committed (resolved high-water mark %d)"
                        % (pending.transaction_id, self.partition_id, high_water_mark)))

    def _lose(self, reason):
        self.lost = reason
        self._cancel_calls()
        self.log.warn("partition {pid} lost: {reason}", pid=self.partition_id, reason=reason)
        # The listeners first: the appends' errbacks below run their callers' code, which must already see the
        # partition lost.
        listeners, self._lost_listeners = self._lost_listeners, []
        for listener in listeners:
            try:
                listener(reason)
            except Exception:
                self.log.failure("a listener of partition {pid}'s loss failed", pid=self.partition_id)
        self._fail_everything(PartitionNotOwned(reason))

    # -- the write path ----------------------------------------------------------------------

    def _pump(self):
        while self._ready_to_send():
            self._send_batch(self.session)
        self._check_flush()

    def _ready_to_send(self):
        """Send when a pipeline slot is free and either nothing is in flight or a full batch is queued.

        A partial batch waits for the one in flight instead of taking the next slot, so that under
        moderate load batches fill up (fewer, larger storage requests) while full ones still pipeline.
        """
        if not self._queue or len(self._in_flight) >= self.max_batches_in_flight:
            return False
        if self.session is None or not self.session.writable:
            return False
        return not self._in_flight or len(self._queue) >= self.max_batch_size

    def _send_batch(self, session):
        batch, size = [], 0
        next_id = self._in_flight[-1][-1].transaction_id + 1 if self._in_flight else self.high_water_mark + 1
        while self._queue and len(batch) < self.max_batch_size:
            size += len(self._queue[0].data)
            if batch and size > MAX_BATCH_DATA_SIZE:
                break       # the storages' frame limit: the rest goes in the next batch
            pending = self._queue.popleft()
            pending.transaction_id = next_id
            next_id += 1
            batch.append(pending)
        self._in_flight.append(batch)
        d = session.write([p.record() for p in batch])
        d.addCallbacks(self._committed, self._write_failed, callbackArgs=(batch, session),
                       errbackArgs=(batch,))

    def _committed(self, last_id, batch, session):
        if not self._in_flight or batch is not self._in_flight[0]:
            return
        self._in_flight.popleft()
        self.high_water_mark = last_id
        for pending in batch:
            pending.deferred.callback(pending.transaction_id)
        self._notify()
        if session is self.session and self.high_water_mark - session.low_water_mark >= self.checkpoint_interval:
            session.close("checkpoint: %d transactions since the low-water mark %d"
                          % (self.high_water_mark - session.low_water_mark, session.low_water_mark))
        self._pump()

    def _write_failed(self, failure, batch):
        failure.trap(SessionClosed)
        # The session is closing; _session_closed moves the batch to the unsettled ones.

    def _notify(self):
        for listener in list(self._listeners):
            listener(self.high_water_mark)
        self._check_flush()

    def _check_flush(self):
        if not self._flush_waiters:
            return
        waiters, self._flush_waiters, waiting = self._flush_waiters, [], []
        for before, waiter in waiters:
            while before and before[0].deferred.called:
                before.popleft()
            if before:
                waiting.append((before, waiter))
            else:
                waiter.callback(self.high_water_mark)
        self._flush_waiters = waiting + self._flush_waiters     # (and any a callback added meanwhile)

    # -- closing -----------------------------------------------------------------------------

    def close(self):
        """Close the session; queued and unsettled appends fail."""
        if self.closed:
            return defer.succeed(None)
        self.closed = True
        self._cancel_calls()
        if self.session is not None:
            self.session.close("store partition closed")
        self._fail_everything(AppendFailed("partition %d closed" % self.partition_id))
        return defer.succeed(None)

    def _fail_everything(self, error):
        """Queued appends fail with ``error``; those sent but unsettled end with :class:`AppendFateUnknown`."""
        queued = list(self._queue)
        self._queue.clear()
        sent = [p for batch in self._unsettled + list(self._in_flight) for p in batch]
        self._unsettled = []
        self._in_flight.clear()
        unknown = AppendFateUnknown("partition %d: %s; the fate of the append is decided by the next owner"
                                    % (self.partition_id, error))
        for item, outcome in [(p, error) for p in queued] + [(p, unknown) for p in sent]:
            if not item.deferred.called:
                item.deferred.errback(outcome)
        waiters, self._flush_waiters = self._flush_waiters, []
        for _before, waiter in waiters:
            waiter.errback(error)
