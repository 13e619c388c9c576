"""The server's client port: real ``L`` frames between a ServerProtocol and a client protocol.

Whole exchanges run over ``twisted.test.iosim`` (both sides encode and decode
real frames); back pressure and bad input are driven byte by byte over
``StringTransport``.
"""

import socket

import pytest
import pytest_twisted
from twisted.internet import defer
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.test import iosim

from waltz.protocols import client_messages as cm
from tests.protocols.recording import RecordingClient, closing_reasons
from waltz.protocols.framing import HEADER_SIZE, Hello, decode_frame_header, encode_frame
from waltz.protocols.locks import lock_hash
from waltz.protocols.values import ReqId
from waltz.server.partition import PartitionSettings, ServerPartition
from waltz.server.protocol import ServerFactory, ServerProtocol

from tests.server.test_partition import DummyStore

PID = 3
GEN = 7


class DummyServerInfo:
    def __init__(self):
        self.preferred = []

    def check_storage_connectivity(self):
        return defer.succeed([("127.0.0.1:55280", True), ("127.0.0.1:55290", False)])

    def assigned_partitions(self):
        return [PID, 5]

    def add_preferred_partitions(self, ids):
        self.preferred.append(ids)
        return defer.succeed(True)

    def remove_preferred_partitions(self, ids):
        return defer.fail(RuntimeError("ZooKeeper is away"))

    def partitions_health(self):
        return [(PID, True), (5, False)]


class DummyRegistry:
    def __init__(self, partitions=()):
        self.partitions = {p.partition_id: p for p in partitions}
        self.info = DummyServerInfo()

    def partition(self, partition_id):
        return self.partitions.get(partition_id)

    def server_info(self):
        return self.info


class Client(RecordingClient):
    """A bare client connection that records every message it receives."""

    def take(self):
        received, self.received = self.received, []
        return received


def rid(seq, client=1, generation=GEN, partition=PID):
    return ReqId(client, generation, partition, seq)


class Cluster:
    """One server partition behind a ServerFactory, and helpers to connect clients over iosim."""

    def __init__(self, records=0, settings=None):
        self.clock = Clock()
        self.store = DummyStore(records, partition_id=PID)
        self.partition = ServerPartition(PID, GEN, self.store, settings or PartitionSettings(), self.clock)
        self.partition.start()
        self.registry = DummyRegistry([self.partition])
        self.factory = ServerFactory(self.registry, max_frame_size=1 << 20)
        self.pumps = []

    def connect(self):
        client, server, pump = iosim.connectedServerAndClient(
            lambda: self.factory.buildProtocol(None), Client, clock=self.clock)
        self.pumps.append(pump)
        return client, server, pump

    def flush(self):
        for _ in range(20):
            for pump in self.pumps:
                pump.flush()
            if not self.clock.getDelayedCalls():
                return


def test_a_whole_client_session_over_real_frames():
    cluster = Cluster(records=2)
    stream, server, _ = cluster.connect()
    rpc, _, _ = cluster.connect()
    cluster.flush()
    assert stream.version == 5 and server.version == 5
    assert cluster.factory.connections == {server, cluster.factory.connections.difference({server}).pop()}

    # Mount at client hwm 0: transaction 1 is streamed, then READY.
    stream.sendMessage(cm.MountRequest(rid(0), 0, 1))
    cluster.flush()
    assert stream.take() == [cm.FeedData(ReqId(99, 1, PID, 1), 1, 1001),
                             cm.MountResponse(rid(0), cm.MountState.READY)]
    stream.sendMessage(cm.FeedRequest(rid(0), 1))

    # Two appends commit and come back in the feed with their own ReqIds.
    lock = lock_hash("account", 42)
    stream.sendMessage(cm.AppendRequest.create(rid(1), 1, 10, b"first", write_locks=[lock]))
    stream.sendMessage(cm.AppendRequest.create(rid(2), 1, 20, b"second", append_locks=[lock]))
    cluster.flush()
    cluster.store.commit()
    cluster.flush()
    assert stream.take() == [cm.FeedData(rid(1), 2, 10), cm.FeedData(rid(2), 3, 20)]

    # A stale write lock fails with the estimate; a flush answers with the hwm.
    stream.sendMessage(cm.AppendRequest.create(rid(3), 1, 30, b"stale", write_locks=[lock]))
    stream.sendMessage(cm.FlushRequest(rid(4)))
    stream.sendMessage(cm.HighWaterMarkRequest(rid(5)))
    cluster.flush()
    assert stream.take() == [cm.LockFailure(rid(3), 3), cm.FlushResponse(rid(4), 3),
                             cm.HighWaterMarkResponse(rid(5), 3)]

    # Transaction data over the RPC connection: cached, from the store, and missing.
    rpc.sendMessage(cm.TransactionDataRequest(rid(6), 2))
    rpc.sendMessage(cm.TransactionDataRequest(rid(7), 0))
    rpc.sendMessage(cm.TransactionDataRequest(rid(8), 99))
    cluster.flush()
    first, old, missing = rpc.take()
    assert first == cm.TransactionDataResponse.success(rid(6), 2, b"first")
    assert old == cm.TransactionDataResponse.success(rid(7), 0, b"old-0")
    assert not missing.ok and "not committed" in missing.error

    # Closing the stream connection releases the mount.
    assert cluster.partition.is_mounted(server, 1)
    server.transport.loseConnection()
    cluster.flush()
    assert cluster.partition.mounted_clients == {}
    assert server not in cluster.factory.connections


