"""One partition as the client sees it: mount state, appends, feed, data and high-water mark.

Mount states (:class:`PartitionState`), the only way a partition's state changes is
:meth:`ClientPartition._set_state`::

    INACTIVE --activate--> ACTIVATING --(application HWM read)--> WAITING_FOR_SERVER
    WAITING_FOR_SERVER --(location known, stream connection ready; MOUNT sent)--> MOUNTING
    MOUNTING --READY (after the feed before it was applied)--> MOUNTED
    MOUNTING --NOT_READY--> MOUNT_RETRY --(client.mountRetryInterval)--> MOUNTING
    MOUNTING --CLIENT_AHEAD--> CLIENT_AHEAD   (an error: see ClientAheadError)
    MOUNTING/MOUNT_RETRY/MOUNTED --(stream lost, or the partition moved)--> WAITING_FOR_SERVER
    any --close--> CLOSED

Appends are sent only in MOUNTED; otherwise executions wait (seed 004's reconnect
procedure: block appends, reconnect, remount, detect failures in the feed, fail
everything still pending when the mount response arrives, unblock). At most
``client.maxConcurrentTransactions`` appends are outstanding; further executions
wait in order (back pressure).

The feed is applied strictly in commit order, one transaction at a time: the
mount response is queued behind the feed data that preceded it, so the monitor
sees every success the server streamed before it declares the rest failed.

**Routing misses.** The partition map comes from ZooKeeper and lags behind the
cluster: a server may have restarted on the same endpoint under a new id, or
given the partition up, before the assignment says so. A server that does not
serve the partition answers a mount NOT_READY and a transaction data request
"partition N is not served here"; neither is an error for the application. The
data request stays pending and is sent again every ``client.mountRetryInterval``
(and at once when the partition moves), and ``on_misrouted(partition_id)``
asks the client to read the partition map again. The same holds for a
high-water mark request, which such a server leaves unanswered.
"""

import enum
import itertools
import types
from collections import deque

import attr
from twisted.internet import defer
from twisted.logger import Logger
from twisted.python.failure import Failure

from waltz.client.api import Transaction, TransactionBuilder
from waltz.client.config import MAX_APPLY_RETRY_INTERVAL
from waltz.client.errors import (
    ClientAheadError, ClientClosedError, DataChecksumError, PartitionInactiveError, TransactionDataError)
from waltz.client.monitor import HighWaterMarkGates, TransactionMonitor
from waltz.client.network import DataChecksumMismatch
from waltz.protocols import client_messages as m
from waltz.protocols.base import is_deferred
from waltz.protocols.values import ReqId

log = Logger()


class PartitionState(enum.Enum):
    INACTIVE = "inactive"
    ACTIVATING = "activating"
    WAITING_FOR_SERVER = "waiting for server"
    MOUNTING = "mounting"
    MOUNT_RETRY = "mount retry"
    MOUNTED = "mounted"
    CLIENT_AHEAD = "client ahead"
    CLOSED = "closed"


#: States in which the partition has sent (or is about to resend) a mount on its stream connection.
_ON_SERVER = (PartitionState.MOUNTING, PartitionState.MOUNT_RETRY, PartitionState.MOUNTED)


def _still_running(result):
    """What ``apply_transaction`` returned, with the coroutine of an ``async def`` apply turned into the
    Deferred that runs it (taken as a plain result, the transaction counted as applied and its body never ran)."""
    if type(result) is types.CoroutineType:
        return defer.Deferred.fromCoroutine(result)
    return result


@attr.s(slots=True)
class _FeedItem:
    """A committed transaction received and waiting to be applied."""

    req_id = attr.ib()
    transaction_id = attr.ib()
    header = attr.ib()
    detected = attr.ib(default=False)
    submission = attr.ib(default=None)
    #: True once applied (or dropped).
    finished = attr.ib(default=False)
    #: The Deferred of :meth:`when_finished`, made only when asked for: almost every item is applied
    #: as soon as it arrives, and one Deferred per item (per client) would cost more than the apply.
    _done = attr.ib(default=None)

    def when_finished(self):
        """None when already finished, else a Deferred firing once it is (never failing): the
        stream protocol's back pressure waits on it."""
        if self.finished:
            return None
        if self._done is None:
            self._done = defer.Deferred()
        return self._done

    def finish(self):
        self.finished = True
        if self._done is not None and not self._done.called:
            self._done.callback(None)


@attr.s(slots=True, frozen=True)
class _MountCompleted:
    """The mount response READY, queued behind the feed data that preceded it."""

    req_id = attr.ib()


@attr.s(slots=True)
class _DataFetch:
    """Callers waiting for one transaction's data, and how many bad checksums it has had."""

    waiters = attr.ib(factory=list)
    bad_checksums = attr.ib(default=0)
    misrouted = attr.ib(default=0)     #: answers "not served here" (the request went to the wrong server)
    refusals = attr.ib(default=0)      #: answers "try again later" (the server could not read it right now)
    sent_at = attr.ib(default=None)    #: reactor time of the last request sent (None: none sent yet)


