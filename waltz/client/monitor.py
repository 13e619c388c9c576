"""Tracking appends until the feed, a lock failure, a flush or a remount settles them.

* :class:`Submission`: one ``execute`` call, across all its attempts; it ends exactly
  once (committed, ignored, expired or failed), calling the context's hook and firing
  the Deferred the caller holds.
* :class:`TransactionMonitor`: the appends of one partition that were sent and are not
  settled yet, in send order, bounded by ``client.maxConcurrentTransactions``. The
  feed is in commit order and the stream connection keeps the client's own appends
  in send order, so when the client's own ReqId shows up in the feed, every older
  pending append of that partition has failed (seed 004, "Detection of Failed Append
  Requests").
* :class:`HighWaterMarkGates`: actions waiting until the client's high-water mark
  reaches a transaction id (retries after a lock failure, deferred flush completions).
"""

import heapq
import itertools
from collections import OrderedDict

from twisted.internet import defer
from twisted.logger import Logger

from waltz.client.api import ExecutionResult, Outcome

log = Logger()


class Submission:
    """One ``execute(context)`` call on ``partition_id`` until it ends."""

    def __init__(self, context, partition_id):
        self.context = context
        self.partition_id = partition_id
        #: Fires with the :class:`~waltz.client.api.ExecutionResult`; fails only with CancelledError,
        #: when the caller cancels it (see :meth:`_cancelled`).
        self.result = defer.Deferred(self._cancelled)
        self.ended = False
        #: The caller cancelled :attr:`result`: the execution is not attempted again.
        self.cancelled = False
        #: ``withdraw(submission)``, set by the partition it is submitted to: called on cancellation.
        self.withdraw = None
        self.attempts = 0
        #: After a lock failure: the transaction id the client's high-water mark must reach
        #: before the next attempt.
        self.retry_after = None
        self.expiry_call = None
        #: Its place among the partition's registrations (sends), set by TransactionMonitor.register.
        self.registration = None
        self._sent_waiters = None       # see when_sent (a list only while someone waits)

    @property
    def done(self) -> bool:
        return self.ended

    def is_expired(self, now, expiration) -> bool:
        """True when ``expiration`` seconds (None: never) have passed since the context's creation."""
        created = self.context.creation_time
        return expiration is not None and created is not None and now - created >= expiration

    def when_sent(self):
        """A Deferred firing with the ReqId of this execution's next append once it is sent, or with None
        if the execution ends first (``flush`` waits for executions not sent yet this way)."""
        d = defer.Deferred()
        if self.ended:
            d.callback(None)
        else:
            if self._sent_waiters is None:
                self._sent_waiters = []
            self._sent_waiters.append(d)
        return d

    def sent(self, req_id):
        """Its append was sent (and registered) with ``req_id``."""
        if self._sent_waiters:
            self._fire_sent_waiters(req_id)

    def _fire_sent_waiters(self, req_id):
        waiters, self._sent_waiters = self._sent_waiters, None
        for d in waiters:
            d.callback(req_id)

    def committed(self, transaction_id):
        self._end(ExecutionResult(Outcome.COMMITTED, partition_id=self.partition_id, transaction_id=transaction_id),
                  "on_completion", True)

    def ignored(self):
        self._end(ExecutionResult(Outcome.IGNORED), "on_completion", False)

    def expired(self):
        self._end(ExecutionResult(Outcome.EXPIRED), "on_expiration")

    def failed(self, exception):
        self._end(ExecutionResult(Outcome.FAILED, exception), "on_exception", exception)

    def applied(self):
        """The committed transaction was applied by this client's callbacks."""
        call_hook(self.context, "on_application")

    def lock_failed(self):
        call_hook(self.context, "on_lock_failure")

    def _cancelled(self, _):
        """The caller cancelled :attr:`result` (which then fails with CancelledError). An execution not
        sent yet is withdrawn and ends with ``on_exception(CancelledError)``; an append already sent
        cannot be taken back: the feed, a lock failure, a flush or a remount settles it as usual, and the
        context's hook says how, but it is not attempted again."""
        self.cancelled = True
        if self.withdraw is None:
            self.end_cancelled()        # not handed to a partition yet (the client is starting)
        else:
            self.withdraw(self)

    def end_cancelled(self):
        """End a cancelled execution that is not sent (any more)."""
        self._end(None, "on_exception", defer.CancelledError("execute() cancelled by its caller"))

    def _end(self, result, hook, *args):
        if self.ended:
            log.error("transaction context {context!r} ended twice ({hook})", context=self.context, hook=hook)
            return
        self.ended = True
        self.cancel_expiry()
        if getattr(self.context, "_waltz_execution", None) is self:
            self.context._waltz_execution = None     # before the hook, which may execute it again
        if self._sent_waiters:
            self._fire_sent_waiters(None)
        call_hook(self.context, hook, *args)
        if not self.cancelled:          # a cancelled one's Deferred has failed already
            self.result.callback(result)

    def cancel_expiry(self):
        if self.expiry_call is not None and self.expiry_call.active():
            self.expiry_call.cancel()
        self.expiry_call = None


def call_hook(context, name, *args):
    """Call ``context.<name>(*args)``; an exception is logged, never propagated."""
    try:
        getattr(context, name)(*args)
    except Exception:
        log.failure("{name} of transaction context {context!r} raised", name=name, context=context)