def test_a_partition_this_server_does_not_have():
    cluster = Cluster()
    client, _, _ = cluster.connect()
    other = ReqId(1, GEN, 9, 0)
    client.sendMessage(cm.MountRequest(other, -1, 1))
    client.sendMessage(cm.AppendRequest.create(ReqId(1, GEN, 9, 1), -1, 0, b"x"))
    client.sendMessage(cm.FlushRequest(ReqId(1, GEN, 9, 2)))
    client.sendMessage(cm.TransactionDataRequest(ReqId(1, GEN, 9, 3), 0))
    cluster.flush()
    mount, data = client.take()
    assert mount == cm.MountResponse(other, cm.MountState.NOT_READY)
    assert not data.ok and "not served here" in data.error


def test_server_messages_are_answered_from_server_info():
    cluster = Cluster()
    client, _, _ = cluster.connect()
    r = rid(0)
    client.sendMessage(cm.CheckStorageConnectivityRequest(r))
    client.sendMessage(cm.ServerPartitionsAssignmentRequest(r))
    client.sendMessage(cm.AddPreferredPartitionRequest(r, (1, 2)))
    client.sendMessage(cm.RemovePreferredPartitionRequest(r, (1,)))
    client.sendMessage(cm.PartitionsHealthRequest(r))
    cluster.flush()
    assert client.take() == [
        cm.CheckStorageConnectivityResponse(r, (("127.0.0.1:55280", True), ("127.0.0.1:55290", False))),
        cm.ServerPartitionsAssignmentResponse(r, (PID, 5)),
        cm.AddPreferredPartitionResponse(r, True),
        cm.RemovePreferredPartitionResponse(r, False),     # the failure is logged, the answer negative
        cm.PartitionsHealthResponse(r, ((PID, True), (5, False))),
    ]
    assert cluster.registry.info.preferred == [(1, 2)]


# -- over StringTransport: bad input and back pressure -------------------------------------------

def frame(message, version=4):
    return encode_frame(b"L", version, cm.CLIENT_CODEC.encode(message, version))


def frames_in(data: bytes, version=4) -> list:
    """Decode the L messages in ``data`` (skipping the Hello)."""
    messages, offset = [], 0
    while offset < len(data):
        magic, _, length = decode_frame_header(data, offset)
        payload = data[offset + HEADER_SIZE:offset + HEADER_SIZE + length]
        offset += HEADER_SIZE + length
        if magic == b"L" and payload:
            messages.append(cm.CLIENT_CODEC.decode(payload, version))
    return messages


def server_over_string_transport(cluster):
    proto = cluster.factory.buildProtocol(None)
    transport = StringTransport()
    proto.makeConnection(transport)
    proto.dataReceived(Hello((3, 4), "Waltz Client").to_frame())
    transport.clear()
    return proto, transport


def test_a_message_a_client_may_not_send_closes_only_that_connection():
    cluster = Cluster()
    bad, bad_transport = server_over_string_transport(cluster)
    good, good_transport = server_over_string_transport(cluster)
    bad.dataReceived(frame(cm.MountResponse(rid(0), cm.MountState.READY)))
    assert bad_transport.disconnecting
    good.dataReceived(frame(cm.HighWaterMarkRequest(rid(1))))
    assert frames_in(good_transport.value()) == [cm.HighWaterMarkResponse(rid(1), -1)]
    assert not good_transport.disconnecting


