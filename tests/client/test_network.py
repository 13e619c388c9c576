"""ManagedConnection (reconnect with back-off, per-connection sequence numbers) and the client codec."""

import itertools

import pytest
from twisted.internet import defer, error
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure

from tests.client.fakes import EP_A, FakeNetwork, FakeServer, FakeStore
from waltz.client.network import (
    CLIENT_SIDE_CODEC, Backoff, ConnectionState, DataChecksumMismatch, Endpoint, ManagedConnection)
from waltz.protocols import client_messages as m
from waltz.protocols.errors import ChecksumError
from waltz.protocols.values import ReqId

RID = ReqId(1, 2, 0, 4)


class Listener:
    def __init__(self):
        self.events = []

    def connection_ready(self, conn):
        self.events.append(("ready", conn.seq_num))

    def connection_lost(self, conn):
        self.events.append(("lost", conn.seq_num))

    def connection_message(self, conn, message):
        self.events.append(("message", message))


@pytest.fixture
def setup():
    clock = Clock()
    network = FakeNetwork(clock)
    server = network.add_server(EP_A, FakeServer(FakeStore(1), [0]))
    listener = Listener()
    conn = ManagedConnection(EP_A, "stream", listener, network.connect, clock, Backoff(0.1, 0.4, jitter=0),
                             itertools.count(10))
    return clock, network, server, listener, conn


def test_ready_only_after_the_hello_exchange(setup):
    clock, network, server, listener, conn = setup
    conn.start()
    assert conn.state is ConnectionState.CONNECTING and not conn.send(m.FlushRequest(RID))
    network.flush()
    assert conn.state is ConnectionState.READY and listener.events == [("ready", 10)]
    assert conn.send(m.HighWaterMarkRequest(RID))
    network.flush()
    assert server.messages(m.HighWaterMarkRequest) == [m.HighWaterMarkRequest(RID)]
    assert listener.events[-1] == ("message", m.HighWaterMarkResponse(RID, -1))


def test_a_lost_connection_is_replaced_at_once_with_the_next_sequence_number(setup):
    clock, network, server, listener, conn = setup
    conn.start()
    network.flush()
    network.disconnect(EP_A)
    assert listener.events == [("ready", 10), ("lost", 10)]
    assert conn.state is ConnectionState.BACKING_OFF
    clock.advance(0)
    network.flush()
    assert listener.events[-1] == ("ready", 11) and conn.seq_num == 11


def test_refused_connections_back_off_doubling_up_to_the_maximum(setup):
    clock, network, server, listener, conn = setup
    times = []

    def refusing(endpoint, factory):
        times.append(clock.seconds())
        if len(times) < 7:
            return defer.fail(error.ConnectionRefusedError())
        return network.connect(endpoint, factory)
    conn._connector = refusing
    conn.start()
    while len(times) < 7:
        clock.advance(min(call.getTime() for call in clock.getDelayedCalls()) - clock.seconds())
    network.flush()
    assert [round(b - a, 2) for a, b in zip(times, times[1:])] == [0.0, 0.1, 0.2, 0.4, 0.4, 0.4]
    assert conn.ready and listener.events == [("ready", 16)]


def test_connections_dropped_soon_after_their_hello_back_off_and_one_that_served_a_while_does_not(setup):
    # Before: every completed Hello reset the back-off, so a server that took each connection and dropped
    # it at once was reconnected to in a tight loop.
    clock, network, server, listener, conn = setup
    times = []

    def recording(endpoint, factory):
        times.append(clock.seconds())
        return network.connect(endpoint, factory)
    conn._connector = recording
    conn.start()
    for _ in range(6):
        network.flush()
        assert conn.ready
        network.disconnect(EP_A)                  # dropped right after the Hello
        clock.advance(min(call.getTime() for call in clock.getDelayedCalls()) - clock.seconds())
    assert [round(b - a, 2) for a, b in zip(times, times[1:])] == [0.0, 0.1, 0.2, 0.4, 0.4, 0.4]
    network.flush()
    clock.advance(0.5)                            # this one serves longer than the back-off's maximum
    network.disconnect(EP_A)
    clock.advance(0)
    assert times[-1] == clock.seconds()           # replaced at once


def test_close_stops_reconnecting_and_reporting(setup):
    clock, network, server, listener, conn = setup
    conn.start()
    network.flush()
    conn.close()
    network.flush()
    clock.advance(10)
    assert conn.state is ConnectionState.CLOSED and listener.events == [("ready", 10)]
    assert len(network.attempts) == 1 and server.connections == []


def test_close_stops_being_the_transports_producer(setup):
    # A transport that paused its producer (a full buffer) resumes it when the buffer drains instead of
    # finishing the close: closing must unregister it first (WaltzProtocol.close does).
    clock, network, server, listener, conn = setup
    conn.start()
    network.flush()
    protocol = conn.protocol
    assert protocol.transport.producer is protocol
    conn.close()
    assert protocol.transport.producer is None and protocol.transport.disconnecting and protocol.closed


