"""The recovery of a new store session, as a Deferred-chained state machine (seed 000).

Each replica is recovered by a :class:`ReplicaRecovery` whose steps are
chained Deferreds and whose state changes only through :meth:`_enter`
(logged, counted in metrics, visible in :attr:`state`):

``WAITING_FOR_CONNECTION`` → ``READING_SESSION_INFO`` → (``TRUNCATING_INCONSISTENT``
| ``TRUNCATING_TO_CLOSING_HWM``) → ``VOTED`` [⇄ ``RAISING_VOTE``] → [the partition resolves] →
(``TRUNCATING_DIRTY`` | ``CATCHING_UP``) → ``SETTING_LOW_WATER_MARK`` → ``RECOVERED``.

* A replica whose storage disagrees with its replica state in ZooKeeper (the
  storage's last session is not the one ZooKeeper recorded, e.g. restored from
  a stale snapshot, or a new replica) is truncated to the storage's own local
  low-water mark: only what it had when its last session started is trusted.
* A replica whose closing high-water mark was already resolved by an earlier
  recovery is truncated to it.
* The replicas of the *electorate* then vote with their max transaction id.
  The electorate is the set of replicas that took part in the last session
  that could write (their replica state is unresolved), whether or not they
  are still assigned: only they can hold that session's committed writes, and
  its quorum was a majority of at least them. A replica new to the partition,
  or one resolved at an earlier closing mark, does not vote; it is brought to
  the resolved mark like the others. (Counting the votes over the *new*
  assignment instead would let added, empty replicas outvote the ones that
  hold acknowledged transactions, and truncate them.) A partition that never
  had a session has no electorate; then every assigned replica votes. The
  partition's :class:`RecoveryManager` re-evaluates the vote
  (:mod:`waltz.recovery.voting`) whenever a vote arrives and stays
  ``UNDECIDABLE`` while missing votes could change the outcome. Members the
  new assignment dropped (*departing* voters) are asked too, while their
  storage still holds the partition: they vote, and may be copied from, but
  are never written to beyond what voting needs (being made consistent,
  raising a vote) and never join the new session; the completed recovery
  lets them go. Meanwhile the voters behind the highest
  vote copy up to it from a voter holding it (``RAISING_VOTE``) and vote
  again: once enough of them hold it, it is decided without the missing
  replicas (seed 000: it becomes decidable when a replica catches up).
* Once resolved at R, each replica drops anything after R, copies what it lacks
  up to R from a replica that holds it (batches of 500), and records R as its
  low-water mark for the new session.

Recovery completes when a quorum of the assigned replicas is recovered: the
manager then writes the partition metadata (clean replicas join the new
session; replicas still unresolved get the resolved closing high-water mark)
and fires :meth:`RecoveryManager.run`'s Deferred with a :class:`RecoveryResult`.
The other replicas go on recovering in the background; their Deferreds are in
the result. A replica that loses its connection during recovery starts its
steps again when it is back (its vote, a fact about durable data, stands).
"""

import enum

import attr
from twisted.internet import defer
from twisted.logger import Logger

from waltz.recovery.replica_reads import RECORDS, read_from_any
from waltz.recovery.voting import quorum_of, resolve_high_water_mark
from waltz.zk.znodes import UNRESOLVED, ReplicaState

#: Records copied per request while a replica catches up (the original copies 20; larger batches let a
#: replica that returns under load catch up with a busy writer).
CATCH_UP_BATCH_SIZE = 500


class ReplicaRecoveryState(enum.Enum):
    WAITING_FOR_CONNECTION = "waiting-for-connection"
    READING_SESSION_INFO = "reading-session-info"
    TRUNCATING_INCONSISTENT = "truncating-inconsistent"
    TRUNCATING_TO_CLOSING_HWM = "truncating-to-closing-hwm"
    VOTED = "voted"
    RAISING_VOTE = "raising-vote"
    TRUNCATING_DIRTY = "truncating-dirty"
    CATCHING_UP = "catching-up"
    SETTING_LOW_WATER_MARK = "setting-low-water-mark"
    RECOVERED = "recovered"
    #: A departing voter (no longer assigned) whose part ended with the resolution of the vote.
    RELEASED = "released"
    ABANDONED = "abandoned"


