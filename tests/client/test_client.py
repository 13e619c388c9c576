"""WaltzClient against fake servers speaking real L frames, on a Clock and iosim (no sockets, no sleeps)."""

import pytest
from twisted.internet import defer
from twisted.logger import LogLevel, globalLogPublisher
from twisted.python.failure import Failure

from tests.client.fakes import EP_A, EP_B, RecordingCallbacks, RecordingContext
from waltz.client.api import Outcome
from waltz.client.client import ClientState
from waltz.client.errors import (
    ClientAheadError, ClientClosedError, ContextInFlightError, HighWaterMarkTimeout, PartitionInactiveError,
    WaltzClientError)
from waltz.client.partition import PartitionState
from waltz.protocols import client_messages as m
from waltz.protocols.locks import lock_hash
from waltz.protocols.values import ReqId


def outcome(d):
    """What a Deferred fired with (None while pending); a failure is consumed (returned as the Failure)."""
    if not hasattr(d, "observed"):
        d.observed = []

        def observe(result):
            d.observed.append(result)
            return None if isinstance(result, Failure) else result
        d.addBoth(observe)
    return d.observed[0] if d.observed else None


# --- mounting ------------------------------------------------------------------------------------

def test_mount_feeds_the_backlog_in_order_then_ready(harness):
    for header in (10, 11, 12):
        harness.commit(0, header=header)
    callbacks = RecordingCallbacks({0: 0})
    client = harness.client(callbacks)
    mounts = harness.server_a.messages(m.MountRequest)
    assert sorted((r.req_id.partition_id, r.client_hwm) for r in mounts) == [(0, 0), (1, -1)]
    assert all(r.req_id.client_id == 7 and r.req_id.generation == 1 for r in mounts)
    assert [(t.transaction_id, t.header) for t in callbacks.applied] == [(1, 11), (2, 12)]
    assert client.partition_state(0) is PartitionState.MOUNTED
    assert client.client_high_water_mark(0) == 2
    # the feed is requested after the mount response, from what was received
    feeds = [r for r in harness.server_a.messages(m.FeedRequest) if r.req_id.partition_id == 0]
    assert [(f.req_id, f.client_hwm) for f in feeds] == [
        (next(r.req_id for r in mounts if r.req_id.partition_id == 0), 2)]
    harness.commit(0, header=13)
    assert callbacks.applied_ids(0) == [1, 2, 3]


def test_not_ready_is_retried_after_the_mount_retry_interval(harness):
    harness.server_a.partitions = {1}
    client = harness.client()
    assert client.partition_state(0) is PartitionState.MOUNT_RETRY
    count = lambda: sum(1 for r in harness.server_a.messages(m.MountRequest) if r.req_id.partition_id == 0)  # noqa
    assert count() == 1
    harness.settle(0.49)
    assert count() == 1
    harness.server_a.partitions = {0, 1}
    harness.settle(0.01)
    assert count() == 2
    assert client.partition_state(0) is PartitionState.MOUNTED


def test_client_ahead_is_reported_and_executions_fail(harness):
    harness.commit(0)
    callbacks = RecordingCallbacks({0: 5})
    client = harness.client(callbacks)
    assert client.partition_state(0) is PartitionState.CLIENT_AHEAD
    [(pid, txn, error)] = callbacks.errors
    assert (pid, txn) == (0, 5) and isinstance(error, ClientAheadError)
    context = RecordingContext()
    result = outcome(client.execute(context))
    assert result.outcome is Outcome.FAILED and isinstance(result.error, ClientAheadError)
    assert context.events == [("exception", "ClientAheadError")]
    assert client.partition_state(1) is PartitionState.MOUNTED


def test_client_ahead_mounts_again_when_the_partition_moves(harness):
    harness.commit(0)
    callbacks = RecordingCallbacks({0: 1})
    client = harness.client(callbacks)
    assert client.partition_state(0) is PartitionState.CLIENT_AHEAD
    harness.commit(0)      # the log catches up (e.g. another server had it)
    harness.server_b.partitions = {0}
    harness.discovery.move(0, EP_B, 2)
    harness.settle()
    assert client.partition_state(0) is PartitionState.MOUNTED


def test_client_ahead_then_moved_applies_each_transaction_once(harness):
    """Re-activated after CLIENT_AHEAD, the partition reads the application's mark afresh: the apply
    still running ends first, and the items queued behind it are fed again, not delivered twice."""
    callbacks = RecordingCallbacks()
    callbacks.hold = True
    client = harness.client(callbacks)
    for header in (10, 11, 12):
        harness.commit(0, header=header)
    assert [t.transaction_id for t, _ in callbacks.pending] == [0]     # 1 and 2 queued behind it
    del harness.logs[0].records[1:]         # the cluster lost what the client received: it is ahead
    harness.server_b.partitions = {0}
    harness.discovery.move(0, EP_B, 2)
    harness.settle()
    assert client.partition_state(0) is PartitionState.CLIENT_AHEAD
    for header in (21, 22):
        harness.commit(0, header=header)
    harness.server_a.partitions = {0, 1}
    harness.discovery.move(0, EP_A, 3)
    harness.settle()
    for _ in range(5):
        callbacks.release()
        harness.settle()
    assert [(t.transaction_id, t.header) for t in callbacks.applied] == [(0, 10), (1, 21), (2, 22)]
    assert client.partition_state(0) is PartitionState.MOUNTED


# --- executing ---------------------------------------------------------------------------------

def test_execute_appends_with_req_id_hwm_header_and_lock_hashes(harness):
    harness.commit(0)
    client = harness.client()
    context = RecordingContext(header=42, data=b"payload", write_locks=[("account", 1)],
                               read_locks=[("account", 2)], append_locks=[("log", 3)])
    d = client.execute(context)
    harness.settle()
    [append] = harness.server_a.messages(m.AppendRequest)
    assert append.req_id.client_id == 7 and append.req_id.generation == 1 and append.req_id.partition_id == 0
    assert append.client_hwm == 0 and append.header == 42 and append.data == b"payload"
    assert append.write_locks == (lock_hash("account", 1),)
    assert append.read_locks == (lock_hash("account", 2),)
    assert append.append_locks == (lock_hash("log", 3),)
    assert outcome(d).outcome is Outcome.COMMITTED
    assert context.events == ["execute", ("completion", True), "application"]
    assert client.callbacks.applied[-1].req_id == append.req_id


def test_execute_before_the_client_joined_waits_for_it(harness):
    client = harness.client(join=False)
    context = RecordingContext()
    d = client.execute(context)
    assert context.events == [] and client.state is ClientState.STARTING
    harness.join()
    assert outcome(d).committed


def test_execute_returning_false_or_raising_ends_without_append(harness):
    client = harness.client()
    ignored, broken = RecordingContext(proceed=False), RecordingContext(raises=KeyError("boom"))
    assert outcome(client.execute(ignored)).outcome is Outcome.IGNORED
    result = outcome(client.execute(broken))
    assert result.outcome is Outcome.FAILED and isinstance(result.error, KeyError)
    harness.settle()
    assert harness.server_a.messages(m.AppendRequest) == []
    assert ignored.events == ["execute", ("completion", False)]
    assert broken.events == ["execute", ("exception", "KeyError")]


class FieldSetDirectly(RecordingContext):
    """Sets a builder field directly, bypassing the setter's checks."""

    def __init__(self, field, value):
        super().__init__()
        self.field, self.value = field, value

    def execute(self, builder):
        proceed = super().execute(builder)
        setattr(builder, self.field, self.value)
        return proceed


@pytest.mark.parametrize("field, value", [("header", 1.5), ("data", "text"), ("write_locks", [("a", 1)]),
                                          ("read_locks", (2 ** 40,))])
def test_a_field_that_cannot_go_on_the_wire_ends_the_context_and_sends_nothing(harness, field, value):
    # It used to fail in the encoder after the append was registered as sent: execute raised to its caller,
    # and the retries that followed (inside the stream handler) closed the stream connection again and again.
    client = harness.client()
    context = FieldSetDirectly(field, value)
    result = outcome(client.execute(context))
    assert result.outcome is Outcome.FAILED and isinstance(result.error, TypeError)
    assert context.events == ["execute", ("exception", "TypeError")]
    harness.clock.advance(30)
    harness.settle()
    assert harness.server_a.messages(m.AppendRequest) == [] and context.executions == 1
    d = client.execute(RecordingContext(header=3))
    harness.settle()
    assert outcome(d).outcome is Outcome.COMMITTED          # the stream connection is fine


def test_set_header_refuses_a_value_that_is_not_an_int(harness):
    client = harness.client()
    context = RecordingContext(header=1.5)
    result = outcome(client.execute(context))
    assert result.outcome is Outcome.FAILED and "signed 32-bit int, got float 1.5" in str(result.error)


def test_a_bad_partition_id_fails_the_execution(harness):
    client = harness.client()
    result = outcome(client.execute(RecordingContext(partition=5)))
    assert result.outcome is Outcome.FAILED and "partition 5 does not exist" in str(result.error)


