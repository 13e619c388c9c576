"""The kazoo bridge against a real ZooKeeper: Deferreds, errors, watches and session events
all on the reactor thread."""

import pytest
import pytest_twisted
from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError, NotEmptyError
from twisted.internet import defer, reactor
from twisted.python import threadable

from tests.conftest import zk_client_for
from waltz.local.ports import free_port
from waltz.zk.bridge import SessionState, ZooKeeperClient
from waltz.zk.errors import ZooKeeperConnectError


def on_reactor_thread(value=None):
    """A callback that records whether it ran on the reactor thread."""
    threads = []

    def callback(*args):
        threads.append(threadable.isInIOThread())
        return args[0] if args else value
    callback.threads = threads
    return callback


class Recorder:
    """Collects callback arguments and fires Deferreds when a given number have arrived."""

    def __init__(self):
        self.calls = []
        self.threads = []
        self._waiting = []

    def __call__(self, *args):
        self.calls.append(args)
        self.threads.append(threadable.isInIOThread())
        ready = [(test, d) for test, d in self._waiting if test(self.calls)]
        self._waiting = [(test, d) for test, d in self._waiting if not test(self.calls)]
        for _, d in ready:
            d.callback(list(self.calls))

    def wait_until(self, test, timeout=5):
        """Fires with the calls once ``test(calls)`` is true."""
        if test(self.calls):
            return defer.succeed(list(self.calls))
        d = defer.Deferred()
        self._waiting.append((test, d))
        return d.addTimeout(timeout, reactor)

    def wait_for(self, count, timeout=5):
        """Fires with the calls once there are ``count`` of them."""
        return self.wait_until(lambda calls: len(calls) >= count, timeout)


@pytest_twisted.ensureDeferred
async def test_crud_results_fire_on_the_reactor_thread(zk_client, cluster_root):
    check = on_reactor_thread()
    path = await zk_client.create(cluster_root + "/node", b"one", makepath=True).addCallback(check)
    assert path == cluster_root + "/node"
    data, stat = await zk_client.get(path).addCallback(check)
    assert data == b"one" and stat.version == 0
    stat = await zk_client.set(path, b"two", version=0).addCallback(check)
    assert stat.version == 1
    assert (await zk_client.exists(path).addCallback(check)).version == 1
    assert await zk_client.get_children(cluster_root).addCallback(check) == ["node"]
    await zk_client.delete(path).addCallback(check)
    assert await zk_client.exists(path).addCallback(check) is None
    assert check.threads == [True] * 7


@pytest_twisted.ensureDeferred
async def test_kazoo_errors_are_the_deferreds_failures(zk_client, cluster_root):
    await zk_client.create(cluster_root + "/a/b", makepath=True)
    with pytest.raises(NoNodeError):
        await zk_client.get(cluster_root + "/missing")
    with pytest.raises(NodeExistsError):
        await zk_client.create(cluster_root + "/a")
    with pytest.raises(BadVersionError):
        await zk_client.set(cluster_root + "/a", b"x", version=5)
    with pytest.raises(NotEmptyError):
        await zk_client.delete(cluster_root + "/a")
    await zk_client.delete(cluster_root + "/a", recursive=True)
    assert await zk_client.exists(cluster_root + "/a") is None


@pytest_twisted.ensureDeferred
async def test_bad_arguments_fail_the_deferred_instead_of_raising(zk_client):
    d = zk_client.create(42)
    with pytest.raises(TypeError):
        await d


@pytest_twisted.ensureDeferred
async def test_one_shot_watches_fire_on_the_reactor_thread(zk_client, zookeeper, cluster_root):
    path = await zk_client.create(cluster_root + "/watched", b"0", makepath=True)
    data_watch, child_watch = Recorder(), Recorder()
    await zk_client.get(path, watch=data_watch)
    await zk_client.get_children(cluster_root, watch=child_watch)
    other = zk_client_for(zookeeper)
    await other.connect()
    try:
        await other.set(path, b"1")
        await other.create(cluster_root + "/sibling")
        (event,), = await data_watch.wait_for(1)
        (child_event,), = await child_watch.wait_for(1)
    finally:
        await other.close()
    assert (event.type, event.path) == ("CHANGED", path)
    assert child_event.type == "CHILD"
    assert data_watch.threads == child_watch.threads == [True]


