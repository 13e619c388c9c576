"""Framing, Hello negotiation, keep-alives, bad input and back pressure of WaltzProtocol.

These tests use a tiny test-only message family (magic ``T``) so that they pin
the framing layer alone; the real families are exercised in test_messages*.py
and test_connections.py.
"""

import struct

import pytest
from twisted.internet import abstract, defer, error
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.logger import globalLogPublisher
from twisted.test import iosim

from waltz.protocols.base import CLOSE_FLUSH_TIMEOUT, Liveness, WaltzProtocol
from waltz.protocols.errors import DecodeError, UnknownMessageType
from waltz.protocols.framing import (
    HELLO_MAGIC, HELLO_VERSION, MAX_HELLO_SIZE, Hello, encode_frame, encode_frame_header, negotiate)
from waltz.server.protocol import ServerProtocol
from waltz.storage.handlers import AdminServerProtocol, StorageServerProtocol
from waltz.protocols.errors import HandshakeError


class EchoCodec:
    """Test family: payload = type byte 1 followed by the message bytes."""

    magic = b"T"

    def __init__(self, versions=(1, 2)):
        self.versions = versions

    def encode(self, message, version):
        return b"\x01" + message

    def decode(self, payload, version):
        if payload[0] != 1:
            raise UnknownMessageType("unknown message type %d" % payload[0])
        if payload[1:2] == b"!":
            raise DecodeError("short body: test")
        return bytes(payload[1:])


class RecordingProtocol(WaltzProtocol):
    hello_name = "Test Peer"

    def __init__(self, codec=None, results=None):
        super().__init__()
        self.codec = codec or EchoCodec()
        self.received = []
        self.readies = 0
        self.results = results  # callable returning what messageReceived returns
        self.paused_events = []

    def connectionReady(self):
        self.readies += 1

    def messageReceived(self, message):
        self.received.append(message)
        if message == b"boom":
            raise RuntimeError("handler exploded")
        return self.results(message) if self.results else None

    def outboundPaused(self):
        self.paused_events.append("paused")

    def outboundResumed(self):
        self.paused_events.append("resumed")


def hello_frame(versions=(1, 2), name="Other"):
    return Hello(tuple(versions), name).to_frame()


def frame(body, version=2, magic=b"T"):
    return encode_frame(magic, version, b"\x01" + body)


@pytest.fixture
def logged():
    events = []
    globalLogPublisher.addObserver(events.append)
    yield events
    globalLogPublisher.removeObserver(events.append)


def connect(proto):
    transport = StringTransport()
    proto.makeConnection(transport)
    return transport


def ready(proto=None, versions=(1, 2)):
    proto = proto or RecordingProtocol()
    transport = connect(proto)
    proto.dataReceived(hello_frame(versions))
    transport.clear()
    return proto, transport


def reasons(events):
    return [e.get("reason", "") for e in events if "reason" in e]


def test_hello_is_sent_on_connect_with_exact_bytes():
    proto = RecordingProtocol()
    transport = connect(proto)
    # magic H, version 0, length 21, i32 2, i16 1, i16 2, i32 9 "Test Peer"
    expected = bytes.fromhex("48 0000 00000015 00000002 0001 0002 00000009") + b"Test Peer"
    assert transport.value() == expected
    assert Hello.decode(transport.value()[7:]) == Hello((1, 2), "Test Peer")


def test_highest_common_version_is_negotiated():
    proto, _ = ready(versions=(0, 1, 7))
    assert proto.version == 1
    assert proto.readies == 1
    assert negotiate((3, 4), (0, 1, 2, 3, 4)) == 4


def test_no_common_version_closes_with_reason(logged):
    proto = RecordingProtocol()
    transport = connect(proto)
    proto.dataReceived(hello_frame((5, 6)))
    assert transport.disconnecting
    assert proto.version is None
    assert any("no common protocol version" in r for r in reasons(logged))
    with pytest.raises(HandshakeError):
        negotiate((1,), (2,))


def test_messages_sent_before_handshake_wait_for_it():
    proto = RecordingProtocol()
    transport = connect(proto)
    transport.clear()
    proto.sendMessage(b"early")
    assert transport.value() == b""
    proto.dataReceived(hello_frame((1,)))
    assert transport.value() == encode_frame(b"T", 1, b"\x01early")