def test_a_message_type_a_client_may_not_send_is_refused_before_its_body_is_decoded():
    # Before: the body was decoded item by item, then refused ("a client may not send ..."): a 64 MiB
    # PartitionsHealthResponse held the reactor (every partition of the server) for about 40 s.
    cluster = Cluster()
    bad, bad_transport = server_over_string_transport(cluster)
    reasons = closing_reasons(bad)
    health = cm.PartitionsHealthResponse(rid(0), tuple((pid, True) for pid in range(20_000)))
    bad.dataReceived(frame(health))
    assert bad_transport.disconnecting
    assert reasons == ["message type 22 (PartitionsHealthResponse) is not one this side of a family L connection "
                       "receives"]


def two_connections_the_other_mounted():
    """``(cluster, proto, transport, other, other_transport)``: client 2 mounted on ``other``."""
    cluster = Cluster()
    proto, transport = server_over_string_transport(cluster)
    other, other_transport = server_over_string_transport(cluster)
    other.dataReceived(frame(cm.MountRequest(rid(0, client=2), -1, 1)))
    cluster.clock.advance(0)
    return cluster, proto, transport, other, other_transport


def test_a_corrupted_append_closes_only_that_connection():
    cluster, proto, transport, other, other_transport = two_connections_the_other_mounted()
    payload = bytearray(cm.CLIENT_CODEC.encode(cm.AppendRequest.create(rid(1), -1, 0, b"hello"), 4))
    payload[-1] ^= 0xFF                                   # break the checksum
    proto.dataReceived(encode_frame(b"L", 4, bytes(payload)))
    assert transport.disconnecting and cluster.store.pending == []
    other.dataReceived(frame(cm.AppendRequest.create(rid(1, client=2), -1, 0, b"fine")))
    assert len(cluster.store.pending) == 1 and not other_transport.disconnecting


def test_an_append_over_the_data_limit_closes_only_that_connection():
    # Stored, it could never be read back: every reply carrying it would exceed a frame limit.
    from waltz.protocols.framing import MAX_TRANSACTION_DATA_SIZE
    cluster = Cluster()
    proto, transport = server_over_string_transport(cluster)
    proto.max_frame_size = 64 * 2 ** 20
    proto.dataReceived(frame(cm.AppendRequest.create(rid(1), -1, 0, b"x" * (MAX_TRANSACTION_DATA_SIZE + 1))))
    assert transport.disconnecting and cluster.store.pending == []


def test_an_append_over_the_lock_limit_closes_only_that_connection():
    from waltz.protocols.locks import MAX_LOCKS_PER_KIND
    cluster, proto, transport, other, other_transport = two_connections_the_other_mounted()
    # The encoder does not refuse it (the builder does): this is what a peer could send.
    proto.dataReceived(frame(cm.AppendRequest.create(rid(1), -1, 0, b"x",
                                                     write_locks=range(MAX_LOCKS_PER_KIND + 1))))
    assert transport.disconnecting and cluster.store.pending == []
    other.dataReceived(frame(cm.AppendRequest.create(rid(1, client=2), -1, 0, b"fine",
                                                     write_locks=range(MAX_LOCKS_PER_KIND))))
    assert len(cluster.store.pending) == 1 and not other_transport.disconnecting


@pytest.mark.parametrize("message", [
    cm.MountRequest(rid(0), -5, 1),
    cm.FeedRequest(rid(0), -2),
    cm.AppendRequest.create(rid(1), -3, 0, b"x"),
    cm.AppendRequest.create(rid(1), 2 ** 62, 0, b"x", write_locks=[7]),   # ahead: its locks never checked
], ids=["mount below -1", "feed below -1", "append below -1", "append ahead of the partition"])
def test_a_client_high_water_mark_no_client_can_have_closes_only_that_connection(message):
    # Below -1, a feed never found its first record and took every store read of the partition from the
    # other clients' catch-ups; ahead of the partition, every lock check passed.
    cluster, proto, transport, other, other_transport = two_connections_the_other_mounted()
    proto.dataReceived(frame(cm.MountRequest(rid(0), -1, 1)))
    cluster.clock.advance(0)
    transport.clear()
    proto.dataReceived(frame(message))
    assert transport.disconnecting and cluster.store.pending == []
    other.dataReceived(frame(cm.AppendRequest.create(rid(1, client=2), -1, 0, b"fine")))
    assert len(cluster.store.pending) == 1 and not other_transport.disconnecting