def test_own_req_id_in_the_feed_fails_older_pending_appends_which_are_retried(harness):
    client = harness.client()
    harness.server_a.hold_appends = True
    contexts = [RecordingContext(header=i) for i in range(3)]
    results = [client.execute(c) for c in contexts]
    harness.settle()
    assert len(harness.server_a.held) == 3
    harness.server_a.hold_appends = False
    harness.server_a.commit_held(2)        # only the newest made it: the two older ones were lost
    harness.settle()
    assert outcome(results[2]).committed
    assert [c.executions for c in contexts] == [2, 2, 1]
    assert all(outcome(r).committed for r in results)
    assert [t.header for t in client.callbacks.applied] == [2, 0, 1]
    retried = harness.server_a.messages(m.AppendRequest)[3:]
    assert [r.client_hwm for r in retried] == [0, 0]   # re-executed after the success was applied


def _waiting_to_retry_after_a_lock_failure(harness, client):
    """Execute a context whose append fails on a lock of transaction 3, which the client has not seen."""
    harness.server_a.hold_appends = True
    context = RecordingContext(write_locks=[("account", 1)])
    d = client.execute(context)
    harness.settle()
    harness.server_a.lock_fail_held(0, 3)
    harness.settle()
    assert context.events == ["execute", "lock failure"] and outcome(d) is None
    return context, d


def test_lock_failure_is_retried_only_once_the_client_hwm_reaches_the_transaction(harness):
    harness.commit(0)
    client = harness.client()
    context, d = _waiting_to_retry_after_a_lock_failure(harness, client)
    harness.server_a.hold_appends = False
    harness.commit(0)                     # txn 1
    harness.commit(0)                     # txn 2
    assert context.executions == 1         # the client is still behind the conflicting txn 3
    harness.commit(0)                     # txn 3
    assert context.executions == 2
    assert context.builders[1].client_high_water_mark == 3
    assert outcome(d).committed


def test_lock_failure_behind_the_client_hwm_is_retried_at_once(harness):
    harness.commit(0)
    client = harness.client()
    harness.server_a.hold_appends = True
    context = RecordingContext()
    client.execute(context)
    harness.settle()
    harness.server_a.lock_fail_held(0, 0)
    harness.settle()
    assert context.executions == 2


def test_an_execution_waiting_to_retry_after_a_lock_failure_fails_when_the_client_closes(harness):
    harness.commit(0)
    client = harness.client(**{"client.transactionExpiration": 0})   # no expiry to end it later
    context, d = _waiting_to_retry_after_a_lock_failure(harness, client)
    client.close()
    harness.settle()
    assert outcome(d).outcome is Outcome.FAILED and isinstance(outcome(d).error, ClientClosedError)
    assert context.events[-1] == ("exception", "ClientClosedError")


def test_an_execution_waiting_to_retry_after_a_lock_failure_fails_when_its_partition_is_dropped(harness):
    harness.commit(0)
    client = harness.client(**{"client.autoMount": False, "client.transactionExpiration": 0})
    client.set_partitions([0])
    harness.settle()
    context, d = _waiting_to_retry_after_a_lock_failure(harness, client)
    client.set_partitions([])
    harness.settle()
    assert outcome(d).outcome is Outcome.FAILED and isinstance(outcome(d).error, PartitionInactiveError)
    harness.commit(0)
    harness.commit(0)
    harness.commit(0)                     # the conflicting transaction: the gate is gone with the partition
    assert context.executions == 1


def test_an_execution_that_expired_waiting_to_retry_is_not_ended_again_when_the_client_closes(harness):
    harness.commit(0)
    client = harness.client(**{"client.transactionExpiration": 5})
    context, d = _waiting_to_retry_after_a_lock_failure(harness, client)
    harness.settle(5)
    assert outcome(d).outcome is Outcome.EXPIRED
    errors = []
    observer = lambda event: errors.append(event) if event["log_level"] >= LogLevel.error else None  # noqa
    globalLogPublisher.addObserver(observer)
    try:
        client.close()
        harness.settle()
    finally:
        globalLogPublisher.removeObserver(observer)
    assert errors == []   # not "transaction context ... ended twice"
    assert context.events[-1] == "expiration"


def test_at_most_max_concurrent_transactions_are_outstanding(harness):
    client = harness.client(**{"client.maxConcurrentTransactions": 3})
    harness.server_a.hold_appends = True
    contexts = [RecordingContext(header=i) for i in range(5)]
    results = [client.execute(c) for c in contexts]
    harness.settle()
    assert [a.request.header for a in harness.server_a.held] == [0, 1, 2]
    assert [c.executions for c in contexts] == [1, 1, 1, 0, 0]
    harness.server_a.commit_held(0)
    harness.settle()
    assert [a.request.header for a in harness.server_a.held] == [1, 2, 3]
    harness.server_a.hold_appends = False
    for _ in range(3):
        harness.server_a.commit_held(0)
    harness.settle()
    assert all(outcome(r).committed for r in results)
    assert [t.header for t in client.callbacks.applied] == [0, 1, 2, 3, 4]


def test_a_waiting_context_expires(harness):
    client = harness.client(**{"client.transactionExpiration": 3000})
    harness.network.take_down(EP_A)            # nothing can be appended any more
    context = RecordingContext()
    d = client.execute(context)
    harness.settle(2.9)
    assert outcome(d) is None
    harness.settle(0.1)
    assert outcome(d).outcome is Outcome.EXPIRED
    assert context.events == ["expiration"]


def test_a_failed_attempt_after_expiration_is_not_retried(harness):
    client = harness.client(**{"client.transactionExpiration": 1000, "client.longWaitThreshold": 5000})
    harness.server_a.hold_appends = True
    context = RecordingContext()
    d = client.execute(context)
    harness.settle(2)                        # sent, still pending when it expires: it may commit
    assert outcome(d) is None
    harness.settle(5)                        # the long-wait flush settles it as failed
    assert outcome(d).outcome is Outcome.EXPIRED
    assert context.events == ["execute", "expiration"]


def test_a_flush_is_sent_when_pending_appends_make_no_progress(harness):
    client = harness.client(**{"client.longWaitThreshold": 2000})
    harness.server_a.hold_appends = True
    context = RecordingContext()
    client.execute(context)
    harness.settle(1.5)
    assert harness.server_a.messages(m.FlushRequest) == []
    harness.settle(1.0)
    [flush] = harness.server_a.messages(m.FlushRequest)
    assert flush.req_id == harness.server_a.messages(m.AppendRequest)[0].req_id
    assert context.executions == 2             # the flush showed it lost; it was sent again


def test_a_flush_response_waits_for_the_client_to_apply_up_to_its_hwm(harness):
    callbacks = RecordingCallbacks()
    client = harness.client(callbacks)
    harness.server_a.hold_appends = True
    context = RecordingContext()
    client.execute(context)
    harness.settle()
    callbacks.hold = True
    harness.commit(0)                           # someone else's transaction, not applied yet
    d = client.flush(0)
    harness.settle()
    assert not d.called and context.executions == 1
    callbacks.release()
    harness.settle()
    assert d.called and context.executions == 2


def test_flush_fires_at_once_with_nothing_pending(harness):
    client = harness.client()
    assert client.flush().called


def test_flush_waits_for_executions_queued_behind_the_cap_and_close_after_it_fails_none(harness):
    # flush() covered only the appends already sent: "execute many, flush, close" failed the executions
    # still queued behind client.maxConcurrentTransactions, and they were never appended.
    client = harness.client(**{"client.maxConcurrentTransactions": 2})
    results = [client.execute(RecordingContext(data=b"t%d" % n)) for n in range(5)]
    assert client.has_pending_transactions()
    ended_at_flush = []

    def flushed(_):
        ended_at_flush.append(sum(d.called for d in results))
        return client.close()
    client.flush().addCallback(flushed)
    harness.settle()
    # Every one has ended when the flush fires (the last one's Deferred fired right after the flush's).
    assert ended_at_flush == [5] and [outcome(d).outcome for d in results] == [Outcome.COMMITTED] * 5
    assert not client.has_pending_transactions()


def test_flush_with_a_backlog_sends_one_flush_for_it_not_one_per_append(harness):
    # A FLUSH went out after every queued append as it was sent: each is a barrier on the server, which
    # then committed the backlog one append per store round trip.
    client = harness.client(**{"client.maxConcurrentTransactions": 2})
    harness.server_a.hold_appends = True
    for n in range(6):
        client.execute(RecordingContext(data=b"t%d" % n))
    harness.settle()
    client.flush()
    harness.settle()
    while harness.server_a.held:
        harness.server_a.commit_held(0)
        harness.settle()
    kinds = [type(message).__name__[0] for message in harness.server_a.messages((m.AppendRequest, m.FlushRequest))]
    assert kinds.count("F") <= 2 and "".join(kinds).startswith("AAF"), kinds


def test_flush_waits_for_an_execution_still_building_its_transaction(harness):
    class Building(RecordingContext):
        def execute(self, builder):
            self.building = defer.Deferred().addCallback(lambda _: RecordingContext.execute(self, builder))
            return self.building
    client = harness.client()
    context = Building()
    result = client.execute(context)
    harness.settle()
    assert client.has_pending_transactions()
    flushed = client.flush()
    harness.settle()
    assert not flushed.called
    context.building.callback(None)             # built and sent: committed by the fake server
    harness.settle()
    assert flushed.called and outcome(result).outcome is Outcome.COMMITTED


