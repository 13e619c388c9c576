"""The Twisted protocol every Waltz connection speaks: framing, Hello, keep-alives, back pressure.

:class:`WaltzProtocol` turns bytes into decoded messages of one family (a
:class:`~waltz.protocols.codec.MessageCodec`) and messages into frames. It

* turns Nagle's algorithm off (``TCP_NODELAY``) on TCP transports, as the original does;
* sends a Hello on connect and picks the highest common version; nothing else
  is sent or accepted before the handshake completes (outgoing messages wait);
* treats a zero-length frame as a keep-alive and, when ``keepalive_interval``
  is set, sends one after that many idle seconds without writes;
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
  reading until the peer catches up.

Subclasses implement :meth:`messageReceived` and may override
:meth:`connectionReady` (handshake complete) and :meth:`connectionClosed`.
"""

from twisted.internet import defer, interfaces
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
    #: Seconds without writes before a keep-alive frame is sent; ``None`` disables.
    keepalive_interval = None
    #: The reactor (or a ``Clock`` in tests) used for keep-alive timers.
    clock = None

    version = None
    closed = False

    def __init__(self):
        self._buffer = bytearray()
        self._offset = 0
        self._outbox = []
        self._pending_inbound = 0
        self._read_pauses = set()   # why reading is paused: "inbound", "outbound"
        self._keepalive_call = None
        self.writable = True

    # -- connection life cycle -------------------------------------------------

    def connectionMade(self):
        self._set_no_delay()
        self.transport.registerProducer(self, True)
        self.transport.write(Hello(tuple(self.codec.versions), self.hello_name).to_frame())

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
        self.closed = True
        self._cancel_keepalive()
        self._outbox = []
        self.connectionClosed(reason)

    @property
    def ready(self) -> bool:
        """True once the handshake has completed and the connection is open."""
        return self.version is not None and not self.closed

    @property
    def peer(self) -> str:
        address = self.transport.getPeer() if self.transport else None
        host, port = getattr(address, "host", None), getattr(address, "port", None)
        return "%s:%s" % (host, port) if host is not None else str(address)

    def close(self, reason: str):
        """Close this connection because of ``reason`` (logged); other connections are unaffected."""
        if self.closed:
            return
        self.closed = True
        self.log.warn("closing connection from {peer}: {reason}", peer=self.peer, reason=reason)
        self._cancel_keepalive()
        self.transport.loseConnection()

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
        payload = self.codec.encode(message, self.version)
        self.transport.writeSequence((encode_frame_header(self.codec.magic, self.version, len(payload)), payload))
        self._schedule_keepalive()

    def sendPayloads(self, payloads):
        """Send messages already encoded by this protocol's codec, in one write (only after the handshake).

        A payload's encoding does not depend on the version (versions only add message types), so
        one encoding serves every connection that negotiated a version carrying the message.
        """
        if self.closed:
            return
        if self.version is None:
            raise RuntimeError("sendPayloads before the handshake completed")
        magic, version, parts = self.codec.magic, self.version, []
        for payload in payloads:
            parts.append(encode_frame_header(magic, version, len(payload)))
            parts.append(payload)
        self.transport.write(b"".join(parts))
        self._schedule_keepalive()

    def sendKeepAlive(self):
        """Send a zero-length frame (only once the handshake completed)."""
        if self.ready:
            self.transport.write(encode_frame_header(self.codec.magic, self.version, 0))
        self._schedule_keepalive()

    def _schedule_keepalive(self):
        if self.keepalive_interval is None or self.closed:
            return
        if self._keepalive_call is not None and self._keepalive_call.active():
            self._keepalive_call.reset(self.keepalive_interval)
        else:
            self._keepalive_call = self._clock().callLater(self.keepalive_interval, self.sendKeepAlive)

    def _cancel_keepalive(self):
        if self._keepalive_call is not None and self._keepalive_call.active():
            self._keepalive_call.cancel()
        self._keepalive_call = None

    def _clock(self):
        if self.clock is None:
            from twisted.internet import reactor
            self.clock = reactor
        return self.clock

    # -- receiving ---------------------------------------------------------------

    def dataReceived(self, data):
        if self.closed:
            return
        self._buffer += data
        self._process_buffer()

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
        decode = self.codec.decode
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
                self._deliver(decode(bytes(buffer[start + HEADER_SIZE:end]), version))
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
            self._deliver(self.codec.decode(payload, version))
        # An empty payload is a keep-alive: nothing to do.

    def _handle_hello(self, hello):
        self.version = negotiate(self.codec.versions, hello.versions)
        self.log.debug("connection from {peer} ({name}) speaks version {version}",
                       peer=self.peer, name=hello.name, version=self.version)
        self._schedule_keepalive()
        outbox, self._outbox = self._outbox, []
        for message in outbox:
            self.sendMessage(message)
        self.connectionReady()

    def _deliver(self, message):
        result = self.messageReceived(message)
        if is_deferred(result):
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
