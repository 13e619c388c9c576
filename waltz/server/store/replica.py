"""Replica sessions and the storage connections they share.

A server keeps one connection per storage node (:class:`StorageConnection`),
shared by every partition's replica sessions on that node, reconnecting with
exponential back-off (``storage.initialRetryInterval`` to
``storage.maxRetryInterval``). A :class:`ReplicaSession` is one partition's
replica on one node within one store session: every request carries the store
session id, so the storage fences older sessions.
"""

from twisted.application.internet import ClientService, backoffPolicy
from twisted.internet import defer
from twisted.logger import Logger
from zope.interface import implementer

from waltz.interfaces import IReplicaSession
from waltz.protocols import storage_messages as sm
from waltz.protocols.base import Liveness
from waltz.protocols.rpc import ConnectionClosed, RequestClientFactory, StorageClientProtocol
from waltz.tls import client_endpoint


#: Seconds a storage request may stay unanswered before its connection is closed (``storage.requestTimeout``).
DEFAULT_REQUEST_TIMEOUT = 30.0


class ReplicaUnavailable(Exception):
    """The replica's storage node is not connected (or the connection was lost)."""


class _PooledStorageProtocol(StorageClientProtocol):
    """A storage connection that tells its :class:`StorageConnection` when it opens and closes."""

    owner = None

    def connectionReady(self):
        super().connectionReady()
        self.opened.addCallbacks(self.owner._opened, lambda f: None)

    def connectionClosed(self, reason):
        # Closed before its Hello or open completed (a node restarting): nobody listens to ``opened`` yet,
        # and its failure would be logged as unhandled.
        self.opened.addErrback(lambda f: None)
        super().connectionClosed(reason)
        self.owner._closed(self)


class StorageConnection:
    """The server's one connection to a storage node (``host:port``), reconnecting forever."""

    log = Logger()

    def __init__(self, storage, open_request, reactor, initial_retry=0.1, max_retry=20.0, max_frame_size=None,
                 request_timeout=DEFAULT_REQUEST_TIMEOUT, on_unused=None, tls=None, liveness=None):
        self.storage = storage
        #: ``on_unused(connection)``: called when the last replica session using the connection closed.
        self.on_unused = on_unused
        self.reactor = reactor
        host, _, port = storage.rpartition(":")
        # Liveness: a silent storage (gone, or its network cut) and one that stops answering requests
        # (a hung disk) both close the connection, failing its requests, instead of holding them.
        liveness = liveness if liveness is not None else Liveness(reactor)
        settings = {"owner": self, "request_timeout": request_timeout, **liveness.settings()}
        if max_frame_size:
            settings["max_frame_size"] = max_frame_size
        factory = RequestClientFactory(_PooledStorageProtocol, open_request, **settings)
        endpoint = client_endpoint(reactor, host, int(port), 5, tls)
        self._service = ClientService(endpoint, factory, retryPolicy=backoffPolicy(initial_retry, max_retry),
                                      clock=reactor)
        self.protocol = None
        self._waiters = []
        self._close_listeners = []

    def start(self):
        self._service.startService()

    def stop(self):
        self._fail_waiters(ReplicaUnavailable("connection to %s stopped" % self.storage))
        return self._service.stopService()

    @property
    def connected(self):
        return self.protocol is not None and not self.protocol.closed

    def when_open(self) -> defer.Deferred:
        """Fires with the opened protocol (at once when connected). Cancelling it (a timeout) forgets
        the waiter, so probes of a node that stays down do not pile up."""
        if self.connected:
            return defer.succeed(self.protocol)
        d = defer.Deferred(lambda cancelled: self._waiters.remove(cancelled) if cancelled in self._waiters else None)
        self._waiters.append(d)
        return d

    def add_close_listener(self, listener):
        """``listener(protocol)`` is called whenever an opened connection closes. Every replica session
        using the connection listens, from its creation to its close: the listeners are its users."""
        self._close_listeners.append(listener)

    def remove_close_listener(self, listener):
        if listener in self._close_listeners:
            self._close_listeners.remove(listener)
            if not self._close_listeners and self.on_unused is not None:
                self.on_unused(self)

    @property
    def in_use(self):
        """Whether a replica session uses the connection."""
        return bool(self._close_listeners)

    def _opened(self, protocol):
        self.log.info("connected to storage {storage}", storage=self.storage)
        self.protocol = protocol
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            waiter.callback(protocol)
        return protocol

    def _closed(self, protocol):
        if protocol is not self.protocol:
            return
        self.log.warn("lost connection to storage {storage}", storage=self.storage)
        self.protocol = None
        for listener in list(self._close_listeners):
            listener(protocol)

    def _fail_waiters(self, error):
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            waiter.errback(error)