def test_flush_counts_an_execution_that_ends_unsent(harness):
    client = harness.client(**{"client.maxConcurrentTransactions": 1})
    harness.server_a.hold_appends = True
    client.execute(RecordingContext())
    queued = client.execute(RecordingContext(proceed=False))
    harness.settle()
    flushed = client.flush()
    harness.server_a.commit_held(0)
    harness.settle()
    assert flushed.called and outcome(queued).outcome is Outcome.IGNORED


def test_a_context_executed_again_while_its_execution_runs_is_refused(harness):
    # Both executions ran: the transaction was appended twice and the context got two terminal hooks.
    client = harness.client()
    harness.server_a.hold_appends = True
    context = RecordingContext()
    first = client.execute(context)
    second = client.execute(context)
    assert second.called and outcome(second).outcome is Outcome.FAILED
    assert isinstance(outcome(second).error, ContextInFlightError)
    harness.settle()
    harness.server_a.commit_held(0)
    harness.settle()
    assert outcome(first).outcome is Outcome.COMMITTED and len(harness.server_a.messages(m.AppendRequest)) == 1
    assert context.events.count(("completion", True)) == 1
    harness.server_a.hold_appends = False
    again = client.execute(context)             # once it ended, the context may run again
    harness.settle()
    assert outcome(again).outcome is Outcome.COMMITTED


def test_a_context_may_execute_itself_again_from_its_terminal_hook(harness):
    class Twice(RecordingContext):
        again = None

        def on_completion(self, result):
            super().on_completion(result)
            if self.again is None:
                self.again = client.execute(self)
    client = harness.client()
    context = Twice(proceed=False)
    first = client.execute(context)
    harness.settle()
    assert outcome(first).outcome is Outcome.IGNORED and outcome(context.again).outcome is Outcome.IGNORED
    assert context.events == ["execute", ("completion", False)] * 2


def test_execute_returning_none_fails_the_context_instead_of_dropping_it_silently(harness):
    client = harness.client()
    context = RecordingContext(proceed=None)
    result = outcome(client.execute(context))
    assert result.outcome is Outcome.FAILED and isinstance(result.error, TypeError)
    assert "returned None" in str(result.error) and harness.server_a.messages(m.AppendRequest) == []
    assert context.events[-1] == ("exception", "TypeError")


# --- the feed ------------------------------------------------------------------------------------

def test_apply_transaction_returning_a_deferred_holds_the_next_one(harness):
    callbacks = RecordingCallbacks()
    client = harness.client(callbacks)
    callbacks.hold = True
    harness.commit(0)
    harness.commit(0)
    assert len(callbacks.pending) == 1 and client.client_high_water_mark(0) == -1
    callbacks.release()
    assert len(callbacks.pending) == 1 and client.client_high_water_mark(0) == 0
    callbacks.release()
    assert callbacks.applied_ids(0) == [0, 1] and client.client_high_water_mark(0) == 1


class AsyncDefCallbacks(RecordingCallbacks):
    """An ``async def`` apply that awaits a Deferred the test fires, then records (or raises once)."""

    async def apply_transaction(self, transaction):
        d = defer.Deferred()
        self.pending.append((transaction, d))
        await d
        if self.fail_next:
            self.fail_next -= 1
            raise RuntimeError("async apply failed on purpose")
        self._record(transaction)


def test_an_async_def_apply_runs_and_counts_only_once_it_returned(harness):
    # Its coroutine was taken as a plain result: the transaction counted as applied, and its body never ran.
    callbacks = AsyncDefCallbacks()
    client = harness.client(callbacks)
    callbacks.fail_next = 1
    harness.commit(0)
    harness.commit(0)
    assert len(callbacks.pending) == 1 and client.client_high_water_mark(0) == -1
    callbacks.release()                         # the first attempt raises: reported, retried later
    assert [e[:2] for e in callbacks.errors] == [(0, 0)] and client.client_high_water_mark(0) == -1
    harness.settle(0.1)
    callbacks.release()
    assert callbacks.applied_ids(0) == [0] and client.client_high_water_mark(0) == 0
    callbacks.release()
    assert callbacks.applied_ids(0) == [0, 1] and client.client_high_water_mark(0) == 1


def test_a_failed_apply_is_reported_and_retried_with_back_off(harness):
    callbacks = RecordingCallbacks()
    client = harness.client(callbacks)
    callbacks.fail_next = 2
    harness.commit(0)
    harness.commit(0)
    assert [e[:2] for e in callbacks.errors] == [(0, 0)]
    assert client.client_high_water_mark(0) == -1
    harness.settle(0.1)
    assert [e[:2] for e in callbacks.errors] == [(0, 0), (0, 0)]
    harness.settle(0.1)
    assert callbacks.applied_ids(0) == []      # the second retry waits twice as long
    harness.settle(0.1)
    assert callbacks.applied_ids(0) == [0, 1]


def test_feed_suspended_is_followed_by_a_new_feed_request(harness):
    harness.server_a.feed_credit = 2
    callbacks = RecordingCallbacks()
    harness.client(callbacks)
    for _ in range(5):
        harness.commit(0)
    assert callbacks.applied_ids(0) == [0, 1, 2, 3, 4]
    requests = [r.client_hwm for r in harness.server_a.messages(m.FeedRequest) if r.req_id.partition_id == 0]
    assert requests == [-1, 1, 3]


def test_feed_data_is_delivered_once_even_when_sent_twice(harness):
    callbacks = RecordingCallbacks()
    client = harness.client(callbacks)
    record = harness.commit(0)
    stream = [p for p in harness.server_a.connections if p.feeds][0]
    stream.sendMessage(m.FeedData(record.req_id, record.transaction_id, record.header))
    harness.settle()
    assert callbacks.applied_ids(0) == [0] and client.client_high_water_mark(0) == 0


# --- reconnecting and moving -----------------------------------------------------------------------

def test_reconnect_procedure(harness):
    client = harness.client()
    harness.server_a.hold_appends = True
    lost, kept = RecordingContext(header=1), RecordingContext(header=2)
    results = [client.execute(lost), client.execute(kept)]
    harness.settle()
    first_seq = harness.server_a.messages(m.MountRequest)[-1].seq_num
    # the server committed 'kept' but the connection drops before the feed reaches the client
    harness.server_a.hold_appends = False
    kept_request = harness.server_a.held.pop(1).request
    harness.server_a.held = []
    for proto in list(harness.server_a.connections):
        proto.feeds.clear()
    harness.server_a.commit_request(kept_request)
    harness.network.disconnect(EP_A)
    assert client.partition_state(0) is PartitionState.WAITING_FOR_SERVER
    blocked = RecordingContext(header=3)
    results.append(client.execute(blocked))
    assert blocked.executions == 0                 # appends are blocked until the remount completes
    appends_before = len(harness.server_a.messages(m.AppendRequest))
    harness.settle()                               # reconnects at once, mounts, feed shows 'kept'
    remount = harness.server_a.messages(m.MountRequest)[-1]
    assert remount.seq_num > first_seq and remount.client_hwm == -1
    assert outcome(results[1]).committed and kept.executions == 1
    # the mount response failed 'lost' (older, pending) which was retried, then 'blocked' went out
    assert lost.executions == 2 and blocked.executions == 1
    assert [a.header for a in harness.server_a.messages(m.AppendRequest)[appends_before:]] == [1, 3]
    assert all(outcome(r).committed for r in results)
    assert [t.header for t in client.callbacks.applied] == [2, 1, 3]


def test_reconnect_backs_off_while_the_server_is_down(harness):
    client = harness.client(**{"client.reconnectInitialInterval": 100, "client.reconnectMaxInterval": 400})
    server = harness.network.take_down(EP_A)
    attempts = lambda: len(harness.network.attempts)  # noqa: E731
    before = attempts()
    harness.settle()
    assert attempts() == before + 2              # stream and RPC try again at once
    harness.settle(0.1)
    assert attempts() == before + 4
    harness.settle(0.2)
    assert attempts() == before + 6
    harness.settle(0.4)
    harness.settle(0.4)
    assert attempts() == before + 10
    harness.network.add_server(EP_A, server)
    harness.settle(0.4)
    assert client.partition_state(0) is PartitionState.MOUNTED


def test_a_feed_suspended_of_an_earlier_mount_is_not_answered_while_remounting(harness):
    client = harness.client()
    first_mount = next(r.req_id for r in harness.server_a.messages(m.MountRequest) if r.req_id.partition_id == 0)
    stream = next(proto for proto in harness.server_a.connections if 0 in proto.feeds)
    harness.server_a.answer_mounts = False
    harness.discovery.move(0, EP_A, 2)      # the same server, a new generation: a remount on the same stream
    harness.settle()
    remounts = [r for r in harness.server_a.messages(m.MountRequest)
                if r.req_id.partition_id == 0 and r.req_id != first_mount]
    assert len(remounts) == 1 and client.partition_state(0) is PartitionState.MOUNTING
    feed_requests = len(harness.server_a.messages(m.FeedRequest))
    stream.sendMessage(m.FeedSuspended(first_mount))   # the old feed's credit ran out meanwhile
    harness.settle()
    # Answering it would make a server replace the new mount's catch-up (which ends with READY).
    assert len(harness.server_a.messages(m.FeedRequest)) == feed_requests
    stream.sendMessage(m.MountResponse(remounts[0].req_id, m.MountState.READY))
    harness.settle()
    assert client.partition_state(0) is PartitionState.MOUNTED
    assert harness.server_a.messages(m.FeedRequest)[-1].req_id == remounts[0].req_id


