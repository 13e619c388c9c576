"""The Twisted protocol every Waltz connection speaks: framing, Hello, keep-alives, back pressure.

:class:`WaltzProtocol` turns bytes into decoded messages of one family (a
:class:`~waltz.protocols.codec.MessageCodec`) and messages into frames. It

* turns Nagle's algorithm off (``TCP_NODELAY``) on TCP transports, as the original does;
* sends a Hello on connect and picks the highest common version; nothing else
  is sent or accepted before the handshake completes (outgoing messages wait);
* treats a zero-length frame as a keep-alive and, with :class:`Liveness` set,
  sends one when it has written nothing for a while and closes a connection on
  which nothing has arrived for ``idle_timeout`` seconds (a peer that vanished
  without closing: a dead host, a cut network, a stopped process);
* closes the connection, with a logged reason naming the problem, on a wrong
  magic, an unsupported version, a length over ``max_frame_size``, a payload
  the codec rejects, a second Hello, or an exception in the handler; a
  truncated frame just waits for more bytes. Nothing raises into the reactor;
* applies back pressure on input: :meth:`messageReceived` may return a
  Deferred meaning "still being handled". While ``inbound_high_watermark`` or
  more are outstanding the protocol stops reading from the transport
  (``pauseProducing``) and stops decoding buffered frames; it resumes when they
  drop to ``inbound_low_watermark``;
* is itself an ``IPushProducer`` registered with its transport, so it learns
  when the peer reads too slowly: :attr:`writable` turns false and
  :meth:`outboundPaused` / :meth:`outboundResumed` are called, which feeds use
  to stop producing; with :attr:`pause_reading_while_unwritable` it also stops
  reading until the peer catches up;
* writes through after a read: what the handling of a read wrote to this connection goes to the
  kernel at the end of that read (:meth:`_write_through`), not at the reactor's next poll, after
  every other connection's reads of the turn. A client process reading the feeds of several
  connections in one turn sends each one's appends while it handles the others, so the server
  works on them meanwhile instead of waiting for the whole turn.

Subclasses implement :meth:`messageReceived` and may override
:meth:`connectionReady` (handshake complete) and :meth:`connectionClosed`.
"""

import attr
from twisted.internet import abstract, defer, error, interfaces
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from waltz.protocols.errors import FrameError, HandshakeError, ProtocolError
from waltz.protocols.framing import (
    DEFAULT_MAX_FRAME_SIZE, HEADER, HEADER_SIZE, HELLO_MAGIC, HELLO_VERSION, MAX_HELLO_SIZE, Hello,
    decode_frame_header, encode_frame_header, negotiate)

def is_deferred(value) -> bool:
    """``isinstance(value, Deferred)``, answered at once for the usual ``None``/``True``/``False``.

    ``Deferred`` derives from an ABC, so ``isinstance`` of anything that is not one goes through
    the ABC machinery: slow on paths that run for every message or transaction.
    """
    return value is not None and value is not True and value is not False and isinstance(value, defer.Deferred)


#: Compact the receive buffer once this many consumed bytes sit at its front.
_COMPACT_THRESHOLD = 64 * 1024

#: Seconds between a live connection's liveness ticks (see :class:`Liveness`).
KEEPALIVE_INTERVAL = 5.0
#: Seconds without receiving anything after which a live connection is closed. A peer that writes
#: nothing sends a keep-alive within two intervals, so this leaves room for two lost ticks.
IDLE_TIMEOUT = 20.0
#: Seconds a closed connection may spend flushing what was written to it before it is aborted: a peer
#: that does not read would otherwise hold it open until TCP gives up (about 15 minutes, or never).
CLOSE_FLUSH_TIMEOUT = 10.0


@attr.s(frozen=True, slots=True)
class Liveness:
    """How a connection notices a peer that is gone without closing (``docs/protocol.md``, "Keep-alives").

    Every ``interval`` seconds a tick sends a keep-alive frame if nothing was written since the
    previous tick, and closes the connection once nothing has been received for ``idle_timeout``
    seconds. Time during which this side paused reading (back pressure) does not count: the
    silence is its own. The daemons and the client library set it on the connections they make
    and accept; a connection without it never times out (TCP alone notices a vanished peer only
    when it writes, after about 15 minutes of retransmissions).
    """

    clock = attr.ib()
    interval = attr.ib(default=KEEPALIVE_INTERVAL)
    idle_timeout = attr.ib(default=IDLE_TIMEOUT)

    def settings(self) -> dict:
        """The protocol attributes this sets (for factories that take attribute settings)."""
        return {"clock": self.clock, "keepalive_interval": self.interval, "idle_timeout": self.idle_timeout}

    def apply(self, proto):
        """Set these on protocol ``proto`` (before its connection is made)."""
        for name, value in self.settings().items():
            setattr(proto, name, value)


