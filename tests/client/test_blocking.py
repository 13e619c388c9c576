"""BlockingWaltzClient: the same WaltzClient on a reactor thread, with blocking calls (real TCP to a fake server)."""

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import pytest_twisted
from twisted.internet import defer, reactor, threads

from tests.client.fakes import BASE_CONFIG, FakeDiscovery, FakeServer, FakeStore, RecordingContext
from waltz.client.api import Outcome, WaltzClientCallbacks
from waltz.client.blocking import BlockingWaltzClient, ThreadedCallbacks, call_blocking, ensure_reactor_running
from waltz.client.discovery import PartitionLocation
from waltz.client.network import Endpoint
from waltz.protocols.values import ReqId


def fake_cluster():
    """A fake server on a real loopback port holding two partitions, and a discovery pointing at it."""
    store = FakeStore(2)
    server = FakeServer(store, [0, 1])
    port = reactor.listenTCP(0, server, interface="127.0.0.1")
    location = PartitionLocation(Endpoint("127.0.0.1", port.getHost().port), 1)
    discovery = FakeDiscovery(2, locations={0: location, 1: location})
    discovery.joined = True
    return store, server, port, discovery


class BlockingCallbacks(WaltzClientCallbacks):
    """Plain blocking callbacks: they run in a worker thread and fetch data synchronously."""

    def __init__(self):
        self.applied = []
        self.threads = set()

    def get_client_high_water_mark(self, partition_id):
        return -1

    def apply_transaction(self, transaction):
        self.threads.add(threading.current_thread().name)
        self.applied.append((transaction.partition_id, transaction.transaction_id, transaction.get_data()))


class AppliedContext(RecordingContext):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.applied = threading.Event()

    def on_application(self):
        super().on_application()
        self.applied.set()


@pytest_twisted.ensureDeferred
async def test_blocking_calls_from_a_script_thread():
    store, server, port, discovery = fake_cluster()
    store.commit(0, ReqId(99, 1, 0, 0), 5, b"first")
    callbacks = BlockingCallbacks()

    def script():
        with BlockingWaltzClient(callbacks, BASE_CONFIG, discovery=discovery, timeout=20) as client:
            context = AppliedContext(header=9, data=b"mine")
            result = client.execute(context)
            assert context.applied.wait(20)
            return (result, client.high_water_marks(), client.get_transaction_data(0, 1),
                    client.read_transactions(0, 0), client.client_high_water_mark(0), client.client_id)
    try:
        result, marks, data, records, hwm, client_id = await threads.deferToThread(script)
    finally:
        await port.stopListening()
    assert result.outcome is Outcome.COMMITTED
    assert marks == {0: 1, 1: -1} and data == b"mine" and hwm == 1 and client_id == 7
    assert [(r.transaction_id, r.header, r.data) for r in records] == [(0, 5, b"first"), (1, 9, b"mine")]
    assert callbacks.applied == [(0, 0, b"first"), (0, 1, b"mine")]
    assert callbacks.threads == {"PoolThread-waltz-callbacks-0"}


@pytest_twisted.ensureDeferred
async def test_a_read_that_timed_out_is_cancelled_and_the_next_read_goes_on():
    store, server, port, discovery = fake_cluster()
    for seq in range(3):
        store.commit(0, ReqId(99, 1, 0, seq), 5, b"x%d" % seq)

    def script():
        from waltz.client.blocking import ReadOnlyCallbacks
        client = BlockingWaltzClient(ReadOnlyCallbacks(), {**BASE_CONFIG, "client.autoMount": False},
                                     discovery=discovery, timeout=1)
        try:
            with pytest.raises(TimeoutError):
                client.read_transactions(0, 0, 5)      # beyond the high-water mark (2): waits
            # before the fix the first read held the partition's read lock for ever: this one timed out too
            records = client.read_transactions(0, 0, 2)
            return [r.transaction_id for r in records], len(client.client._reads)
        finally:
            client.close()
    try:
        ids, reads_left = await threads.deferToThread(script)
    finally:
        await port.stopListening()
    assert ids == [0, 1, 2] and reads_left == 0