def test_a_partition_moving_to_another_server_is_remounted_with_its_new_generation(harness):
    client = harness.client()
    harness.server_a.hold_appends = True
    context = RecordingContext()
    d = client.execute(context)
    harness.settle()
    harness.server_a.partitions = {1}
    harness.server_b.partitions = {0}
    harness.discovery.move(0, EP_B, 2)
    harness.settle()
    [mount] = harness.server_b.messages(m.MountRequest)
    assert mount.req_id.generation == 2 and mount.req_id.partition_id == 0
    [retry] = harness.server_b.messages(m.AppendRequest)
    assert retry.req_id.generation == 2
    assert context.executions == 2 and outcome(d).committed


def test_a_partition_without_a_live_server_waits(harness):
    client = harness.client()
    harness.discovery.move(0, None, 0)
    harness.settle()
    assert client.partition_state(0) is PartitionState.WAITING_FOR_SERVER
    context = RecordingContext()
    d = client.execute(context)
    harness.settle()
    assert context.executions == 0
    harness.discovery.move(0, EP_A, 3)
    harness.settle()
    assert outcome(d).committed


def test_connections_to_a_server_without_partitions_are_closed(harness):
    harness.server_b.partitions = {0, 1}
    client = harness.client()
    assert len(harness.server_a.connections) == 2
    harness.discovery.move(0, EP_B, 2)
    harness.discovery.move(1, EP_B, 2)
    harness.settle()
    assert harness.server_a.connections == [] and len(harness.server_b.connections) == 2
    assert client.partition_state(1) is PartitionState.MOUNTED


# --- transaction data and high-water marks ------------------------------------------------------------

def test_transaction_data_is_fetched_lazily_over_rpc(harness):
    harness.commit(0, data=b"hello")
    callbacks = RecordingCallbacks()
    harness.client(callbacks)
    assert harness.server_a.messages(m.TransactionDataRequest) == []
    d = callbacks.applied[0].get_data()
    harness.settle()
    assert d.result == b"hello"
    [request] = harness.server_a.messages(m.TransactionDataRequest)
    rpc = [p for p, msg in harness.server_a.received if msg is request][0]
    assert not rpc.feeds                      # the RPC connection, not the stream one


def test_transaction_data_with_a_bad_checksum_is_fetched_again(harness):
    harness.commit(0, data=b"hello")
    client = harness.client()
    harness.server_a.corrupt[0] = 2
    d = client.get_transaction_data(0, 0)
    harness.settle()
    assert d.result == b"hello"
    assert len(harness.server_a.messages(m.TransactionDataRequest)) == 3


def test_transaction_data_failing_its_checksum_too_often_fails(harness):
    harness.commit(0, data=b"hello")
    client = harness.client(**{"client.maxDataFetchRetries": 5})
    harness.server_a.corrupt[0] = 100
    d = client.get_transaction_data(0, 0)
    harness.settle()
    failure = []
    d.addErrback(failure.append)
    assert "failed its checksum 6 times" in failure[0].getErrorMessage()
    assert len(harness.server_a.messages(m.TransactionDataRequest)) == 6
    assert len(harness.server_a.connections) == 2     # the connection stayed up


def test_transaction_data_errors_from_the_server_fail_the_fetch(harness):
    harness.commit(0)
    client = harness.client()
    harness.server_a.data_errors[0] = "no such transaction"
    d = client.get_transaction_data(0, 0)
    harness.settle()
    failure = []
    d.addErrback(failure.append)
    assert "no such transaction" in failure[0].getErrorMessage()


def test_a_transient_data_failure_is_asked_again_with_a_doubling_delay_before_it_fails(harness):
    harness.commit(0, data=b"x")
    client = harness.client(**{"client.maxDataFetchRetries": 3})
    transient = "reading transaction 0 of partition 0 failed (try again later): no readable replica right now"
    harness.server_a.data_errors[0] = transient
    d = client.get_transaction_data(0, 0)
    harness.settle()
    for delay in (0.5, 1.0):                          # client.mountRetryInterval, doubling
        harness.settle(delay)
    assert not d.called and len(harness.server_a.messages(m.TransactionDataRequest)) == 3
    del harness.server_a.data_errors[0]               # the storage is back
    harness.settle(2.0)
    assert d.result == b"x"

    harness.server_a.data_errors[0] = transient       # a failure that lasts: reported after the retries
    d = client.get_transaction_data(0, 0)
    for delay in (0, 0.5, 1.0, 2.0):
        harness.settle(delay)
    failure = []
    d.addErrback(failure.append)
    assert "no readable replica right now" in failure[0].getErrorMessage()


def test_pending_data_requests_are_sent_again_after_a_reconnect(harness):
    harness.commit(0, data=b"x")
    client = harness.client()
    server = harness.network.take_down(EP_A)
    d = client.get_transaction_data(0, 0)
    harness.settle()
    assert not d.called
    harness.network.add_server(EP_A, server)
    harness.settle(0.1)
    assert d.result == b"x"


def test_a_data_request_left_unanswered_is_sent_again_after_the_long_wait_threshold(harness):
    # A server that took the request and never answered, its connection staying up, held every apply that
    # needed the data for as long as that connection lived: a fetch joined by later callers sent nothing new.
    harness.commit(0, data=b"late")
    client = harness.client()
    answer, dropped = harness.server_a.on_TransactionDataRequest, []

    def drop_the_first(proto, message):
        if dropped:
            answer(proto, message)
        else:
            dropped.append(message)
    harness.server_a.on_TransactionDataRequest = drop_the_first
    d = client.get_transaction_data(0, 0)
    harness.settle(2)
    assert not d.called and len(dropped) == 1
    joined = client.get_transaction_data(0, 0)
    harness.settle(2)
    assert not joined.called and len(harness.server_a.messages(m.TransactionDataRequest)) == 1
    harness.settle(3.5)         # (the nudge runs every half long-wait threshold: 2.5 s)
    assert d.result == joined.result == b"late"
    assert len(harness.server_a.messages(m.TransactionDataRequest)) == 2


def test_high_water_marks(harness):
    harness.commit(0)
    harness.commit(0)
    client = harness.client()
    d = client.high_water_marks()
    harness.settle()
    assert d.result == {0: 1, 1: -1}
    d = client.high_water_marks([1])
    harness.settle()
    assert d.result == {1: -1}


def test_calls_made_before_the_client_joined_fail_or_wait_for_it(harness):
    # high_water_marks() answered {} ("every partition" was none yet), and flush(pid) raised instead of
    # returning a failed Deferred; a flush now waits for the start, and sends what was queued meanwhile.
    client = harness.client(join=False)
    assert client.state is ClientState.STARTING
    marks = client.high_water_marks()
    assert isinstance(marks.result.value, WaltzClientError)
    marks.addErrback(lambda _: None)
    context = RecordingContext()
    executed = client.execute(context)
    flushed = client.flush()
    flushed_one = client.flush(0)
    assert not flushed.called and not flushed_one.called
    harness.join()
    assert flushed.called and flushed_one.called and executed.called
    assert context.events[:2] == ["execute", ("completion", True)]
    client.close()
    harness.settle()
    for call in (lambda: client.flush(0), client.flush, client.high_water_marks):
        failed = call()
        assert isinstance(failed.result.value, ClientClosedError)
        failed.addErrback(lambda _: None)


def test_high_water_marks_name_the_partitions_that_do_not_answer(harness):
    # One partition served nowhere must not hold up the others for ever, and the error names it.
    client = harness.client()
    harness.discovery.move(1, None, 0)
    harness.settle()
    d = client.high_water_marks(timeout=5)
    harness.settle()
    assert not d.called                           # partition 0 answered; 1 has nowhere to ask
    harness.settle(5.1)
    failures = []
    d.addErrback(failures.append)           # consumed: not logged as an unhandled error at collection
    with pytest.raises(HighWaterMarkTimeout, match=r"partition\(s\) 1:"):
        failures[0].raiseException()
    d = client.high_water_marks([0], timeout=5)
    harness.settle()
    assert d.result == {0: -1}


def test_high_water_mark_requests_that_timed_out_are_forgotten(harness):
    # A monitoring loop asking with a timeout for a partition served nowhere used to add a waiter each time.
    client = harness.client()
    harness.discovery.move(1, None, 0)
    harness.settle()
    for _ in range(5):
        d = client.high_water_marks([1], timeout=1)
        harness.settle(1.1)
        d.addErrback(lambda failure: failure.trap(HighWaterMarkTimeout))
    assert not client._partitions[1]._hwm_waiters