def test_frames_split_anywhere_are_reassembled():
    proto, _ = ready()
    data = frame(b"abc") + frame(b"") + frame(b"de")
    for i in range(len(data)):
        proto.dataReceived(data[i:i + 1])
    assert proto.received == [b"abc", b"", b"de"]


def test_keepalive_frames_are_ignored_and_not_delivered():
    proto, transport = ready()
    proto.dataReceived(encode_frame(b"T", 2, b"") + frame(b"x"))
    assert proto.received == [b"x"]
    assert not transport.disconnecting


KEEPALIVE = struct.pack(">chi", b"T", 2, 0)


def live(**kwargs):
    """A handshaken protocol with liveness on a Clock: ticks every 10 s, idle timeout 30 s."""
    proto = RecordingProtocol()
    Liveness(Clock(), interval=10, idle_timeout=30, **kwargs).apply(proto)
    return ready(proto)


def test_a_keepalive_is_sent_at_a_tick_with_nothing_written_since_the_last():
    proto, transport = live()
    proto.clock.advance(9)
    proto.sendMessage(b"m")
    transport.clear()
    proto.clock.advance(1)              # tick: a message was written since the last one
    assert transport.value() == b""
    proto.clock.advance(10)             # tick: nothing written since
    assert transport.value() == KEEPALIVE
    transport.clear()
    proto.dataReceived(frame(b"x"))     # (keeps the connection alive)
    proto.clock.advance(10)
    assert transport.value() == KEEPALIVE
    proto.connectionLost(None)
    assert proto.clock.getDelayedCalls() == []


def test_a_connection_on_which_nothing_arrives_is_closed_after_the_idle_timeout(logged):
    proto, transport = live()
    for _ in range(5):                  # a peer that only sends keep-alives is alive
        proto.clock.advance(10)
        proto.dataReceived(KEEPALIVE)
    # The last keep-alive came at 50 s; the tick at 60 s saw it, the one at 90 s closes. (Clock.advance
    # runs every call due by its end at its end time: step like a reactor, one tick at a time.)
    proto.clock.pump([10, 10, 10])
    assert not transport.disconnecting
    proto.clock.advance(10)
    assert transport.disconnecting
    assert any("nothing received for 30 s" in r for r in reasons(logged))
    assert proto.clock.getDelayedCalls() == []


def test_silence_while_reading_is_paused_here_does_not_count():
    held = []
    proto = RecordingProtocol(results=lambda m: held.append(defer.Deferred()) or held[-1])
    proto.inbound_high_watermark, proto.inbound_low_watermark = 1, 0
    Liveness(Clock(), interval=10, idle_timeout=30).apply(proto)
    proto, transport = ready(proto)
    proto.dataReceived(frame(b"slow"))  # reading pauses until the handler finishes
    assert proto.reading_paused
    proto.clock.pump([10] * 10)
    assert not transport.disconnecting
    held[0].callback(None)              # reading resumes: silence counts from the last paused tick (100 s)
    proto.clock.pump([10, 10])
    assert not transport.disconnecting
    proto.clock.advance(10)
    assert transport.disconnecting


@pytest.mark.parametrize("waiting_peer_is_silent", [True, False])
def test_silence_while_a_request_is_being_handled_here_counts_only_for_request_servers(waiting_peer_is_silent):
    # An admin tool sends nothing while it waits for a slow answer (an assignment recovering a large log):
    # before, the storage node closed its connection after the idle timeout although the wait was its own.
    # A client's feed, whose server ticks whatever the client is doing, still notices a vanished server.
    held = []
    proto = RecordingProtocol(results=lambda m: held.append(defer.Deferred()) or held[-1])
    proto.waiting_peer_is_silent = waiting_peer_is_silent
    Liveness(Clock(), interval=10, idle_timeout=30).apply(proto)
    proto, transport = ready(proto)
    proto.dataReceived(frame(b"slow"))  # below the high watermark: reading goes on
    assert not proto.reading_paused
    proto.clock.pump([10] * 10)
    assert transport.disconnecting is not waiting_peer_is_silent
    if not waiting_peer_is_silent:
        return
    held[0].callback(None)
    proto.clock.pump([10, 10])
    assert not transport.disconnecting
    proto.clock.advance(10)
    assert transport.disconnecting