class PartitionRecoveryState(enum.Enum):
    VOTING = "voting"
    UNDECIDABLE = "undecidable"
    RESOLVED = "resolved"
    UPDATING_METADATA = "updating-metadata"
    COMPLETE = "complete"
    FAILED = "failed"


class RecoveryAborted(Exception):
    """Recovery stopped: the session was closed, or another session took the partition over."""


class RecoveryStepFailed(Exception):
    """A replica's recovery step did not leave the replica as it should; the step is tried again."""


class SessionFenced(RecoveryAborted):
    """The partition metadata names a newer store session than the one recovering."""


@attr.s(frozen=True, slots=True, auto_attribs=True)
class RecoveryResult:
    """What a completed recovery established.

    ``high_water_mark`` is the resolved closing high-water mark (the new
    session starts writing after it); ``recovered`` the storages recovered
    when the quorum was reached; ``background`` maps the other storages to
    Deferreds that fire when they finish recovering (or fail).
    """

    high_water_mark: int
    recovered: frozenset
    background: dict


class ReplicaRecovery:
    """Recovers one replica; each step is a Deferred chained to the next."""

    log = Logger()

    def __init__(self, manager, replica, departing=False):
        self.manager = manager
        self.replica = replica
        self.storage = replica.replica_id.storage
        #: A member of the last session that the new assignment dropped: it only votes (and raises its vote),
        #: and is released once the vote is resolved.
        self.departing = departing
        self.state = None
        self.vote = None
        #: True when the storage forgot the session ZooKeeper records it in (its data was wiped, or
        #: restored from an older copy): it must not vote (see :meth:`_make_consistent`).
        self.abstains = False
        self.max_transaction_id = None
        self.done = defer.Deferred()
        #: True once a step before the vote failed (the storage refuses, or the connection dropped): the vote
        #: is then not counted on as coming (see RecoveryManager._votes_still_coming).
        self.failed_before_voting = False
        self._raising = False       # a copy raising the vote is running (see raise_vote)
        self._raised = False        # a copy raising the vote ran: max_transaction_id may be stale
        self._raise_waiters = []    # Deferreds fired when the copy raising the vote ends
        self._retry = None          # the DelayedCall of the next attempt after a failed step
        self._let_go = False        # a departing voter released by the completed recovery (see release)

    def _enter(self, state):
        previous, self.state = self.state, state
        self.manager.transition(self, previous, state)

    def start(self):
        self._attempt()
        return self.done

    def _attempt(self):
        if self.manager.stopped:
            return self._abandon(RecoveryAborted("recovery of session %d stopped" % self.manager.session_id))
        self._enter(ReplicaRecoveryState.WAITING_FOR_CONNECTION)
        d = self.replica.when_connected()
        steps = (self._read_session_info, self._make_consistent, self._cast_vote, self._await_resolution)
        if not self.departing:
            steps += (self._settle_at, self._set_low_water_mark)
        for step in steps:
            d.addCallback(self._unless_stopped, step)
        d.addCallbacks(self._released if self.departing else self._recovered, self._step_failed)

    def _unless_stopped(self, result, step):
        if self.manager.stopped or self._let_go:
            raise RecoveryAborted("recovery of session %d stopped" % self.manager.session_id)
        return step(result)

    def _read_session_info(self, _):
        self._enter(ReplicaRecoveryState.READING_SESSION_INFO)
        return defer.gatherResults([self.replica.last_session_info(), self.replica.max_transaction_id()],
                                   consumeErrors=True).addErrback(_first_error)

    def _make_consistent(self, results):
        (last_session_id, _lwm, local_lwm), max_id = results
        self.max_transaction_id = max_id
        state = self.manager.metadata.replica_state(self.replica.replica_id)
        if state is None or state.session_id != last_session_id:
            # ZooKeeper and the storage disagree: trust only what the storage had when its last session started.
            if state is not None and last_session_id < state.session_id:
                # A storage records a session (durably, with its low-water mark) before ZooKeeper records it
                # as a member: one that does not remember it lost what it held. Its vote would count records
                # it no longer has as never written, and could truncate acknowledged transactions from the
                # others (seed 001, "Handling Snapshot or Backup": such a replica is caught up, not asked).
                self.abstains = True
                self.log.error(
                    "partition {pid}: replica {storage} reports last session {last} but ZooKeeper records it in "
                    "session {recorded}: its data was lost or restored from an older copy; it does not vote and "
                    "will be caught up", pid=self.manager.partition_id, storage=self.storage, last=last_session_id,
                    recorded=state.session_id)
            self._enter(ReplicaRecoveryState.TRUNCATING_INCONSISTENT)
            return self._truncate(local_lwm)
        if state.is_resolved:
            self._enter(ReplicaRecoveryState.TRUNCATING_TO_CLOSING_HWM)
            return self._truncate(state.closing_high_water_mark)
        return None

    def _truncate(self, transaction_id):
        if self.max_transaction_id <= transaction_id:
            return None
        d = self.replica.truncate(transaction_id)
        d.addCallback(self._set_max)
        return d

    def _await_resolution(self, _):
        return self.manager.when_resolved().addCallback(self._after_raising)

    # -- raising the vote while the partition is undecidable ---------------------------------------

    @property
    def raising(self) -> bool:
        return self._raising

    def raise_vote(self, mark, read):
        """Copy the records after this replica's vote up to ``mark`` (``read(first, count)`` reads them from
        the voters holding them), then vote ``mark``. Seed 000: an undecidable vote becomes decidable when a
        replica behind catches up with one ahead. The members of the last session hold prefixes of one
        sequence of records, so the copy only gives this replica what it would have held had it received more
        of that session's batches. Its new vote can commit transactions whose fate nobody was told; it cannot
        lower the outcome below what a quorum held."""
        self._raising = self._raised = True
        self._enter(ReplicaRecoveryState.RAISING_VOTE)
        # From what it holds now: an earlier raise that failed half-way may have copied some batches.
        d = self.replica.max_transaction_id()
        d.addCallback(lambda held: copy_records(read, self.replica, held + 1, mark))
        d.addCallbacks(self._vote_raised, self._raise_failed)
        d.addBoth(self._raise_ended)

    def _vote_raised(self, copied):
        self.max_transaction_id = max(self.max_transaction_id, copied)
        self._raise_done()
        if self.manager.high_water_mark is None and not self.manager.stopped:
            self.log.info("partition {pid}: replica {storage} copied up to {mark} and votes it",
                          pid=self.manager.partition_id, storage=self.storage, mark=copied)
            self.vote = copied
            self.manager.voted(self)

    def _raise_failed(self, failure):
        self._raise_done()
        self.manager.raise_failed(self, failure)

    def _raise_done(self):
        if self.state is ReplicaRecoveryState.RAISING_VOTE:   # (unless its own steps moved on meanwhile)
            self._enter(ReplicaRecoveryState.VOTED)

    def _raise_ended(self, _):
        self._raising = False
        waiters, self._raise_waiters = self._raise_waiters, []
        for waiter in waiters:
            waiter.callback(None)

    def _after_raising(self, high_water_mark):
        """The resolved mark, once no copy raising the vote runs; what the replica holds is read again if one
        ran (a copy that failed half-way leaves more than ``max_transaction_id`` says)."""
        if not self._raised:
            return high_water_mark
        if self._raising:
            waiter = defer.Deferred()
            self._raise_waiters.append(waiter)
        else:
            waiter = defer.succeed(None)
        waiter.addCallback(lambda _: self.replica.max_transaction_id())
        waiter.addCallback(self._set_max)
        return waiter.addCallback(lambda _: high_water_mark)

    def _set_max(self, max_id):
        self.max_transaction_id = max_id

    def _cast_vote(self, _):
        self._enter(ReplicaRecoveryState.VOTED)
        if self.vote is None and not self.abstains and self.storage in self.manager.electorate:
            self.vote = self.max_transaction_id
            self.manager.voted(self)

    def _settle_at(self, high_water_mark):
        if self.max_transaction_id > high_water_mark:
            self._enter(ReplicaRecoveryState.TRUNCATING_DIRTY)
            return self._truncate(high_water_mark).addCallback(self._truncated_dirty, high_water_mark)
        if self.max_transaction_id < high_water_mark:
            self._enter(ReplicaRecoveryState.CATCHING_UP)
            return self._catch_up(high_water_mark)
        return None

    def _truncated_dirty(self, _, high_water_mark):
        """A storage that kept less than asked (it found damage) is caught up like any replica behind."""
        if self.max_transaction_id > high_water_mark:
            raise RecoveryStepFailed("storage %s still ends at %d after truncation to %d"
                                     % (self.storage, self.max_transaction_id, high_water_mark))
        return self._settle_at(high_water_mark)

    def _catch_up(self, high_water_mark):
        d = copy_records(lambda first, count: self.manager.read_for(self, first, count), self.replica,
                         self.max_transaction_id + 1, high_water_mark)
        return d.addCallback(self._set_max)

    def _set_low_water_mark(self, _):
        self._enter(ReplicaRecoveryState.SETTING_LOW_WATER_MARK)
        return self.replica.set_low_water_mark(self.manager.high_water_mark)

    def _recovered(self, _):
        if self.manager.stopped:
            return self._abandon(RecoveryAborted("recovery of session %d stopped" % self.manager.session_id))
        self._enter(ReplicaRecoveryState.RECOVERED)
        self.manager.replica_recovered(self)
        self.done.callback(self.storage)

    def _released(self, _):
        """A departing voter's part ends with the resolution: the new session neither holds nor writes it."""
        if self.manager.stopped:
            return self._abandon(RecoveryAborted("recovery of session %d stopped" % self.manager.session_id))
        self.release()

    def release(self):
        """Let a departing voter go, whatever it is doing: the vote was resolved (with its vote, or without
        it once the recovery completed, when its session closes). A step still running ends quietly, and no
        attempt follows: a voter that never answered would otherwise be retried, logged and checked against
        ZooKeeper every retry interval for as long as the new session lasts."""
        self._let_go = True
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        if not self.done.called:
            self._enter(ReplicaRecoveryState.RELEASED)
            self.done.callback(self.storage)

    def _step_failed(self, failure):
        if self._let_go:
            return None             # released meanwhile (see release): its steps no longer matter
        if failure.check(RecoveryAborted) or self.manager.stopped:
            return self._abandon(failure)
        if self.vote is None:
            self.failed_before_voting = True
        self.log.info("recovery of partition {pid} on {storage} interrupted in {state}: {reason}; will retry",
                      pid=self.manager.partition_id, storage=self.storage, state=self.state.value,
                      reason=failure.getErrorMessage())
        self._retry = self.manager.reactor.callLater(self.manager.retry_interval, self._retry_now)
        self.manager.check_fenced()

    def _retry_now(self):
        self._retry = None
        self._attempt()

    def stop(self, reason):
        """The recovery stopped: a pending retry is cancelled and the replica abandoned now (the steps that
        are running notice at their next step)."""
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
            self._abandon(reason)

    def _abandon(self, reason):
        self._enter(ReplicaRecoveryState.ABANDONED)
        if not self.done.called:
            self.done.errback(reason)
            self.done.addErrback(lambda f: None)