def test_high_water_mark_asked_after_a_commit_is_never_answered_by_an_earlier_request(harness):
    # Before: a caller arriving while an earlier request was unanswered got that request's answer, which the
    # server had read before the caller's own transaction committed (-1 here, after transaction 0).
    client = harness.client()
    answers = []

    def answer_later(proto, message):
        hwm = harness.logs[message.req_id.partition_id].high_water_mark     # read on receipt, sent later
        answers.append(lambda: proto.sendMessage(m.HighWaterMarkResponse(message.req_id, hwm)))
    harness.server_a.on_HighWaterMarkRequest = answer_later
    early = client.high_water_mark(0)
    harness.settle()
    d = client.execute(RecordingContext())
    harness.settle()
    assert outcome(d).transaction_id == 0
    late, also_late = client.high_water_mark(0), client.high_water_mark(0)
    harness.settle()
    assert len(answers) == 1                # the next request waits for the one in flight
    answers.pop(0)()
    harness.settle()
    assert (outcome(early), outcome(late), outcome(also_late)) == (-1, None, None)
    assert len(answers) == 1                # one request for both later callers
    answers.pop(0)()
    harness.settle()
    assert (outcome(late), outcome(also_late)) == (0, 0)


# --- partitions chosen by the application ---------------------------------------------------------

def test_set_partitions_mounts_only_the_chosen_ones(harness):
    client = harness.client(**{"client.autoMount": False})
    assert harness.server_a.messages(m.MountRequest) == []
    assert client.partition_state(0) is PartitionState.INACTIVE
    result = outcome(client.execute(RecordingContext()))
    assert isinstance(result.error, PartitionInactiveError)
    client.set_partitions([1])
    harness.settle()
    assert client.partitions == {1}
    assert [r.req_id.partition_id for r in harness.server_a.messages(m.MountRequest)] == [1]
    d = client.execute(RecordingContext(partition=1))
    harness.settle()
    assert outcome(d).committed


def test_dropping_a_partition_settles_its_pending_appends_first(harness):
    client = harness.client(**{"client.autoMount": False, "client.maxConcurrentTransactions": 1})
    client.set_partitions([0])
    harness.settle()
    harness.server_a.hold_appends = True
    sent, queued = RecordingContext(), RecordingContext()
    client.execute(sent)
    harness.settle()
    client.execute(queued)
    client.set_partitions([])
    harness.settle()
    assert queued.events == [("exception", "PartitionInactiveError")]
    assert client.partition_state(0) is PartitionState.INACTIVE      # the flush showed 'sent' lost
    assert sent.events == ["execute", ("exception", "PartitionInactiveError")]


def applying_the_first_of_two(harness):
    """``(client, callbacks)``: partition 0 chosen, transactions 0 and 1 committed, the apply of 0 pending."""
    callbacks = RecordingCallbacks()
    client = harness.client(callbacks, **{"client.autoMount": False})
    client.set_partitions([0])
    harness.settle()
    callbacks.hold = True
    harness.commit(0)
    harness.commit(0)
    harness.settle()
    assert [t.transaction_id for t, _ in callbacks.pending] == [0]
    return client, callbacks


def test_a_partition_dropped_and_added_back_during_an_apply_applies_each_transaction_once(harness):
    client, callbacks = applying_the_first_of_two(harness)
    client.set_partitions([])                 # waits for the apply of transaction 0 to end...
    client.set_partitions([0])                # ...so adding it back does not deliver 0 again
    harness.settle()
    assert [t.transaction_id for t, _ in callbacks.pending] == [0]
    callbacks.release()
    harness.settle()
    callbacks.release()
    harness.settle()
    assert callbacks.applied_ids(0) == [0, 1]


def test_a_partition_dropped_during_an_apply_becomes_inactive_once_it_ends(harness):
    client, callbacks = applying_the_first_of_two(harness)
    client.set_partitions([])
    harness.settle()
    assert client.partition_state(0) is not PartitionState.INACTIVE
    callbacks.release()
    harness.settle()
    assert client.partition_state(0) is PartitionState.INACTIVE
    assert callbacks.applied_ids(0) == [0] and client.client_high_water_mark(0) == 0


def test_set_partitions_needs_auto_mount_off(harness):
    client = harness.client()
    with pytest.raises(ValueError):
        client.set_partitions([0])


# --- reading ranges ----------------------------------------------------------------------------------

def test_read_transactions_mounts_under_another_client_id(harness):
    for header in range(6):
        harness.commit(0, header=header % 2, data=b"d%d" % header)
    client = harness.client(**{"client.autoMount": False})
    d = client.read_transactions(0, 2, 4)
    harness.settle()
    records = outcome(d)
    assert [(r.transaction_id, r.header, r.data) for r in records] == [(2, 0, b"d2"), (3, 1, b"d3"), (4, 0, b"d4")]
    [mount] = harness.server_a.messages(m.MountRequest)
    assert mount.client_hwm == 1 and mount.req_id.client_id != client.client_id
    assert len(harness.server_a.connections) == 2      # the read's own connection is closed


def test_read_transactions_filters_headers_and_stops_at_the_hwm(harness):
    for header in range(5):
        harness.commit(0, header=header, data=b"d%d" % header)
    client = harness.client()
    d = client.read_transactions(0, 0, headers={1, 3}, include_data=False)
    harness.settle()
    assert [(r.transaction_id, r.data) for r in outcome(d)] == [(1, None), (3, None)]
    assert harness.server_a.messages(m.TransactionDataRequest) == []


def test_read_transactions_waits_for_transactions_beyond_the_hwm(harness):
    harness.commit(0)
    client = harness.client()
    d = client.read_transactions(0, 0, 2)
    harness.settle()
    assert outcome(d) is None
    harness.commit(0)
    harness.commit(0)
    harness.settle()
    assert [r.transaction_id for r in outcome(d)] == [0, 1, 2]


def test_a_read_follows_its_partition_to_another_server_when_its_server_dies(harness):
    for header in range(3):
        harness.commit(0, header=header, data=b"d%d" % header)
    client = harness.client(**{"client.autoMount": False})
    d = client.read_transactions(0, 0, 4)           # waits on server A's feed for transactions 3 and 4
    harness.settle()
    assert outcome(d) is None
    harness.network.take_down(EP_A)                  # dead: it will never answer again
    harness.settle(1)
    harness.server_b.partitions = {0}
    harness.discovery.move(0, EP_B, 2)
    harness.settle()
    [mount] = harness.server_b.messages(m.MountRequest)
    assert mount.client_hwm == 2                     # it goes on from the last transaction received
    harness.commit(0, header=3, data=b"d3")
    harness.commit(0, header=4, data=b"d4")
    harness.settle()
    assert [(r.transaction_id, r.header, r.data) for r in outcome(d)] == [(i, i, b"d%d" % i) for i in range(5)]


def test_a_read_asks_again_when_the_server_cannot_read_right_now_and_fails_when_it_never_can(harness):
    for header in range(3):
        harness.commit(0, header=header, data=b"d%d" % header)
    client = harness.client(**{"client.autoMount": False, "client.maxDataFetchRetries": 2})
    harness.server_a.batch_errors = ["reading transactions of partition 0 failed (try again later): no replica"] * 2
    d = client.read_transactions(0, 0, 2, committed=True)
    harness.settle()
    assert outcome(d) is None                        # asked again after client.mountRetryInterval, doubling
    harness.settle(0.5)
    assert outcome(d) is None
    harness.settle(1.0)
    assert [(r.transaction_id, r.data) for r in outcome(d)] == [(0, b"d0"), (1, b"d1"), (2, b"d2")]
    harness.server_a.batch_errors = ["reading transactions of partition 0 failed (try again later): no replica"] * 3
    d = client.read_transactions(0, 0, 2, committed=True)
    for delay in (0, 0.5, 1.0):
        harness.settle(delay)
    failures = []
    d.addErrback(failures.append)
    assert failures and "no replica" in failures[0].getErrorMessage()


def test_a_batch_told_to_try_again_later_waits_its_delay_while_other_batches_are_answered(harness):
    # The answers to the other batches send what is queued: the refused batch must not be in the queue,
    # or it spends its retries within milliseconds of each other, and the read fails.
    for txn in range(4000):                          # four batches of 1,000 transactions
        harness.logs.commit(0, ReqId(99, 1, 0, txn), 0, b"x")
    harness.network.flush()
    server = harness.server_a
    answer = server.on_TransactionDataBatchRequest
    asked = []

    def on_batch_request(proto, message):
        first = message.transaction_ids[0]
        asked.append((harness.clock.seconds(), first))
        if first == 0 and harness.clock.seconds() < 0.3:     # its range cannot be read for 0.3 s
            proto.sendMessage(m.TransactionDataBatchResponse.failure(
                message.req_id, "reading transactions of partition 0 failed (try again later): timeout"))
        elif first == 0:
            answer(proto, message)
        else:                                        # the others are answered 10 ms apart
            delay = 0.01 * sum(1 for _, f in asked if f != 0)
            harness.clock.callLater(delay, lambda: (answer(proto, message), harness.network.flush()))
    server.on_TransactionDataBatchRequest = on_batch_request
    client = harness.client(**{"client.autoMount": False, "client.maxDataFetchRetries": 2})
    d = client.read_transactions(0, 0, 3999, committed=True)
    harness.settle()
    for _ in range(100):
        harness.settle(0.01)
    assert [when for when, first in asked if first == 0] == pytest.approx([0.0, 0.5])   # client.mountRetryInterval
    assert len(outcome(d)) == 4000