def test_appends_over_the_cap_pause_reading_until_the_store_catches_up():
    cluster = Cluster(settings=PartitionSettings(max_pending_appends=2))
    proto, transport = server_over_string_transport(cluster)
    proto.inbound_high_watermark, proto.inbound_low_watermark = 3, 1
    proto.dataReceived(frame(cm.MountRequest(rid(0), -1, 1)))
    cluster.clock.advance(0)
    proto.dataReceived(b"".join(frame(cm.AppendRequest.create(rid(seq), -1, 0, b"x")) for seq in range(1, 9)))
    # 2 with the store, 3 held (the protocol's high watermark), the other 3 still unread in the buffer.
    assert len(cluster.store.pending) == 2
    assert transport.producerState == "paused" and proto.reading_paused
    assert cluster.partition.pending_appends == 5
    cluster.store.commit()
    cluster.store.commit()
    cluster.store.commit()
    cluster.store.commit()
    assert transport.producerState == "producing"
    assert cluster.partition.high_water_mark == 7


def test_flushes_waiting_for_appends_in_flight_wait_as_one_and_do_not_stop_reading():
    # Each FLUSH used to queue its own barrier, without limit. Counted toward the connection's back
    # pressure instead, FLUSHes waiting on a partition whose store cannot recover would stop the reading of
    # every other partition on that connection. Now they wait at one barrier, a repeated one adds nothing,
    # and reading goes on.
    cluster = Cluster()
    proto, transport = server_over_string_transport(cluster)
    proto.inbound_high_watermark, proto.inbound_low_watermark = 3, 1
    proto.dataReceived(frame(cm.MountRequest(rid(0), -1, 1)))
    cluster.clock.advance(0)
    proto.dataReceived(frame(cm.AppendRequest.create(rid(1), -1, 0, b"x")))
    proto.dataReceived(b"".join(frame(cm.FlushRequest(rid(1))) for _ in range(1000)))
    proto.dataReceived(frame(cm.FlushRequest(rid(2))))
    assert transport.producerState == "producing" and not proto.reading_paused
    assert cluster.partition.pending_appends == 1 and len(cluster.partition._queue) == 1
    cluster.store.commit()
    cluster.clock.advance(0)
    answers = [m for m in frames_in(transport.value()) if isinstance(m, cm.FlushResponse)]
    assert answers == [cm.FlushResponse(rid(1), 0), cm.FlushResponse(rid(2), 0)]


def test_feeds_stop_while_the_client_reads_slowly_and_resume_when_it_catches_up():
    cluster = Cluster(records=50, settings=PartitionSettings(min_fetch_size=10))
    proto, transport = server_over_string_transport(cluster)
    proto.dataReceived(frame(cm.MountRequest(rid(0), 49, 1)))
    cluster.clock.advance(0)
    proto.dataReceived(frame(cm.FeedRequest(rid(0), -1)))
    transport.clear()
    proto.pauseProducing()                                # the transport's write buffer is full
    cluster.clock.advance(0)
    assert frames_in(transport.value()) == []
    proto.resumeProducing()
    cluster.clock.advance(0)
    cluster.clock.advance(0)
    messages = frames_in(transport.value())
    assert [m.transaction_id for m in messages if isinstance(m, cm.FeedData)] == list(range(50))
    assert messages[-1] == cm.FeedSuspended(rid(0))


def test_a_client_that_does_not_read_its_data_answers_is_not_read_from():
    # Pipelined data requests whose answers are never read would grow the server's buffer without bound.
    cluster = Cluster(records=5)
    proto, transport = server_over_string_transport(cluster)
    proto.dataReceived(frame(cm.TransactionDataRequest(rid(1), 0)))
    assert len(frames_in(transport.value())) == 1 and transport.producerState == "producing"
    proto.pauseProducing()                                # the client stopped reading: the buffer is full
    assert transport.producerState == "paused"
    transport.clear()
    proto.dataReceived(frame(cm.TransactionDataRequest(rid(2), 1)))
    assert frames_in(transport.value()) == []             # buffered, not handled
    proto.resumeProducing()                               # it read: the waiting request is answered
    assert transport.producerState == "producing"
    assert [m.req_id for m in frames_in(transport.value())] == [rid(2)]