@pytest_twisted.ensureDeferred
async def test_persistent_watches_follow_each_change_until_cancelled(zk_client, cluster_root):
    path = cluster_root + "/data"
    await zk_client.ensure_path(cluster_root)
    data, children = Recorder(), Recorder()
    data_handle = await zk_client.watch_data(path, data)
    children_handle = await zk_client.watch_children(cluster_root, children)
    assert data.calls == [(None, None)] and children.calls == [([],)]
    # Each change waits for the last to be seen: a watch re-reads the znode when it fires, so two
    # changes in quick succession may show only the second (ZooKeeper's watch semantics).
    await zk_client.create(path, b"a")
    await data.wait_for(2)
    await zk_client.set(path, b"b")
    calls = await data.wait_for(3)
    assert [value for value, _stat in calls] == [None, b"a", b"b"]
    assert (await children.wait_for(2))[-1] == (["data"],)
    data_handle.cancel()
    children_handle.cancel()
    # Watches set after the cancelled ones see the same events after them, in kazoo's order.
    later_data, later_children = Recorder(), Recorder()
    await zk_client.watch_data(path, later_data)
    await zk_client.watch_children(cluster_root, later_children)
    await zk_client.set(path, b"c")
    await zk_client.create(cluster_root + "/more")
    await later_data.wait_until(lambda calls: calls[-1][0] == b"c")
    await later_children.wait_until(lambda calls: calls[-1] == (["data", "more"],))
    assert len(data.calls) == 3 and len(children.calls) == 2
    assert all(data.threads + children.threads)


@pytest_twisted.ensureDeferred
async def test_transactions_are_atomic(zk_client, cluster_root):
    await zk_client.ensure_path(cluster_root)
    results = await zk_client.transaction().create(cluster_root + "/x", b"1").create(
        cluster_root + "/y", b"2").commit()
    assert results == [cluster_root + "/x", cluster_root + "/y"]
    txn = zk_client.transaction().set_data(cluster_root + "/x", b"changed").check(cluster_root + "/y", 7)
    with pytest.raises(BadVersionError):
        await txn.commit()
    assert (await zk_client.get(cluster_root + "/x"))[0] == b"1"


@pytest_twisted.ensureDeferred
async def test_connect_to_nothing_fails_with_a_clear_error():
    client = ZooKeeperClient("127.0.0.1:%d" % free_port(), connect_timeout_ms=300)
    with pytest.raises(ZooKeeperConnectError, match="cannot connect to ZooKeeper at 127.0.0.1:.* within 300 ms"):
        await client.connect()
    await client.close()


@pytest_twisted.ensureDeferred
async def test_connect_to_a_zookeeper_that_never_answers_fails_within_the_connect_timeout():
    # A hung ZooKeeper (or a firewall dropping packets) accepts connections and says nothing: the failed
    # connect then waited for kazoo's stop, which waited for the handshake, for the session timeout (30 s).
    import socket
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)               # never accepted: the kernel completes the TCP handshake, nothing answers
    try:
        client = ZooKeeperClient("127.0.0.1:%d" % listener.getsockname()[1], session_timeout_ms=20000,
                                 connect_timeout_ms=500)
        started = reactor.seconds()
        with pytest.raises(ZooKeeperConnectError, match="within 500 ms"):
            await client.connect()
        await client.close()
        assert reactor.seconds() - started < 5
    finally:
        listener.close()


@pytest_twisted.ensureDeferred
async def test_a_missing_chroot_is_named_at_connect(zookeeper):
    # Every request used to fail with a bare "NoNodeError".
    client = ZooKeeperClient(zookeeper.connect_string + "/no_such_chroot", connect_timeout_ms=5000)
    with pytest.raises(ZooKeeperConnectError, match="the chroot /no_such_chroot of the ZooKeeper connect string "
                                                    ".* does not exist"):
        await client.connect()
    await client.close()


@pytest_twisted.ensureDeferred
async def test_a_close_while_connecting_ends_the_connect_at_once():
    # A command line giving up closes clients whose connect still waits: the close used to fail
    # ("Cannot close connection until it is stopped") or wait for the whole connect timeout.
    from twisted.internet import task
    client = ZooKeeperClient("127.0.0.1:%d" % free_port(), connect_timeout_ms=20000)
    connecting = client.connect()
    await task.deferLater(reactor, 0.3, lambda: None)
    started = reactor.seconds()
    await client.close()
    with pytest.raises(ZooKeeperConnectError, match="closed while connecting"):
        await connecting
    assert reactor.seconds() - started < 5