class ClientPartition:
    """The client's side of one partition (see the module docstring)."""

    def __init__(self, partition_id, client_id, callbacks, settings, clock):
        self.partition_id = partition_id
        self.client_id = client_id
        self._callbacks = callbacks
        self._settings = settings
        self._clock = clock
        self.state = PartitionState.INACTIVE
        #: False once ``set_partitions`` dropped the partition: it drains its appends, then unmounts.
        self.wanted = False
        self.generation = -1
        self.location = None
        self.stream = None
        self.rpc = None
        self._seq_nums = itertools.count(1)
        #: The last transaction the application applied (the client high-water mark).
        self.applied_hwm = -1
        #: The last transaction received from the feed (applied or waiting to be).
        self.received_hwm = -1
        self.monitor = TransactionMonitor(settings.max_concurrent_transactions, clock)
        self._gates = HighWaterMarkGates()
        #: Executions waiting at a gate to retry after a lock failure (in no queue meanwhile).
        self._gated = {}
        self._apply_waiters = []
        self._waiting = deque()
        self._retrying = deque()
        self._pumping = False
        self._feed = deque()
        self._feed_epoch = 0            # counts _drop_feed calls
        self._applying = False
        self._apply_in_flight = False   # an apply_transaction Deferred has not fired yet
        self._activate_after_apply = False  # an activation (after CLIENT_AHEAD) waits for that Deferred
        self._draining = False
        self._building = set()
        self._apply_failures = 0
        self._mount_req_id = None
        self._timers = {}
        self._fetches = {}
        self._hwm_waiters = {}          # Deferred -> number of the first request whose answer may settle it
        self._hwm_asked = 0             # high-water mark requests sent so far (they are numbered from 1)
        self._hwm_request = None        # (ReqId, number) of the latest one, until it is answered
        self._hwm_sent_at = None
        #: Called with the partition id when a server says it does not serve the partition (the client
        #: then reads the partition map again).
        self.on_misrouted = None

    def __repr__(self):
        return "<partition %d %s gen %d hwm %d>" % (
            self.partition_id, self.state.value, self.generation, self.applied_hwm)

    # --- state ---------------------------------------------------------------------------------

    def _set_state(self, state):
        if state is not self.state:
            log.debug("partition {pid}: {old} -> {new}", pid=self.partition_id,
                      old=self.state.value, new=state.value)
            self.state = state

    def next_req_id(self) -> ReqId:
        """A new ReqId (client id, current generation, partition, next sequence number)."""
        return ReqId(self.client_id, self.generation, self.partition_id, next(self._seq_nums))

    def _later(self, name, delay, function, *args):
        """Schedule ``function`` as the single timer called ``name`` (replacing an earlier one)."""
        self._cancel(name)
        self._timers[name] = self._clock.callLater(delay, self._fire_timer, name, function, *args)

    def _fire_timer(self, name, function, *args):
        self._timers.pop(name, None)
        function(*args)

    def _cancel(self, name):
        call = self._timers.pop(name, None)
        if call is not None and call.active():
            call.cancel()

    # --- activation ------------------------------------------------------------------------------

    def activate(self):
        """Start working on the partition: read the application's high-water mark, then mount."""
        if self.state is PartitionState.CLOSED:
            return
        self.wanted = True
        if self.state not in (PartitionState.CLIENT_AHEAD, PartitionState.INACTIVE):
            return
        # The application's mark is read afresh: an apply still running must end first, else the mark
        # misses it and the transaction is delivered again. (A partition is found CLIENT_AHEAD while it may
        # still be applying.)
        if self._apply_in_flight:
            self._activate_after_apply = True
            return
        if self.state is PartitionState.CLIENT_AHEAD:
            # What is queued behind that apply was received against the old mark: dropped and fed again.
            self._drop_feed()
        self._set_state(PartitionState.ACTIVATING)
        d = defer.maybeDeferred(self._callbacks.get_client_high_water_mark, self.partition_id)
        d.addCallbacks(self._activated, self._activation_failed)

    def _activated(self, high_water_mark):
        if self.state is not PartitionState.ACTIVATING:
            return
        if isinstance(high_water_mark, bool) or not isinstance(high_water_mark, int) or high_water_mark < -1:
            self._activation_failed(Failure(ValueError(
                "get_client_high_water_mark(%d) returned %r, not an int >= -1"
                % (self.partition_id, high_water_mark))))
            return
        self.applied_hwm = self.received_hwm = high_water_mark
        self._set_state(PartitionState.WAITING_FOR_SERVER)
        self._try_mount()

    def _activation_failed(self, failure):
        if self.state is not PartitionState.ACTIVATING:
            return
        log.error("partition {pid}: cannot read the client high-water mark: {error!r}",
                  pid=self.partition_id, error=failure.value)
        self._report(-1, failure.value)
        self._set_state(PartitionState.INACTIVE)
        self._later("activate", self._settings.mount_retry_interval, self._reactivate)

    def _reactivate(self):
        if self.wanted:
            self.activate()

    def deactivate(self):
        """Stop working on the partition: queued executions fail with PartitionInactiveError;
        appends already sent are settled (flushing them), then the partition unmounts."""
        if not self.wanted:
            return
        self.wanted = False
        self._fail_queued(PartitionInactiveError(self.partition_id))
        self._send_flush()
        self._finish_deactivation()

    def _finish_deactivation(self):
        if self.wanted:     # checked first: this runs after every settlement
            return
        # An apply_transaction still running must end first: dropped from the feed, and the partition
        # re-activated meanwhile, it would be delivered again (the application's mark does not show it yet).
        settled = not (len(self.monitor) or self._building or self._apply_in_flight)
        if not settled or self.state in (PartitionState.INACTIVE, PartitionState.CLOSED):
            return
        self._cancel("mount")
        self._cancel("activate")
        self._set_state(PartitionState.INACTIVE)
        self._drop_feed()
        self._gates.clear()
        # Nothing more is applied here: whoever waits for a later transaction would wait for ever.
        waiters, self._apply_waiters = self._apply_waiters, []
        for _, d in waiters:
            d.errback(PartitionInactiveError(self.partition_id))

    # --- where the partition lives ---------------------------------------------------------------

    def relocate(self, location, connections):
        """The partition is now at ``location`` (None: no live server holds it), reached through
        ``connections`` (:class:`~waltz.client.network.ServerConnections` or None)."""
        if location is not None and location.generation > self.generation:
            self.generation = location.generation
        stream = connections.stream if connections is not None else None
        rpc = connections.rpc if connections is not None else None
        if location == self.location and stream is self.stream and rpc is self.rpc:
            return
        log.info("partition {pid}: now at {location}", pid=self.partition_id, location=location)
        self.location, self.stream, self.rpc = location, stream, rpc
        if self.state in _ON_SERVER:
            self._unmounted()
        if self.state is PartitionState.CLIENT_AHEAD:
            self.activate()
        self._try_mount()
        self._resend_rpc()

    def _unmounted(self):
        self._cancel("mount")
        self._mount_req_id = None
        self._set_state(PartitionState.WAITING_FOR_SERVER)

    def _try_mount(self):
        if self.state not in (PartitionState.WAITING_FOR_SERVER, PartitionState.MOUNT_RETRY):
            return
        if self.stream is None or not self.stream.ready:
            self._set_state(PartitionState.WAITING_FOR_SERVER)
            return
        self._mount_req_id = req_id = self.next_req_id()
        self._set_state(PartitionState.MOUNTING)
        log.info("partition {pid}: mounting at {endpoint} with client high-water mark {hwm}",
                 pid=self.partition_id, endpoint=self.stream.endpoint, hwm=self.received_hwm)
        self.stream.send(m.MountRequest(req_id, self.received_hwm, self.stream.seq_num))

    # --- stream connection events ----------------------------------------------------------------

    def stream_ready(self, conn):
        if conn is not self.stream:
            return
        if self.state is PartitionState.CLIENT_AHEAD:
            self.activate()
        self._try_mount()

    def stream_lost(self, conn):
        if conn is self.stream and self.state in _ON_SERVER:
            self._unmounted()

    def stream_message(self, conn, message):
        """A message for this partition on a stream connection; may return a Deferred (back pressure)."""
        if conn is not self.stream or self.state not in _ON_SERVER:
            return None
        handler = self._STREAM_HANDLERS.get(type(message))
        if handler is None:
            log.warn("partition {pid}: unexpected {message!r} on the stream connection",
                     pid=self.partition_id, message=message)
            return None
        return handler(self, message)

    def _on_mount_response(self, message):
        if message.req_id != self._mount_req_id or self.state is not PartitionState.MOUNTING:
            return
        if message.state is m.MountState.READY:
            self.stream.send(m.FeedRequest(message.req_id, self.received_hwm))
            self._feed.append(_MountCompleted(message.req_id))
            self._drain()
        elif message.state is m.MountState.NOT_READY:
            log.info("partition {pid}: not ready at {endpoint}; mounting again in {delay} s",
                     pid=self.partition_id, endpoint=self.stream.endpoint,
                     delay=self._settings.mount_retry_interval)
            self._set_state(PartitionState.MOUNT_RETRY)
            self._later("mount", self._settings.mount_retry_interval, self._try_mount)
            self._misrouted()
        else:
            self._client_ahead()

    def _client_ahead(self):
        error = ClientAheadError(self.partition_id, self.received_hwm)
        log.error("{error}", error=str(error))
        self._set_state(PartitionState.CLIENT_AHEAD)
        self._mount_req_id = None
        self._fail_queued(error)
        with self.monitor.settling():
            for submission in self.monitor.fail_all():
                submission.failed(error)
        self._report(self.received_hwm, error)

    def _on_feed_data(self, message):
        txn = message.transaction_id
        if txn != self.received_hwm + 1:
            if txn > self.received_hwm:
                log.warn("partition {pid}: feed skipped from {hwm} to {txn}; ignored",
                         pid=self.partition_id, hwm=self.received_hwm, txn=txn)
            return None
        self.received_hwm = txn
        if not self._feed and not self._draining:
            return self._apply_at_once(message.req_id, txn, message.header)
        item = _FeedItem(message.req_id, txn, message.header)
        self._feed.append(item)
        self._drain()
        return item.when_finished()

    def _apply_at_once(self, req_id, txn, header):
        """A transaction arriving with nothing queued before it (most of the feed): the steps of
        :meth:`_apply` and :meth:`_applied`, without a queue item, when ``apply_transaction`` returns at
        once and nothing dropped the feed meanwhile. (The queue's bookkeeping was a fifth of a client's
        CPU per feed item.) Otherwise (an apply that raised or returned a Deferred, or a hook or the apply
        itself that deactivated or closed the partition) the item goes the queue's way, as if it had been
        at the head of the queue all along.
        """
        epoch = self._feed_epoch
        submission = self._start_applying(req_id, txn, True)
        failure = None
        try:
            result = _still_running(
                self._callbacks.apply_transaction(Transaction(self.partition_id, txn, header, req_id, self)))
        except Exception:
            failure = Failure()
            result = None
        deferred = is_deferred(result)
        if not deferred:
            self._apply_in_flight = False
        dropped = self._feed_epoch != epoch or self.state is PartitionState.CLOSED
        if failure is None and not dropped and not deferred:
            self._apply_failures = 0
            self.applied_hwm = txn
            if submission is not None:
                submission.applied()
            if self._gates:
                self._gates.release(txn)
            self._release_apply_waiters()
            self._finish_deactivation()
            if not self._resume_activation():
                self._pump()
            return None
        item = _FeedItem(req_id, txn, header, detected=True, submission=submission)
        if dropped:
            item.finish()       # as _drop_feed finishes the items it drops: the outcome is then ignored
        else:
            self._feed.append(item)
            self._applying = True
        if failure is not None:
            self._apply_failed(failure, item)
        else:
            self._apply_returned(result, item)
        self._pump()
        return item.when_finished()

    def _on_feed_suspended(self, message):
        # Only the current mount's feed is asked to go on: a FEED_SUSPENDED of an earlier mount on this
        # connection, answered, would make the server replace the current mount's catch-up with it.
        if message.req_id == self._mount_req_id:
            self.stream.send(m.FeedRequest(message.req_id, self.received_hwm))

    def _on_flush_response(self, message):
        self._flush_completed(message.req_id, message.high_water_mark)

    def _flush_completed(self, req_id, high_water_mark):
        if self.applied_hwm < high_water_mark:
            self._gates.wait(high_water_mark, lambda: self._flush_completed(req_id, high_water_mark))
            return
        with self.monitor.settling():
            for submission in self.monitor.flush(req_id):
                self._attempt_failed(submission)
        self._after_settlement()

    def _on_lock_failure(self, message):
        with self.monitor.settling():
            submission = self.monitor.abort(message.req_id)
            if submission is None:
                return
            log.debug("partition {pid}: lock failure of {req_id}; retry once the high-water mark reaches {txn}",
                      pid=self.partition_id, req_id=message.req_id, txn=message.transaction_id)
            submission.lock_failed()
            submission.retry_after = message.transaction_id
            self._attempt_failed(submission)
        self._after_settlement()

    _STREAM_HANDLERS = {
        m.MountResponse: _on_mount_response,
        m.FeedData: _on_feed_data,
        m.FeedSuspended: _on_feed_suspended,
        m.FlushResponse: _on_flush_response,
        m.LockFailure: _on_lock_failure,
    }

    # --- applying the feed ---------------------------------------------------------------------

    def _drain(self):
        """Apply queued feed items in order, one at a time; handle queued mount completions."""
        if self._draining:
            return
        self._draining = True
        try:
            while self._feed and not self._applying and self.state is not PartitionState.CLOSED:
                event = self._feed[0]
                if isinstance(event, _MountCompleted):
                    self._feed.popleft()
                    self._mount_completed(event.req_id)
                else:
                    self._applying = True
                    self._apply(event)
        finally:
            self._draining = False
        self._pump()

    def _detect(self, req_id, txn):
        """This client's transaction ``txn`` reached the feed: its append is settled as committed, and the
        older appends still pending failed (seed 004). Its submission, or None."""
        with self.monitor.settling():
            submission, failed = self.monitor.committed(req_id)
            for other in failed:
                self._attempt_failed(other)
            if submission is not None:
                submission.committed(txn)
        return submission

    def _start_applying(self, req_id, txn, detect):
        """An apply starts: in flight from here (the completion hooks that :meth:`_detect` runs, then
        ``apply_transaction``) until it ends, so that an application dropping the partition meanwhile (and
        perhaps adding it back) does not see it deactivated, nor has its mark re-read, before then: the
        transaction would be delivered again. With ``detect``, this client's own transaction is settled first:
        its submission, or None."""
        self._apply_in_flight = True
        # Most of the feed is other clients' transactions: only this client's can settle an append.
        if not detect or req_id.client_id != self.client_id:
            return None
        try:
            return self._detect(req_id, txn)
        except BaseException:
            self._apply_in_flight = False   # (hooks run guarded: only a bug gets here; never block deactivation)
            raise

    def _apply(self, item):
        submission = self._start_applying(item.req_id, item.transaction_id, not item.detected)
        if not item.detected:
            item.detected = True
            item.submission = submission
        transaction = Transaction(self.partition_id, item.transaction_id, item.header, item.req_id, self)
        # Called directly rather than through maybeDeferred: the usual apply is synchronous, and
        # two Deferreds per item per client were a large share of the client's CPU per transaction.
        try:
            result = _still_running(self._callbacks.apply_transaction(transaction))
        except Exception:
            self._apply_failed(Failure(), item)
            return
        self._apply_returned(result, item)

    def _apply_returned(self, result, item):
        """``apply_transaction`` returned ``result`` for ``item``: applied, or applying until it fires."""
        if is_deferred(result):
            self._apply_in_flight = True
            result.addCallbacks(self._applied, self._apply_failed, callbackArgs=(item,), errbackArgs=(item,))
        else:
            self._applied(result, item)

    def _applied(self, _, item):
        self._apply_in_flight = False
        if self.state is PartitionState.CLOSED or not self._feed or self._feed[0] is not item:
            self._resume_activation()
            return
        self._feed.popleft()
        self._applying = False
        self._apply_failures = 0
        self.applied_hwm = item.transaction_id
        if item.submission is not None:
            item.submission.applied()
        item.finish()
        self._gates.release(self.applied_hwm)
        self._release_apply_waiters()
        self._finish_deactivation()
        if self._resume_activation():
            return
        # _drain pumps once it has applied all it can (not once per item: a pump costs more than
        # a synchronous apply, and retries released above start with a higher high-water mark).
        self._drain()

    def _apply_failed(self, failure, item):
        self._apply_in_flight = False
        if self.state is PartitionState.CLOSED or not self._feed or self._feed[0] is not item:
            self._resume_activation()
            return
        self._apply_failures += 1
        delay = min(MAX_APPLY_RETRY_INTERVAL,
                    self._settings.apply_retry_interval * 2 ** (self._apply_failures - 1))
        log.failure("partition {pid}: apply_transaction failed for transaction {txn}; retrying in {delay} s",
                    failure, pid=self.partition_id, txn=item.transaction_id, delay=delay)
        self._report(item.transaction_id, failure.value)
        if self.state is PartitionState.CLOSED or not self._feed or self._feed[0] is not item:
            # uncaught_exception dropped the feed (closed, or dropped and re-added the partition): a retry armed
            # now would apply the item again beside its redelivery.
            self._resume_activation()
            return
        self._later("apply", delay, self._retry_apply)
        self._finish_deactivation()     # a deactivation waiting for this apply goes on (no retry then)
        self._resume_activation()       # so does an activation (which drops the retry)

    def _resume_activation(self):
        """Once an apply has ended: an activation that waited for it goes on. True if one did."""
        if not self._activate_after_apply:
            return False
        self._activate_after_apply = False
        if not self.wanted or self.state not in (PartitionState.CLIENT_AHEAD, PartitionState.INACTIVE):
            return False
        self.activate()
        return True

    def _retry_apply(self):
        self._applying = False
        self._drain()

    def _mount_completed(self, req_id):
        if req_id != self._mount_req_id or self.state is not PartitionState.MOUNTING:
            return
        log.info("partition {pid}: mounted at {endpoint} (high-water mark {hwm})",
                 pid=self.partition_id, endpoint=self.stream.endpoint, hwm=self.applied_hwm)
        with self.monitor.settling():
            for submission in self.monitor.fail_all():
                self._attempt_failed(submission)
        if req_id != self._mount_req_id or self.state is not PartitionState.MOUNTING:
            return      # a hook run by a failure closed the client (or the partition moved): that stands
        self._set_state(PartitionState.MOUNTED)
        self._after_settlement()

    def _drop_feed(self):
        """Forget feed items not applied yet (the partition stops being applied)."""
        self._feed_epoch += 1
        for event in self._feed:
            if isinstance(event, _FeedItem):
                event.finish()
        self._feed.clear()
        self._applying = False
        self._cancel("apply")
        self.received_hwm = self.applied_hwm

    def _report(self, transaction_id, exception):
        try:
            self._callbacks.uncaught_exception(self.partition_id, transaction_id, exception)
        except Exception:
            log.failure("uncaught_exception callback failed")

    # --- executing contexts --------------------------------------------------------------------

    def submit(self, submission):
        """Queue an execution; it is attempted as soon as the partition is mounted and has room."""
        submission.withdraw = self._withdraw
        error = self._refusal()
        if error is not None:
            submission.failed(error)
            return
        if not self._pumping and not self._waiting and not self._retrying and self._can_start():
            # What _pump would do, without queueing it first (executions it starts meanwhile queue).
            self._pumping = True
            try:
                self._attempt(submission)
            finally:
                self._pumping = False
        else:
            self._waiting.append(submission)
        self._pump()
        if not submission.attempts and not submission.done:
            # Still waiting for room: expire it in time. (One attempted at once needs no timer: the
            # attempt checks expiry itself, and a timer armed and cancelled per append is not free.)
            self._arm_expiry(submission)

    def _refusal(self):
        if self.state is PartitionState.CLOSED:
            return ClientClosedError("the Waltz client is closed")
        if not self.wanted:
            return PartitionInactiveError(self.partition_id)
        if self.state is PartitionState.CLIENT_AHEAD:
            return ClientAheadError(self.partition_id, self.received_hwm)
        return None

    def _queue(self, queue, submission):
        queue.append(submission)
        self._arm_expiry(submission)

    def _arm_expiry(self, submission):
        """Expire ``submission`` at its context's expiration time unless an attempt starts first."""
        expiration = self._settings.transaction_expiration
        submission.cancel_expiry()
        if expiration is not None and submission.context.creation_time is not None:
            remaining = submission.context.creation_time + expiration - self._clock.seconds()
            submission.expiry_call = self._clock.callLater(max(0.0, remaining), self._expire_queued, submission)

    def _expire_queued(self, submission):
        submission.expiry_call = None
        self._take_back(submission)
        if not submission.done:
            submission.expired()
        self._after_settlement()

    def _withdraw(self, submission):
        """Its caller cancelled ``submission``: it ends now unless its append is on the server."""
        if self._take_back(submission):
            submission.end_cancelled()
            self._after_settlement()

    def _take_back(self, submission) -> bool:
        """Take ``submission`` out of wherever it waits unsent. False if it waits nowhere (its append was
        sent, or its ``execute`` is running)."""
        for queue in (self._waiting, self._retrying):
            if submission in queue:
                queue.remove(submission)
                return True
        if submission in self._gated:
            del self._gated[submission]
            return True
        if submission in self._building:
            self._building.discard(submission)  # its execute's Deferred, if it ever fires, is ignored
            return True
        return False

    def _attempt_failed(self, submission):
        """An attempt failed: retry (after the lock failure's transaction when there was one), unless the
        caller cancelled the execution meanwhile."""
        if submission.cancelled:
            if not submission.done:
                submission.end_cancelled()
            return
        error = self._refusal()
        if error is not None:
            submission.failed(error)
        elif submission.retry_after is not None and self.applied_hwm < submission.retry_after:
            self._gated[submission] = None
            self._gates.wait(submission.retry_after, lambda: self._ungate(submission))
            self._arm_expiry(submission)
        else:
            self._retry(submission)

    def _ungate(self, submission):
        self._gated.pop(submission, None)
        self._retry(submission)

    def _retry(self, submission):
        if submission.done:
            return
        error = self._refusal()
        if error is not None:
            submission.failed(error)
            return
        self._queue(self._retrying, submission)

    def _pump(self):
        """Start queued executions while mounted and below ``maxConcurrentTransactions`` (appends
        outstanding plus contexts still building theirs)."""
        if self._pumping or not (self._retrying or self._waiting):
            return          # (the common case: it runs after every feed item applied)
        self._pumping = True
        try:
            while self._can_start():
                queue = self._retrying or self._waiting
                if not queue:
                    break
                self._attempt(queue.popleft())
        finally:
            self._pumping = False

    def _can_start(self) -> bool:
        return (self.state is PartitionState.MOUNTED and self.wanted
                and len(self.monitor) + len(self._building) < self._settings.max_concurrent_transactions)

    def _attempt(self, submission):
        """Execute the context with a fresh builder; append what it built (now, or when the Deferred
        it returned fires)."""
        submission.cancel_expiry()
        if submission.is_expired(self._clock.seconds(), self._settings.transaction_expiration):
            submission.expired()
            return
        submission.attempts += 1
        submission.retry_after = None
        builder = TransactionBuilder(self.next_req_id(), self.applied_hwm)
        try:
            proceed = submission.context.execute(builder)
        except Exception:
            self._execute_failed(Failure(), submission)
            return
        if is_deferred(proceed):
            self._building.add(submission)
            self._arm_expiry(submission)    # an execute whose Deferred never fires must not hold its slot
            mount = self._mount_req_id
            proceed.addCallbacks(self._built_later, self._build_failed_later,
                                 callbackArgs=(submission, builder, mount), errbackArgs=(submission,))
        else:
            self._built(proceed, submission, builder)

    def _built_later(self, proceed, submission, builder, mount):
        self._building.discard(submission)
        submission.cancel_expiry()
        if submission.done:
            return
        if mount != self._mount_req_id or self.state is not PartitionState.MOUNTED or not self.wanted:
            # remounted meanwhile (maybe with another generation): build it again once mounted
            self._retry(submission)
        else:
            self._built(proceed, submission, builder)
        self._after_settlement()

    def _built(self, proceed, submission, builder):
        try:
            if not proceed:
                if proceed is None:
                    raise TypeError("execute() of %r returned None: return True to append the transaction, "
                                    "False to drop it" % (submission.context,))
                submission.ignored()
                return
            if self.state is not PartitionState.MOUNTED or not self.wanted:
                # execute() itself closed the client or dropped the partition (the clean-up could not see
                # this submission, which was in none of its queues): not sent, it fails or waits to retry.
                self._retry(submission)
                return
            request = builder.build_request()
            self.stream.send(request)
        except Exception:
            # Nothing was sent (a request that cannot be encoded fails before any byte is written).
            self._execute_failed(Failure(), submission)
            return
        self.monitor.register(request.req_id, submission)
        submission.sent(request.req_id)

    def _build_failed_later(self, failure, submission):
        self._building.discard(submission)
        submission.cancel_expiry()
        self._execute_failed(failure, submission)
        self._after_settlement()

    def _execute_failed(self, failure, submission):
        """``execute`` raised (or its Deferred failed): the context ends with ``on_exception``."""
        if submission.done:
            return
        log.failure("partition {pid}: execute of {context!r} raised", failure, pid=self.partition_id,
                    context=submission.context)
        submission.failed(failure.value)

    def _after_settlement(self):
        self._pump()
        self._finish_deactivation()

    def _fail_queued(self, error):
        """End every execution not sent yet (waiting to retry, queued, or still building) with ``error``."""
        gated, self._gated = self._gated, {}
        for submission in gated:
            submission.failed(error)
        for queue in (self._retrying, self._waiting):
            while queue:
                queue.popleft().failed(error)
        building, self._building = self._building, set()
        for submission in building:
            submission.failed(error)

    def when_applied(self, transaction_id):
        """A Deferred firing once this client has applied ``transaction_id`` (at once if it has); it
        fails at once, or when the partition is deactivated, if this client does not apply it."""
        if self.state is PartitionState.CLOSED:
            return defer.fail(ClientClosedError("the Waltz client is closed"))
        if transaction_id > self.applied_hwm and not self.wanted:
            return defer.fail(PartitionInactiveError(self.partition_id))
        d = defer.Deferred()
        self._apply_waiters.append((transaction_id, d))
        self._release_apply_waiters()
        return d

    def _release_apply_waiters(self):
        if not self._apply_waiters:
            return
        ready = [d for txn, d in self._apply_waiters if txn <= self.applied_hwm]
        if ready:
            self._apply_waiters = [(txn, d) for txn, d in self._apply_waiters if txn > self.applied_hwm]
            for d in ready:
                d.callback(self.applied_hwm)

    # --- flush -----------------------------------------------------------------------------------

    def flush(self):
        """A Deferred firing once every append pending now is settled (success or failure), and every
        execution not sent yet (queued, building, waiting to retry) has been sent and settled, or ended
        unsent. (The Java client's submit returned only once the append was registered, so its flush
        covered every execution submitted before it.)"""
        settled = self.monitor.when_settled()
        unsent = self._unsent()
        self._send_flush()
        if not unsent:
            return settled
        sent = defer.gatherResults([submission.when_sent() for submission in unsent])
        return defer.gatherResults([settled, sent.addCallback(self._when_settled_once_sent)])

    def _when_settled_once_sent(self, req_ids):
        """Once every execution a flush waited for is sent (or ended unsent, None): one FLUSH for all of
        them. (A FLUSH per send would put a barrier between every two appends: the server lets nothing
        behind a barrier into the store until everything before it committed.)"""
        req_ids = [req_id for req_id in req_ids if req_id is not None]
        if not req_ids:
            return None
        settled = self.monitor.when_settled(req_ids)
        self._send_flush()
        return settled

    def _unsent_collections(self):
        """Where executions not sent yet wait: queued, waiting to retry, gated after a lock failure, building."""
        return self._waiting, self._retrying, self._gated, self._building

    def _unsent(self):
        return [submission for collection in self._unsent_collections() for submission in collection]

    def has_pending(self) -> bool:
        """Whether an execution on this partition has not ended yet, sent or not."""
        return len(self.monitor) > 0 or any(self._unsent_collections())

    def nudge(self, now):
        """Send a FLUSH when pending appends made no progress within ``client.longWaitThreshold``; ask
        for the high-water mark again when it has been unanswered that long (a server that does not
        serve the partition drops the request), and for a transaction's data likewise."""
        if len(self.monitor) and now - self.monitor.last_progress >= self._settings.long_wait_threshold:
            log.debug("partition {pid}: no progress for {seconds} s; flushing", pid=self.partition_id,
                      seconds=now - self.monitor.last_progress)
            self._send_flush()
        if (self._hwm_waiters and self._hwm_sent_at is not None
                and now - self._hwm_sent_at >= self._settings.long_wait_threshold):
            log.info("partition {pid}: high-water mark request unanswered for {seconds} s; asking again",
                     pid=self.partition_id, seconds=now - self._hwm_sent_at)
            self._misrouted()
            self._send_hwm_request()
        unanswered = [(transaction_id, fetch.sent_at) for transaction_id, fetch in self._fetches.items()
                      if fetch.sent_at is not None and now - fetch.sent_at >= self._settings.long_wait_threshold]
        if unanswered:
            log.info("partition {pid}: data of {count} transaction(s) unanswered for {seconds} s; asking again",
                     pid=self.partition_id, count=len(unanswered), seconds=now - min(t for _, t in unanswered))
            self._misrouted()
            for transaction_id, _ in unanswered:
                self._send_data_request(transaction_id)

    def _send_flush(self):
        req_id = self.monitor.last_req_id
        if req_id is not None and self.state is PartitionState.MOUNTED:
            self.stream.send(m.FlushRequest(req_id))
            self.monitor.flush_sent(req_id)

    # --- RPC: transaction data and high-water mark -------------------------------------------------

    def fetch_data(self, transaction_id):
        """A Deferred firing with the data of ``transaction_id`` (checksum verified; refetched up to
        ``client.maxDataFetchRetries`` times when it does not match)."""
        if self.state is PartitionState.CLOSED:
            return defer.fail(ClientClosedError("the Waltz client is closed"))
        d = defer.Deferred()
        fetch = self._fetches.get(transaction_id)
        if fetch is None:
            fetch = self._fetches[transaction_id] = _DataFetch()
            self._send_data_request(transaction_id)
        fetch.waiters.append(d)
        return d

    def _send_data_request(self, transaction_id):
        if self.rpc is not None and self.rpc.ready:
            self.rpc.send(m.TransactionDataRequest(self.next_req_id(), transaction_id))
            self._fetches[transaction_id].sent_at = self._clock.seconds()

    def high_water_mark(self):
        """A Deferred firing with the partition's current high-water mark, asked over RPC."""
        if self.state is PartitionState.CLOSED:
            return defer.fail(ClientClosedError("the Waltz client is closed"))
        d = defer.Deferred(self._forget_hwm_waiter)    # a caller's timeout cancels it: forget it then
        # Only the answer to a request sent from now on settles it: one sent earlier may have been answered
        # before a commit the caller has seen since. Callers coalesce on the next request.
        self._hwm_waiters[d] = self._hwm_asked + 1
        if self._hwm_request is None:
            self._send_hwm_request()
        return d

    def _forget_hwm_waiter(self, waiter):
        self._hwm_waiters.pop(waiter, None)
        if not self._hwm_waiters:
            self._hwm_request = None    # the next caller asks afresh (as the first caller of all did)

    def _send_hwm_request(self):
        self._hwm_sent_at = self._clock.seconds()
        if self.rpc is not None and self.rpc.ready:
            self._hwm_asked += 1
            self._hwm_request = (self.next_req_id(), self._hwm_asked)
            self.rpc.send(m.HighWaterMarkRequest(self._hwm_request[0]))

    def _hwm_answered(self, message):
        """Settle the waiters that asked before the latest request was sent; ask again for the others."""
        if self._hwm_request is None or message.req_id != self._hwm_request[0]:
            return      # the answer to a request asked again since: the latest one answers for it
        number = self._hwm_request[1]
        self._hwm_request = None
        answered = [d for d, first in self._hwm_waiters.items() if first <= number]
        for d in answered:
            del self._hwm_waiters[d]
        for d in answered:
            d.callback(message.high_water_mark)
        if self._hwm_waiters:
            self._send_hwm_request()

    def rpc_ready(self, conn):
        if conn is self.rpc:
            self._resend_rpc()

    def _misrouted(self):
        """The server at the partition's location does not serve it (yet, or any more)."""
        if self.on_misrouted is not None:
            try:
                self.on_misrouted(self.partition_id)
            except Exception:
                log.failure("partition {pid}: on_misrouted failed", pid=self.partition_id)

    def _resend_rpc(self):
        """Send again every request still unanswered (the connection or the server changed)."""
        self._cancel("rpc")
        for transaction_id in list(self._fetches):
            self._send_data_request(transaction_id)
        if self._hwm_waiters:
            self._send_hwm_request()

    def rpc_message(self, conn, message):
        if conn is not self.rpc:
            return
        if isinstance(message, m.TransactionDataResponse):
            self._data_received(message)
        elif isinstance(message, DataChecksumMismatch):
            self._data_corrupted(message)
        elif isinstance(message, m.HighWaterMarkResponse):
            self._hwm_answered(message)
        else:
            log.warn("partition {pid}: unexpected {message!r} on the RPC connection",
                     pid=self.partition_id, message=message)

    def _data_received(self, message):
        fetch = self._fetches.get(message.transaction_id)
        if fetch is None:
            return
        if not message.ok and m.is_not_served(message.error):
            fetch.misrouted += 1
            (log.info if fetch.misrouted == 1 else log.debug)(
                "partition {pid}: transaction {txn} data: {endpoint} does not serve the partition ({error}); "
                "asking again in {delay} s", pid=self.partition_id, txn=message.transaction_id,
                endpoint=self.rpc.endpoint if self.rpc is not None else None, error=message.error,
                delay=self._settings.mount_retry_interval)
            self._misrouted()
            if "rpc" not in self._timers:
                self._later("rpc", self._settings.mount_retry_interval, self._resend_rpc)
            return
        if not message.ok and self._retry_later(fetch, message):
            return
        del self._fetches[message.transaction_id]
        if message.ok:
            for d in fetch.waiters:
                d.callback(message.data)
        else:
            error = TransactionDataError("partition %d transaction %d: %s"
                                         % (self.partition_id, message.transaction_id, message.error))
            for d in fetch.waiters:
                d.errback(error)

    def _retry_later(self, fetch, message):
        """A transient failure (a storage restarting, say): ask again after a doubling delay, up to
        ``client.maxDataFetchRetries`` times, rather than fail the application's apply at once."""
        if not m.is_retry_later(message.error) or fetch.refusals >= self._settings.max_data_fetch_retries:
            return False
        fetch.refusals += 1
        delay = self._settings.retry_later_delay(fetch.refusals)
        log.info("partition {pid}: transaction {txn} data: {error}; asking again in {delay} s",
                 pid=self.partition_id, txn=message.transaction_id, error=message.error, delay=delay)
        if "rpc" not in self._timers:
            self._later("rpc", delay, self._resend_rpc)
        return True

    def _data_corrupted(self, message):
        fetch = self._fetches.get(message.transaction_id)
        if fetch is None:
            return
        fetch.bad_checksums += 1
        if fetch.bad_checksums <= self._settings.max_data_fetch_retries:
            log.warn("partition {pid}: transaction {txn} data failed its checksum; fetching again ({n})",
                     pid=self.partition_id, txn=message.transaction_id, n=fetch.bad_checksums)
            self._send_data_request(message.transaction_id)
            return
        del self._fetches[message.transaction_id]
        error = DataChecksumError("partition %d transaction %d: data failed its checksum %d times"
                                  % (self.partition_id, message.transaction_id, fetch.bad_checksums))
        for d in fetch.waiters:
            d.errback(error)

    # --- closing -------------------------------------------------------------------------------

    def close(self):
        """Stop: every queued or pending execution and every outstanding request fails with
        ClientClosedError (a pending append may still have been committed)."""
        if self.state is PartitionState.CLOSED:
            return
        self._set_state(PartitionState.CLOSED)
        for name in list(self._timers):
            self._cancel(name)
        error = ClientClosedError("the Waltz client is closed")
        self._fail_queued(error)
        with self.monitor.settling():
            for submission in self.monitor.fail_all():
                submission.failed(error)
        self._gates.clear()
        self._drop_feed()
        fetches, self._fetches = self._fetches, {}
        for fetch in fetches.values():
            for d in fetch.waiters:
                d.errback(error)
        waiters, self._hwm_waiters, self._hwm_request = list(self._hwm_waiters), {}, None
        waiters += [d for _, d in self._apply_waiters]
        self._apply_waiters = []
        for d in waiters:
            d.errback(error)