def test_the_facade_refuses_the_reactor_thread():
    # pytest-twisted runs the reactor in this thread
    with pytest.raises(RuntimeError, match="reactor thread"):
        ensure_reactor_running(reactor)


def test_every_blocking_call_refuses_the_reactor_thread():
    # Waiting on the reactor thread for the reactor would freeze it until the timeout (or for ever).
    with pytest.raises(RuntimeError, match="reactor thread"):
        call_blocking(reactor, lambda: 1, timeout=5)


@pytest_twisted.ensureDeferred
async def test_a_callback_may_close_the_client_from_its_worker_thread_and_other_closes_wait_for_it():
    # The application's own close() (a with block's exit) used to return at once while the callback that had
    # closed the client still ran: the callback's close() took the worker thread and cannot wait for itself.
    store, server, port, discovery = fake_cluster()
    store.commit(0, ReqId(99, 1, 0, 0), 5, b"first")
    closed, made, finished = threading.Event(), threading.Event(), threading.Event()
    errors = []

    class Closing(BlockingCallbacks):
        def apply_transaction(self, transaction):
            made.wait(20)                   # the apply may start before the constructor has returned
            try:
                self.client.close()
            except Exception as exc:        # before the fix: "cannot join current thread"
                errors.append(exc)
            closed.set()
            threading.Event().wait(0.5)     # then finishes its own work
            finished.set()

    def script():
        callbacks = Closing()
        callbacks.client = BlockingWaltzClient(callbacks, BASE_CONFIG, discovery=discovery, timeout=20)
        made.set()
        assert closed.wait(20)
        callbacks.client.close()
        return callbacks.client, finished.is_set()
    try:
        client, finished_when_closed = await threads.deferToThread(script)
    finally:
        await port.stopListening()
    assert errors == [] and client.client.state.value == "closed"
    assert finished_when_closed, "close() returned while the callback still ran"