def test_the_storage_nodes_ports_wait_for_silent_peers():
    assert StorageServerProtocol.waiting_peer_is_silent and AdminServerProtocol.waiting_peer_is_silent
    assert not ServerProtocol.waiting_peer_is_silent


def test_an_idle_timeout_aborts_the_connection_at_once():
    # Waiting to flush what was written to a peer that is gone or stuck would keep the connection (and
    # every request on it) until TCP gives up.
    proto, transport = live()
    proto.sendMessage(b"unread")
    proto.clock.pump([10, 10, 10, 10])  # (the Hello was received before the first tick)
    assert transport.disconnected and transport.producer is None


def test_a_close_unregisters_the_producer_and_aborts_a_connection_still_flushing_after_a_while(logged):
    # Registered, a producer the transport paused (its buffer full) is resumed once the buffer drains, and
    # Twisted then never finishes the close: the connection stayed open for good.
    proto, transport = live()
    assert transport.producer is proto
    proto.close("test")
    assert transport.producer is None and transport.disconnecting and not transport.disconnected
    proto.clock.advance(CLOSE_FLUSH_TIMEOUT)
    assert transport.disconnected
    proto, transport = live()
    proto.close("test")
    proto.connectionLost(None)          # flushed in time
    assert proto.clock.getDelayedCalls() == []


def test_without_liveness_nothing_is_scheduled():
    proto = RecordingProtocol()
    proto.clock = Clock()
    proto, transport = ready(proto)
    proto.clock.advance(3600)
    assert transport.value() == b"" and not transport.disconnecting
    assert proto.clock.getDelayedCalls() == []


@pytest.mark.parametrize("bad, problem", [
    (encode_frame(b"X", 2, b"\x01a"), "wrong magic"),
    (encode_frame(b"T", 1, b"\x01a"), "frame version 1 differs"),
    (struct.pack(">chi", b"T", 2, 17 * 1024 * 1024), "frame length"),
    (struct.pack(">chi", b"T", 2, -5), "frame length"),
    (encode_frame(b"T", 2, b"\x09a"), "unknown message type"),
    (encode_frame(b"T", 2, b"\x01!"), "short body"),
    (hello_frame(), "second Hello"),
    (frame(b"boom"), "handler error"),
])
def test_bad_input_closes_only_that_connection_with_a_named_reason(bad, problem, logged):
    victim, victim_transport = ready()
    bystander, bystander_transport = ready()
    victim.dataReceived(frame(b"ok") + bad + frame(b"never"))
    assert victim_transport.disconnecting
    assert victim.received[0] == b"ok" and b"never" not in victim.received
    assert any(problem in r for r in reasons(logged)), reasons(logged)
    bystander.dataReceived(frame(b"still fine"))
    assert bystander.received == [b"still fine"]
    assert not bystander_transport.disconnecting
    victim.dataReceived(frame(b"after close"))  # ignored, never raises
    assert b"after close" not in victim.received


def test_first_frame_must_be_hello():
    proto = RecordingProtocol()
    transport = connect(proto)
    proto.dataReceived(frame(b"x"))
    assert transport.disconnecting
    assert proto.received == []


def test_an_oversized_hello_closes_the_connection_before_it_is_read():
    # A 16 MiB Hello of distinct versions cost 330 MB and seconds of CPU to decode: it is refused from
    # its header, with only the header read.
    proto = RecordingProtocol()
    transport = connect(proto)
    proto.dataReceived(encode_frame_header(HELLO_MAGIC, HELLO_VERSION, MAX_HELLO_SIZE + 1))
    assert transport.disconnecting and proto.version is None


def test_truncated_frame_waits_without_closing():
    proto, transport = ready()
    data = frame(b"0123456789")
    proto.dataReceived(data[:-3])
    assert proto.received == [] and not transport.disconnecting
    proto.dataReceived(data[-3:])
    assert proto.received == [b"0123456789"]


def test_configurable_max_frame_size():
    proto = RecordingProtocol()
    proto.max_frame_size = 32
    proto, transport = ready(proto)
    proto.dataReceived(frame(b"x" * 31))  # payload 32 bytes: allowed
    assert proto.received == [b"x" * 31]
    proto.dataReceived(frame(b"x" * 32))  # payload 33 bytes
    assert transport.disconnecting


