"""A store session: recovery, then quorum writes to the replicas that recovered with it.

A :class:`StoreSession` owns one :class:`~waltz.interfaces.IReplicaSession`
per assigned replica and sees them only through that interface. It first runs
the :class:`~waltz.recovery.manager.RecoveryManager`; no write is accepted
before recovery completes. The replicas recovered at that point *joined* the
session; writes go to every joined replica and are committed when a quorum of
the *assigned* replicas has them durably.

A replica that finishes recovering in the background, after the quorum, joins
the running session: it is recorded in ZooKeeper as taking part in this
session, copies the committed transactions it lacks from a joined replica,
and, once it is within :data:`JOIN_HOLD_THRESHOLD` transactions, new batches
are held while the last few are copied, so it joins exactly at the committed
high-water mark (receiving the batch in flight, if any).

Each join waits for the batches in flight itself, so that several replicas
joining at once are each admitted with no batch in flight.

A session never takes a replica back: a joined replica that fails, falls too
far behind or disconnects makes the session close (after the batches in flight
commit, if each can still reach quorum from the replicas it was sent to), and
the store partition starts a new session with its own recovery.
"""

import collections
import enum
import itertools

import attr
from twisted.internet import defer
from twisted.logger import Logger

from waltz.recovery.manager import RecoveryAborted, RecoveryManager, SessionFenced, copy_records
from waltz.recovery.replica_reads import RECORDS, read_from_any
from waltz.recovery.voting import quorum_of
from waltz.zk.znodes import UNRESOLVED, ReplicaState

#: A background replica this close to the committed high-water mark makes the session hold new batches
#: while it copies the rest, so that it can join.
JOIN_HOLD_THRESHOLD = 1000
#: Longest wait between attempts to join a replica that recovered in the background (from the
#: recovery retry interval, doubling).
MAX_JOIN_RETRY_INTERVAL = 30.0


class SessionClosed(Exception):
    """The store session closed; what it had not committed is settled by the next recovery."""


class SessionState(enum.Enum):
    CREATED = "created"
    RECOVERING = "recovering"
    WRITING = "writing"
    CLOSED = "closed"


class _Batch:
    """One write in flight: which joined replicas acknowledged or failed it."""

    __slots__ = ("records", "sent", "acks", "failures", "deferred")

    def __init__(self, records):
        self.records = records
        self.sent = 0          # joined replicas it was sent to (one that fell behind is skipped)
        self.acks = 0
        self.failures = 0
        self.deferred = defer.Deferred()