def test_bad_checksums_are_counted_per_record_in_a_batched_read(harness):
    # Each of several records failing once is no reason to give up: the limit is per record.
    for header in range(8):
        harness.commit(0, header=header, data=b"d%d" % header)
    client = harness.client(**{"client.autoMount": False, "client.maxDataFetchRetries": 2})
    for txn in (1, 3, 5, 7):
        harness.server_a.corrupt[txn] = 1
    d = client.read_transactions(0, 0, 7, committed=True)
    harness.settle()
    assert [(r.transaction_id, r.data) for r in outcome(d)] == [(i, b"d%d" % i) for i in range(8)]
    harness.server_a.corrupt[2] = 3                  # one record failing more than the limit still fails it
    d = client.read_transactions(0, 0, 7, committed=True)
    harness.settle()
    assert "transaction 2: data failed its checksum 3 times" in outcome(d).getErrorMessage()


def test_a_read_refused_while_its_partition_moves_opens_one_connection_and_closes_it(harness):
    for header in range(3):
        harness.commit(0, header=header, data=b"d%d" % header)
    client = harness.client(**{"client.autoMount": False})
    harness.server_a.batch_errors = ["partition 0 is not served here"]
    d = client.read_transactions(0, 0, 2, committed=True)
    harness.settle()
    harness.discovery.move(0, None, None)            # unassigned for a moment (a failover)
    harness.settle(5)                                # the remount looks the partition up, and waits
    harness.server_b.partitions = {0}
    harness.discovery.move(0, EP_B, 2)               # the move and the lookup both want a connection
    harness.settle()
    assert [r.transaction_id for r in outcome(d)] == [0, 1, 2]
    harness.settle(1)
    assert len(harness.server_b.connections) == 2    # the client's stream and RPC: the read's went with it
    client.close()
    harness.settle(1)
    assert harness.server_b.connections == []


def test_a_failed_read_stays_failed_and_leaves_no_connection(harness):
    from waltz.protocols.values import ReqId
    for txn in range(1500):                          # two batches of data requests
        harness.logs.commit(0, ReqId(99, 1, 0, txn), 0, b"x")
    harness.network.flush()
    held = []
    harness.server_a.on_TransactionDataBatchRequest = lambda proto, message: held.append((proto, message))
    client = harness.client(**{"client.autoMount": False, "client.mountRetryInterval": 1000})
    d = client.read_transactions(0, 0, 1499, committed=True)
    failures = []
    d.addErrback(failures.append)
    harness.settle()
    (first, first_request), (second, second_request) = held
    first.sendMessage(m.TransactionDataBatchResponse.failure(first_request.req_id,
                                                             "partition 0 failed (try again later)"))
    harness.settle()                                 # t=0: asks again at t=1
    harness.settle(0.4)
    second.sendMessage(m.TransactionDataBatchResponse.failure(second_request.req_id, "partition 0 is not served here"))
    harness.settle()                                 # t=0.4: looks the partition up again at t=1.4
    harness.settle(0.7)                              # t=1.1: the retry timer fired; the remount is still due
    client.close()
    harness.settle()
    assert len(failures) == 1
    harness.settle(2)                                # the remount must not bring the read back
    assert harness.server_a.connections == [] and len(held) == 2


def test_read_transactions_beyond_the_log_fails(harness):
    client = harness.client()
    d = client.read_transactions(0, 5, 9)
    harness.settle()
    failure = []
    d.addErrback(failure.append)
    assert "the log ends before it" in failure[0].getErrorMessage()


# --- closing ------------------------------------------------------------------------------------------

def test_close_fails_pending_executions_and_closes_connections(harness):
    client = harness.client()
    harness.server_a.hold_appends = True
    context = RecordingContext()
    d = client.execute(context)
    harness.settle()
    client.close()
    harness.settle()
    result = outcome(d)
    assert result.outcome is Outcome.FAILED and isinstance(result.error, ClientClosedError)
    assert harness.server_a.connections == [] and harness.discovery.closed
    later = outcome(client.execute(RecordingContext()))
    assert isinstance(later.error, ClientClosedError)


def test_req_ids_number_appends_per_partition(harness):
    client = harness.client()
    for pid in (0, 1, 0):
        client.execute(RecordingContext(partition=pid))
    harness.settle()
    ids = [a.req_id for a in harness.server_a.messages(m.AppendRequest)]
    assert [i.partition_id for i in ids] == [0, 1, 0]
    assert ids[2].seq_num > ids[0].seq_num
    assert all(isinstance(i, ReqId) for i in ids)


def test_the_mount_response_settles_pending_appends_only_after_the_feed_before_it_is_applied(harness):
    callbacks = RecordingCallbacks()
    client = harness.client(callbacks)
    harness.server_a.hold_appends = True
    context = RecordingContext()
    d = client.execute(context)
    harness.settle()
    request = harness.server_a.held.pop().request
    harness.server_a.hold_appends = False
    for proto in list(harness.server_a.connections):
        proto.feeds.clear()
    harness.commit(0)                              # someone else's transaction, then ours:
    harness.server_a.commit_request(request)       # committed, but the client has seen neither
    callbacks.hold = True                          # the application is slow to apply
    harness.network.disconnect(EP_A)
    harness.settle()                               # remount: FEED_DATA x2, then MOUNT_RESPONSE(READY)
    assert client.partition_state(0) is PartitionState.MOUNTING and outcome(d) is None
    callbacks.release()
    harness.settle()
    assert context.executions == 1 and outcome(d).committed
    callbacks.release()
    assert client.partition_state(0) is PartitionState.MOUNTED
    assert callbacks.applied_ids(0) == [0, 1]


def test_an_append_lost_in_a_reconnect_fails_when_the_mount_completes(harness):
    client = harness.client()
    harness.server_a.hold_appends = True
    context = RecordingContext()
    d = client.execute(context)
    harness.settle()
    harness.server_a.held = []                     # the server lost it with the connection
    harness.server_a.hold_appends = False
    harness.network.disconnect(EP_A)
    harness.settle()
    assert context.executions == 2 and outcome(d).committed   # no flush or long wait was needed
    assert harness.server_a.messages(m.FlushRequest) == []