def test_a_failed_constructor_leaves_no_thread_behind():
    # A bad config key: the constructor raises, and nothing it started may keep the process alive.
    script = textwrap.dedent("""
        import threading
        from tests.client.test_blocking import BlockingCallbacks
        from waltz.client.blocking import BlockingWaltzClient
        try:
            BlockingWaltzClient(BlockingCallbacks(), {"zookeeper.connectString": "127.0.0.1:1",
                                                      "cluster.root": "/t", "client.bogus": 1}, timeout=20)
        except Exception as exc:
            print(type(exc).__name__)
        print(sorted(t.name for t in threading.enumerate() if t.is_alive() and t is not threading.main_thread()
                     and not t.daemon))
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=os.getcwd(), capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["ConfigError", "[]"]


def test_a_script_without_a_reactor_gets_one_in_a_thread(tmp_path):
    script = textwrap.dedent("""
        import threading
        from twisted.internet import reactor
        from tests.client.fakes import BASE_CONFIG, RecordingContext
        from tests.client.test_blocking import BlockingCallbacks, fake_cluster
        from waltz.client.blocking import BlockingWaltzClient, ThreadedCallbacks, call_blocking, ensure_reactor_running

        ensure_reactor_running(reactor)
        assert reactor.running and threading.current_thread() is threading.main_thread()
        store, server, port, discovery = call_blocking(reactor, fake_cluster)
        with BlockingWaltzClient(BlockingCallbacks(), BASE_CONFIG, discovery=discovery, timeout=20) as client:
            print(client.execute(RecordingContext(partition=1)).outcome.value)
            print(client.high_water_mark(1))
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=os.getcwd(), capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["committed", "0"]


@pytest_twisted.ensureDeferred
async def test_a_threaded_callback_that_returns_a_deferred_is_an_error():
    # Run in the worker thread, its Deferred used to be taken as the result: a high-water mark that is
    # not an int, or a transaction counted applied before its Deferred fired (its failure lost).
    class Asynchronous(WaltzClientCallbacks):
        def get_client_high_water_mark(self, partition_id):
            return defer.succeed(-1)

    callbacks = ThreadedCallbacks(Asynchronous(), reactor)
    try:
        with pytest.raises(TypeError, match="returned a Deferred from the callbacks' worker thread"):
            await callbacks.get_client_high_water_mark(0)
    finally:
        callbacks.stop()


@pytest_twisted.ensureDeferred
async def test_a_close_refused_on_the_reactor_thread_stops_nothing():
    # The refusal used to come after the worker thread was stopped anyway (joined on the reactor thread):
    # the client ran on with no worker, every later apply failed and was retried for ever.
    store, server, port, discovery = fake_cluster()
    store.commit(0, ReqId(99, 1, 0, 0), 5, b"first")
    callbacks = BlockingCallbacks()
    client = await threads.deferToThread(
        lambda: BlockingWaltzClient(callbacks, BASE_CONFIG, discovery=discovery, timeout=20))
    try:
        await threads.deferToThread(client.when_applied, 0, 0)
        with pytest.raises(RuntimeError, match="reactor thread"):
            client.close()                 # pytest-twisted runs this test on the reactor thread
        store.commit(0, ReqId(99, 1, 0, 1), 5, b"second")
        await threads.deferToThread(client.when_applied, 0, 1)
        assert callbacks.applied == [(0, 0, b"first"), (0, 1, b"second")]
    finally:
        await threads.deferToThread(client.close)
        await port.stopListening()


@pytest_twisted.ensureDeferred
async def test_close_waits_for_a_blocked_callback_at_most_the_timeout():
    store, server, port, discovery = fake_cluster()
    store.commit(0, ReqId(99, 1, 0, 0), 5, b"first")
    entered, release = threading.Event(), threading.Event()

    class Stuck(BlockingCallbacks):
        def apply_transaction(self, transaction):
            entered.set()
            release.wait(30)          # a database call that hangs

    def script():
        client = BlockingWaltzClient(Stuck(), BASE_CONFIG, discovery=discovery, timeout=1)
        assert entered.wait(20)
        with pytest.raises(TimeoutError, match="waltz-callbacks thread did not finish its current call within 1 s"):
            client.close()
        return client
    try:
        client = await threads.deferToThread(script)
        assert client.client.state.value == "closed"
    finally:
        release.set()
        await port.stopListening()


def test_a_stopped_reactor_fails_every_call_at_once():
    # A reactor cannot run again once stopped: calls used to wait their whole timeout (or for ever), and
    # ensure_reactor_running said the reactor "did not start" (ReactorNotRestartable went to stderr).
    script = textwrap.dedent("""
        import threading, time
        from twisted.internet import reactor
        from waltz.client.blocking import ReactorStoppedError, call_blocking, ensure_reactor_running
        ensure_reactor_running(reactor)
        waiting = []

        def wait_for_ever():
            try:
                call_blocking(reactor, lambda: __import__("twisted.internet.defer").internet.defer.Deferred())
            except ReactorStoppedError:
                waiting.append("stopped")
        waiter = threading.Thread(target=wait_for_ever)
        waiter.start()
        time.sleep(0.3)
        reactor.callFromThread(reactor.stop)
        waiter.join(10)
        print(waiting)
        for call in (lambda: call_blocking(reactor, lambda: 1, timeout=30),
                     lambda: ensure_reactor_running(reactor, timeout=30)):
            start = time.monotonic()
            try:
                call()
            except ReactorStoppedError:
                print("refused", time.monotonic() - start < 5)
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=os.getcwd(), capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:3] == ["['stopped']", "refused True", "refused True"]


@pytest_twisted.ensureDeferred
async def test_a_failing_threaded_uncaught_exception_is_logged_not_left_in_a_deferred():
    from twisted.logger import globalLogPublisher

    class Failing(WaltzClientCallbacks):
        def get_client_high_water_mark(self, partition_id):
            return -1

        def uncaught_exception(self, partition_id, transaction_id, exception):
            raise ValueError("the report failed")

    events = []
    globalLogPublisher.addObserver(events.append)
    callbacks = ThreadedCallbacks(Failing(), reactor)
    try:
        callbacks.uncaught_exception(0, 3, RuntimeError("apply failed"))
        for _ in range(100):
            if events and any("could not report" in e.get("log_format", "") for e in events):
                break
            await threads.deferToThread(threading.Event().wait, 0.05)
    finally:
        globalLogPublisher.removeObserver(events.append)
        callbacks.stop()
    reports = [e for e in events if "could not report" in e.get("log_format", "")]
    assert len(reports) == 1 and reports[0]["log_failure"].check(ValueError)
    assert reports[0]["pid"] == 0 and reports[0]["txn"] == 3


def test_an_answer_there_at_the_deadline_is_the_answer_not_a_timeout():
    # Before: once the deadline had passed the wait returned "no answer" without looking, so an execute
    # that committed in the last instant was reported as a timeout ("may or may not have committed").
    import queue
    from waltz.client.blocking import _NO_ANSWER, _wait_for_answer
    answered = queue.Queue()
    answered.put("committed")
    assert _wait_for_answer(reactor, answered, 0) == "committed"
    assert _wait_for_answer(reactor, queue.Queue(), 0) is _NO_ANSWER


# --- from the review of the blocking layers (2026-11-29) ---------------------------------------------

class _AsyncDefApply(WaltzClientCallbacks):
    def __init__(self):
        self.applied = []

    def get_client_high_water_mark(self, partition_id):
        return -1

    async def apply_transaction(self, transaction):      # a natural mistake with threaded callbacks
        self.applied.append(transaction.transaction_id)


@pytest_twisted.ensureDeferred
async def test_a_threaded_async_def_apply_is_refused_not_counted_applied():
    # Its coroutine was taken as the result: the transaction counted as applied, and its body never ran.
    from waltz.client.api import Transaction
    app = _AsyncDefApply()
    callbacks = ThreadedCallbacks(app, reactor)
    try:
        with pytest.raises(TypeError, match="returned an awaitable from the callbacks' worker thread"):
            await callbacks.apply_transaction(Transaction(0, 0, 0, ReqId(1, 1, 0, 0), None))
    finally:
        callbacks.stop()
    assert app.applied == []


class _FixedData:
    def fetch_data(self, transaction_id):
        return defer.succeed(b"payload")


class _RecordingDeserializer:
    def __init__(self):
        self.threads = []

    def deserialize(self, data):
        self.threads.append(threading.current_thread().name)
        return data.upper()


@pytest_twisted.ensureDeferred
async def test_get_data_decodes_in_the_calling_thread_not_on_the_reactor():
    # A heavy or blocking decode on the reactor stalled every feed and every other blocking call.
    from waltz.client.api import Transaction
    serializer, seen = _RecordingDeserializer(), []

    class App(WaltzClientCallbacks):
        def apply_transaction(self, transaction):
            seen.append((threading.current_thread().name, transaction.get_data(serializer, timeout=10)))

    callbacks = ThreadedCallbacks(App(), reactor, timeout=10)
    try:
        await callbacks.apply_transaction(Transaction(0, 0, 0, ReqId(1, 1, 0, 0), _FixedData()))
    finally:
        callbacks.stop()
    assert [name for name, _ in seen] == serializer.threads and seen[0][1] == b"PAYLOAD"
    assert serializer.threads != [threading.current_thread().name]       # (the test runs on the reactor)