class TransactionMonitor:
    """The sent, unsettled appends of one partition, oldest first.

    Each registration is settled once: :meth:`committed`, :meth:`abort`,
    :meth:`flush` and :meth:`fail_all` remove what they settle and return the
    submissions for the caller to finish or retry.
    """

    def __init__(self, capacity, clock):
        self.capacity = capacity
        self._clock = clock
        self._pending = OrderedDict()
        self._waiters = []
        self._holding = 0             # depth of settling() blocks: waiters are told at the outermost end
        self._tell_later = False      # something settled inside such a block
        self._registrations = 0       # appends registered so far; each is sent as it is registered
        self._flushes = {}            # flushed ReqId -> registrations its first unanswered FLUSH covers
        #: Reactor time of the last registration or settlement (see ``client.longWaitThreshold``).
        self.last_progress = clock.seconds()

    def __len__(self):
        return len(self._pending)

    def __contains__(self, req_id):
        return req_id in self._pending

    @property
    def has_capacity(self) -> bool:
        return len(self._pending) < self.capacity

    @property
    def last_req_id(self):
        """The ReqId of the most recently sent pending append, or None."""
        return next(reversed(self._pending)) if self._pending else None

    def get(self, req_id):
        return self._pending.get(req_id)

    def register(self, req_id, submission):
        if req_id in self._pending:
            raise ValueError("duplicate ReqId %r" % (req_id,))
        self._pending[req_id] = submission
        self._registrations += 1
        submission.registration = self._registrations
        self.touch()

    def touch(self):
        """Record progress now (a registration, a settlement or a flush sent)."""
        self.last_progress = self._clock.seconds()

    def committed(self, req_id):
        """The feed carried ``req_id``: ``(its submission or None, older submissions that failed)``."""
        if req_id not in self._pending:
            return None, []
        failed = self._settle_through(req_id)
        return failed.pop(), failed

    def abort(self, req_id):
        """``req_id`` failed (a lock failure); the others stay. Its submission, or None."""
        submission = self._pending.pop(req_id, None)
        if submission is not None:
            self._settled()
        return submission

    def flush_sent(self, req_id):
        """A FLUSH naming ``req_id`` was sent: its response will answer every append registered (so sent)
        before it, and none registered after it."""
        # A FLUSH sent again for the same ReqId (a nudge) keeps the first one's count: the server answers
        # repeated FLUSHes once, and the first count is what any of the answers covers at least.
        self._flushes.setdefault(req_id, self._registrations)
        self.touch()

    def flush(self, req_id):
        """The FLUSH naming ``req_id`` completed and its transactions were applied: every append sent before
        that FLUSH and still pending has failed, whether or not ``req_id`` itself still is (a lock failure
        may have ended it meanwhile). Appends sent after the FLUSH are not answered by it (an ``execute``
        that returned a Deferred may send an older ReqId later). Their submissions, oldest first."""
        covered = self._flushes.pop(req_id, None)
        if covered is None:
            return []               # not a FLUSH of this mount, or one answered already
        settled = []
        while self._pending:
            oldest = next(iter(self._pending))
            if self._pending[oldest].registration > covered:
                break
            settled.append(self._pending.pop(oldest))
        if settled:
            self._settled()
        return settled

    def fail_all(self):
        """A mount completed: nothing is pending on the server any more. Every submission, oldest first."""
        failed = list(self._pending.values())
        self._pending.clear()
        self._flushes.clear()       # the new mount answers none of the earlier FLUSHes
        if failed:
            self._settled()
        return failed

    def settling(self):
        """``with monitor.settling():`` around settling appends *and* finishing their submissions: what
        :meth:`when_settled` returned fires only at the end of the block, once every result and hook of
        what it settled has run, not between them (nested blocks: at the outermost end)."""
        return self

    def __enter__(self):
        self._holding += 1
        return self

    def __exit__(self, *exc_info):
        self._holding -= 1
        if not self._holding and self._tell_later:
            self._tell_later = False
            self._tell_waiters()
        return False

    def when_settled(self, req_ids=None):
        """A Deferred firing once none of ``req_ids`` (default: all pending now) is pending."""
        waiting = set(self._pending if req_ids is None else req_ids) & set(self._pending)
        d = defer.Deferred()
        if waiting:
            self._waiters.append((waiting, d))
        else:
            d.callback(None)
        return d

    def _settle_through(self, req_id):
        settled = []
        while self._pending:
            other, submission = self._pending.popitem(last=False)
            settled.append(submission)
            if other == req_id:
                break
        self._settled()
        return settled

    def _settled(self):
        self.touch()
        if self._holding:
            self._tell_later = True   # at the end of the settling() block
        else:
            self._tell_waiters()

    def _tell_waiters(self):
        still, ready = [], []
        for waiting, d in self._waiters:
            waiting &= self._pending.keys()
            (still if waiting else ready).append((waiting, d))
        self._waiters = still
        for _, d in ready:
            d.callback(None)


class HighWaterMarkGates:
    """Actions that run once the client's high-water mark reaches a transaction id, in id order."""

    def __init__(self):
        self._heap = []
        self._order = itertools.count()

    def __len__(self):
        return len(self._heap)

    def wait(self, transaction_id, action):
        heapq.heappush(self._heap, (transaction_id, next(self._order), action))

    def release(self, high_water_mark):
        """Run (and forget) every action whose transaction id is at most ``high_water_mark``."""
        while self._heap and self._heap[0][0] <= high_water_mark:
            _, _, action = heapq.heappop(self._heap)
            action()

    def clear(self):
        self._heap = []
