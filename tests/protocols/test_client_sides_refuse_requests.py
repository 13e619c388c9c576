"""Every side that opens a connection (the client library, the server's storage connections, the admin tools,
``waltz server list``) refuses a request sent to it before decoding its body, as the servers refuse replies."""

import uuid

import pytest
from twisted.internet.testing import StringTransport

from tests.protocols.recording import closing_reasons
from waltz.cli.server import _HealthQuery
from waltz.client.network import ClientProtocol
from waltz.protocols import admin_messages as am
from waltz.protocols import client_messages as cm
from waltz.protocols import storage_messages as sm
from waltz.protocols.framing import Hello, encode_frame
from waltz.protocols.rpc import AdminClientProtocol, StorageClientProtocol
from waltz.protocols.values import Record, ReqId

KEY = uuid.UUID(int=7)
RID = ReqId(1, 2, 3, 4)


class _Owner:
    """What a ClientProtocol reports to (a ManagedConnection in the library)."""

    def __init__(self):
        self.messages = []

    def protocol_ready(self, protocol):
        pass

    def protocol_message(self, protocol, message):
        self.messages.append(message)

    def protocol_closed(self, protocol, reason):
        pass


def _client_protocol():
    proto = ClientProtocol()
    proto.owner = _Owner()
    return proto


def _rpc_protocol(cls, open_request):
    def make():
        proto = cls()
        proto.open_request = open_request
        return proto
    return make


_RECORDS = tuple(Record.create(n, RID, 0, b"x" * 10) for n in range(2000))

SIDES = {
    # A large request of each family, and a reply the side does take.
    "client library": (_client_protocol, cm.CLIENT_CODEC,
                       cm.TransactionDataBatchRequest(RID, tuple(range(5000))), cm.FlushResponse(RID, 5)),
    "server list": (_HealthQuery, cm.CLIENT_CODEC,
                    cm.TransactionDataBatchRequest(RID, tuple(range(5000))), cm.FlushResponse(RID, 5)),
    "storage client": (_rpc_protocol(StorageClientProtocol, sm.OpenRequest.create(KEY, 4)), sm.STORAGE_CODEC,
                       sm.AppendRequest(1, 0, 0, _RECORDS, False), sm.SuccessResponse(-1, -1, -1)),
    "admin client": (_rpc_protocol(AdminClientProtocol, am.OpenRequest(-1, KEY, 4)), am.ADMIN_CODEC,
                     am.PartitionAssignmentRequest(0, tuple(range(5000)), True, False), am.SuccessResponse(-1)),
}


def _frame(codec, message):
    version = codec.versions[-1]
    return encode_frame(codec.magic, version, codec.encode(message, version))


def _connected(side):
    make, codec, request, reply = SIDES[side]
    proto = make()
    transport = StringTransport()
    proto.makeConnection(transport)
    reasons = closing_reasons(proto)
    proto.dataReceived(Hello(tuple(codec.versions), "Peer").to_frame())
    return proto, transport, reasons, codec, request, reply


@pytest.mark.parametrize("side", sorted(SIDES))
def test_a_request_sent_to_a_client_side_is_refused_before_its_body_is_decoded(side):
    proto, transport, reasons, codec, request, _ = _connected(side)
    proto.dataReceived(_frame(codec, request))
    assert transport.disconnecting
    assert len(reasons) == 1 and reasons[0] == (
        "message type %d (%s) is not one this side of a family %s connection receives" % (
            codec.spec_for(request).code, type(request).__name__, codec.family)), reasons


@pytest.mark.parametrize("side", sorted(SIDES))
def test_a_reply_is_still_taken(side):
    proto, transport, reasons, codec, _, reply = _connected(side)
    proto.dataReceived(_frame(codec, reply))
    assert reasons == [] and not transport.disconnecting


def test_every_family_s_replies_are_its_classes_not_named_request():
    for codec in (cm.CLIENT_CODEC, sm.STORAGE_CODEC, am.ADMIN_CODEC):
        names = {spec.cls.__name__ for spec in codec.specs}
        assert {cls.__name__ for cls in codec.replies} == {n for n in names if not n.endswith("Request")}
    assert {cm.FeedData, cm.FeedSuspended, cm.LockFailure, cm.MountResponse} <= cm.CLIENT_CODEC.replies
