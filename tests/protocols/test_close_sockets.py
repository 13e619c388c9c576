"""WaltzProtocol.close() ends the connection, over real loopback sockets (Twisted's own transport).

Before, close() called loseConnection() with the protocol still registered as the transport's streaming
producer. A transport that had paused that producer (more than 64 KiB buffered: any store batch or record
list that size) resumed it once the buffer drained instead of finishing the close, and never looked again:
connectionLost never came, the pending requests never failed and nothing reconnected. And while the peer
read nothing (a dead host or a stopped process: what the idle and request timeouts are for), loseConnection
waited for a flush that never came.
"""

import socket
import uuid

import pytest
import pytest_twisted
from twisted.internet import endpoints, reactor, task
from twisted.internet.protocol import Factory, Protocol

from waltz.protocols import storage_messages as sm
from waltz.protocols.framing import Hello, encode_frame
from waltz.protocols.rpc import RequestClientFactory, StorageClientProtocol
from waltz.protocols.values import Record, ReqId

KEY = uuid.UUID(int=7)


class StuckStorage(Protocol):
    """A storage that says hello, accepts the open, then stops reading (a hung or stopped process)."""

    instances = []

    def connectionMade(self):
        StuckStorage.instances.append(self)
        self.transport.pauseProducing()         # not reading
        version = sm.STORAGE_CODEC.versions[-1]
        self.transport.write(Hello(tuple(sm.STORAGE_CODEC.versions), "Waltz Storage").to_frame())
        self.transport.write(encode_frame(b"S", version, sm.STORAGE_CODEC.encode(sm.SuccessResponse(-1, -1, -1),
                                                                                  version)))

    def dataReceived(self, data):
        pass                                    # (once it reads again: discards everything)


@pytest.fixture
def stuck_storage():
    StuckStorage.instances = []
    port = pytest_twisted.blockon(endpoints.TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(
        Factory.forProtocol(StuckStorage)))
    # Small kernel buffers (inherited by accepted sockets), so that what is written stays in Twisted's buffer
    # instead of being absorbed by a receive buffer that autotunes up to tcp_rmem's maximum.
    port.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    yield port
    for peer in StuckStorage.instances:
        peer.transport.abortConnection()
    pytest_twisted.blockon(port.stopListening())


async def connect_with_big_pending_appends(port):
    factory = RequestClientFactory(StorageClientProtocol, sm.OpenRequest.create(KEY, 4),
                                   request_timeout=0.5, keepalive_interval=0.1, idle_timeout=1000.0, clock=reactor)
    proto = await endpoints.TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port).connect(factory)
    await proto.opened
    proto.transport.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
    data = b"x" * (512 * 1024)
    pending = []
    for i in range(8):                          # 8 MiB: far more than the (shrunk) socket buffers hold
        records = (Record.create(2 * i, ReqId(1, 1, 0, 2 * i), 0, data),
                   Record.create(2 * i + 1, ReqId(1, 1, 0, 2 * i + 1), 0, data))
        d = proto.request(sm.AppendRequest(1, 0, 0, records, False))
        d.addErrback(lambda f: pending.append(f) and None)
        pending.append(d)
    return proto, pending


async def wait_until(condition, seconds):
    for _ in range(int(seconds / 0.05)):
        if condition():
            return True
        await task.deferLater(reactor, 0.05, lambda: None)
    return condition()


def lost(proto):
    return not proto.transport.connected


@pytest_twisted.ensureDeferred
async def test_a_timed_out_connection_to_a_peer_that_never_reads_is_lost(stuck_storage):
    proto, _ = await connect_with_big_pending_appends(stuck_storage)
    assert await wait_until(lambda: proto.closed, 3), "the request timeout did not close the connection"
    try:
        assert await wait_until(lambda: lost(proto), 3), (
            "the request timeout closed the connection to a peer that does not read, but loseConnection "
            "waits for a flush that never comes: its requests hang instead of failing")
    finally:
        proto.transport.abortConnection()


@pytest_twisted.ensureDeferred
async def test_a_close_made_while_the_transport_paused_the_protocol_ends_once_the_peer_reads(stuck_storage):
    proto, _ = await connect_with_big_pending_appends(stuck_storage)
    assert await wait_until(lambda: not proto.writable, 3), "the transport never paused the protocol"
    proto.close("closed by the test")          # not a timeout: what was written is flushed first
    StuckStorage.instances[0].transport.resumeProducing()
    try:
        assert await wait_until(lambda: lost(proto), 5), "the closed connection stayed open"
    finally:
        proto.transport.abortConnection()
