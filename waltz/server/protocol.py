"""The server's client port: family ``L`` connections from Waltz clients.

A :class:`ServerProtocol` is one client connection (a client opens two per
server: a *stream* connection for mount, append, feed and flush, and an *RPC*
connection for transaction data). It dispatches each message through a table:

* partition messages (mount, append, feed, flush, high-water mark,
  transaction data) go to ``registry.partition(req_id.partition_id)``'s
  :meth:`~waltz.server.partition.ServerPartition.handle`. When the registry
  has no such partition a mount is answered ``MountResponse(NOT_READY)`` and a
  transaction data request (single or batched) with a failure; the others are dropped (the
  client re-mounts elsewhere);
* server messages (storage connectivity, partition assignment, preferred
  partitions, partitions health) are answered from ``registry.server_info()``;
  if that fails the answer is the empty or negative one and the error is logged;
* anything else (a response type, say) is a protocol error that closes this
  connection only.

The connection tells every partition it talked to when it closes and when it
can be written to again (:meth:`outboundResumed`), so feeds stop and resume.
Handlers never raise into the reactor; an unexpected error closes this
connection with a logged reason (``WaltzProtocol``).

``registry`` provides ``partition(partition_id) -> ServerPartition | None`` and
``server_info()`` whose object has ``check_storage_connectivity() ->
Deferred[list[(str, bool)]]``, ``assigned_partitions() -> list[int]``,
``add_preferred_partitions(ids) -> Deferred[bool]``,
``remove_preferred_partitions(ids) -> Deferred[bool]`` and
``partitions_health() -> list[(int, bool)]`` (plain values or Deferreds).
"""

import attr
from twisted.internet import defer
from twisted.internet.protocol import Factory
from zope.interface import implementer

from waltz.protocols import client_messages as cm
from waltz.protocols.base import WaltzProtocol
from waltz.protocols.errors import ProtocolError
from waltz.protocols.framing import MAX_TRANSACTION_DATA_SIZE
from waltz.protocols.read_gate import ReadGate
from waltz.server.partition import ClientConnection, ServerPartition

#: Answers to partition messages for a partition this server does not have (others are dropped).
NOT_SERVED = {
    cm.MountRequest: lambda m: cm.MountResponse(m.req_id, cm.MountState.NOT_READY),
    cm.TransactionDataRequest: lambda m: cm.TransactionDataResponse.failure(
        m.req_id, m.transaction_id, cm.not_served_error(m.req_id.partition_id)),
    cm.TransactionDataBatchRequest: lambda m: cm.TransactionDataBatchResponse.failure(
        m.req_id, cm.not_served_error(m.req_id.partition_id)),
}


@attr.s(frozen=True, slots=True)
class ServerRequest:
    """How one server message is answered: ``server_info().<method>(*args(message))`` -> ``response``."""

    method = attr.ib()
    response = attr.ib()            # (message, result) -> response message
    fallback = attr.ib()            # result used when the method fails
    args = attr.ib(default=lambda message: ())


SERVER_REQUESTS = {
    cm.CheckStorageConnectivityRequest: ServerRequest(
        "check_storage_connectivity",
        lambda m, result: cm.CheckStorageConnectivityResponse(m.req_id, tuple(result)), ()),
    cm.ServerPartitionsAssignmentRequest: ServerRequest(
        "assigned_partitions",
        lambda m, result: cm.ServerPartitionsAssignmentResponse(m.req_id, tuple(result)), ()),
    cm.AddPreferredPartitionRequest: ServerRequest(
        "add_preferred_partitions",
        lambda m, result: cm.AddPreferredPartitionResponse(m.req_id, bool(result)), False,
        lambda m: (tuple(m.partition_ids),)),
    cm.RemovePreferredPartitionRequest: ServerRequest(
        "remove_preferred_partitions",
        lambda m, result: cm.RemovePreferredPartitionResponse(m.req_id, bool(result)), False,
        lambda m: (tuple(m.partition_ids),)),
    cm.PartitionsHealthRequest: ServerRequest(
        "partitions_health",
        lambda m, result: cm.PartitionsHealthResponse(m.req_id, tuple(result)), ()),
}