def slow_protocol():
    """A RecordingProtocol whose every message stays "being handled" until the test fires its Deferred
    (the list returned, in arrival order)."""
    pending = []

    def slow(message):
        d = defer.Deferred()
        pending.append(d)
        return d

    return RecordingProtocol(results=slow), pending


def test_back_pressure_pauses_reading_and_resumes_when_consumer_catches_up():
    proto, pending = slow_protocol()
    proto.inbound_high_watermark = 4
    proto.inbound_low_watermark = 2
    proto, transport = ready(proto)
    proto.dataReceived(b"".join(frame(b"%d" % i) for i in range(10)))
    # Four outstanding: reading paused, the rest stays buffered and undecoded.
    assert proto.received == [b"0", b"1", b"2", b"3"]
    assert transport.producerState == "paused" and proto.reading_paused
    pending[0].callback(None)
    assert transport.producerState == "paused"  # 3 outstanding > low watermark 2
    pending[1].callback(None)
    # Down to 2: resumed, buffered frames decoded until the high watermark again.
    assert proto.received == [b"%d" % i for i in range(6)]
    assert transport.producerState == "paused"
    while not all(d.called for d in pending):
        next(d for d in pending if not d.called).callback(None)
    assert proto.received == [b"%d" % i for i in range(10)]
    assert transport.producerState == "producing" and not proto.reading_paused
    assert proto.inbound_pending == 0


def test_failed_handler_deferred_closes_connection(logged):
    proto = RecordingProtocol(results=lambda m: defer.fail(ValueError("bad state")))
    proto, transport = ready(proto)
    proto.dataReceived(frame(b"x"))
    assert transport.disconnecting
    assert any("bad state" in r for r in reasons(logged))


def test_protocol_is_push_producer_for_outbound_flow_control():
    proto, transport = ready()
    assert transport.producer is proto and transport.streaming
    transport.producer.pauseProducing()
    assert not proto.writable
    transport.producer.resumeProducing()
    assert proto.writable
    assert proto.paused_events == ["paused", "resumed"]


def test_a_request_server_stops_reading_while_its_peer_does_not_read_its_answers():
    proto, pending = slow_protocol()
    proto.pause_reading_while_unwritable = True
    proto.inbound_high_watermark = 4
    proto.inbound_low_watermark = 2
    proto, transport = ready(proto)
    transport.producer.pauseProducing()        # the transport's write buffer is full
    assert transport.producerState == "paused" and proto.reading_paused
    proto.dataReceived(b"".join(frame(b"%d" % i) for i in range(8)))
    assert proto.received == []                # buffered, not decoded: no more answers to buffer
    transport.producer.resumeProducing()
    assert proto.received == [b"0", b"1", b"2", b"3"]   # up to the inbound high watermark
    assert transport.producerState == "paused"
    transport.producer.pauseProducing()        # both reasons now
    for d in pending[:2]:
        d.callback(None)                       # inbound is low again, but the peer still does not read
    assert proto.received == [b"0", b"1", b"2", b"3"] and transport.producerState == "paused"
    transport.producer.resumeProducing()
    assert proto.received == [b"%d" % i for i in range(6)]
    assert proto.paused_events == ["paused", "resumed", "paused", "resumed"]


def test_server_side_connections_stop_reading_while_their_peer_does_not_read():
    assert StorageServerProtocol.pause_reading_while_unwritable
    assert AdminServerProtocol.pause_reading_while_unwritable
    assert ServerProtocol.pause_reading_while_unwritable
    assert not WaltzProtocol.pause_reading_while_unwritable


def test_two_real_peers_negotiate_and_exchange_messages():
    server = RecordingProtocol(EchoCodec((1, 2, 3)))
    client = RecordingProtocol(EchoCodec((0, 2)))
    client.sendMessage(b"hello server")
    pump = iosim.connect(server, iosim.makeFakeServer(server), client, iosim.makeFakeClient(client))
    server.sendMessage(b"hello client")
    pump.flush()
    assert server.version == client.version == 2
    assert server.received == [b"hello server"]
    assert client.received == [b"hello client"]


