"""The client's connections to servers: one stream and one RPC connection per server.

* :class:`ClientProtocol` is a :class:`~waltz.protocols.base.WaltzProtocol` of family
  ``L`` that hands every message to its :class:`ManagedConnection`. Transaction data
  whose checksum does not match does not close the connection: the codec turns it into
  a :class:`DataChecksumMismatch` so the client can fetch it again.
* :class:`ManagedConnection` keeps one logical connection to one server open: it
  connects, waits for the Hello handshake, and when the connection is lost (or cannot
  be made) connects again with a doubling back-off, until :meth:`~ManagedConnection.close`.
  Each TCP connection it makes gets the next number of a client-wide sequence
  (:attr:`~ManagedConnection.seq_num`), which the stream connection's mount requests
  carry so that the server can drop an older connection of the same client. We never
  try to recover a connection after an unexpected error: a new one is made and the
  partitions are mounted again (seed 001, "Fault Recovery").

Connection states: ``IDLE`` → ``CONNECTING`` → ``READY`` → (lost) ``BACKING_OFF`` →
``CONNECTING`` ... and ``CLOSED`` from anywhere.
"""

import enum
import random

import attr
from twisted.internet import defer
from twisted.internet.protocol import Factory
from twisted.logger import Logger

from waltz.protocols.base import IDLE_TIMEOUT, Liveness, WaltzProtocol
from waltz.protocols.client_messages import CLIENT_CODEC, TransactionDataResponse
from waltz.protocols.errors import ChecksumError
from waltz.protocols.primitives import Reader
from waltz.protocols.values import ReqId
from waltz.tls import client_endpoint

log = Logger()


@attr.s(frozen=True, slots=True, auto_attribs=True)
class Endpoint:
    """A server's client port."""

    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> "Endpoint":
        host, _, port = text.rpartition(":")
        return cls(host, int(port))

    def __str__(self):
        return "%s:%d" % (self.host, self.port)


@attr.s(frozen=True, slots=True, auto_attribs=True)
class DataChecksumMismatch:
    """Not a wire message: a TransactionDataResponse whose data failed its CRC32C check."""

    req_id: ReqId
    transaction_id: int
    error: str


class ChecksumTolerantCodec:
    """:data:`CLIENT_CODEC`, except that a transaction-data response with a bad checksum decodes
    to a :class:`DataChecksumMismatch` instead of closing the connection."""

    def __init__(self, codec=CLIENT_CODEC):
        self._codec = codec
        self.magic = codec.magic
        self.versions = codec.versions
        self.replies = codec.replies

    def encode(self, message, version):
        return self._codec.encode(message, version)

    def encoder(self, version):
        return self._codec.encoder(version)

    def decoder(self, version, accepted=None):
        decode = self._codec.decoder(version, accepted)

        def decode_tolerating_checksums(payload):
            try:
                return decode(payload)
            except ChecksumError as exc:
                return self._checksum_mismatch(payload, exc)
        return decode_tolerating_checksums

    def decode(self, payload, version):
        try:
            return self._codec.decode(payload, version)
        except ChecksumError as exc:
            return self._checksum_mismatch(payload, exc)

    @staticmethod
    def _checksum_mismatch(payload, exc):
        if not payload or payload[0] != TransactionDataResponse.TYPE:
            raise exc
        reader = Reader(payload)
        reader.u8("message type")
        return DataChecksumMismatch(ReqId.decode(reader), reader.i64("transactionId"), str(exc))


CLIENT_SIDE_CODEC = ChecksumTolerantCodec()


class ClientProtocol(WaltzProtocol):
    """One TCP connection of a :class:`ManagedConnection` (set as :attr:`owner` by the factory)."""

    codec = CLIENT_SIDE_CODEC
    hello_name = "Waltz Client"
    owner = None
    #: A request sent to a client closes the connection before its body is decoded.
    receives = CLIENT_SIDE_CODEC.replies

    def connectionReady(self):
        self.owner.protocol_ready(self)

    def messageReceived(self, message):
        return self.owner.protocol_message(self, message)

    def connectionClosed(self, reason):
        self.owner.protocol_closed(self, reason)


