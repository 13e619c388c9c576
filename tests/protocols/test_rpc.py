"""RequestClientProtocol: request numbering, and the request deadline checked at liveness ticks."""

import uuid

import pytest
from twisted.internet.error import ConnectionDone, ConnectionLost
from twisted.internet.interfaces import INegotiated
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from zope.interface import implementer

from waltz.protocols import storage_messages as sm
from waltz.protocols.base import Liveness
from waltz.protocols.framing import Hello, encode_frame
from waltz.protocols.rpc import ConnectionClosed, StorageClientProtocol

KEY = uuid.UUID(int=7)


def response(message, version):
    return encode_frame(b"S", version, sm.STORAGE_CODEC.encode(message, version))


def opened_connection(request_timeout=30):
    """A storage client connection past its Hello and open request, ticking every 10 s on a Clock."""
    proto = StorageClientProtocol()
    proto.open_request = sm.OpenRequest.create(KEY, 4)
    proto.request_timeout = request_timeout
    Liveness(Clock(), interval=10, idle_timeout=1000).apply(proto)
    transport = StringTransport()
    proto.makeConnection(transport)
    proto.dataReceived(Hello(tuple(sm.STORAGE_CODEC.versions), "Waltz Storage").to_frame())
    proto.dataReceived(response(sm.SuccessResponse(-1, -1, -1), proto.version))
    assert proto.is_open
    return proto, transport


def ask(proto):
    return proto.request(sm.MaxTransactionIdRequest(1, -1, 0, False))


def test_a_request_left_unanswered_closes_the_connection_and_fails_every_request(logged_failures):
    proto, transport = opened_connection()
    first = ask(proto)
    proto.clock.pump([10, 10])
    second = ask(proto)
    proto.clock.pump([10, 10])          # the first has been seen pending for 30 s at the 40 s tick
    assert transport.disconnecting
    proto.connectionLost(None)
    for d in (first, second):
        assert isinstance(logged_failures(d), ConnectionClosed)


def test_a_request_waiting_behind_an_older_one_is_timed_from_when_it_was_sent(logged_failures):
    # Before: a request's age counted from the tick at which it became the oldest pending one, so one sent
    # behind a slow older request could wait nearly twice the timeout.
    proto, transport = opened_connection()
    first = ask(proto)
    proto.clock.advance(10)             # the tick at 10 s sees the first pending
    second = ask(proto)
    proto.clock.advance(10)             # the tick at 20 s sees the second pending
    proto.dataReceived(response(sm.MaxTransactionIdResponse(1, 0, 0, 5), proto.version))
    assert first.called
    proto.clock.pump([10, 10])
    assert not transport.disconnecting
    proto.clock.advance(10)             # 50 s: the second has been seen pending for 30 s
    assert transport.disconnecting
    proto.connectionLost(None)
    assert isinstance(logged_failures(second), ConnectionClosed)


def test_requests_answered_in_time_keep_the_connection(logged_failures):
    proto, transport = opened_connection()
    for seq in range(10):               # one request always pending, each answered after 20 s
        d = ask(proto)
        proto.clock.pump([10, 10])
        proto.dataReceived(response(sm.MaxTransactionIdResponse(1, seq, 0, 5), proto.version))
        assert d.called
    assert not transport.disconnecting


def test_without_a_request_timeout_requests_wait_as_long_as_the_connection():
    proto, transport = opened_connection(request_timeout=None)
    d = ask(proto)
    proto.clock.pump([10] * 50)
    assert not d.called and not transport.disconnecting


@pytest.fixture
def logged_failures():
    """``failure_of(d)``: the exception a fired Deferred failed with (consumed, so it is not logged)."""
    def failure_of(d):
        failures = []
        d.addErrback(failures.append)
        assert failures, "the Deferred did not fail"
        return failures[0].value
    return failure_of


def test_without_a_request_timeout_ticks_keep_no_record():
    proto, transport = opened_connection(request_timeout=None)
    ask(proto)
    proto.clock.pump([10] * 100)
    assert not transport.disconnecting and len(proto._ticks) == 0


def connection_closed_before_its_hello(transport, reason, closed_here=False):
    """A storage client connection on ``transport`` whose peer sent nothing, gone with ``reason``; the
    failure its open request got."""
    proto = StorageClientProtocol()
    proto.open_request = sm.OpenRequest.create(KEY, 4)
    proto.makeConnection(transport)
    failures = []
    proto.opened.addErrback(failures.append)
    if closed_here:
        proto.close("this side's reason", abort=True)
    proto.connectionLost(Failure(reason))
    return failures[0].value


@implementer(INegotiated)
class NegotiatedTransport(StringTransport):
    """A transport that, as Twisted's TLS transport, provides INegotiated."""
    negotiatedProtocol = None


def test_a_plain_connection_the_peer_closes_before_its_hello_is_said_to_be_likely_a_tls_port():
    # It said only "Connection was closed cleanly.": the usual cause, a tool without the ssl.* keys against
    # a port that speaks TLS, was left to guess.
    for reason in (ConnectionDone(), ConnectionLost()):
        message = str(connection_closed_before_its_hello(StringTransport(), reason))
        assert "the peer closed it before sending its Hello: not a Waltz port, or one that speaks TLS" in message
    # Not when the connection speaks TLS, closed after the Hello, or was closed by this side.
    tls = str(connection_closed_before_its_hello(NegotiatedTransport(), ConnectionDone()))
    assert tls.endswith("closed: Connection was closed cleanly.")
    ours = str(connection_closed_before_its_hello(StringTransport(), ConnectionDone(), closed_here=True))
    assert "TLS" not in ours
    proto, _ = opened_connection()
    failures = []
    ask(proto).addErrback(failures.append)
    proto.connectionLost(Failure(ConnectionDone()))
    assert str(failures[0].value).endswith("closed: Connection was closed cleanly.")