@pytest_twisted.ensureDeferred
async def test_session_events_reach_listeners_on_the_reactor_thread(zookeeper, cluster_root):
    states = Recorder()
    client = zk_client_for(zookeeper)
    client.add_state_listener(states)
    await client.connect()
    await states.wait_for(1)
    old_session = client.session_id
    # Expire the session from outside: another client attaches to it and closes it.
    session_id, password = client.kazoo.client_id

    def expire():
        thief = KazooClient(hosts=zookeeper.connect_string, client_id=(session_id, password))
        thief.start(5)
        thief.stop()
        thief.close()
    await client.run_blocking(lambda _kazoo: expire())
    # kazoo reports the expiry, then reconnects with a new session.
    calls = await states.wait_until(
        lambda calls: (SessionState.EXPIRED,) in calls and calls[-1] == (SessionState.CONNECTED,))
    states_seen = [state for (state,) in calls]
    assert states_seen[0] == SessionState.CONNECTED
    assert SessionState.EXPIRED in states_seen
    assert states_seen[-1] == SessionState.CONNECTED
    assert client.session_id != old_session
    await client.close()
    calls = await states.wait_for(len(calls) + 1)
    assert calls[-1] == (SessionState.LOST,)  # closed, not expired
    assert all(states.threads)


async def _connected_then_cut_off(private_zookeeper, request_timeout_ms):
    """A client connected to ``private_zookeeper``, which is then stopped: fires once kazoo noticed."""
    from twisted.internet import task
    private_zookeeper.start()
    client = zk_client_for(private_zookeeper, request_timeout_ms=request_timeout_ms)
    await client.connect()
    await client.ensure_path("/waltz_test/cut")
    await client.run_blocking(lambda _kazoo: private_zookeeper.stop())
    for _ in range(100):
        if not client.connected:
            break
        await task.deferLater(reactor, 0.1, lambda: None)
    assert not client.connected
    return client


@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_requests_and_watches_fail_within_the_request_timeout_while_zookeeper_is_unreachable(
        private_zookeeper):
    # Kazoo queues a request made while disconnected until the connection is back: every caller used to
    # wait for the whole outage, and each watch set-up held a thread of the reactor's pool meanwhile.
    from kazoo.exceptions import ConnectionLoss

    from waltz.zk.errors import ZooKeeperRequestTimeout
    client = await _connected_then_cut_off(private_zookeeper, request_timeout_ms=1500)
    try:
        for request in (lambda: client.get("/waltz_test/cut"), lambda: client.create("/waltz_test/cut/x"),
                        lambda: client.transaction().create("/waltz_test/cut/y").commit(),
                        lambda: client.watch_data("/waltz_test/cut", lambda *a: None),
                        lambda: client.watch_children("/waltz_test/cut", lambda *a: None)):
            started = reactor.seconds()
            with pytest.raises(ZooKeeperRequestTimeout, match="did not answer .* within 1500 ms"):
                await request()
            assert 1.0 < reactor.seconds() - started < 5
        assert issubclass(ZooKeeperRequestTimeout, ConnectionLoss)     # callers' "outcome unknown"
    finally:
        await client.close()


@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_close_ends_during_an_outage_even_with_the_thread_pool_full_of_blocked_watches(
        private_zookeeper):
    # Watch set-ups blocked in kazoo hold the reactor's pool threads until the session ends; close()
    # ran in that same pool, and waited behind them for ever.
    client = await _connected_then_cut_off(private_zookeeper, request_timeout_ms=500)
    pool = reactor.getThreadPool()
    attempts = [client.watch_data("/waltz_test/cut", lambda *a: None).addErrback(lambda _: None)
                for _ in range(pool.max)]
    await defer.gatherResults(attempts)                  # each timed out; its thread is still blocked
    started = reactor.seconds()
    await client.close()
    assert reactor.seconds() - started < 10