def test_backoff_resets_after_success():
    backoff = Backoff(0.1, 1.0, jitter=0)
    assert [backoff.next_delay() for _ in range(6)] == [0.0, 0.1, 0.2, 0.4, 0.8, 1.0]
    backoff.reset()
    assert backoff.next_delay() == 0.0


class _Draws:
    """A ``random.Random`` stand-in returning given draws."""

    def __init__(self, *draws):
        self._draws = iter(draws)

    def random(self):
        return next(self._draws)


def test_reconnect_delays_are_shortened_by_a_random_part_of_up_to_the_jitter():
    # Before: every client of a server that went away retried at the same instants (0, 0.1, 0.3, 0.7 s ...).
    backoff = Backoff(0.1, 0.4, jitter=0.5, rng=_Draws(0.0, 1.0, 0.5, 0.25))
    delays = [backoff.next_delay() for _ in range(5)]
    assert delays == pytest.approx([0.0, 0.1, 0.1, 0.3, 0.35])
    assert Backoff(0.1, 0.4).jitter == 0.5          # the default
    with pytest.raises(ValueError, match="jitter is a fraction"):
        Backoff(0.1, 0.4, jitter=1)


def test_two_clients_backing_off_from_the_same_server_do_not_retry_in_step():
    first, second = Backoff(0.1, 5.0), Backoff(0.1, 5.0)
    a = [first.next_delay() for _ in range(8)]
    b = [second.next_delay() for _ in range(8)]
    assert a[0] == b[0] == 0.0 and a[1:] != b[1:]
    assert all(0.5 * d <= x <= d for x, d in zip(a[1:], (0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0)))


def test_a_corrupt_data_response_decodes_to_a_mismatch_marker():
    bad = m.TransactionDataResponse(RID, 9, True, b"data", 12345)
    payload = m.CLIENT_CODEC.encode(bad, 4)
    with pytest.raises(ChecksumError):
        m.CLIENT_CODEC.decode(payload, 4)
    decoded = CLIENT_SIDE_CODEC.decode(payload, 4)
    assert isinstance(decoded, DataChecksumMismatch)
    assert (decoded.req_id, decoded.transaction_id) == (RID, 9)
    good = m.TransactionDataResponse.success(RID, 9, b"data")
    assert CLIENT_SIDE_CODEC.decode(m.CLIENT_CODEC.encode(good, 4), 4) == good


def test_other_checksum_errors_still_close_the_connection():
    bad = m.AppendRequest(RID, 0, (), (), (), 0, b"data", 1)
    with pytest.raises(ChecksumError):
        CLIENT_SIDE_CODEC.decode(m.CLIENT_CODEC.encode(bad, 4), 4)


def test_endpoint_parse_and_str():
    assert Endpoint.parse("example.org:55180") == Endpoint("example.org", 55180)
    assert str(Endpoint("h", 1)) == "h:1"


def test_a_peer_that_accepts_and_never_says_hello_is_dropped_and_retried():
    clock = Clock()
    transports = []

    def silent(endpoint, factory):
        """The TCP connect succeeds, and the peer never sends its Hello."""
        proto = factory.buildProtocol(None)
        transport = StringTransport()
        proto.makeConnection(transport)
        transports.append((proto, transport))
        return defer.succeed(proto)
    conn = ManagedConnection(EP_A, "stream", Listener(), silent, clock, Backoff(0.1, 0.4, jitter=0),
                             itertools.count(10), handshake_timeout=5.0)
    conn.start()
    proto, transport = transports[0]
    clock.advance(4.9)
    assert conn.state is ConnectionState.CONNECTING and not transport.disconnecting
    clock.advance(0.1)
    assert transport.disconnecting                      # dropped once the deadline passed
    proto.connectionLost(Failure(error.ConnectionDone()))
    assert conn.state is ConnectionState.BACKING_OFF
    clock.advance(0)
    assert len(transports) == 2 and conn.seq_num == 11  # and tried again


def test_the_hello_deadline_is_cancelled_once_ready_and_on_close(setup):
    clock, network, server, listener, conn = setup
    conn.start()
    network.flush()
    # Only the connection's liveness tick is left (see test_framing.py for what it does).
    assert conn.ready and [c.func.__name__ for c in clock.getDelayedCalls()] == ["_liveness_tick"]
    conn.close()
    network.flush()
    assert not clock.getDelayedCalls()


def test_a_back_off_that_could_not_grow_is_refused():
    # An initial interval of 0 never doubled: every reconnect followed the last at once, a busy loop on
    # the reactor against a dead server.
    with pytest.raises(ValueError, match="initial delay above 0"):
        Backoff(0, 5.0)
    backoff = Backoff(10.0, 0.05, jitter=0)         # an initial delay above the maximum is capped, as before
    assert [backoff.next_delay() for _ in range(3)] == [0.0, 0.05, 0.05]
    from waltz.config import ConfigError
    from tests.client.fakes import BASE_CONFIG
    from waltz.client.config import client_config
    with pytest.raises(ConfigError, match="client.reconnectInitialInterval"):
        client_config(dict(BASE_CONFIG, **{"client.reconnectInitialInterval": 0}))