def test_factory_closes_every_connection():
    cluster = Cluster()
    first, first_transport = server_over_string_transport(cluster)
    second, second_transport = server_over_string_transport(cluster)
    assert cluster.factory.connections == {first, second}
    cluster.factory.close_connections()
    assert first_transport.disconnecting and second_transport.disconnecting


@pytest.mark.parametrize("message", [cm.FeedData(rid(0), 1, 2), cm.FlushResponse(rid(0), 3)])
def test_responses_are_protocol_errors(message):
    registry = DummyRegistry()
    proto = ServerProtocol(registry)
    with pytest.raises(Exception, match="may not send"):
        proto.messageReceived(message)


# -- socket options on a real loopback connection -----------------------------------------------


class _Owner:
    """The ManagedConnection side of a ClientProtocol: records readiness."""

    def __init__(self):
        self.ready = defer.Deferred()

    def protocol_ready(self, protocol):
        self.ready.callback(protocol)

    def protocol_message(self, protocol, message):
        return None

    def protocol_closed(self, protocol, reason):
        pass


@pytest_twisted.ensureDeferred
async def test_both_ends_of_a_client_connection_turn_nagle_off():
    """TCP_NODELAY on the server's and the client's socket (the original sets it on every channel):
    with Nagle on, small feed and append frames waited for delayed ACKs, adding tens of ms."""
    from twisted.internet import endpoints, reactor
    from twisted.internet.protocol import Factory
    from waltz.client.network import ClientProtocol

    server_factory = ServerFactory(DummyRegistry())
    port = await endpoints.TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(server_factory)
    owner = _Owner()

    class ClientFactory(Factory):
        def buildProtocol(self, addr):
            proto = ClientProtocol()
            proto.factory, proto.owner = self, owner
            return proto

    client = None
    try:
        client = await endpoints.TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port).connect(
            ClientFactory())
        await owner.ready
        server = next(iter(server_factory.connections))
        for proto in (client, server):
            sock = proto.transport.getHandle()
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0, proto
    finally:
        if client is not None:
            client.transport.loseConnection()
        server_factory.close_connections()
        await port.stopListening()


def test_a_transport_without_tcp_options_is_fine():
    proto = ServerProtocol(DummyRegistry())
    transport = StringTransport()
    proto.makeConnection(transport)
    assert proto.transport is transport and transport.value()   # the Hello went out


def test_a_reader_that_stops_reading_gets_only_a_few_data_answers_buffered():
    # Before: every pipelined batch request started its store read at once, and every 4 MiB answer went
    # into the transport's buffer after the client had stopped reading (1 GiB for the client's default 256).
    from waltz.protocols.values import Record
    from waltz.protocols.read_gate import MAX_READS_IN_FLIGHT
    mib = 1024 * 1024

    class HeldStore(DummyStore):
        def __init__(self):
            super().__init__(0, partition_id=3)
            self.records = [Record.create(i, ReqId(99, 1, 3, i), 0, bytes([i]) * mib) for i in range(5)]
            self.high_water_mark = 4
            self.reads = []

        def get_records(self, transaction_id, max_records):
            d = defer.Deferred()
            self.reads.append((d, tuple(self.records[transaction_id:transaction_id + max_records])))
            return d

    store = HeldStore()
    partition = ServerPartition(3, 7, store, PartitionSettings(), Clock())
    partition.start()
    proto = ServerFactory(DummyRegistry([partition]), max_frame_size=1 << 26).buildProtocol(None)
    transport = StringTransport()
    proto.makeConnection(transport)
    proto.dataReceived(Hello((3, 4, 5), "Waltz Client").to_frame())
    proto.dataReceived(b"".join(encode_frame(b"L", 5, cm.CLIENT_CODEC.encode(
        cm.TransactionDataBatchRequest(ReqId(1, 7, 3, n), list(range(5))), 5))
        for n in range(2 * MAX_READS_IN_FLIGHT + 8)))
    assert len(store.reads) == MAX_READS_IN_FLIGHT
    transport.clear()
    store.reads.pop(0)[0].callback(store.records)
    proto.pauseProducing()                   # that first answer filled the socket's buffer
    while store.reads:
        d, records = store.reads.pop(0)
        d.callback(records)
    assert len(transport.value()) <= MAX_READS_IN_FLIGHT * 5 * mib
    proto.resumeProducing()                  # the client reads again: the next reads start
    assert len(store.reads) == MAX_READS_IN_FLIGHT