@pytest_twisted.ensureDeferred
async def test_watches_fail_when_closed_or_on_a_missing_znode(zookeeper, cluster_root):
    # Kazoo's recipes swallowed both: the watch "succeeded" and never called back.
    from kazoo.exceptions import ConnectionClosedError
    client = zk_client_for(zookeeper)
    with pytest.raises(ConnectionClosedError):
        await client.watch_data(cluster_root, lambda *a: None)          # not connected yet
    await client.connect()
    try:
        with pytest.raises(NoNodeError, match="no such znode"):
            await client.watch_children(cluster_root + "/missing", lambda *a: None)
        seen = Recorder()
        handle = await client.watch_data(cluster_root + "/missing", seen)
        assert seen.calls == [(None, None)]              # a data watch follows a znode yet to come
        handle.cancel()
    finally:
        await client.close()
    for watch in (client.watch_data, client.watch_children):
        with pytest.raises(ConnectionClosedError):
            await watch(cluster_root, lambda *a: None)


@pytest_twisted.ensureDeferred
async def test_a_cancelled_watch_leaves_nothing_registered_in_kazoo(zk_client, cluster_root):
    # Cancelling only muted the callback: each watch kept a kazoo session listener (re-reading its znode at
    # every reconnect) until the znode next changed.
    await zk_client.create(cluster_root + "/w", b"x", makepath=True)
    before = len(zk_client.kazoo.state_listeners)
    for _ in range(20):
        (await zk_client.watch_data(cluster_root + "/w", lambda *a: None)).cancel()
        (await zk_client.watch_children(cluster_root, lambda *a: None)).cancel()
    assert len(zk_client.kazoo.state_listeners) == before
    seen = Recorder()
    handle = await zk_client.watch_data(cluster_root + "/w", seen)
    await zk_client.set(cluster_root + "/w", b"y")
    await seen.wait_for(2)
    handle.cancel()
    await zk_client.set(cluster_root + "/w", b"z")
    await zk_client.sync(cluster_root)
    from twisted.internet import task
    await task.deferLater(reactor, 0.3, lambda: None)
    assert [data for data, _ in seen.calls] == [b"x", b"y"]


@pytest_twisted.ensureDeferred
async def test_cancelling_a_watch_set_up_stops_the_watch_it_sets_up(zk_client, cluster_root):
    # The set-up's Deferred had no canceller: cancelled, its caller got no handle, and the watch called
    # back for ever.
    await zk_client.create(cluster_root + "/w", b"x", makepath=True)
    before = len(zk_client.kazoo.state_listeners)
    seen = Recorder()
    setting_up = zk_client.watch_data(cluster_root + "/w", seen)
    setting_up.cancel()
    with pytest.raises(defer.CancelledError):
        await setting_up
    from twisted.internet import task
    await task.deferLater(reactor, 0.5, lambda: None)          # the set-up ends in the thread pool
    await zk_client.set(cluster_root + "/w", b"y")
    await zk_client.sync(cluster_root)
    await task.deferLater(reactor, 0.3, lambda: None)
    assert seen.calls == [] and len(zk_client.kazoo.state_listeners) == before


@pytest_twisted.ensureDeferred
async def test_the_session_timeout_zookeeper_negotiated_is_known_after_the_handshake(zookeeper, tmp_path):
    from waltz.local.zookeeper import LocalZooKeeper
    # Asked within the server's bounds (the shared ZooKeeper allows up to 600 s): granted as asked.
    client = ZooKeeperClient(zookeeper.connect_string, session_timeout_ms=12000, reactor=reactor)
    assert client.negotiated_session_timeout_ms is None
    await client.connect()
    try:
        assert client.negotiated_session_timeout_ms == 12000
    finally:
        await client.close()
    # A ZooKeeper whose maxSessionTimeout is 4 s grants 4 s to a client asking for 30 s.
    strict = LocalZooKeeper(tmp_path / "strict", max_session_timeout=4000)
    from twisted.internet import threads
    await threads.deferToThread(strict.start)
    try:
        client = ZooKeeperClient(strict.connect_string, session_timeout_ms=30000, reactor=reactor)
        await client.connect()
        try:
            assert client.negotiated_session_timeout_ms == 4000
            assert client.session_timeout_ms == 30000
        finally:
            await client.close()
    finally:
        await threads.deferToThread(strict.stop)
