"""The storage node's ports over StringTransport, with a stub node whose reads the test answers."""

import uuid

import pytest
from twisted.internet import defer
from twisted.internet.testing import StringTransport

from tests.protocols.recording import closing_reasons
from waltz.metrics import Registry
from waltz.protocols import admin_messages as am
from waltz.protocols import storage_messages as sm
from waltz.protocols.framing import Hello, encode_frame
from waltz.protocols.read_gate import MAX_READS_IN_FLIGHT
from waltz.protocols.values import Record, ReqId
from waltz.storage.errors import ControlFileMismatch
from waltz.storage.handlers import AdminServerProtocol, StorageServerProtocol
from waltz.storage.node import StorageMetrics

KEY = uuid.UUID(int=7)


class StubNode:
    """Accepts KEY/4; every partition request and record read returns a Deferred the test fires."""

    def __init__(self):
        self.registry = Registry()
        self.metrics = StorageMetrics(self.registry)
        self.held = []

    def check_open(self, key, partitions):
        if (key, partitions) != (KEY, 4):
            raise ControlFileMismatch("this node belongs to cluster %s with 4 partitions" % KEY)

    def partition(self, pid):
        return self

    def handle(self, message):
        return self._held(message)

    def read_records(self, transaction_id, max_records):
        return self._held(transaction_id)

    def _held(self, what):
        d = defer.Deferred()
        self.held.append((d, what))
        return d


def frame(codec, message):
    version = codec.versions[-1]
    return encode_frame(codec.magic, version, codec.encode(message, version))


def opened(proto_class, codec, open_request):
    node = StubNode()
    proto = proto_class(node)
    transport = StringTransport()
    proto.makeConnection(transport)
    proto.dataReceived(Hello(tuple(codec.versions), "Peer").to_frame() + frame(codec, open_request))
    assert proto.opened
    transport.clear()
    return node, proto, transport


RECORDS = (Record.create(0, ReqId(1, 1, 0, 0), 0, b"x" * 1024),)


@pytest.mark.parametrize("port", ["storage", "admin"])
def test_a_peer_that_stops_reading_gets_at_most_a_few_record_reads_answered(port):
    # Before: every read request read from the socket was started at once (up to 600, the inbound high
    # watermark), and all their answers (record lists of up to 8 MiB) were buffered for a peer that did
    # not read them: gigabytes per connection.
    if port == "storage":
        node, proto, transport = opened(StorageServerProtocol, sm.STORAGE_CODEC, sm.OpenRequest.create(KEY, 4))
        requests = [frame(sm.STORAGE_CODEC, sm.RecordListRequest(1, seq, 0, 0, 1000)) for seq in range(100)]
        answer = lambda seq: sm.RecordListResponse(1, seq, 0, RECORDS)   # noqa: E731
    else:
        node, proto, transport = opened(AdminServerProtocol, am.ADMIN_CODEC, am.OpenRequest(-1, KEY, 4))
        requests = [frame(am.ADMIN_CODEC, am.RecordListRequest(seq, 0, 0, 1000)) for seq in range(100)]
        answer = lambda seq: RECORDS     # noqa: E731 (read_records returns the records)
    proto.dataReceived(b"".join(requests))          # one read of the socket
    assert len(node.held) == MAX_READS_IN_FLIGHT
    proto.pauseProducing()                           # the peer stops reading
    for seq, (d, _) in enumerate(list(node.held)):
        d.callback(answer(seq))
    assert len(node.held) == MAX_READS_IN_FLIGHT     # nothing more started while it does not read
    proto.resumeProducing()
    while any(not d.called for d, _ in node.held):
        assert sum(1 for d, _ in node.held if not d.called) <= MAX_READS_IN_FLIGHT
        for seq, (d, _) in enumerate(list(node.held)):
            if not d.called:
                d.callback(answer(seq))
    assert len(node.held) == 100
    assert transport.value().count(b"x" * 1024) == 100       # every request answered in the end


def test_appends_are_not_held_by_the_read_gate():
    node, proto, transport = opened(StorageServerProtocol, sm.STORAGE_CODEC, sm.OpenRequest.create(KEY, 4))
    proto.dataReceived(b"".join(frame(sm.STORAGE_CODEC, sm.RecordListRequest(1, seq, 0, 0, 1000))
                                for seq in range(MAX_READS_IN_FLIGHT + 5)))
    proto.dataReceived(frame(sm.STORAGE_CODEC, sm.AppendRequest(1, 99, 0, RECORDS, False)))
    assert isinstance(node.held[-1][1], sm.AppendRequest) and len(node.held) == MAX_READS_IN_FLIGHT + 1


def test_a_failed_open_request_leaves_even_an_opened_connection_unopened():
    # protocol.md: after a failed OpenRequest the connection stays open but unopened.
    node, proto, transport = opened(StorageServerProtocol, sm.STORAGE_CODEC, sm.OpenRequest.create(KEY, 4))
    proto.dataReceived(frame(sm.STORAGE_CODEC, sm.OpenRequest.create(uuid.UUID(int=8), 9)))
    assert not proto.opened and transport.value() and transport.connected
    transport.clear()
    proto.dataReceived(frame(sm.STORAGE_CODEC, sm.MaxTransactionIdRequest(1, 0, 0, False)))
    assert transport.disconnecting and not node.held     # a request before a (successful) open


@pytest.mark.parametrize("port", ["storage", "admin"])
def test_a_response_sent_to_a_storage_port_is_refused_before_its_body_is_decoded(port):
    # Before: a FailureResponse (a stack of frames) or an admin status response was decoded item by item,
    # even before the open request, then refused: a 16 MiB one held the storage's reactor for 12 s.
    codec, proto_class, response = {
        "storage": (sm.STORAGE_CODEC, StorageServerProtocol, sm.FailureResponse(1, 0, 0, sm.ExceptionInfo(
            "boom", tuple(sm.StackFrame("C", "m", "f.py", i) for i in range(5000))))),
        "admin": (am.ADMIN_CODEC, AdminServerProtocol, am.AssignedPartitionStatusResponse(
            1, tuple((pid, True) for pid in range(5000))))}[port]
    proto = proto_class(StubNode())
    transport = StringTransport()
    proto.makeConnection(transport)
    reasons = closing_reasons(proto)
    proto.dataReceived(Hello(tuple(codec.versions), "Peer").to_frame() + frame(codec, response))
    assert transport.disconnecting
    assert len(reasons) == 1 and reasons[0].startswith("message type %d (%s) is not one this side" % (
        codec.spec_for(response).code, type(response).__name__)), reasons