class StorageConnectionPool:
    """One :class:`StorageConnection` per storage node, created on first use.

    ``wanted()`` names the storage nodes the server keeps connected (those of the replica assignment). A
    connection to any other node (one removed from the assignment) is stopped once no replica session uses
    it (the sessions made before the change close): otherwise a server would reconnect for ever, logging each
    attempt, to every node ever decommissioned while it ran.
    """

    log = Logger()

    def __init__(self, open_request, reactor, initial_retry=0.1, max_retry=20.0,
                 request_timeout=DEFAULT_REQUEST_TIMEOUT, wanted=None, tls=None, liveness=None):
        self.open_request = open_request
        self.tls = tls              # a waltz.tls.TLSConfig for every connection, or None (plain TCP)
        self.liveness = liveness    # every connection's Liveness, or None (the default)
        self.wanted = wanted
        self.reactor = reactor
        self.initial_retry = initial_retry
        self.max_retry = max_retry
        self.request_timeout = request_timeout
        self.connections = {}
        self.stopped = False

    def connection(self, storage) -> StorageConnection:
        """The connection to ``storage``, started on first use; :class:`ReplicaUnavailable` once stopped (a
        session whose creation was under way when the server stopped would open connections no one stops)."""
        if self.stopped:
            raise ReplicaUnavailable("the storage connections are stopped: the server is stopping")
        conn = self.connections.get(storage)
        if conn is None:
            conn = StorageConnection(storage, self.open_request, self.reactor, self.initial_retry, self.max_retry,
                                     request_timeout=self.request_timeout, on_unused=self._unused, tls=self.tls,
                                     liveness=self.liveness)
            self.connections[storage] = conn
            conn.start()
        return conn

    def release_unwanted(self):
        """Stop the connections to nodes not wanted any more that no replica session uses (the others are
        stopped when their last session closes)."""
        for conn in list(self.connections.values()):
            self._unused(conn)

    def _unused(self, conn):
        if self.wanted is None or conn.in_use or self.connections.get(conn.storage) is not conn:
            return
        if conn.storage in self.wanted():
            return
        del self.connections[conn.storage]
        self.log.info("storage {storage} is no longer assigned: connection closed", storage=conn.storage)
        conn.stop().addErrback(
            lambda f: self.log.failure("closing the connection to storage {storage}", f, storage=conn.storage))

    def stop(self):
        self.stopped = True
        connections, self.connections = self.connections, {}
        return defer.DeferredList([c.stop() for c in connections.values()])


@implementer(IReplicaSession)
class ReplicaSession:
    """A partition's replica on one storage node, within one store session.

    It binds to the connection that is open when :meth:`when_connected`
    fires; if that connection closes, the disconnect listeners are told once
    and requests fail with :class:`ReplicaUnavailable` until :meth:`when_connected`
    binds again (recovery may retry; the write path never does).
    """

    def __init__(self, replica_id, session_id, connection):
        self.replica_id = replica_id
        self.session_id = session_id
        self.partition_id = replica_id.partition_id
        self._connection = connection
        self._protocol = None
        self._disconnect_callbacks = []
        self._waiters = []         # when_open() Deferreds of when_connected() calls not answered yet
        self._closed = False
        connection.add_close_listener(self._connection_closed)

    @property
    def storage(self):
        return self.replica_id.storage

    @property
    def connected(self):
        return self._protocol is not None and not self._protocol.closed and not self._closed

    def when_connected(self):
        if self._closed:
            return defer.fail(ReplicaUnavailable("replica session %s is closed" % (self.storage,)))
        if self.connected:
            return defer.succeed(self)
        waiter = self._connection.when_open()
        self._waiters.append(waiter)
        waiter.addBoth(self._waited, waiter)
        return waiter.addCallback(self._bind)

    def _waited(self, result, waiter):
        if waiter in self._waiters:
            self._waiters.remove(waiter)
        return result

    def _bind(self, protocol):
        if self._closed:
            raise ReplicaUnavailable("replica session %s is closed" % (self.storage,))
        self._protocol = protocol
        return self

    def on_disconnect(self, callback):
        self._disconnect_callbacks.append(callback)

    def _connection_closed(self, protocol):
        if protocol is self._protocol:
            self._protocol = None
            callbacks, self._disconnect_callbacks = self._disconnect_callbacks, []
            for callback in callbacks:
                callback(self)

    def close(self):
        """Stop using the connection (it stays open for other sessions); a wait for it to open is
        cancelled (a node down for long would otherwise keep one waiter per closed session)."""
        self._closed = True
        self._protocol = None
        self._disconnect_callbacks = []
        self._connection.remove_close_listener(self._connection_closed)
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            waiter.cancel()

    def _request(self, cls, *fields):
        if not self.connected:
            return defer.fail(ReplicaUnavailable("storage %s is not connected" % self.storage))
        d = self._protocol.request(cls(self.session_id, 0, self.partition_id, *fields))
        return d.addErrback(self._unavailable)

    def _unavailable(self, failure):
        failure.trap(ConnectionClosed)
        raise ReplicaUnavailable("storage %s: %s" % (self.storage, failure.getErrorMessage()))

    def last_session_info(self):
        d = self._request(sm.LastSessionInfoRequest, False)
        return d.addCallback(lambda r: (r.last_session_id, r.low_water_mark, r.local_low_water_mark))

    def max_transaction_id(self):
        return self._request(sm.MaxTransactionIdRequest, False).addCallback(lambda r: r.transaction_id)

    def truncate(self, transaction_id):
        return self._request(sm.TruncateRequest, transaction_id, False).addCallback(lambda r: r.transaction_id)

    def set_low_water_mark(self, low_water_mark):
        return self._request(sm.SetLowWaterMarkRequest, low_water_mark, False).addCallback(lambda r: None)

    def append(self, records):
        return self._request(sm.AppendRequest, tuple(records), False).addCallback(lambda r: None)

    def get_records(self, transaction_id, max_records):
        return self._request(sm.RecordListRequest, transaction_id, max_records).addCallback(lambda r: r.records)

    def get_headers(self, transaction_id, max_records):
        return self._request(sm.RecordHeaderListRequest, transaction_id, max_records).addCallback(
            lambda r: r.record_headers)

    def get_record(self, transaction_id):
        return self._request(sm.RecordRequest, transaction_id).addCallback(lambda r: r.record)
