"""Cancelling the Deferred of ``WaltzClient.execute``: an execution not sent yet is withdrawn, one sent
settles as usual and is not attempted again (fake servers on a Clock, as in test_client.py)."""

from twisted.internet import defer
from twisted.python.failure import Failure

from tests.client.fakes import EP_A, RecordingContext
from tests.client.test_client import SlowContext, _waiting_to_retry_after_a_lock_failure, outcome
from waltz.client.client import ClientState
from waltz.client.errors import ClientClosedError
from waltz.client.partition import PartitionState
from waltz.protocols import client_messages as m


def _cancelled(d):
    """True when ``d`` failed with CancelledError (consumed)."""
    result = outcome(d)
    return isinstance(result, Failure) and result.check(defer.CancelledError) is not None


def test_an_execution_cancelled_while_it_waits_for_room_is_never_appended(harness):
    # Before: the cancelled submission stayed queued, was executed once there was room, and committed: a
    # transaction the caller had given up on (addTimeout) was in the log.
    client = harness.client(**{"client.maxConcurrentTransactions": 1})
    harness.server_a.hold_appends = True
    first, second = RecordingContext(header=1), RecordingContext(header=2)
    d_first = client.execute(first)
    harness.settle()
    d_second = client.execute(second)              # waits for room behind the first
    d_second.addTimeout(1, harness.clock)
    harness.settle(1.5)
    failures = []
    d_second.addErrback(failures.append)
    assert failures and failures[0].check(defer.TimeoutError)
    assert second.events == [("exception", "CancelledError")]
    harness.server_a.hold_appends = False
    harness.server_a.commit_held(0)                # room again
    harness.settle()
    assert outcome(d_first).committed
    assert [a.header for a in harness.server_a.messages(m.AppendRequest)] == [1]
    assert len(harness.logs[0].records) == 1 and second.executions == 0
    d_third = client.execute(RecordingContext(header=3))     # the slot is free for the next one
    harness.settle()
    assert outcome(d_third).committed


def test_an_execution_cancelled_while_its_execute_runs_frees_its_slot_and_is_not_appended(harness):
    client = harness.client(**{"client.maxConcurrentTransactions": 1})
    slow, quick = SlowContext(header=1), RecordingContext(header=2)
    d_slow = client.execute(slow)
    d_quick = client.execute(quick)                # waits for the slot the slow execute holds
    harness.settle()
    d_slow.cancel()
    assert _cancelled(d_slow) and slow.events == ["execute", ("exception", "CancelledError")]
    harness.settle()
    assert outcome(d_quick).committed
    slow.finish()                                  # its execute's Deferred fires at last: ignored
    harness.settle()
    assert [a.header for a in harness.server_a.messages(m.AppendRequest)] == [2]


def test_an_execution_cancelled_while_it_waits_to_retry_after_a_lock_failure_is_not_retried(harness):
    client = harness.client()
    context, d = _waiting_to_retry_after_a_lock_failure(harness, client)
    d.cancel()
    assert _cancelled(d) and context.events[-1] == ("exception", "CancelledError")
    harness.server_a.hold_appends = False
    for _ in range(4):
        harness.commit(0)                          # past the conflicting transaction 3
    assert context.executions == 1 and len(harness.server_a.messages(m.AppendRequest)) == 1


def test_an_append_already_sent_settles_as_usual_when_its_execution_is_cancelled(harness):
    client = harness.client()
    harness.server_a.hold_appends = True
    committed, conflicting = RecordingContext(header=1), RecordingContext(header=2)
    d_committed, d_conflicting = client.execute(committed), client.execute(conflicting)
    harness.settle()
    d_committed.cancel()
    d_conflicting.cancel()
    assert _cancelled(d_committed) and _cancelled(d_conflicting)
    assert committed.events == ["execute"] and conflicting.events == ["execute"]   # on the server: not ended
    harness.server_a.commit_held(0)
    harness.server_a.lock_fail_held(0, 0)
    harness.settle()
    # The hooks say what became of them; the failed one is not attempted again.
    assert committed.events[1] == ("completion", True)
    assert conflicting.events == ["execute", "lock failure", ("exception", "CancelledError")]
    assert [a.header for a in harness.server_a.messages(m.AppendRequest)] == [1, 2]


def test_an_execution_cancelled_before_the_client_started_is_never_executed(harness):
    client = harness.client(join=False)
    context = RecordingContext()
    d = client.execute(context)
    d.cancel()
    assert _cancelled(d) and context.events == [("exception", "CancelledError")]
    harness.join()
    assert context.executions == 0 and harness.server_a.messages(m.AppendRequest) == []


def test_a_hook_that_closes_the_client_while_a_mount_completes_leaves_the_partition_closed(harness):
    # The mount's completion fails what is still pending; a hook run by that closed the client, and the
    # mount then marked the partition MOUNTED again: a later get_data on it never answered.
    client = harness.client()
    partition = client._partitions[0]
    harness.server_a.hold_appends = True

    class ClosesTheClient(RecordingContext):
        def on_exception(self, exception):
            super().on_exception(exception)
            client.close()

    context = ClosesTheClient()
    d = client.execute(context)
    harness.settle()
    d.cancel()                                     # sent: it settles as usual, then ends with CancelledError
    assert _cancelled(d)
    harness.server_a.held = []                     # the append is lost with the connection
    harness.network.disconnect(EP_A)               # the remount's completion fails it: the hook closes
    harness.settle(1)
    assert context.events[-1] == ("exception", "CancelledError")
    assert client.state is ClientState.CLOSED and partition.state is PartitionState.CLOSED
    fetched = partition.fetch_data(0)
    assert isinstance(outcome(fetched), Failure) and outcome(fetched).check(ClientClosedError)
