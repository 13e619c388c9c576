"""Kazoo behind Deferreds: every result, watch and session event arrives on the reactor thread.

Kazoo runs its own threads (a connection thread and a callback thread). Each
operation here calls the matching ``*_async`` kazoo method, ``rawlink``\\ s the
kazoo async result, and hands the outcome to the reactor with
``reactor.callFromThread``, so callers only ever see ordinary Deferreds fired on
the reactor thread. Watch functions and session-state listeners are
re-dispatched the same way. Blocking kazoo calls (``start``, ``stop``,
recursive delete, recipes) run through the reactor's thread pool.

Kazoo's exceptions (``NoNodeError``, ``NodeExistsError``, ``BadVersionError``,
``NotEmptyError``, ``ConnectionLoss``, ``SessionExpiredError``...) are the
Deferreds' failures, unchanged; only a failed connect is reported as
:class:`~waltz.zk.errors.ZooKeeperConnectError`.

Every request method (``create``, ``get``, ``set``, ``exists``, ``get_children``,
a non-recursive ``delete``, ``ensure_path``, ``sync``, a transaction's ``commit``) and
the set-up of every persistent watch is bounded: while the connection is down kazoo
queues requests until it is back, so without a bound a caller would wait for the
whole outage. (``run_blocking`` and a recursive ``delete`` run kazoo's blocking calls
in the thread pool, unbounded; ``close`` ends them.) After ``request_timeout_ms`` (default: the
session timeout) it fails with :class:`~waltz.zk.errors.ZooKeeperRequestTimeout`,
a ``ConnectionLoss``: the outcome is unknown, as for any request in flight when a
connection drops, and a late answer is ignored.

After a session expires kazoo reconnects with a *new* session: listeners see
``EXPIRED`` and then ``CONNECTED`` again, and whoever owns ephemeral znodes must
create them again.

Kazoo does not re-register watches on a new connection (it sends no
``SetWatches``), even within the same session: a ZooKeeper restarted in between
knows none of them. The persistent watches here (kazoo's ``DataWatch`` and
``ChildrenWatch``) read their znode again after a reconnect and call back if it
changed; code that must not miss a change made while it was disconnected also
reads again itself on ``CONNECTED`` (membership, discovery).
"""

import atexit
import threading
import time

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import ConnectionClosedError, NoNodeError, RolledBackError
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.protocol.serialization import Connect as KazooConnect
from kazoo.protocol.states import KeeperState
from twisted.internet import defer, threads
from twisted.logger import Logger

from waltz.zk.errors import ZooKeeperConnectError, ZooKeeperRequestTimeout


class SessionState:
    """The session states reported to :meth:`ZooKeeperClient.add_state_listener` callbacks."""

    CONNECTED = KazooState.CONNECTED   # connected (first time, after a reconnect, or with a new session)
    SUSPENDED = KazooState.SUSPENDED   # connection lost; the session may still be alive
    LOST = KazooState.LOST             # the session is gone because the client was closed
    EXPIRED = "EXPIRED"                # the server expired the session; ephemeral znodes are gone


def _first_error(results):
    """The real failure in a kazoo multi-op result list (the others are RolledBackError)."""
    errors = [r for r in results if isinstance(r, Exception)]
    real = [e for e in errors if not isinstance(e, RolledBackError)]
    return (real or errors or [None])[0]


class Transaction:
    """A ZooKeeper multi-op: add operations, then :meth:`commit` them atomically."""

    def __init__(self, client, kazoo_transaction):
        self._client = client
        self._txn = kazoo_transaction

    def create(self, path, value=b"", ephemeral=False, sequence=False):
        self._txn.create(path, value, ephemeral=ephemeral, sequence=sequence)
        return self

    def set_data(self, path, value, version=-1):
        self._txn.set_data(path, value, version)
        return self

    def delete(self, path, version=-1):
        self._txn.delete(path, version)
        return self

    def check(self, path, version):
        self._txn.check(path, version)
        return self

    def __len__(self):
        return len(self._txn.operations)

    def commit(self):
        """Deferred firing with the per-operation results, or failing with the first real error."""
        def check(results):
            error = _first_error(results)
            if error is not None:
                raise error
            return results
        return self._client._bridge(self._txn.commit_async).addCallback(check)