class _ProtocolFactory(Factory):
    noisy = False

    def __init__(self, owner, clock, seq_num, idle_timeout):
        self.owner = owner
        self.clock = clock
        self.seq_num = seq_num
        self.idle_timeout = idle_timeout

    def buildProtocol(self, addr):
        proto = ClientProtocol()
        proto.factory = self
        proto.owner = self.owner
        Liveness(self.clock, idle_timeout=self.idle_timeout).apply(proto)
        return proto


def tcp_connector(reactor, timeout, tls=None):
    """The default way to open a connection: ``connector(endpoint, factory) -> Deferred[protocol]``, through
    TLS when ``tls`` (a :class:`waltz.tls.TLSConfig`) is given."""
    def connect(endpoint, factory):
        return client_endpoint(reactor, endpoint.host, endpoint.port, timeout, tls).connect(factory)
    return connect


#: The part of each reconnect delay drawn at random (see :class:`Backoff`).
RECONNECT_JITTER = 0.5


class Backoff:
    """Reconnect delays: 0 first, then ``initial`` doubling up to ``maximum``; :meth:`reset` once a
    connection has served at least ``maximum`` seconds.

    Each delay after the first is shortened by a random part of up to ``jitter`` of it (drawn with
    ``rng``): the clients of a server that went away would otherwise retry in step, every one of them at
    the same instants, against the server that comes back (or takes its partitions over)."""

    def __init__(self, initial, maximum, jitter=RECONNECT_JITTER, rng=None):
        if not initial > 0:
            # 0 would never double: every attempt would follow the last at once, a busy loop.
            raise ValueError("reconnect back-off needs an initial delay above 0, not %r" % (initial,))
        if not 0 <= jitter < 1:
            raise ValueError("reconnect jitter is a fraction from 0 up to 1, not %r" % (jitter,))
        self.initial = initial
        self.maximum = maximum
        self.jitter = jitter
        self._rng = rng if rng is not None else random.Random()
        self._next = 0.0

    def next_delay(self) -> float:
        delay = self._next
        self._next = min(self.maximum, max(self.initial, 2 * self._next))
        if delay and self.jitter:
            delay -= delay * self.jitter * self._rng.random()
        return delay

    def reset(self):
        self._next = 0.0


class ConnectionState(enum.Enum):
    IDLE = "idle"
    CONNECTING = "connecting"
    READY = "ready"
    BACKING_OFF = "backing off"
    CLOSED = "closed"