@implementer(interfaces.IPushProducer)
class WaltzProtocol(Protocol):
    """A framed, version-negotiated connection carrying one message family."""

    log = Logger()

    #: Set by subclasses or the factory.
    codec = None
    hello_name = "Waltz"
    max_frame_size = DEFAULT_MAX_FRAME_SIZE
    inbound_high_watermark = 600
    inbound_low_watermark = 300
    #: Stop reading while the peer does not read what is written (the transport's buffer is full).
    #: For request/response servers, where every request read makes an answer to buffer: without it a
    #: peer that sends requests and never reads would grow the buffer until the process runs out of memory.
    pause_reading_while_unwritable = False
    #: Seconds between liveness ticks; ``None`` (the default) disables keep-alives and the idle timeout.
    keepalive_interval = None
    #: Seconds without receiving anything before the connection is closed (checked at each tick).
    idle_timeout = None
    #: Count ticks at which requests of the peer are still being handled here as heard: for request/response
    #: servers whose peers may send nothing while they wait for an answer (an admin tool, which does not tick).
    #: Not for a client's feed, whose server ticks whatever the client does with what it received.
    waiting_peer_is_silent = False
    #: The reactor (or a ``Clock`` in tests) used for liveness ticks.
    clock = None
    #: The message classes this side receives (None: any of the family). Set by the server sides of the
    #: protocols: a frame of another type (a response sent to a server) closes the connection before its
    #: body is decoded, so a peer cannot make the reactor decode a large refused message item by item.
    receives = None

    version = None
    closed = False
    #: Set when the connection is gone: True when the peer (or the network) ended it, False when this side
    #: closed it (:meth:`close`).
    closed_by_peer = None

    def __init__(self):
        self._buffer = bytearray()
        self._offset = 0
        self._outbox = []
        self._pending_inbound = 0
        self._read_pauses = set()   # why reading is paused: "inbound", "outbound"
        self._liveness_call = None
        self._wrote = False         # since the last liveness tick
        self._received = False      # since the last liveness tick
        self._last_heard = None     # clock time of the last tick that found something received
        self._abort_call = None     # aborts a closed connection still flushing (see close)
        self._encode = self._decode = None   # the codec's functions for the negotiated version
        self._unsent = False        # written since the last write-through (see _write_through)
        self._writes_through = False    # the transport is a TCP one (see _write_through)
        self.writable = True

    # -- connection life cycle -------------------------------------------------

    def connectionMade(self):
        self._set_no_delay()
        self._writes_through = isinstance(self.transport, abstract.FileDescriptor)
        self.transport.registerProducer(self, True)
        self.transport.write(Hello(tuple(self.codec.versions), self.hello_name).to_frame())
        self._start_liveness()

    def _set_no_delay(self):
        """Turn Nagle's algorithm off (TCP_NODELAY, as the original sets on every channel).

        Waltz traffic is small request and response frames in both directions; with Nagle on, a
        frame written while an earlier one is unacknowledged waits for the peer's delayed ACK
        (up to 40 ms on Linux), which showed up as tens of ms of feed and append latency. Writes
        made in one reactor turn still leave in one ``send``: the transport buffers them.
        """
        set_no_delay = getattr(self.transport, "setTcpNoDelay", None)
        if set_no_delay is None:
            return          # not TCP (a test transport, a UNIX socket)
        try:
            set_no_delay(True)
        except OSError as exc:
            self.log.warn("cannot set TCP_NODELAY on the connection from {peer}: {error}",
                          peer=self.peer, error=exc)

    def connectionLost(self, reason):
        self.closed_by_peer = not self.closed
        self.closed = True
        self._stop_liveness()
        if self._abort_call is not None and self._abort_call.active():
            self._abort_call.cancel()
        self._abort_call = None
        self._outbox = []
        self.connectionClosed(reason)

    def describe_close(self, reason) -> str:
        """What ended the connection, in words for an error or a log line: ``reason``'s message (a Failure,
        as :meth:`connectionClosed` gets it), and the likely cause when the peer closed a plain connection
        without sending its Hello. Every Waltz port sends its Hello first, so such a peer is not a Waltz
        port, or one that speaks TLS (which closes a connection whose first bytes are not a TLS handshake,
        without a word)."""
        if (self.version is None and self.closed_by_peer and reason is not None
                and reason.check(error.ConnectionDone, error.ConnectionLost)
                and not interfaces.INegotiated.providedBy(self.transport)):
            return ("the peer closed it before sending its Hello: not a Waltz port, or one that speaks TLS "
                    "(this side connected without it; see docs/operations.md, \"TLS\")")
        return reason.getErrorMessage() if reason is not None else "closed"

    @property
    def ready(self) -> bool:
        """True once the handshake has completed and the connection is open."""
        return self.version is not None and not self.closed

    @property
    def peer(self) -> str:
        address = self.transport.getPeer() if self.transport else None
        host, port = getattr(address, "host", None), getattr(address, "port", None)
        return "%s:%s" % (host, port) if host is not None else str(address)

    def close(self, reason: str, abort: bool = False, expected: bool = False):
        """Close this connection because of ``reason`` (logged: a warning unless ``expected``, as this
        side's own orderly close); other connections are unaffected.

        What was written still goes out, for at most :data:`CLOSE_FLUSH_TIMEOUT` seconds, after which
        the connection is aborted; with ``abort`` (the peer is gone or stuck) it is dropped at once.
        """
        if self.closed:
            return
        self.closed = True
        (self.log.debug if expected else self.log.warn)(
            "closing connection from {peer}: {reason}", peer=self.peer, reason=reason)
        self._stop_liveness()
        transport = self.transport
        # Unregistered first: a transport that paused this producer (its buffer full) resumes it once
        # the buffer drains instead of finishing the close, and the connection would stay open for good.
        if getattr(transport, "producer", None) is not None:
            transport.unregisterProducer()
        if abort:
            transport.abortConnection()
        else:
            transport.loseConnection()
            self._abort_call = self._clock().callLater(CLOSE_FLUSH_TIMEOUT, transport.abortConnection)

    # -- hooks for subclasses ----------------------------------------------------

    def connectionReady(self):
        """Called once the handshake picked :attr:`version`."""

    def messageReceived(self, message):
        """Handle one decoded message; may return a Deferred (see back pressure)."""
        raise NotImplementedError

    def connectionClosed(self, reason):
        """Called when the connection is gone, for any reason."""

    def outboundPaused(self):
        """The transport's write buffer is full: stop producing until :meth:`outboundResumed`."""

    def outboundResumed(self):
        """The transport drained its write buffer."""

    # -- sending ---------------------------------------------------------------

    def sendMessage(self, message):
        """Encode and send ``message``; before the handshake it waits in an outbox."""
        if self.closed:
            return
        if self.version is None:
            self._outbox.append(message)
            return
        payload = self._encode(message)
        self.transport.writeSequence((HEADER.pack(self.codec.magic, self.version, len(payload)), payload))
        self._wrote = self._unsent = True

    def sendPayloads(self, payloads):
        """Send messages already encoded by this protocol's codec, in one write (only after the handshake).

        A payload's encoding does not depend on the version (versions only add message types), so
        one encoding serves every connection that negotiated a version carrying the message.
        """
        if self.closed:
            return
        if self.version is None:
            raise RuntimeError("sendPayloads before the handshake completed")
        magic, version, pack, parts = self.codec.magic, self.version, HEADER.pack, []
        for payload in payloads:
            parts.append(pack(magic, version, len(payload)))
            parts.append(payload)
        self.transport.write(b"".join(parts))
        self._wrote = self._unsent = True

    def sendKeepAlive(self):
        """Send a zero-length frame (only once the handshake completed)."""
        if self.ready:
            self.transport.write(encode_frame_header(self.codec.magic, self.version, 0))
            self._wrote = True

    # -- liveness (see Liveness) ---------------------------------------------------

    def _start_liveness(self):
        if self.keepalive_interval is None or self.closed:
            return
        clock = self._clock()
        self._last_heard = clock.seconds()
        self._liveness_call = clock.callLater(self.keepalive_interval, self._liveness_tick)

    def _liveness_tick(self):
        # Per message, sending and receiving only set a flag: a timer reset per message would cost a
        # clock read and a heap operation on paths that run several times per transaction.
        self._liveness_call = None
        if self.closed:
            return
        clock = self._clock()
        now = clock.seconds()
        if (self._received or (self._read_pauses and self.version is not None)
                or (self._pending_inbound and self.waiting_peer_is_silent)):
            # (Paused reading, or a peer waiting for answers still being worked out: the silence is this side's.
            # Not before the Hello exchange: under TLS the Hello waits for the handshake, pausing reading, and a
            # peer that never finished its handshake would hold the connection for good.)
            self._last_heard = now
        self._received = False
        if self.idle_timeout is not None and now - self._last_heard >= self.idle_timeout:
            self.close("nothing received for %.0f s: the peer is gone or stuck" % (now - self._last_heard),
                       abort=True)
            return
        self.checkLiveness(now)
        if self.closed:
            return
        if not self._wrote and self.writable:
            self.sendKeepAlive()
        self._wrote = False
        self._liveness_call = clock.callLater(self.keepalive_interval, self._liveness_tick)

    def checkLiveness(self, now):
        """Called at every liveness tick of an open connection; subclasses may close it (a peer that is
        alive but stopped answering)."""

    def _stop_liveness(self):
        if self._liveness_call is not None and self._liveness_call.active():
            self._liveness_call.cancel()
        self._liveness_call = None

    def _clock(self):
        if self.clock is None:
            from twisted.internet import reactor
            self.clock = reactor
        return self.clock

    # -- receiving ---------------------------------------------------------------

    def dataReceived(self, data):
        if self.closed:
            return
        self._received = True
        self._buffer += data
        self._process_buffer()
        if self._unsent:
            self._write_through()

    def _write_through(self):
        """Hand what this connection buffered to the kernel now (a non-blocking send), not at the next poll.

        Only on a TCP transport (a Twisted ``FileDescriptor``) that is open and writable: a closing
        (or half-closed) one finishes through the reactor, and one whose peer reads slowly (outbound
        paused) waits for the reactor to find it writable, as before. Whatever the send leaves (a full
        socket buffer), or an error it meets, stays with the transport, still registered for writing: the
        reactor's own write sends the rest or closes the connection, as it would have. ``doWrite`` is looked
        up at each call: an aborted transport replaces it with one that writes nothing.
        """
        self._unsent = False
        transport = self.transport
        if (not self._writes_through or self.closed or not self.writable or not transport.connected
                or transport.disconnecting or getattr(transport, "_writeDisconnecting", False)):
            return
        transport.doWrite()

    def _process_buffer(self):
        try:
            while not self.closed and not self._read_pauses:
                if self.version is not None and not self._deliver_frames():
                    break
                frame = self._next_frame()
                if frame is None:
                    break
                self._handle_frame(*frame)
        except ProtocolError as exc:
            self.close(str(exc))
        except Exception:
            self.log.failure("handler error on connection from {peer}", peer=self.peer)
            self.close("handler error: %s" % Failure().getErrorMessage())
        self._compact()

    def _deliver_frames(self) -> bool:
        """The steady state, after the handshake: deliver every complete, well-formed frame.

        False when it stopped for want of bytes (or because reading paused or the connection
        closed); True when the next frame is unusual (a bad header, a Hello), for the generic
        :meth:`_next_frame` to raise its precise error. One tight loop instead of several calls per
        frame: every transaction crosses three or more connections.
        """
        buffer, unpack = self._buffer, HEADER.unpack_from
        magic, version, limit = self.codec.magic, self.version, self.max_frame_size
        decode, received = self._decode, self.messageReceived
        while not self.closed and not self._read_pauses:
            start = self._offset
            if len(buffer) - start < HEADER_SIZE:
                return False
            frame_magic, frame_version, length = unpack(buffer, start)
            if frame_magic != magic or frame_version != version or not 0 <= length <= limit:
                return True
            end = start + HEADER_SIZE + length
            if len(buffer) < end:
                return False
            self._offset = end
            if length:  # an empty payload is a keep-alive
                # (_deliver, inlined: this runs for every message of every connection)
                result = received(decode(bytes(buffer[start + HEADER_SIZE:end])))
                if is_deferred(result):
                    self._handling(result)
        return False

    def _next_frame(self):
        """The next complete frame as ``(magic, version, payload)``, or None to wait for bytes."""
        if len(self._buffer) - self._offset < HEADER_SIZE:
            return None
        magic, version, length = decode_frame_header(self._buffer, self._offset)
        self._check_header(magic, version, length)
        end = self._offset + HEADER_SIZE + length
        if len(self._buffer) < end:
            return None
        payload = bytes(self._buffer[self._offset + HEADER_SIZE:end])
        self._offset = end
        return magic, version, payload

    def _check_header(self, magic, version, length):
        if self.version is None:
            if magic != HELLO_MAGIC:
                raise FrameError("expected a Hello frame first, got magic %r" % magic)
            if version != HELLO_VERSION:
                raise FrameError("unsupported Hello version %d" % version)
            if length > MAX_HELLO_SIZE:
                raise FrameError("Hello frame of %d bytes, over the limit of %d" % (length, MAX_HELLO_SIZE))
        elif magic == HELLO_MAGIC:
            raise HandshakeError("second Hello received")
        elif magic != self.codec.magic:
            raise FrameError("wrong magic %r, expected %r" % (magic, self.codec.magic))
        elif version != self.version:
            raise FrameError("frame version %d differs from the negotiated version %d" % (version, self.version))
        if length < 0 or length > self.max_frame_size:
            raise FrameError("frame length %d outside 0..%d" % (length, self.max_frame_size))

    def _handle_frame(self, magic, version, payload):
        if magic == HELLO_MAGIC:
            self._handle_hello(Hello.decode(payload))
        elif payload:
            self._deliver(self._decode(payload))
        # An empty payload is a keep-alive: nothing to do.

    def _handle_hello(self, hello):
        self.version = negotiate(self.codec.versions, hello.versions)
        self._encode, self._decode = self._codec_functions(self.version)
        self.log.debug("connection from {peer} ({name}) speaks version {version}",
                       peer=self.peer, name=hello.name, version=self.version)
        outbox, self._outbox = self._outbox, []
        for message in outbox:
            self.sendMessage(message)
        self.connectionReady()

    def _codec_functions(self, version):
        """``(encode(message), decode(payload))`` for ``version``: the codec's own per-version functions
        when it has them (:meth:`~waltz.protocols.codec.MessageCodec.encoder`), else its generic methods."""
        codec = self.codec
        if hasattr(codec, "encoder") and hasattr(codec, "decoder"):
            return codec.encoder(version), codec.decoder(version, self.receives)
        return (lambda message: codec.encode(message, version)), (lambda payload: codec.decode(payload, version))

    def _deliver(self, message):
        result = self.messageReceived(message)
        if is_deferred(result):
            self._handling(result)

    def _handling(self, result):
        """``messageReceived`` returned the Deferred ``result``: the message counts toward the inbound
        back pressure until it fires."""
        self._pending_inbound += 1
        if self._pending_inbound >= self.inbound_high_watermark:
            self._pause_reading("inbound")
        result.addBoth(self._inbound_done)

    def _inbound_done(self, result):
        self._pending_inbound -= 1
        if isinstance(result, Failure):
            self.log.failure("handler error on connection from {peer}", result, peer=self.peer)
            self.close("handler error: %s" % result.getErrorMessage())
        elif self._pending_inbound <= self.inbound_low_watermark:
            self._resume_reading("inbound")
        return None

    def _pause_reading(self, reason):
        if not self._read_pauses:
            self.transport.pauseProducing()
        self._read_pauses.add(reason)

    def _resume_reading(self, reason):
        if reason not in self._read_pauses:
            return
        self._read_pauses.discard(reason)
        if not self._read_pauses and not self.closed:
            self.transport.resumeProducing()
            self._process_buffer()

    def _compact(self):
        if self._offset and (self._offset >= _COMPACT_THRESHOLD or self._offset == len(self._buffer)):
            del self._buffer[:self._offset]
            self._offset = 0

    @property
    def inbound_pending(self) -> int:
        """How many received messages are still being handled."""
        return self._pending_inbound

    @property
    def reading_paused(self) -> bool:
        return bool(self._read_pauses)

    # -- IPushProducer: the transport tells us when the peer reads too slowly ---------

    def pauseProducing(self):
        self.writable = False
        if self.pause_reading_while_unwritable:
            self._pause_reading("outbound")
        self.outboundPaused()

    def resumeProducing(self):
        self.writable = True
        if self.pause_reading_while_unwritable:
            self._resume_reading("outbound")
        self.outboundResumed()

    def stopProducing(self):
        self.writable = False