class WatchHandle:
    """Returned by the ``watch_*`` methods; :meth:`cancel` stops further callbacks and the watch itself."""

    def __init__(self):
        self.cancelled = False
        self._stop = None

    def attach(self, stop):
        """``stop()`` ends the underlying watch: at :meth:`cancel`, or now if that came first."""
        self._stop = stop
        if self.cancelled:
            stop()

    def cancel(self):
        self.cancelled = True
        if self._stop is not None:
            stop, self._stop = self._stop, None
            stop()


class ZooKeeperClient:
    """One ZooKeeper session, with a Deferred API.

    ``connect_string`` is ``host:port[,host:port...][/chroot]``; timeouts are in
    milliseconds. ``request_timeout_ms`` bounds each request (default: the session
    timeout). ``reactor`` defaults to the global one; ``kazoo_client`` may be given
    instead of being built from the connect string (tests).
    """

    log = Logger()

    def __init__(self, connect_string, session_timeout_ms=30000, connect_timeout_ms=10000,
                 reactor=None, kazoo_client=None, request_timeout_ms=None):
        if reactor is None:
            from twisted.internet import reactor
        self._reactor = reactor
        self.connect_string = connect_string
        self.session_timeout_ms = session_timeout_ms
        self.connect_timeout_ms = connect_timeout_ms
        self.request_timeout_ms = session_timeout_ms if request_timeout_ms is None else request_timeout_ms
        self._kazoo = kazoo_client or KazooClient(
            hosts=connect_string, timeout=session_timeout_ms / 1000.0,
            connection_retry={"max_tries": -1, "max_delay": 1.0},
            command_retry=None)
        #: The session timeout ZooKeeper granted at the last session's handshake (it bounds what a client asks
        #: for by its ``minSessionTimeout``..``maxSessionTimeout``), in ms; None before the first handshake.
        self.negotiated_session_timeout_ms = None
        self._record_negotiated_timeout()
        self._listeners = []
        self._kazoo.add_listener(self._on_kazoo_state)
        # A close may come while a connect still waits in another thread (a command line giving up):
        # kazoo's stop and close must then not race with the connect's own clean-up.
        self._closing = threading.Event()
        self._stop_lock = threading.Lock()
        self._stopping_in_background = False   # kazoo is being stopped without waiting (_stop_in_background)

    def _record_negotiated_timeout(self):
        """Keep the session timeout ZooKeeper negotiates. Kazoo keeps it to itself: it is the ``time_out`` of the
        answer to the handshake's ``Connect`` request, which kazoo's connection sends through ``_invoke``
        (kazoo 2.x), before it reports the session connected. A kazoo without that method leaves
        :attr:`negotiated_session_timeout_ms` None (the requested one is used)."""
        connection = getattr(self._kazoo, "_connection", None)
        invoke = getattr(connection, "_invoke", None)
        if invoke is None:
            return

        def recording_invoke(timeout, request, *args, **kwargs):
            result = invoke(timeout, request, *args, **kwargs)
            if isinstance(request, KazooConnect) and isinstance(result, tuple) and result:
                granted = getattr(result[0], "time_out", None)
                if isinstance(granted, int) and granted > 0:
                    self.negotiated_session_timeout_ms = granted
            return result
        connection._invoke = recording_invoke

    @classmethod
    def from_config(cls, config, reactor=None):
        """A client for a :class:`waltz.config.Config` holding the ``zookeeper.*`` keys."""
        return cls(config["zookeeper.connectString"], config["zookeeper.sessionTimeout"],
                   config["zookeeper.connectTimeout"], reactor=reactor)

    # --- session -----------------------------------------------------------------------------

    @property
    def kazoo(self):
        """The underlying ``KazooClient`` (for ``client_id`` and the like; never call it blocking
        on the reactor thread)."""
        return self._kazoo

    @property
    def connected(self):
        return self._kazoo.connected

    @property
    def session_id(self):
        """The current session id, or ``None`` before the first connect."""
        client_id = self._kazoo.client_id
        return client_id[0] if client_id else None

    def connect(self):
        """Connect; fires with ``self``, or fails with :class:`ZooKeeperConnectError` on timeout."""
        timeout = self.connect_timeout_ms / 1000.0

        def failed(reason):
            reason.trap(KazooTimeoutError)
            raise ZooKeeperConnectError(
                "cannot connect to ZooKeeper at %s within %d ms; is it running?"
                % (self.connect_string, self.connect_timeout_ms))

        d = self._blocking(self._start, timeout)
        d.addCallbacks(lambda _: self, failed)
        return d

    def _start(self, timeout):
        """Kazoo's ``start``, except that a :meth:`close` meanwhile ends the wait at once."""
        connected = self._kazoo.start_async()
        # A session still open when the interpreter exits (a command interrupted before its clean-up, a
        # script that never closed its client) is stopped first. Kazoo's own exit hook (registered by
        # start_async, so it runs after this one) only joins its worker threads: one blocked in a request
        # (a watch re-reading its znode) while ZooKeeper is unreachable would wait for ever. Stopping the
        # session fails such requests.
        atexit.register(self._stop_and_close)
        deadline = time.monotonic() + timeout
        while not connected.wait(min(0.05, max(0.0, deadline - time.monotonic()))):
            if self._closing.is_set() or time.monotonic() >= deadline:
                break
        if not self._kazoo.connected:
            self._stop_in_background()
            if self._closing.is_set():
                raise ZooKeeperConnectError("the ZooKeeper client was closed while connecting to %s"
                                            % self.connect_string)
            raise KazooTimeoutError("Connection time-out")
        chroot = self._kazoo.chroot
        if chroot and not self._kazoo.exists("/"):
            # Every request would fail with a bare NoNodeError.
            self._stop_and_close()
            raise ZooKeeperConnectError("the chroot %s of the ZooKeeper connect string %s does not exist; "
                                        "create it first" % (chroot, self.connect_string))

    def close(self):
        """End the session (its ephemeral znodes go) and free kazoo's threads and sockets; a connect
        still waiting ends (failing with :class:`ZooKeeperConnectError`).

        Runs in a thread of its own, not the reactor's pool: during an outage the pool's threads may
        all be blocked in kazoo calls that only this close ends."""
        self._closing.set()
        if not self._kazoo.connected:
            # No session to end now (never connected, or cut off): nothing to wait for.
            self._stop_in_background()
            return defer.succeed(None)
        d = defer.Deferred()

        def close_in_thread():
            try:
                self._stop_and_close()
            except Exception as exc:
                self._reactor.callFromThread(d.errback, exc)
            else:
                self._reactor.callFromThread(d.callback, None)
        threading.Thread(target=close_in_thread, name="zookeeper-close", daemon=True).start()
        return d

    def _stop_in_background(self):
        """Stop kazoo without waiting: its stop waits for its connection thread, which a ZooKeeper that
        accepts and never answers (hung, or behind a firewall dropping packets) holds in the handshake for
        the whole session timeout, so neither a connect timeout nor a close would bound the wait."""
        if not self._stopping_in_background:
            self._stopping_in_background = True
            threading.Thread(target=self._stop_and_close, name="zookeeper-stop", daemon=True).start()

    def _stop_and_close(self):
        with self._stop_lock:
            atexit.unregister(self._stop_and_close)
            self._kazoo.stop()
            self._kazoo.close()

    def add_state_listener(self, listener):
        """Call ``listener(state)`` on the reactor thread at each :class:`SessionState` change."""
        self._listeners.append(listener)

    def remove_state_listener(self, listener):
        self._listeners.remove(listener)

    def _on_kazoo_state(self, state):
        # Kazoo's connection thread; must not block. Expiry and close both arrive as LOST:
        # the keeper state, already updated when listeners run, tells them apart.
        if state == KazooState.LOST and self._kazoo.client_state == KeeperState.EXPIRED_SESSION:
            state = SessionState.EXPIRED
        self._reactor.callFromThread(self._dispatch_state, state)

    def _dispatch_state(self, state):
        self.log.info("ZooKeeper session {state} ({connect_string})", state=state,
                      connect_string=self.connect_string)
        for listener in list(self._listeners):
            try:
                listener(state)
            except Exception:
                self.log.failure("ZooKeeper state listener {listener!r} failed", listener=listener)

    # --- thread plumbing ---------------------------------------------------------------------

    def _bridge(self, start, *args, **kwargs):
        """Run ``start(*args, **kwargs)`` (a kazoo ``*_async`` call) and return a Deferred
        fired on the reactor thread with its result or exception (bounded, see the module docstring)."""
        d = defer.Deferred()
        try:
            async_result = start(*args, **kwargs)
        except Exception:
            return defer.fail()

        def completed(result):
            # Kazoo's callback thread, or this thread when kazoo's handler is stopped.
            try:
                value = result.get_nowait()
            except Exception as exc:
                self._reactor.callFromThread(self._settle, d, d.errback, exc)
            else:
                self._reactor.callFromThread(self._settle, d, d.callback, value)

        self._bound(d, "a %s request" % getattr(start, "__name__", "").replace("_async", ""))
        async_result.rawlink(completed)
        return d

    def _bound(self, d, what):
        """Fail ``d`` with :class:`ZooKeeperRequestTimeout` unless it fires within the request timeout."""
        def expire():
            d.errback(ZooKeeperRequestTimeout(
                "ZooKeeper at %s did not answer %s within %d ms (connection lost?); its outcome is unknown"
                % (self.connect_string, what, self.request_timeout_ms)))
        timer = self._reactor.callLater(self.request_timeout_ms / 1000.0, expire)
        d.addBoth(self._cancel_timer, timer)
        return d

    @staticmethod
    def _cancel_timer(result, timer):
        if timer.active():
            timer.cancel()
        return result

    @staticmethod
    def _settle(d, fire, value):
        """Fire ``d`` unless it timed out already (the late answer is dropped)."""
        if not d.called:
            fire(value)

    def _on_reactor(self, function):
        """Wrap a callback kazoo calls from its thread so that it runs on the reactor thread."""
        if function is None:
            return None

        def dispatch(*args):
            self._reactor.callFromThread(function, *args)
        return dispatch

    def _blocking(self, function, *args, **kwargs):
        """Run a blocking call in the reactor's thread pool."""
        return threads.deferToThreadPool(self._reactor, self._reactor.getThreadPool(),
                                         function, *args, **kwargs)

    def run_blocking(self, function, *args, **kwargs):
        """Run ``function(kazoo_client, *args, **kwargs)`` in the thread pool (for kazoo recipes)."""
        return self._blocking(function, self._kazoo, *args, **kwargs)

    # --- operations --------------------------------------------------------------------------

    def create(self, path, value=b"", ephemeral=False, sequence=False, makepath=False):
        """Create a znode; fires with its actual path (with the sequence suffix)."""
        return self._bridge(self._kazoo.create_async, path, value, ephemeral=ephemeral,
                            sequence=sequence, makepath=makepath)

    def get(self, path, watch=None):
        """Fires with ``(data, ZnodeStat)``; ``watch(WatchedEvent)`` runs once on the reactor thread."""
        return self._bridge(self._kazoo.get_async, path, watch=self._on_reactor(watch))

    def set(self, path, value, version=-1):
        """Set data if the znode's version is ``version`` (-1: any); fires with the new ``ZnodeStat``."""
        return self._bridge(self._kazoo.set_async, path, value, version)

    def exists(self, path, watch=None):
        """Fires with the ``ZnodeStat``, or ``None`` when the znode does not exist."""
        return self._bridge(self._kazoo.exists_async, path, watch=self._on_reactor(watch))

    def get_children(self, path, watch=None):
        """Fires with the list of child names."""
        return self._bridge(self._kazoo.get_children_async, path, watch=self._on_reactor(watch))

    def delete(self, path, version=-1, recursive=False):
        """Delete a znode (with ``recursive``, its whole subtree, through the thread pool)."""
        if recursive:
            return self._blocking(self._kazoo.delete, path, version, recursive=True)
        return self._bridge(self._kazoo.delete_async, path, version)

    def ensure_path(self, path):
        """Create ``path`` and any missing parents (empty data)."""
        return self._bridge(self._kazoo.ensure_path_async, path)

    def sync(self, path):
        """Make this session's view of ``path`` at least as new as the leader's."""
        return self._bridge(self._kazoo.sync_async, path)

    def transaction(self):
        """A new :class:`Transaction` (multi-op) on this session."""
        return Transaction(self, self._kazoo.transaction())

    # --- persistent watches --------------------------------------------------------------------

    def watch_data(self, path, callback):
        """Call ``callback(data, stat)`` now and after changes of ``path`` (``(None, None)``
        while it does not exist), on the reactor thread, until the handle is cancelled.

        Each call carries the znode as read when the watch fired: changes in quick succession
        may show only the latest (ZooKeeper's watches are one-shot and re-set by the read), so
        callers treat a call as "the current state", never as one event per change.

        Fires with the :class:`WatchHandle` once the watch is set (after the first callback).
        """
        handle = WatchHandle()

        def on_change(data, stat):
            if handle.cancelled:
                return False
            self._reactor.callFromThread(self._if_active, handle, callback, data, stat)
            return None

        # kazoo's DataWatch reads the znode synchronously when built: keep that off the reactor.
        return self._set_watch(self._kazoo.DataWatch, path, on_change, handle)

    def watch_children(self, path, callback):
        """Call ``callback(children)`` now and after changes of ``path``'s children, on the
        reactor thread, until the handle is cancelled. As with :meth:`watch_data`, a call carries
        the current children; changes in quick succession may show only the latest.

        Fires with the :class:`WatchHandle` once the watch is set (after the first callback).
        """
        handle = WatchHandle()

        def on_change(children):
            if handle.cancelled:
                return False
            self._reactor.callFromThread(self._if_active, handle, callback, children)
            return None

        return self._set_watch(self._kazoo.ChildrenWatch, path, on_change, handle)

    def _set_watch(self, recipe, path, on_change, handle):
        """Build kazoo's watch ``recipe`` in the thread pool; fires with ``handle``. Fails at once once
        closed or before connecting (kazoo's recipes would swallow that and never call back), with
        :class:`NoNodeError` when a children watch's znode does not exist (kazoo's stops silently), and
        after the request timeout. Whenever it fails (cancelled too), the watch it sets up is stopped: nobody
        holds its handle."""
        if self._closing.is_set() or self._kazoo.client_state == KeeperState.CLOSED:
            return defer.fail(ConnectionClosedError("the ZooKeeper client is closed or not connected"))
        outcome = defer.Deferred()

        def built(watch):
            if getattr(watch, "_stopped", False):     # ChildrenWatch: the znode did not exist
                raise NoNodeError("cannot watch the children of %s: no such znode" % path)
            handle.attach(lambda: self._stop_watch(watch))
            return handle

        d = self._blocking(recipe, path, on_change).addCallback(built)
        d.addCallbacks(lambda result: self._settle(outcome, outcome.callback, result),
                       lambda failure: self._settle(outcome, outcome.errback, failure))
        self._bound(outcome, "the set-up of a watch of %s" % path)
        return outcome.addErrback(self._cancel_handle, handle)

    @staticmethod
    def _cancel_handle(failure, handle):
        handle.cancel()
        return failure

    def _stop_watch(self, watch):
        """End a kazoo watch recipe now. Kazoo ends one only when its function returns False, at the
        znode's next change: until then its session listener stays, and reads the znode at every reconnect.
        (Kazoo offers no public way; its recipes check ``_stopped`` before every read.)"""
        watch._stopped = True
        self._kazoo.remove_listener(watch._session_watcher)

    def _if_active(self, handle, callback, *args):
        if not handle.cancelled:
            callback(*args)