class SlowContext(RecordingContext):
    """A context whose execute returns a Deferred (e.g. it reads the application's database in a thread)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.pending = []

    def execute(self, builder):
        proceed = super().execute(builder)
        d = defer.Deferred()
        self.pending.append((d, proceed))
        return d

    def finish(self, error=None):
        d, proceed = self.pending.pop(0)
        if error is None:
            d.callback(proceed)
        else:
            d.errback(error)


def test_execute_may_return_a_deferred_and_holds_its_slot_meanwhile(harness):
    client = harness.client(**{"client.maxConcurrentTransactions": 1})
    slow, quick = SlowContext(header=1), RecordingContext(header=2)
    results = [client.execute(slow), client.execute(quick)]
    harness.settle()
    assert harness.server_a.messages(m.AppendRequest) == [] and quick.executions == 0
    slow.finish()
    harness.settle()
    assert [a.header for a in harness.server_a.messages(m.AppendRequest)] == [1, 2]
    assert all(outcome(r).committed for r in results)


def test_an_execute_whose_deferred_never_fires_expires_and_frees_its_slot(harness):
    client = harness.client(**{"client.maxConcurrentTransactions": 1, "client.transactionExpiration": 10000})
    stuck, quick = SlowContext(header=1), RecordingContext(header=2)
    results = [client.execute(stuck)]
    harness.settle(5)
    results.append(client.execute(quick))         # waits for the slot (it expires 5 s after the stuck one)
    harness.settle(4.9)
    assert harness.server_a.messages(m.AppendRequest) == [] and quick.executions == 0
    harness.settle(0.2)
    assert outcome(results[0]).outcome is Outcome.EXPIRED and stuck.events[-1] == "expiration"
    harness.settle()
    assert outcome(results[1]).committed and [a.header for a in harness.server_a.messages(m.AppendRequest)] == [2]
    stuck.finish()                                # firing at last changes nothing
    harness.settle()
    assert [a.header for a in harness.server_a.messages(m.AppendRequest)] == [2]


def test_a_flush_does_not_fail_an_append_of_an_older_req_id_sent_after_it(harness):
    # The slow context got its ReqId first but was sent after the FLUSH: the server's answer to the FLUSH
    # does not cover it, and failing it ran the context again while its append was still queued (the log
    # then held its transaction twice).
    client = harness.client(**{"client.longWaitThreshold": 100000})
    server = harness.server_a
    server.hold_appends = True
    flushes = []
    server.on_FlushRequest = lambda proto, message: flushes.append((proto, message))   # answered below
    slow, quick = SlowContext(header=1), RecordingContext(header=2)
    d_slow = client.execute(slow)
    client.execute(quick)
    harness.settle()
    [a_quick] = server.messages(m.AppendRequest)
    client.flush()
    harness.settle()
    [(proto, flush)] = flushes
    slow.finish()                                 # sent after the FLUSH
    harness.settle()
    server.held = [h for h in server.held if h.request.req_id != a_quick.req_id]      # the quick one was lost
    proto.sendMessage(m.FlushResponse(flush.req_id, harness.logs[0].high_water_mark))
    harness.settle()
    assert slow.executions == 1
    server.commit_held(0)                         # the slow one's append commits
    harness.settle()
    assert outcome(d_slow).committed and slow.executions == 1
    assert [r.header for r in harness.logs[0].records].count(1) == 1


def test_a_context_still_building_across_a_remount_is_executed_again(harness):
    client = harness.client()
    slow = SlowContext()
    d = client.execute(slow)
    harness.settle()
    harness.server_b.partitions = {0}
    harness.discovery.move(0, EP_B, 2)
    harness.settle()
    slow.finish()                          # built for generation 1: dropped, built again
    harness.settle()
    assert slow.executions == 2 and harness.server_a.messages(m.AppendRequest) == []
    slow.finish()
    harness.settle()
    [append] = harness.server_b.messages(m.AppendRequest)
    assert append.req_id.generation == 2 and outcome(d).committed


def test_a_failing_deferred_from_execute_ends_the_context(harness):
    client = harness.client()
    slow = SlowContext()
    d = client.execute(slow)
    slow.finish(KeyError("gone"))
    result = outcome(d)
    assert result.outcome is Outcome.FAILED and isinstance(result.error, KeyError)
    assert slow.events[-1] == ("exception", "KeyError")
    after = client.execute(RecordingContext())      # its slot was released
    harness.settle()
    assert outcome(after).committed


def test_when_applied_lets_the_application_read_its_own_write(harness):
    callbacks = RecordingCallbacks()
    client = harness.client(callbacks)
    harness.commit(0)
    callbacks.hold = True
    d = client.execute(RecordingContext())
    harness.settle()
    result = outcome(d)
    assert result.committed and (result.partition_id, result.transaction_id) == (0, 1)
    applied = client.when_applied(0, result.transaction_id)
    assert outcome(applied) is None            # committed, but not applied yet
    callbacks.release()
    assert outcome(applied) == 1 and outcome(client.when_applied(0, 0)) == 1
    pending = client.when_applied(0, 5)
    client.close()
    assert outcome(pending).check(ClientClosedError)


def test_when_applied_fails_for_a_partition_this_client_does_not_apply(harness):
    client = harness.client(**{"client.autoMount": False})
    harness.commit(0)
    assert outcome(client.when_applied(0, 0)).check(PartitionInactiveError)     # never mounted
    client.set_partitions([0])
    harness.settle()
    assert outcome(client.when_applied(0, 0)) == 0
    waiting = client.when_applied(0, 5)
    client.set_partitions([])
    harness.settle()
    assert client.partition_state(0) is PartitionState.INACTIVE
    assert outcome(waiting).check(PartitionInactiveError)                         # dropped meanwhile
    assert outcome(client.when_applied(0, 0)) == 0                                 # applied before: at once


def test_a_client_that_cannot_join_closes_its_zookeeper_session(harness):
    from waltz.zk.errors import ClusterNotFoundError
    client = harness.client(join=False)
    harness.discovery._waiting.pop().errback(ClusterNotFoundError("no Waltz cluster at /test"))
    assert client.state is ClientState.FAILED and harness.discovery.closed


def test_a_failing_high_water_mark_read_is_reported_and_retried(harness):
    callbacks = RecordingCallbacks()
    answers = [RuntimeError("database down"), "not a number", 0]

    def get_client_high_water_mark(partition_id):
        if partition_id == 1:
            return -1
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer
    callbacks.get_client_high_water_mark = get_client_high_water_mark
    harness.commit(0)
    harness.commit(0)
    client = harness.client(callbacks)
    assert client.partition_state(0) is PartitionState.INACTIVE
    assert [(pid, txn, type(e).__name__) for pid, txn, e in callbacks.errors] == [(0, -1, "RuntimeError")]
    harness.settle(0.5)
    assert [type(e).__name__ for _, _, e in callbacks.errors] == ["RuntimeError", "ValueError"]
    harness.settle(0.5)
    assert client.partition_state(0) is PartitionState.MOUNTED and callbacks.applied_ids(0) == [1]


def test_a_client_that_cannot_join_fails_its_executions(harness):
    from waltz.zk.errors import ClusterNotFoundError
    client = harness.client(join=False)
    assert outcome(client.high_water_mark(0)).check(WaltzClientError)
    waiting = client.execute(RecordingContext())
    started = client.when_started()
    harness.discovery._waiting.pop().errback(ClusterNotFoundError("no Waltz cluster at /test"))
    assert client.state is ClientState.FAILED
    assert outcome(started).check(ClusterNotFoundError)
    assert isinstance(outcome(waiting).error, ClusterNotFoundError)
    assert isinstance(outcome(client.execute(RecordingContext())).error, ClusterNotFoundError)


def test_a_slow_application_pauses_reading_the_stream_connection(harness):
    callbacks = RecordingCallbacks()
    client = harness.client(callbacks)
    callbacks.hold = True
    for _ in range(700):
        harness.commit(0)
    stream = client._servers[EP_A].stream.protocol
    assert stream.reading_paused and stream.inbound_pending == 600
    while callbacks.pending:
        callbacks.release()
        harness.settle()
    assert not stream.reading_paused and callbacks.applied_ids(0) == list(range(700))


class DroppingContext(RecordingContext):
    """On completion, the application drops the transaction's partition (``client.set_partitions([])``), and
    with ``add_back`` adds it back at once."""

    def __init__(self, client, add_back=False):
        super().__init__()
        self.client = client
        self.add_back = add_back

    def on_completion(self, result):
        super().on_completion(result)
        self.client.set_partitions([])
        if self.add_back:
            self.client.set_partitions([0])


def test_a_partition_dropped_by_a_completion_hook_applies_that_transaction_then_unmounts(harness):
    # The completion hook runs just before the transaction is applied: the partition unmounts once that apply
    # has ended, and the transaction counts as applied, as the application recorded it.
    client = harness.client(**{"client.autoMount": False})
    client.set_partitions([0])
    harness.settle()
    context = DroppingContext(client)
    result = client.execute(context)
    harness.settle()
    assert result.called and result.result.committed
    assert client.callbacks.applied_ids(0) == [0]
    assert client.partition_state(0) is PartitionState.INACTIVE
    assert client.client_high_water_mark(0) == 0
    assert context.events[-1] == "application"


def test_an_own_transaction_whose_apply_fails_is_retried_and_then_applied_once(harness):
    client = harness.client()
    client.callbacks.fail_next = 1
    context = RecordingContext()
    result = client.execute(context)
    harness.settle()
    assert result.result.committed and context.events == ["execute", ("completion", True)]
    harness.settle(60)
    assert client.callbacks.applied_ids(0) == [0]
    assert context.events == ["execute", ("completion", True), "application"]
    assert client.client_high_water_mark(0) == 0


class DroppingCallbacks(RecordingCallbacks):
    """The application drops the partition (``client.set_partitions([])``) from inside apply_transaction, once,
    then raises or returns what ``outcome`` says: ``"raise"``, ``"hold"`` (a pending Deferred) or ``"return"``."""

    def __init__(self, outcome):
        super().__init__()
        self.outcome = outcome
        self.client = None
        self.calls = []

    def apply_transaction(self, transaction):
        self.calls.append(transaction.transaction_id)
        if len(self.calls) == 1:
            self.client.set_partitions([])
            if self.outcome == "raise":
                raise RuntimeError("apply failed after dropping its partition")
            if self.outcome == "hold":
                self.hold = True
        return super().apply_transaction(transaction)


@pytest.mark.parametrize("outcome", ["raise", "hold", "return"])
def test_an_apply_that_drops_its_partition_ends_first_is_not_retried_and_the_partition_comes_back_clean(
        harness, outcome):
    callbacks = DroppingCallbacks(outcome)
    client = harness.client(callbacks, **{"client.autoMount": False})
    callbacks.client = client
    client.set_partitions([0])
    harness.settle()
    harness.commit(0)
    harness.settle(600)                     # past any retry of the failed apply
    # The partition unmounts once the apply that dropped it has ended (a held one, when it fires).
    assert client.partition_state(0) is (PartitionState.MOUNTED if outcome == "hold" else PartitionState.INACTIVE)
    callbacks.release()
    harness.settle()
    assert client.partition_state(0) is PartitionState.INACTIVE
    # A failed apply is not retried once its partition is dropped, nor counted; one that returned is counted.
    assert callbacks.calls == [0] and client.client_high_water_mark(0) == (-1 if outcome == "raise" else 0)
    callbacks.hold = False
    client.set_partitions([0])               # mounted again from the application's own mark
    harness.settle()
    # An apply that raised recorded nothing: the application's mark sends transaction 0 again, once. One that
    # returned (at once or later) recorded it: it is not delivered again.
    assert callbacks.calls == ([0, 0] if outcome == "raise" else [0])
    assert client.client_high_water_mark(0) == 0 and callbacks.high_water_marks[0] == 0


class CountingCallbacks(RecordingCallbacks):
    """Records the transaction ids handed to apply_transaction."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def apply_transaction(self, transaction):
        self.calls.append(transaction.transaction_id)
        return super().apply_transaction(transaction)


