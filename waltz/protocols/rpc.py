"""Request/response client connections for the storage (``S``) and admin (``A``) families.

Both families match a response to its request by ``seq_num``. A
:class:`RequestClientProtocol` numbers each request it sends (the caller's
``seq_num`` is replaced), keeps a Deferred per outstanding request, and fires it
with the response message, or fails it with :class:`RemoteError` when the
storage answered with a failure response, or with :class:`ConnectionClosed`
when the connection went away first. With :attr:`RequestClientProtocol.request_timeout`
(and liveness ticks, see :class:`~waltz.protocols.base.Liveness`), a request left
unanswered that long closes the connection, failing every request on it: a peer
that is alive but stuck (a hung disk under its worker) must not hold its callers
forever.

Every connection starts with an open request (cluster key and partition
count); :attr:`opened` fires with the protocol once the storage accepted it,
and requests made before then wait for it.
"""

import collections

import attr
from twisted.internet import defer
from twisted.internet.protocol import ClientFactory

from waltz.protocols import admin_messages, storage_messages
from waltz.protocols.base import WaltzProtocol
from waltz.protocols.errors import ProtocolError


class RemoteError(Exception):
    """The peer answered with a failure response; ``info`` is its ExceptionInfo."""

    def __init__(self, info):
        super().__init__(info.message)
        self.info = info


class ConnectionClosed(Exception):
    """The connection closed before the response arrived."""


class RequestClientProtocol(WaltzProtocol):
    """Sends numbered requests and matches responses to them.

    Set :attr:`codec`, :attr:`failure_type` (the family's failure response class)
    and :attr:`open_request` (sent first, with ``seq_num`` -1).
    """

    hello_name = "Waltz Server"
    failure_type = None
    open_request = None
    #: Seconds a request may stay unanswered before the connection is closed (checked at liveness
    #: ticks, so it fires up to one tick interval late); None: requests wait as long as the connection.
    request_timeout = None

    def __init__(self):
        super().__init__()
        self._next_number = 0
        self._pending = {}
        self._waiting_for_open = []
        self.is_open = False
        self.opened = defer.Deferred()
        # (tick time, the number the next request will get) of each liveness tick since the oldest
        # pending request was sent: a request's age is known to a tick's precision (from the first tick
        # that saw it pending) without a clock read per request.
        self._ticks = collections.deque()

    @property
    def receives(self):
        """The family's replies: a request sent to this side closes the connection before it is decoded."""
        return self.codec.replies

    def connectionReady(self):
        self._pending[-1] = d = defer.Deferred()
        d.addCallbacks(self._open_accepted, self._open_refused)
        super().sendMessage(attr.evolve(self.open_request, seq_num=-1))

    def _open_accepted(self, response):
        self.is_open = True
        waiting, self._waiting_for_open = self._waiting_for_open, []
        for message, d in waiting:
            self._send_request(message).chainDeferred(d)
        self.opened.callback(self)

    def _open_refused(self, failure):
        self.opened.errback(failure)
        self.close("open refused: %s" % failure.getErrorMessage())

    def request(self, message) -> defer.Deferred:
        """Send ``message`` with the next sequence number; fires with the response."""
        if self.closed:
            return defer.fail(ConnectionClosed("connection to %s is closed" % self.peer))
        if not self.is_open:
            d = defer.Deferred()
            self._waiting_for_open.append((message, d))
            return d
        return self._send_request(message)

    def _send_request(self, message):
        seq_num = self._next_number
        self._next_number += 1
        self._pending[seq_num] = d = defer.Deferred()
        self.sendMessage(attr.evolve(message, seq_num=seq_num))
        return d

    @property
    def outstanding(self) -> int:
        return len(self._pending)

    def checkLiveness(self, now):
        if self.request_timeout is None:
            return
        ticks = self._ticks
        ticks.append((now, self._next_number))
        oldest = next(iter(self._pending), None)    # requests are numbered in order: the first is oldest
        if oldest is None:
            ticks.clear()
            return
        while ticks[0][1] <= oldest:                # ticks from before it was sent (the last one is after)
            ticks.popleft()
        since = ticks[0][0]                         # the first tick that saw it pending
        if now - since >= self.request_timeout:
            self.close("request %d unanswered for %.0f s: the peer is stuck" % (oldest, now - since), abort=True)

    def messageReceived(self, message):
        d = self._pending.pop(message.seq_num, None)
        if d is None:
            raise ProtocolError("response with unknown seq_num %d (%s)" % (message.seq_num, type(message).__name__))
        if isinstance(message, self.failure_type):
            d.errback(RemoteError(message.exception))
        else:
            d.callback(message)

    def connectionClosed(self, reason):
        error = ConnectionClosed("connection to %s closed: %s" % (self.peer, self.describe_close(reason)))
        pending, self._pending = self._pending, {}
        waiting, self._waiting_for_open = self._waiting_for_open, []
        for d in list(pending.values()) + [d for _, d in waiting]:
            d.errback(error)
        if not self.opened.called:
            self.opened.errback(error)
        else:
            # Nobody may be listening any more; swallow so it is not logged as unhandled.
            self.opened.addErrback(lambda f: None)


class RequestClientFactory(ClientFactory):
    """Builds one :class:`RequestClientProtocol` configured for a family and a cluster."""

    noisy = False

    def __init__(self, protocol_class, open_request, **settings):
        self.protocol_class = protocol_class
        self.open_request = open_request
        self.settings = settings

    def buildProtocol(self, addr):
        proto = self.protocol_class()
        proto.factory = self
        proto.open_request = self.open_request
        for name, value in self.settings.items():
            setattr(proto, name, value)
        return proto



class StorageClientProtocol(RequestClientProtocol):
    """A server's connection to a storage node's storage port (family ``S``)."""

    codec = storage_messages.STORAGE_CODEC
    failure_type = storage_messages.FailureResponse


class AdminClientProtocol(RequestClientProtocol):
    """A tool's connection to a storage node's admin port (family ``A``)."""

    hello_name = "Waltz Admin Client"
    codec = admin_messages.ADMIN_CODEC
    failure_type = admin_messages.FailureResponse


def connect_storage_client(reactor, host, port, cluster_key, num_partitions, admin=False, timeout=5, tls=None):
    """Connect to a storage node's storage port (or, with ``admin``, its admin port).

    The connection opens with the cluster's key and partition count; fires with the
    protocol once connected (``proto.opened`` fires when the node accepted the open).
    With ``tls`` (a ``waltz.tls.TLSConfig``), the connection speaks TLS.
    """
    from twisted.internet import endpoints
    if admin:
        factory = RequestClientFactory(AdminClientProtocol, admin_messages.OpenRequest(-1, cluster_key, num_partitions))
    else:
        factory = RequestClientFactory(StorageClientProtocol,
                                       storage_messages.OpenRequest.create(cluster_key, num_partitions))
    endpoint = endpoints.HostnameEndpoint(reactor, host, port, timeout=timeout)
    if tls is not None:
        endpoint = tls.wrap_client(endpoint, host)
    return endpoint.connect(factory)