def test_encoded_payloads_go_out_as_frames_in_one_write():
    proto, transport = ready()
    writes = []
    transport.write = lambda data, write=transport.write: (writes.append(data), write(data))
    proto.sendPayloads([b"\x01ab", b"\x01c"])
    assert writes == [frame(b"ab") + frame(b"c")]
    with pytest.raises(RuntimeError):
        RecordingProtocol().sendPayloads([b"\x01x"])    # no version negotiated yet


def test_good_frames_of_one_read_are_delivered_before_a_bad_one_closes(logged):
    proto, transport = ready()
    proto.dataReceived(frame(b"a") + frame(b"b") + frame(b"c", magic=b"X") + frame(b"d"))
    assert proto.received == [b"a", b"b"]
    assert transport.disconnecting
    assert any("wrong magic" in r for r in reasons(logged))


def test_is_deferred_answers_like_isinstance():
    from twisted.internet import defer

    from waltz.protocols.base import is_deferred
    assert is_deferred(defer.Deferred()) and is_deferred(defer.DeferredList([]))
    assert not any(is_deferred(v) for v in (None, True, False, 0, b"", object()))


class SocketlessDescriptor(abstract.FileDescriptor):
    """A TCP-like transport (a Twisted ``FileDescriptor``) whose kernel is a list: what ``doWrite`` sends lands
    in :attr:`sent`, or the send fails with :attr:`send_error`. Its reactor records who waits to write."""

    def __init__(self, reactor):
        super().__init__(reactor)
        self.connected = True
        self.sent = []
        self.send_error = None

    def writeSomeData(self, data):
        if self.send_error is not None:
            return self.send_error
        self.sent.append(bytes(data))
        return len(data)

    def getPeer(self):
        return "peer"

    def getHost(self):
        return "host"


def echoing_over_a_descriptor():
    """A protocol that answers every message at once, on a :class:`SocketlessDescriptor`, after the handshake."""
    reactor = MemoryReactorClock()
    transport = SocketlessDescriptor(reactor)
    proto = RecordingProtocol(results=lambda message: proto.sendMessage(b"re:" + message))
    proto.makeConnection(transport)
    proto.dataReceived(hello_frame())
    transport.doWrite()         # the Hello, as the reactor would
    transport.sent.clear()
    return proto, transport, reactor


def test_what_the_handling_of_a_read_writes_goes_to_the_kernel_at_the_end_of_the_read():
    proto, transport, reactor = echoing_over_a_descriptor()
    proto.dataReceived(frame(b"a") + frame(b"b"))
    # Without the write-through the answers would wait in the transport for the reactor's next poll.
    assert b"".join(transport.sent) == frame(b"re:a") + frame(b"re:b")
    assert transport not in reactor.getWriters()        # nothing left for the reactor to write


def test_a_read_that_writes_nothing_sends_nothing_and_a_slow_peer_waits_for_the_reactor():
    proto, transport, reactor = echoing_over_a_descriptor()
    proto.results = None
    proto.dataReceived(frame(b"quiet"))
    assert transport.sent == []
    proto.results = lambda message: proto.sendMessage(b"re:" + message)
    proto.pauseProducing()                               # the peer does not read: outbound paused
    proto.dataReceived(frame(b"c"))
    assert transport.sent == [] and transport in reactor.getWriters()
    proto.resumeProducing()
    transport.doWrite()
    assert b"".join(transport.sent) == frame(b"re:c")


def test_a_failed_write_through_is_left_to_the_reactor_and_a_closing_connection_finishes_through_it():
    proto, transport, reactor = echoing_over_a_descriptor()
    transport.send_error = error.ConnectionLost()
    proto.dataReceived(frame(b"d"))
    assert transport in reactor.getWriters()            # its own write meets the error and closes it
    transport.send_error = None
    transport.doWrite()
    assert b"".join(transport.sent) == frame(b"re:d")
    transport.sent.clear()
    transport.disconnecting = True
    proto.dataReceived(frame(b"e"))
    assert transport.sent == [] and transport in reactor.getWriters()


def test_an_aborted_or_half_closed_transport_is_not_written_through():
    proto, transport, reactor = echoing_over_a_descriptor()
    transport._writeDisconnecting = True            # loseWriteConnection was called
    proto.dataReceived(frame(b"f"))
    assert transport.sent == []
    transport._writeDisconnecting = False
    transport.doWrite = lambda: None                # what abortConnection installs
    proto.dataReceived(frame(b"g"))
    assert transport.sent == []