@pytest.mark.parametrize("dropped_by", ["apply", "completion hook"])
def test_a_partition_added_back_while_the_apply_that_dropped_it_runs_waits_for_that_apply(harness, dropped_by):
    # Dropped from inside apply_transaction (or from the completion hook just before it), the partition became
    # INACTIVE before that apply returned its Deferred; added back meanwhile, it read the application's mark
    # (which did not show the transaction yet) and delivered the same transaction again, concurrently.
    callbacks = DroppingCallbacks("hold") if dropped_by == "apply" else CountingCallbacks()
    client = harness.client(callbacks, **{"client.autoMount": False})
    callbacks.client = client
    client.set_partitions([0])
    harness.settle()
    if dropped_by == "apply":
        harness.commit(0)
    else:
        callbacks.hold = True
        client.execute(DroppingContext(client))
    harness.settle()
    # Dropped by the apply itself, the partition waits for that apply before it unmounts; dropped by the hook
    # while the transaction was not being applied yet (the apply was held), it is inactive.
    assert not client.partitions
    assert callbacks.calls == [0] and len(callbacks.pending) == 1      # its apply still runs
    client.set_partitions([0])
    harness.settle()
    assert callbacks.calls == [0]
    callbacks.hold = False
    callbacks.release()                      # the apply ends: the partition goes on from the mark it recorded
    harness.settle()
    assert client.partition_state(0) is PartitionState.MOUNTED
    harness.commit(0)
    assert callbacks.calls == [0, 1] and client.client_high_water_mark(0) == 1


class ReaddingCallbacks(RecordingCallbacks):
    """The application drops its partition and adds it back, synchronously, from inside apply_transaction of
    transaction ``txn`` (the first time), then applies that transaction (raising first, with ``fail``)."""

    def __init__(self, txn, fail=False):
        super().__init__()
        self.client = None
        self.calls = []
        self.txn = txn
        self.fail = fail

    def apply_transaction(self, transaction):
        self.calls.append(transaction.transaction_id)
        if self.calls.count(self.txn) == 1 and transaction.transaction_id == self.txn:
            self.client.set_partitions([])
            self.client.set_partitions([0])
            if self.fail:
                raise RuntimeError("apply failed after dropping and re-adding its partition")
        return super().apply_transaction(transaction)


def test_a_partition_dropped_and_added_back_by_a_completion_hook_delivers_nothing_twice(harness):
    # The hook runs just before the transaction is applied: re-added there, the partition read the application's
    # mark before that apply and delivered the transaction again.
    callbacks = CountingCallbacks()
    client = harness.client(callbacks, **{"client.autoMount": False})
    client.set_partitions([0])
    harness.settle()
    result = client.execute(DroppingContext(client, add_back=True))
    harness.settle()
    assert result.called and result.result.committed
    harness.commit(0)
    harness.settle()
    assert callbacks.calls == [0, 1] and client.client_high_water_mark(0) == 1
    assert client.partition_state(0) is PartitionState.MOUNTED


@pytest.mark.parametrize("fail", [False, True])
@pytest.mark.parametrize("queued", [False, True])
def test_a_partition_dropped_and_added_back_inside_a_synchronous_apply_delivers_nothing_twice(
        harness, fail, queued):
    # The partition was INACTIVE, and active again, before that apply returned: it read the application's mark,
    # which did not show the transaction yet, and delivered it again. Transaction 1 is applied at once as it
    # arrives, or (``queued``) from the feed queue, behind a held apply of transaction 0.
    callbacks = ReaddingCallbacks(1, fail)
    client = harness.client(callbacks, **{"client.autoMount": False})
    callbacks.client = client
    client.set_partitions([0])
    harness.settle()
    callbacks.hold = queued
    harness.commit(0)
    harness.commit(0)
    callbacks.hold = False
    callbacks.release()
    harness.commit(0)
    harness.settle(600)         # past any retry of the failed apply
    assert callbacks.calls == ([0, 1, 1, 2] if fail else [0, 1, 2])     # a failed apply is delivered again, once
    assert callbacks.applied_ids() == [0, 1, 2] and client.client_high_water_mark(0) == 2
    assert client.partition_state(0) is PartitionState.MOUNTED and client.partitions == {0}


class ReaddingOnFailure(RecordingCallbacks):
    """apply_transaction fails once; the application's uncaught_exception then drops its partition and adds it
    back, and applies slowly from then on (a pending Deferred)."""

    def __init__(self):
        super().__init__()
        self.client = None
        self.calls = []
        self.fail_next = 1

    def apply_transaction(self, transaction):
        self.calls.append(transaction.transaction_id)
        return super().apply_transaction(transaction)

    def uncaught_exception(self, partition_id, transaction_id, exception):
        super().uncaught_exception(partition_id, transaction_id, exception)
        if len(self.errors) == 1:
            self.client.set_partitions([])
            self.client.set_partitions([0])
            self.hold = True


def test_a_partition_dropped_and_added_back_from_uncaught_exception_applies_nothing_twice_at_once(harness):
    # The retry of the failed apply was armed after uncaught_exception had dropped the feed: it fired beside the
    # redelivery of the same transaction and applied it again while that apply was still running.
    callbacks = ReaddingOnFailure()
    client = harness.client(callbacks, **{"client.autoMount": False})
    callbacks.client = client
    client.set_partitions([0])
    harness.settle()
    harness.commit(0)
    harness.settle(5)               # past any retry
    assert callbacks.calls == [0, 0] and len(callbacks.pending) == 1     # failed, then redelivered (held)
    callbacks.hold = False
    callbacks.release()
    harness.settle()
    assert callbacks.calls == [0, 0] and callbacks.applied_ids() == [0]
    assert client.client_high_water_mark(0) == 0


def test_a_failed_apply_of_the_clients_own_transaction_lets_the_next_execution_start_at_once(harness):
    client = harness.client(**{"client.maxConcurrentTransactions": 1})
    first, second = RecordingContext(), RecordingContext()
    client.execute(first)
    client.execute(second)                   # waits for room
    assert second.events == []
    client.callbacks.fail_next = 1           # the apply of the first transaction fails (retried later)
    harness.settle()                         # its feed item settles it: room for the second at once
    assert first.events[:2] == ["execute", ("completion", True)]
    assert second.events[:1] == ["execute"]


class ClosingContext(RecordingContext):
    """Its execute closes the client, or drops the partition, before returning True."""

    def __init__(self, client, action):
        super().__init__()
        self.client = client
        self.action = action

    def execute(self, builder):
        proceed = super().execute(builder)
        if self.action == "close":
            self.client.close()
        else:
            self.client.set_partitions([])
        return proceed


@pytest.mark.parametrize("action, error", [("close", ClientClosedError), ("drop", PartitionInactiveError)])
def test_an_execute_that_closes_the_client_or_drops_its_partition_ends_its_own_context(harness, action, error):
    # Before: the execution being attempted was in none of the queues the clean-up fails, and its append was
    # registered on the closed partition: its Deferred never fired.
    client = harness.client(**{"client.autoMount": False})
    client.set_partitions([0])
    harness.settle()
    context = ClosingContext(client, action)
    d = client.execute(context)
    harness.settle()
    assert isinstance(outcome(d).error, error) and context.events[-1] == ("exception", error.__name__)
    assert harness.server_a.messages(m.AppendRequest) == []


def test_a_read_through_the_feed_fetches_its_data_on_a_connection_without_the_feed(harness):
    """The mount's catch-up would go on past ``end`` (to the partition's end) for as long as the data takes:
    once the feed reached ``end`` the read leaves that connection, and later commits are not fed to it."""
    for header in range(6):
        harness.commit(0, header=header % 2, data=b"d%d" % header)
    held = []
    harness.server_a.on_TransactionDataBatchRequest = lambda proto, message: held.append((proto, message))
    client = harness.client(**{"client.autoMount": False})
    d = client.read_transactions(0, 0, 1, headers={1})
    harness.settle()
    [(fetching, request)] = held
    [mounted] = [proto for proto, message in harness.server_a.received if isinstance(message, m.MountRequest)]
    assert fetching is not mounted and fetching.mount_seq_nums == []
    assert mounted not in harness.server_a.connections, "the fed connection is closed"
    assert request.transaction_ids == (1,)
    fetching.sendMessage(m.TransactionDataBatchResponse.success(
        request.req_id, (harness.logs[0].records[1],)))
    harness.settle()
    assert [(r.transaction_id, r.data) for r in outcome(d)] == [(1, b"d1")]


def test_client_idle_timeout_sets_when_a_silent_server_connection_is_dropped(harness):
    """The fake servers send no keep-alives: a connection hears nothing once the mount is done."""
    default = harness.client()
    patient = harness.client(**{"client.idleTimeout": 40000})

    def seq_nums(client):
        connections = client._servers[EP_A]
        return connections.stream.seq_num, connections.rpc.seq_num
    before = {client: seq_nums(client) for client in (default, patient)}
    for _ in range(30):         # past 20 s and a liveness tick: the default client dropped both and reconnected
        harness.settle(1)
    assert seq_nums(default) != before[default]
    assert seq_nums(patient) == before[patient]
    for _ in range(20):         # past 40 s: the patient one too
        harness.settle(1)
    assert seq_nums(patient) != before[patient]