class RecoveryManager:
    """Runs the recovery of one new store session over its replica sessions.

    ``metadata`` is the partition metadata as the session was created
    (``session_id`` is the new session's); ``replicas`` maps storage connect
    strings to :class:`~waltz.interfaces.IReplicaSession`; ``metadata_store``
    is an :class:`~waltz.interfaces.IPartitionMetadataStore`. ``departing``
    maps the electorate's members that are no longer assigned to replica
    sessions of theirs (see :func:`departing_voters`): they are asked for their
    votes, nothing else.
    """

    log = Logger()

    def __init__(self, partition_id, metadata, replicas, metadata_store, reactor, metrics=None,
                 retry_interval=0.5, departing=None):
        self.partition_id = partition_id
        self.metadata = metadata
        self.session_id = metadata.session_id
        self.replicas = dict(replicas)
        self.departing = dict(departing or {})
        if set(self.departing) & set(self.replicas):
            raise ValueError("departing voters %s are assigned" % sorted(set(self.departing) & set(self.replicas)))
        self.metadata_store = metadata_store
        self.reactor = reactor
        self.metrics = metrics
        self.retry_interval = retry_interval
        self.quorum = quorum_of(len(self.replicas))
        #: The storages whose votes decide the closing high-water mark (see the module docstring).
        self.electorate = electorate_of(metadata, self.replicas)
        self.state = None
        self.stopped = False
        self.high_water_mark = None
        self._resolution_waiters = []
        self.recoveries = {storage: ReplicaRecovery(self, replica) for storage, replica in sorted(self.replicas.items())}
        self.recoveries.update((storage, ReplicaRecovery(self, replica, departing=True))
                               for storage, replica in sorted(self.departing.items())
                               if storage in self.electorate)
        self._recovered = set()
        self._complete = defer.Deferred()
        self._usher_waiters = []
        self._usher_timer = None
        self._raise_timer = None
        self._rebinding = set()     # storages of voters waiting for their connection to bind again
        self._fence_check = None    # the metadata read of check_fenced, while it runs

    # -- states -------------------------------------------------------------------------------

    def _enter(self, state, reason=""):
        previous, self.state = self.state, state
        self.log.info("partition {pid} session {sid} recovery: {previous} -> {state}{reason}",
                      pid=self.partition_id, sid=self.session_id,
                      previous=previous.value if previous else "start", state=state.value,
                      reason=" (%s)" % reason if reason else "")
        if self.metrics is not None:
            self.metrics.recovery_transition(self.partition_id, state.value)

    def transition(self, recovery, previous, state):
        """Called by a replica's recovery on each state change."""
        self.log.debug("partition {pid} session {sid} replica {storage}: {previous} -> {state}",
                       pid=self.partition_id, sid=self.session_id, storage=recovery.storage,
                       previous=previous.value if previous else "start", state=state.value)
        if self.metrics is not None:
            self.metrics.replica_transition(self.partition_id, state.value)

    def replica_states(self):
        """Storage -> current state name, for health pages and tests."""
        return {storage: r.state.value for storage, r in self.recoveries.items()}

    # -- running ------------------------------------------------------------------------------

    def run(self) -> defer.Deferred:
        """Start every replica's recovery; fires with a :class:`RecoveryResult` at quorum."""
        if self.stopped:
            return defer.fail(RecoveryAborted("recovery of partition %d session %d stopped before it ran"
                                              % (self.partition_id, self.session_id)))
        self._enter(PartitionRecoveryState.VOTING)
        for recovery in self.recoveries.values():
            recovery.start()
        return self._complete

    def stop(self, reason="session closed", error=RecoveryAborted):
        """Abandon recovery (the session closed); replicas stop at their next step. The recovery fails with
        ``error`` (a :class:`RecoveryAborted`)."""
        if self.stopped:
            return
        self.stopped = True
        self._cancel_usher_timer()
        self._cancel_raise_timer()
        failure = error("recovery of partition %d session %d stopped: %s"
                        % (self.partition_id, self.session_id, reason))
        waiters = self._usher_waiters + self._resolution_waiters
        self._usher_waiters, self._resolution_waiters = [], []
        for waiter in waiters:
            waiter.errback(failure)
        for recovery in self.recoveries.values():
            recovery.stop(failure)
        self._fail(failure)

    def check_fenced(self):
        """A replica's step failed: read the partition metadata (one read at a time) and stop with
        :class:`SessionFenced` if it names a newer session.

        Storages refuse a session once a newer one has reached them (a server that took the partition
        over). Nothing else in recovery would notice before its metadata write, which the refused steps
        never reach: the replicas would retry forever and the appends queued on the session never end.
        """
        if self.stopped or self._fence_check is not None:
            return
        self._fence_check = d = defer.maybeDeferred(self.metadata_store.read, self.partition_id)
        d.addCallbacks(self._fence_checked, self._fence_check_failed)

    def _fence_checked(self, current):
        self._fence_check = None
        if current.session_id > self.session_id and not self.stopped:
            self.log.warn("partition {pid}: session {newer} took the partition over from recovering session "
                          "{sid}; recovery stops", pid=self.partition_id, newer=current.session_id,
                          sid=self.session_id)
            self.stop("partition %d is in session %d" % (self.partition_id, current.session_id), SessionFenced)

    def _fence_check_failed(self, failure):
        self._fence_check = None    # (ZooKeeper unreachable: the next failed step checks again)
        self.log.info("partition {pid}: could not read the metadata to check session {sid} is current: {reason}",
                      pid=self.partition_id, sid=self.session_id, reason=failure.getErrorMessage())

    def _fail(self, failure):
        if not self._complete.called:
            ran = self.state is not None
            if ran:      # (one that never ran has no state to leave: no transition)
                self._enter(PartitionRecoveryState.FAILED, str(failure))
            self._complete.errback(failure)
            if not ran:
                self._complete.addErrback(lambda _: None)   # nobody called run(): nobody listens

    def voted(self, recovery):
        """A replica voted: decide the closing high-water mark if it is decidable now."""
        if self.high_water_mark is not None:
            return
        votes = [r.vote for r in self.recoveries.values() if r.vote is not None]
        outcome = resolve_high_water_mark(votes, len(self.electorate))
        if not outcome.decided:
            if self.state is not PartitionRecoveryState.UNDECIDABLE or len(votes) == 1:
                self._enter(PartitionRecoveryState.UNDECIDABLE, outcome.reason)
            self._raise_lagging_votes()
            return
        self._cancel_raise_timer()
        self.high_water_mark = outcome.high_water_mark
        self._enter(PartitionRecoveryState.RESOLVED, outcome.reason)
        waiters, self._resolution_waiters = self._resolution_waiters, []
        for waiter in waiters:
            waiter.callback(self.high_water_mark)

    def _raise_lagging_votes(self):
        """While the vote is undecidable and no vote can still come from a connected replica, the connected
        voters behind the highest vote copy up to it from the voters holding it
        (:meth:`ReplicaRecovery.raise_vote`), so that it may become decidable without the missing replicas.
        Checked at each vote, and every retry interval until resolved (a failed copy is tried again then)."""
        self._cancel_raise_timer()
        if self.stopped or self.high_water_mark is not None:
            return
        self._rebind_voters()
        if not self._votes_still_coming():
            voters = [r for r in self.recoveries.values() if r.vote is not None]
            top = max(r.vote for r in voters)
            for recovery in voters:
                if self.high_water_mark is not None or self.stopped:
                    break       # the raise just started decided it (replicas that answer at once)
                if recovery.vote < top and not recovery.raising and recovery.replica.connected:
                    self.log.info("partition {pid}: undecidable; replica {storage} copies {first}..{top} from a "
                                  "voter holding them", pid=self.partition_id, storage=recovery.storage,
                                  first=recovery.vote + 1, top=top)
                    recovery.raise_vote(top, lambda first, count, recovery=recovery, top=top:
                                        self._read_from_voters(recovery, top, first, count))
        if self.high_water_mark is None and not self.stopped and self._raise_timer is None:
            self._raise_timer = self.reactor.callLater(self.retry_interval, self._raise_lagging_votes)

    def _votes_still_coming(self) -> bool:
        """Whether a connected member of the electorate may still vote (it is still being read, and no step
        of it has failed: a storage that refuses every request stays connected)."""
        return any(r.vote is None and not r.abstains and not r.failed_before_voting and r.replica.connected
                   and r.storage in self.electorate for r in self.recoveries.values())

    def _rebind_voters(self):
        """Voters whose connection dropped bind to it again once it is open. Their votes stand, and raising
        votes and catching up read from them, but a replica session binds only when asked to: one whose
        recovery waits for the resolution (or has ended) would otherwise stay unusable for the session."""
        for recovery in self.recoveries.values():
            storage = recovery.storage
            if recovery.vote is not None and not recovery.replica.connected and storage not in self._rebinding:
                self._rebinding.add(storage)
                recovery.replica.when_connected().addBoth(self._rebound, storage)

    def _rebound(self, _, storage):
        self._rebinding.discard(storage)    # bound, or the session closed (nothing to do then)

    def _read_from_voters(self, recovery, mark, first, count):
        holders = [other.replica for other in self._voters_holding(mark, recovery)]
        return read_from_any(holders, RECORDS, first, count, self._usher_failed)

    def release_departing(self):
        """The recovery completed (a quorum of the assigned replicas holds the mark): every departing voter is
        let go, voted or not (:meth:`ReplicaRecovery.release`); their sessions close."""
        for other in self.recoveries.values():
            if other.departing:
                other.release()

    def _voters_holding(self, mark, recovery):
        """The recoveries other than ``recovery`` of connected replicas that voted ``mark`` or more."""
        return [other for other in self.recoveries.values()
                if other is not recovery and other.replica.connected and other.vote is not None
                and other.vote >= mark]

    def raise_failed(self, recovery, failure):
        """A copy raising a vote failed; the next check (every retry interval) tries again."""
        if not self.stopped and self.high_water_mark is None:
            self.log.info("partition {pid}: replica {storage} could not copy to raise its vote: {reason}; will "
                          "retry", pid=self.partition_id, storage=recovery.storage, reason=failure.getErrorMessage())

    def _cancel_raise_timer(self):
        timer, self._raise_timer = self._raise_timer, None
        if timer is not None and timer.active():
            timer.cancel()

    def when_resolved(self) -> defer.Deferred:
        """Fires with the resolved closing high-water mark (a new Deferred for each caller)."""
        if self.high_water_mark is not None:
            return defer.succeed(self.high_water_mark)
        waiter = defer.Deferred()
        self._resolution_waiters.append(waiter)
        return waiter

    def ushers_for(self, recovery, first) -> defer.Deferred:
        """Fires with the connected replicas holding the records from ``first`` up to the resolved mark
        (all of them, to copy from in turn), waiting while there are none; fails with
        :class:`RecoveryAborted` once recovery stopped."""
        if self.stopped:
            return defer.fail(RecoveryAborted("recovery of partition %d session %d stopped"
                                              % (self.partition_id, self.session_id)))
        self._rebind_voters()
        # Voters holding the mark, and the replicas recovered at it: once the recovery completes, the voters
        # that decided it may all be departing ones, let go since, and only the recovered replicas hold it.
        holders = self._voters_holding(self.high_water_mark, recovery)
        holders += [self.recoveries[storage] for storage in sorted(self._recovered)
                    if storage != recovery.storage and self.recoveries[storage] not in holders
                    and self.recoveries[storage].replica.connected]
        ushers = [other.replica for other in holders
                  if other.max_transaction_id is not None and other.max_transaction_id >= first]
        if ushers:
            return defer.succeed(ushers)
        waiter = defer.Deferred()
        self._usher_waiters.append(waiter)
        # Re-check shortly: a replica holding the records may reconnect. One timer serves every waiter
        # (a timer per waiter, each waking all of them, would double the timers at every interval).
        if self._usher_timer is None:
            self._usher_timer = self.reactor.callLater(self.retry_interval, self._offer_ushers)
        return waiter.addCallback(lambda _: self.ushers_for(recovery, first))

    def read_for(self, recovery, first, count) -> defer.Deferred:
        """Records ``first``.. (at most ``count``) for ``recovery`` to copy, from the first usher that
        serves them (a usher failing the read is logged and the next one asked)."""
        d = self.ushers_for(recovery, first)
        return d.addCallback(read_from_any, RECORDS, first, count, self._usher_failed)

    def _usher_failed(self, replica, failure):
        if self.metrics is not None:
            self.metrics.read_failure(self.partition_id, replica.replica_id.storage)
        self.log.warn("partition {pid}: reading records to copy from {storage} failed: {reason}",
                      pid=self.partition_id, storage=replica.replica_id.storage, reason=failure.getErrorMessage())

    def _offer_ushers(self):
        self._cancel_usher_timer()
        waiters, self._usher_waiters = self._usher_waiters, []
        for waiter in waiters:
            waiter.callback(None)

    def _cancel_usher_timer(self):
        timer, self._usher_timer = self._usher_timer, None
        if timer is not None and timer.active():
            timer.cancel()

    def replica_recovered(self, recovery):
        if self.stopped:
            return
        self._recovered.add(recovery.storage)
        self._offer_ushers()
        if len(self._recovered) == self.quorum and not self._complete.called:
            self._update_metadata()

    @defer.inlineCallbacks
    def _update_metadata(self):
        self._enter(PartitionRecoveryState.UPDATING_METADATA)
        written = []

        def change(current):
            # Every replica recovered by the time of this write joins; later ones recover in the background.
            recovered = frozenset(self._recovered)
            written.append(recovered)
            return self._new_metadata(current, recovered)
        try:
            yield self.metadata_store.update(self.partition_id, change)
        except Exception as exc:
            self.stop("metadata update failed: %s" % (str(exc) or type(exc).__name__))  # kazoo's are often bare
            return
        if self._complete.called:
            return
        recovered = written[-1]
        self._enter(PartitionRecoveryState.COMPLETE, "high-water mark %d, recovered %s"
                    % (self.high_water_mark, ", ".join(sorted(recovered))))
        background = {storage: r.done for storage, r in self.recoveries.items()
                      if storage not in recovered and not r.departing}
        self._complete.callback(RecoveryResult(self.high_water_mark, recovered, background))

    def _new_metadata(self, current, recovered):
        """Seed 000 step 6: clean replicas join the new session; unresolved ones get the closing mark."""
        if current.session_id != self.session_id:
            raise SessionFenced("partition %d is in session %d, not %d" % (self.partition_id, current.session_id,
                                                                            self.session_id))
        states = []
        for storage, replica in sorted(self.replicas.items()):
            replica_id = replica.replica_id
            old = current.replica_state(replica_id)
            if storage in recovered:
                states.append(ReplicaState(replica_id, self.session_id, UNRESOLVED))
            elif old is None:
                continue  # a new replica that has not recovered yet: nothing to record
            elif not old.is_resolved:
                states.append(ReplicaState(replica_id, old.session_id, self.high_water_mark))
            else:
                states.append(old)
        return attr.evolve(current, replica_states=tuple(states))