@implementer(ClientConnection)
class ServerProtocol(WaltzProtocol):
    """One client connection to this server (see the module doc)."""

    codec = cm.CLIENT_CODEC
    hello_name = "Waltz Server"
    #: A client that does not read what it is sent gets nothing more read from it: its feeds stop by
    #: themselves, and its data requests would be answered into the transport's buffer (the reads already
    #: started still are, at most ReadGate's few). (Its appends then wait in its own buffers: the back
    #: pressure reaches the application.)
    pause_reading_while_unwritable = True
    #: Messages handled by a partition.
    PARTITION_MESSAGES = frozenset(ServerPartition.HANDLERS)
    #: What a client may send; any other message type closes the connection before its body is decoded.
    receives = PARTITION_MESSAGES | frozenset(SERVER_REQUESTS)
    #: The partition messages that carry the client's high-water mark.
    _CLIENT_HWM_MESSAGES = frozenset((cm.MountRequest, cm.FeedRequest, cm.AppendRequest))

    def __init__(self, registry):
        super().__init__()
        self.registry = registry
        self._partitions = {}    # partition id -> the ServerPartition this connection talked to
        self._data_reads = ReadGate(self)

    def run_data_read(self, read):
        return self._data_reads.run(read)

    # -- connection life ----------------------------------------------------------------------

    def connectionMade(self):
        super().connectionMade()
        connections = getattr(self.factory, "connections", None) if self.factory else None
        if connections is not None:
            connections.add(self)

    def connectionClosed(self, reason):
        connections = getattr(self.factory, "connections", None) if self.factory else None
        if connections is not None:
            connections.discard(self)
        partitions, self._partitions = list(self._partitions.values()), {}
        for partition in partitions:
            partition.connection_closed(self)
        self._data_reads.wake()     # what waits is dropped

    def outboundResumed(self):
        self._data_reads.wake()
        for partition in list(self._partitions.values()):
            partition.connection_writable(self)

    # -- dispatch -------------------------------------------------------------------------------

    def messageReceived(self, message):
        kind = type(message)
        if kind in self.PARTITION_MESSAGES:
            if kind is cm.AppendRequest and len(message.data) > MAX_TRANSACTION_DATA_SIZE:
                # It could be stored, but never read back: every reply carrying it would exceed
                # the frame limit of the connections it crosses.
                raise ProtocolError("append of %d bytes of data, over the limit of %d"
                                    % (len(message.data), MAX_TRANSACTION_DATA_SIZE))
            if kind in self._CLIENT_HWM_MESSAGES and message.client_hwm < -1:
                # No transaction has such an id; a feed from it would never find its first record, and
                # take every store read of the partition from the other clients' catch-ups.
                raise ProtocolError("%s with client high-water mark %d, below -1"
                                    % (kind.__name__, message.client_hwm))
            return self._partition_message(message)
        request = SERVER_REQUESTS.get(kind)
        if request is None:
            raise ProtocolError("a client may not send %s" % kind.__name__)
        return self._server_request(request, message)

    def _partition_message(self, message):
        partition_id = message.req_id.partition_id
        partition = self.registry.partition(partition_id)
        if partition is None:
            return self._not_served(message)
        self._partitions[partition_id] = partition
        return partition.handle(self, message)

    def _not_served(self, message):
        answer = NOT_SERVED.get(type(message))
        if answer is None:
            self.log.debug("{kind} for partition {pid} from {peer} dropped: partition not served here",
                           kind=type(message).__name__, pid=message.req_id.partition_id, peer=self.peer)
            return None
        self.sendMessage(answer(message))
        return None

    def _server_request(self, request, message):
        d = defer.maybeDeferred(lambda: getattr(self.registry.server_info(), request.method)(
            *request.args(message)))
        d.addErrback(self._server_request_failed, request, message)
        d.addCallback(lambda result: self.sendMessage(request.response(message, result)))
        return d

    def _server_request_failed(self, failure, request, message):
        self.log.failure("{kind} from {peer} failed; answering {fallback!r}", failure,
                         kind=type(message).__name__, peer=self.peer, fallback=request.fallback)
        return request.fallback


class ServerFactory(Factory):
    """Builds a :class:`ServerProtocol` per client connection; :attr:`connections` are the open ones."""

    noisy = False
    protocol = ServerProtocol

    def __init__(self, registry, max_frame_size=None, liveness=None):
        self.registry = registry
        self.max_frame_size = max_frame_size
        self.liveness = liveness        # a waltz.protocols.base.Liveness, or None
        self.connections = set()

    def buildProtocol(self, addr):
        proto = self.protocol(self.registry)
        proto.factory = self
        if self.max_frame_size is not None:
            proto.max_frame_size = self.max_frame_size
        if self.liveness is not None:
            self.liveness.apply(proto)
        return proto

    def close_connections(self, reason="server shutting down"):
        """Close every open client connection (server shutdown; partitions given up)."""
        for connection in list(self.connections):
            connection.close(reason)