class StoreSession:
    """One store session of one partition."""

    log = Logger()

    def __init__(self, partition_id, metadata, replicas, metadata_store, reactor, on_close=None, metrics=None,
                 max_outstanding_batches=64, recovery_retry_interval=0.5, departing=None):
        self.partition_id = partition_id
        self.session_id = metadata.session_id
        self.generation = metadata.generation
        self.metadata = metadata
        self.replicas = dict(replicas)
        self.quorum = quorum_of(len(self.replicas))
        self.reactor = reactor
        self.metrics = metrics
        self.max_outstanding_batches = max_outstanding_batches
        self._on_close = on_close
        self.metadata_store = metadata_store
        #: Replica sessions of the last session's members that the assignment dropped: recovery asks them for
        #: their votes; they are closed once it completes.
        self.departing = dict(departing or {})
        self.recovery = RecoveryManager(partition_id, metadata, self.replicas, metadata_store, reactor,
                                        metrics, recovery_retry_interval, departing=self.departing)
        self._join_retry_interval = recovery_retry_interval
        self._join_retries = {}    # storage -> the DelayedCall that tries its join again
        self.state = SessionState.CREATED
        self.close_reason = None
        self.low_water_mark = None
        self.high_water_mark = None
        self.joined = {}
        self._outstanding = {}
        self._close_after_batch = None
        self._batches = collections.deque()
        self._holders = 0          # joins holding new batches until they are admitted
        self._left = set()         # joined replicas that left (kept in joined until the batches in flight settle)
        self._read_failures = {}   # storage -> when it last failed a read (a counter): asked last
        self._failure_order = itertools.count()
        self._idle_waiters = []
        self._writable_listeners = []

    def _enter(self, state, detail=""):
        self.log.info("partition {pid} store session {sid}: {old} -> {new}{detail}", pid=self.partition_id,
                      sid=self.session_id, old=self.state.value, new=state.value,
                      detail=" (%s)" % detail if detail else "")
        self.state = state

    @property
    def writable(self):
        return self.state is SessionState.WRITING and self._close_after_batch is None and not self._holders

    def add_writable_listener(self, listener):
        """``listener()`` is called when the session becomes writable again after holding batches."""
        self._writable_listeners.append(listener)

    # -- recovery ---------------------------------------------------------------------------------

    def start(self) -> defer.Deferred:
        """Run recovery; fires with the :class:`RecoveryResult` once the session can write."""
        self._enter(SessionState.RECOVERING, "replicas %s" % ", ".join(sorted(self.replicas)))
        d = self.recovery.run()
        d.addCallbacks(self._recovered, self._recovery_failed)
        return d

    def _recovered(self, result):
        if self.state is SessionState.CLOSED:
            raise SessionClosed("session %d closed during recovery: %s" % (self.session_id, self.close_reason))
        self.low_water_mark = self.high_water_mark = result.high_water_mark
        self._close_departing()     # a quorum of the assigned replicas holds the mark: they serve the rest
        for storage in result.recovered:
            self._admit(storage)
        if self.state is not SessionState.CLOSED:
            self._enter(SessionState.WRITING, "low-water mark %d, joined %s"
                        % (self.low_water_mark, ", ".join(sorted(self.joined))))
        for storage, done in result.background.items():
            done.addCallbacks(self._background_recovered, lambda f: None)
        return result

    def _close_departing(self):
        self.recovery.release_departing()
        departing, self.departing = self.departing, {}
        for replica in departing.values():
            replica.close()

    def _recovery_failed(self, failure):
        self.close("recovery failed: %s" % failure.getErrorMessage())
        return failure

    def _admit(self, storage):
        replica = self.replicas[storage]
        self.joined[storage] = replica
        self._outstanding[storage] = 0
        replica.on_disconnect(self._replica_lost)
        if not replica.connected:
            self._replica_lost(replica)

    def _background_recovered(self, storage, attempt=0):
        self._join_retries.pop(storage, None)
        if self.state is SessionState.WRITING and storage not in self.joined:
            self._join(storage).addErrback(self._join_failed, storage, attempt)

    @defer.inlineCallbacks
    def _join(self, storage):
        """Bring a replica that recovered after the quorum up to the committed mark and join it."""
        replica = self.replicas[storage]
        # Bound again if its connection dropped since it recovered (a session binds only when asked to).
        yield replica.when_connected()
        yield self.metadata_store.update(self.partition_id, lambda current: self._with_member(current, replica))
        copied = yield replica.max_transaction_id()
        holding = False
        try:
            while True:
                self._check_writing()
                if not holding and self.high_water_mark - copied <= JOIN_HOLD_THRESHOLD:
                    # Each join waits for the batches in flight itself: one admitted while a batch is
                    # in flight would miss that batch's records.
                    holding = True
                    self._holders += 1
                    yield self._idle()
                    self._check_writing()
                if copied < self.high_water_mark:
                    copied = yield copy_records(self.read_records, replica, copied + 1, self.high_water_mark)
                    continue
                if holding:
                    break
            self._admit(storage)
            self.log.info("partition {pid} store session {sid}: replica {storage} joined at {hwm}",
                          pid=self.partition_id, sid=self.session_id, storage=storage, hwm=self.high_water_mark)
        finally:
            if holding:
                self._release()

    def _with_member(self, current, replica):
        """The metadata with ``replica`` recorded as taking part in this session."""
        if current.session_id != self.session_id:
            raise SessionFenced("partition %d is in session %d, not %d" % (self.partition_id, current.session_id,
                                                                            self.session_id))
        others = tuple(s for s in current.replica_states if s.replica_id != replica.replica_id)
        state = ReplicaState(replica.replica_id, self.session_id, UNRESOLVED)
        return attr.evolve(current, replica_states=others + (state,))

    def _check_writing(self):
        if self.state is not SessionState.WRITING:
            raise RecoveryAborted("session %d is %s" % (self.session_id, self.state.value))

    def _idle(self):
        """Fires when no batch is in flight."""
        if not self._batches:
            return defer.succeed(None)
        waiter = defer.Deferred()
        self._idle_waiters.append(waiter)
        return waiter

    def _release(self):
        """One join stopped holding new batches; the last one makes the session writable again."""
        self._holders -= 1
        if not self._holders:
            for listener in list(self._writable_listeners):
                listener()

    def _join_failed(self, failure, storage, attempt):
        if failure.check(SessionFenced):
            self.close("fenced while replica %s joined: %s" % (storage, failure.getErrorMessage()))
        elif self.state is SessionState.WRITING:
            # Tried again until it joins or the session ends: a replica left out until the next session
            # (the checkpoint, or a failure; an idle partition may see neither) leaves it one failure
            # from losing its quorum, while recorded as a member of this session.
            delay = min(MAX_JOIN_RETRY_INTERVAL, self._join_retry_interval * 2 ** attempt)
            self.log.warn("partition {pid} store session {sid}: replica {storage} could not join: {reason}; "
                          "trying again in {delay} s", pid=self.partition_id, sid=self.session_id,
                          storage=storage, reason=failure.getErrorMessage(), delay=delay)
            self._join_retries[storage] = self.reactor.callLater(delay, self._background_recovered, storage,
                                                                 attempt + 1)

    def _replica_lost(self, replica):
        self._leave(replica.replica_id.storage, "lost its connection")

    def _leave(self, storage, why):
        """A joined replica left: close now, or after the batches in flight if they can all still commit."""
        if self.state is SessionState.CLOSED:
            return
        reason = "replica %s %s" % (storage, why)
        self._left.add(storage)     # it may lack committed batches: no more reads from it
        if self._batches and all(self._can_commit(batch) for batch in self._batches):
            self._close_after_batch = reason
        else:
            self.close(reason)

    # -- writes ----------------------------------------------------------------------------------

    @property
    def batches_in_flight(self) -> int:
        return len(self._batches)

    def write(self, records) -> defer.Deferred:
        """Send a batch to every joined replica; fires when a quorum stored it durably.

        Several batches may be in flight; they commit in the order they were
        written (each replica acknowledges in order on its connection, so a
        quorum for a batch implies one for every earlier batch). Fails with
        :class:`SessionClosed` when the session closes first (the batch's fate
        is then decided by the next session's recovery).
        """
        if not self.writable:
            return defer.fail(SessionClosed("session %d is not writable (%s)" % (self.session_id, self.state.value)))
        batch = _Batch(tuple(records))
        self._batches.append(batch)
        if self.metrics is not None:
            self.metrics.batch_size.observe(len(batch.records), self.partition_id)
        receivers, behind = [], []
        for storage, replica in sorted(self.joined.items()):
            if self._outstanding[storage] >= self.max_outstanding_batches:
                behind.append(storage)
            else:
                receivers.append((storage, replica))
        batch.sent = len(receivers)
        for storage, replica in receivers:
            self._outstanding[storage] += 1
            d = replica.append(batch.records)
            d.addCallbacks(self._acked, self._append_failed, callbackArgs=(batch, storage),
                           errbackArgs=(batch, storage))
        for storage in behind:     # after sending, so that the batch's own chances are known
            self._leave(storage, "fell %d batches behind" % self._outstanding[storage])
        return batch.deferred

    def _acked(self, _, batch, storage):
        self._outstanding[storage] -= 1
        batch.acks += 1
        while self._batches and self._batches[0].acks >= self.quorum and self.state is not SessionState.CLOSED:
            self._commit(self._batches.popleft())

    def _append_failed(self, failure, batch, storage):
        self._outstanding[storage] -= 1
        batch.failures += 1
        if storage not in self._left:
            # Once: a lost connection fails every batch in flight to the replica.
            self.log.warn("partition {pid} session {sid}: append to {storage} failed: {reason}",
                          pid=self.partition_id, sid=self.session_id, storage=storage,
                          reason=failure.getErrorMessage())
        self._leave(storage, "failed an append: %s" % failure.getErrorMessage())   # may close the session now

    def _can_commit(self, batch):
        pending = batch.sent - batch.acks - batch.failures
        return batch.acks + pending >= self.quorum and not batch.deferred.called

    def _commit(self, batch):
        self.high_water_mark = batch.records[-1].transaction_id
        batch.deferred.callback(self.high_water_mark)
        if self._batches:
            return
        if self._close_after_batch is not None:
            self.close(self._close_after_batch)
        waiters, self._idle_waiters = self._idle_waiters, []
        for waiter in waiters:
            waiter.callback(None)

    # -- reads -----------------------------------------------------------------------------------

    def readers(self) -> list:
        """The replicas to read committed records from, in the order to ask them: the connected joined
        replicas that have not left, those that failed a read last (in the order they failed)."""
        usable = [(self._read_failures.get(storage, -1), storage, replica)
                  for storage, replica in self.joined.items() if replica.connected and storage not in self._left]
        return [replica for _, _, replica in sorted(usable, key=lambda entry: entry[:2])]

    def read(self, what, first, count) -> defer.Deferred:
        """Committed records (``what`` is :data:`~waltz.recovery.replica_reads.RECORDS` or ``HEADERS``)
        from ``first`` on, at most ``count``, from the first reader that serves them."""
        return read_from_any(self.readers(), what, first, count, self._read_failed)

    def read_records(self, first, count) -> defer.Deferred:
        return self.read(RECORDS, first, count)

    def _read_failed(self, replica, failure):
        """A replica failed a read: logged, and asked last from now on in this session."""
        storage = replica.replica_id.storage
        self._read_failures[storage] = next(self._failure_order)
        if self.metrics is not None:
            self.metrics.read_failure(self.partition_id, storage)
        self.log.warn("partition {pid} store session {sid}: read from {storage} failed: {reason}; asking the "
                      "next replica", pid=self.partition_id, sid=self.session_id, storage=storage,
                      reason=failure.getErrorMessage())

    # -- closing ---------------------------------------------------------------------------------

    def close(self, reason):
        """Close the session; the batch in flight (if any) fails with :class:`SessionClosed`."""
        if self.state is SessionState.CLOSED:
            return
        self.close_reason = reason
        self._enter(SessionState.CLOSED, reason)
        self.recovery.stop(reason)
        retries, self._join_retries = self._join_retries, {}
        for call in retries.values():
            if call.active():
                call.cancel()
        for replica in self.replicas.values():
            replica.close()
        self._close_departing()
        batches, self._batches = self._batches, collections.deque()
        for batch in batches:
            if not batch.deferred.called:
                batch.deferred.errback(SessionClosed("session %d closed: %s" % (self.session_id, reason)))
        waiters, self._idle_waiters = self._idle_waiters, []
        for waiter in waiters:
            waiter.errback(SessionClosed("session %d closed: %s" % (self.session_id, reason)))
        if self._on_close is not None:
            self._on_close(self, reason)
