"""A store session: recovery, then quorum writes to the replicas that recovered with it.

A :class:`StoreSession` owns one :class:`~waltz.interfaces.IReplicaSession`
per assigned replica and sees them only through that interface. It first runs
the :class:`~waltz.recovery.manager.RecoveryManager`; no write is accepted
before recovery completes. The replicas recovered at that point *joined* the
session; writes go to every joined replica and are committed when a quorum of
the *assigned* replicas has them durably.

A session never takes a replica back: a joined replica that fails, falls too
far behind or disconnects makes the session close (after the batch in flight
commits, if it reaches quorum), and the store partition starts a new session
with its own recovery. A replica that finishes recovering in the background,
after the quorum, also closes the session so the next one includes it from
the start.
"""

import enum

from twisted.internet import defer
from twisted.logger import Logger

from waltz.recovery.manager import RecoveryManager
from waltz.recovery.voting import quorum_of


class SessionClosed(Exception):
    """The store session closed; what it had not committed is settled by the next recovery."""


class SessionState(enum.Enum):
    CREATED = "created"
    RECOVERING = "recovering"
    WRITING = "writing"
    CLOSED = "closed"


class _Batch:
    """One write in flight: which joined replicas acknowledged or failed it."""

    __slots__ = ("records", "acks", "failures", "deferred")

    def __init__(self, records):
        self.records = records
        self.acks = 0
        self.failures = 0
        self.deferred = defer.Deferred()


class StoreSession:
    """One store session of one partition."""

    log = Logger()

    def __init__(self, partition_id, metadata, replicas, metadata_store, reactor, on_close=None, metrics=None,
                 max_outstanding_batches=64, recovery_retry_interval=0.5):
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
        self.recovery = RecoveryManager(partition_id, metadata, self.replicas, metadata_store, reactor,
                                        metrics, recovery_retry_interval)
        self.state = SessionState.CREATED
        self.close_reason = None
        self.low_water_mark = None
        self.joined = {}
        self._outstanding = {}
        self._close_after_batch = None

    def _enter(self, state, detail=""):
        self.log.info("partition {pid} store session {sid}: {old} -> {new}{detail}", pid=self.partition_id,
                      sid=self.session_id, old=self.state.value, new=state.value,
                      detail=" (%s)" % detail if detail else "")
        self.state = state

    @property
    def writable(self):
        return self.state is SessionState.WRITING and self._close_after_batch is None

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
        self.low_water_mark = result.high_water_mark
        for storage in result.recovered:
            replica = self.replicas[storage]
            self.joined[storage] = replica
            self._outstanding[storage] = 0
            replica.on_disconnect(self._replica_lost)
            if not replica.connected:
                self._replica_lost(replica)
        if self.state is not SessionState.CLOSED:
            self._enter(SessionState.WRITING, "low-water mark %d, joined %s"
                        % (self.low_water_mark, ", ".join(sorted(self.joined))))
        for storage, done in result.background.items():
            done.addCallbacks(self._background_recovered, lambda f: None)
        return result

    def _recovery_failed(self, failure):
        self.close("recovery failed: %s" % failure.getErrorMessage())
        return failure

    def _background_recovered(self, storage):
        if self.state is SessionState.WRITING:
            self.close("replica %s recovered after the quorum: re-forming the session to include it" % storage)

    def _replica_lost(self, replica):
        self._leave(replica.replica_id.storage, "lost its connection")

    def _leave(self, storage, why):
        """A joined replica left: close now, or after the batch in flight if it can still commit."""
        if self.state is SessionState.CLOSED:
            return
        reason = "replica %s %s" % (storage, why)
        if self._batch is not None and self._batch_can_commit():
            self._close_after_batch = reason
        else:
            self.close(reason)

    # -- writes ----------------------------------------------------------------------------------

    _batch = None

    def write(self, records) -> defer.Deferred:
        """Send a batch to every joined replica; fires when a quorum stored it durably.

        Fails with :class:`SessionClosed` when the session closes first (the
        batch's fate is then decided by the next session's recovery).
        """
        if not self.writable:
            return defer.fail(SessionClosed("session %d is not writable (%s)" % (self.session_id, self.state.value)))
        if self._batch is not None:
            raise RuntimeError("one batch at a time per store session")
        batch = self._batch = _Batch(tuple(records))
        for storage, replica in sorted(self.joined.items()):
            if self._outstanding[storage] >= self.max_outstanding_batches:
                self._leave(storage, "fell %d batches behind" % self._outstanding[storage])
                continue
            self._outstanding[storage] += 1
            d = replica.append(batch.records)
            d.addCallbacks(self._acked, self._append_failed, callbackArgs=(batch, storage),
                           errbackArgs=(batch, storage))
        return batch.deferred

    def _acked(self, _, batch, storage):
        self._outstanding[storage] -= 1
        batch.acks += 1
        if batch.acks == self.quorum and batch is self._batch:
            self._commit(batch)

    def _append_failed(self, failure, batch, storage):
        self._outstanding[storage] -= 1
        batch.failures += 1
        self.log.warn("partition {pid} session {sid}: append to {storage} failed: {reason}", pid=self.partition_id,
                      sid=self.session_id, storage=storage, reason=failure.getErrorMessage())
        self._leave(storage, "failed an append: %s" % failure.getErrorMessage())

    def _batch_can_commit(self):
        batch = self._batch
        pending = len(self.joined) - batch.acks - batch.failures
        return batch.acks + pending >= self.quorum and not batch.deferred.called

    def _commit(self, batch):
        self._batch = None
        batch.deferred.callback(batch.records[-1].transaction_id)
        if self._close_after_batch is not None:
            self.close(self._close_after_batch)

    # -- reads -----------------------------------------------------------------------------------

    def reader(self):
        """A connected joined replica to read committed records from, or ``None``."""
        for storage, replica in sorted(self.joined.items()):
            if replica.connected:
                return replica
        return None

    # -- closing ---------------------------------------------------------------------------------

    def close(self, reason):
        """Close the session; the batch in flight (if any) fails with :class:`SessionClosed`."""
        if self.state is SessionState.CLOSED:
            return
        self.close_reason = reason
        self._enter(SessionState.CLOSED, reason)
        self.recovery.stop(reason)
        for replica in self.replicas.values():
            replica.close()
        batch, self._batch = self._batch, None
        if batch is not None and not batch.deferred.called:
            batch.deferred.errback(SessionClosed("session %d closed: %s" % (self.session_id, reason)))
        if self._on_close is not None:
            self._on_close(self, reason)