class ManagedConnection:
    """A self-healing connection to ``endpoint`` for one ``role`` (``"stream"`` or ``"rpc"``).

    ``listener`` gets ``connection_ready(conn)``, ``connection_lost(conn)`` and
    ``connection_message(conn, message)`` (which may return a Deferred: the
    protocol's back pressure then applies). ``seq_numbers`` is the client's
    iterator of network-client sequence numbers. A connection whose Hello exchange has
    not completed ``handshake_timeout`` seconds after the TCP connect (a peer that
    accepts and never answers) is dropped and retried.
    """

    def __init__(self, endpoint, role, listener, connector, reactor, backoff, seq_numbers, handshake_timeout=10.0,
                 idle_timeout=IDLE_TIMEOUT):
        self.endpoint = endpoint
        self.role = role
        self._listener = listener
        self._connector = connector
        self._reactor = reactor
        self._backoff = backoff
        self._seq_numbers = seq_numbers
        self.state = ConnectionState.IDLE
        self.protocol = None
        self.seq_num = None
        self._attempt = None
        self._retry_call = None
        self._handshake_timeout = handshake_timeout
        self._idle_timeout = idle_timeout
        self._handshake_call = None
        self._ready_since = None

    def __repr__(self):
        return "<%s connection to %s #%s %s>" % (self.role, self.endpoint, self.seq_num, self.state.value)

    @property
    def ready(self) -> bool:
        return self.state is ConnectionState.READY

    def _set_state(self, state):
        if state is not self.state:
            log.debug("{conn}: {old} -> {new}", conn=self, old=self.state.value, new=state.value)
            self.state = state

    def start(self):
        """Start connecting (no-op unless idle)."""
        if self.state is ConnectionState.IDLE:
            self._connect()

    def _connect(self):
        self._retry_call = None
        self.seq_num = next(self._seq_numbers)
        self._set_state(ConnectionState.CONNECTING)
        attempt = self._attempt = defer.maybeDeferred(
            self._connector, self.endpoint, _ProtocolFactory(self, self._reactor, self.seq_num, self._idle_timeout))
        attempt.addCallbacks(self._connected, self._connect_failed,
                             callbackArgs=(attempt,), errbackArgs=(attempt,))

    def _current(self, protocol) -> bool:
        """True when ``protocol`` belongs to the latest connection attempt."""
        return protocol.factory.seq_num == self.seq_num and self.state is not ConnectionState.CLOSED

    def _connected(self, protocol, attempt):
        if attempt is self._attempt:
            self._attempt = None
        if not self._current(protocol):
            protocol.transport.loseConnection()
            return
        if protocol.closed or self.state is not ConnectionState.CONNECTING:
            return
        self.protocol = protocol
        # Ready once the Hello exchange completes (protocol_ready), which may already have happened;
        # it has not (the state would be READY), so it gets a deadline.
        self._handshake_call = self._reactor.callLater(self._handshake_timeout, self._handshake_expired, protocol)

    def _handshake_expired(self, protocol):
        self._handshake_call = None
        if self._current(protocol) and self.state is ConnectionState.CONNECTING and not protocol.closed:
            protocol.close("no Hello from %s within %s s" % (self.endpoint, self._handshake_timeout))

    def _cancel_handshake_deadline(self):
        if self._handshake_call is not None and self._handshake_call.active():
            self._handshake_call.cancel()
        self._handshake_call = None

    def _connect_failed(self, reason, attempt):
        if attempt is not self._attempt or self.state is ConnectionState.CLOSED:
            return
        self._attempt = None
        log.info("{conn}: cannot connect: {error}", conn=self, error=reason.getErrorMessage())
        self._schedule_reconnect()

    def _schedule_reconnect(self):
        self._cancel_handshake_deadline()
        self.protocol = None
        self._set_state(ConnectionState.BACKING_OFF)
        self._retry_call = self._reactor.callLater(self._backoff.next_delay(), self._connect)

    # --- from ClientProtocol -------------------------------------------------------------------

    def protocol_ready(self, protocol):
        if not self._current(protocol) or self.state is not ConnectionState.CONNECTING:
            return
        self.protocol = protocol
        self._cancel_handshake_deadline()
        self._ready_since = self._reactor.seconds()
        self._set_state(ConnectionState.READY)
        log.info("{conn}: connected (version {version})", conn=self, version=protocol.version)
        self._listener.connection_ready(self)

    def protocol_message(self, protocol, message):
        if protocol is not self.protocol or self.state is not ConnectionState.READY:
            return None
        return self._listener.connection_message(self, message)

    def protocol_closed(self, protocol, reason):
        if not self._current(protocol) or self.state is ConnectionState.BACKING_OFF:
            return
        was_ready = self.state is ConnectionState.READY
        log.info("{conn}: connection lost: {reason}", conn=self, reason=protocol.describe_close(reason))
        if was_ready and self._reactor.seconds() - self._ready_since >= self._backoff.maximum:
            # It served a while: reconnect at once. One closed soon after its Hello (a server that takes
            # every connection and drops it) goes on backing off instead of reconnecting in a tight loop.
            self._backoff.reset()
        self._schedule_reconnect()
        if was_ready:
            self._listener.connection_lost(self)

    # --- use ---------------------------------------------------------------------------------

    def send(self, message) -> bool:
        """Send ``message`` if the connection is ready; False (nothing sent) otherwise."""
        if not self.ready:
            return False
        self.protocol.sendMessage(message)
        return True

    def drop(self, reason):
        """Close the current TCP connection (a new one follows): e.g. the server misbehaved."""
        if self.protocol is not None and not self.protocol.closed:
            self.protocol.close(reason)

    def close(self):
        """Close for good; no reconnect, no more listener calls."""
        if self.state is ConnectionState.CLOSED:
            return
        self._set_state(ConnectionState.CLOSED)
        self._cancel_handshake_deadline()
        if self._retry_call is not None and self._retry_call.active():
            self._retry_call.cancel()
        if self._attempt is not None:
            attempt, self._attempt = self._attempt, None
            attempt.cancel()
        if self.protocol is not None:
            self.protocol.close("the client closed it", expected=True)
            self.protocol = None


@attr.s(slots=True)
class ServerConnections:
    """The two connections the client keeps to one server."""

    endpoint = attr.ib()
    stream = attr.ib()
    rpc = attr.ib()

    def start(self):
        self.stream.start()
        self.rpc.start()

    def close(self):
        self.stream.close()
        self.rpc.close()