def electorate_of(metadata, assigned) -> frozenset:
    """The storages that vote on the closing high-water mark: those whose replica state in ``metadata``
    is unresolved (they took part in the last session that could write), or, when there are none (a
    partition that never had a session), every storage in ``assigned``."""
    members = frozenset(state.replica_id.storage for state in metadata.replica_states if not state.is_resolved)
    return members or frozenset(assigned)


def departing_voters(metadata, assigned) -> frozenset:
    """The members of the electorate that ``assigned`` no longer has: a store session asks them for their
    votes while their storage still holds the partition (until ``waltz storage sync-partitions`` unassigns
    it there). Without them, dropping one of two members (replacing the node of a partition that had one
    replica) would leave the vote undecidable for ever."""
    return electorate_of(metadata, assigned) - frozenset(assigned)


@defer.inlineCallbacks
def copy_records(read, target, first, last, batch_size=CATCH_UP_BATCH_SIZE):
    """Copy records ``first``..``last`` to the replica ``target``, reading one batch ahead.

    ``read(start, count)`` fires with the checked records from ``start`` on, at most ``count`` of
    them (see :func:`~waltz.recovery.replica_reads.read_from_any`). Fires with ``last`` once
    everything is appended.
    """
    def read_from(start):
        return read(start, min(batch_size, last - start + 1))

    next_read = read_from(first) if first <= last else None
    copied = first - 1
    try:
        while copied < last:
            records, next_read = (yield next_read), None
            following = records[-1].transaction_id + 1
            if following <= last:
                next_read = read_from(following)
            yield target.append(records)
            copied = records[-1].transaction_id
    finally:
        if next_read is not None:
            next_read.addErrback(lambda f: None)  # abandoned read-ahead
    return copied


def _first_error(failure):
    """Unwrap gatherResults' FirstError so the replica step sees the real failure."""
    if failure.check(defer.FirstError):
        return failure.value.subFailure
    return failure
