"""The storage node's two ports: the storage protocol (``S``) and the admin protocol (``A``).

Both connections must start with an open request naming the cluster key and
partition count; a mismatch is a failure response naming both values. Each
request is answered with its response or with a failure response carrying the
exception; requests are answered as their partition's worker finishes them,
so responses of different partitions may be reordered (they carry their
``seq_num``). A message that is not a request of the family, or a request
before the open, closes that connection with a logged reason.
"""

import time

from twisted.internet import defer
from twisted.internet.protocol import Factory

from waltz.protocols import admin_messages as am
from waltz.protocols import storage_messages as sm
from waltz.protocols.base import WaltzProtocol
from waltz.protocols.errors import ProtocolError
from waltz.protocols.read_gate import ReadGate
from waltz.storage.controlfile import PartitionFlags
from waltz.storage.errors import StorageError


class _RequestServerProtocol(WaltzProtocol):
    """Open handshake, dispatch through a table, failure responses for errors."""

    #: Request class -> name of the method that serves it (returns a response or a Deferred of one).
    handlers = {}
    pause_reading_while_unwritable = True   # a peer that does not read its answers gets no more
    waiting_peer_is_silent = True           # an admin tool sends nothing while it waits for a slow answer
    open_type = None
    failure_type = None

    def __init__(self, node):
        super().__init__()
        self.node = node
        self.opened = False
        self._reads = ReadGate(self)

    @property
    def receives(self):
        """The requests this port serves; any other message type closes the connection before its body is
        decoded (a response sent here, say: a storage failure response can carry a frame's worth of stack)."""
        return frozenset(self.handlers) | {self.open_type}

    def outboundResumed(self):
        self._reads.wake()

    def connectionClosed(self, reason):
        self._reads.wake()          # what waits is dropped

    def _gated(self, read, message):
        """Serve ``message`` with ``read`` when the read gate admits it: its answer may be megabytes, and a
        peer that stops reading would otherwise have every record read it sent at once buffered here."""
        return self._reads.run(lambda: read(message))

    def messageReceived(self, message):
        self.node.metrics.requests.inc(1, type(message).__name__)
        if isinstance(message, self.open_type):
            d = defer.maybeDeferred(self._open, message)
        elif not self.opened:
            raise ProtocolError("%s before the open request" % type(message).__name__)
        else:
            name = self.handlers.get(type(message))
            if name is None:
                raise ProtocolError("unexpected message %s: not a request" % type(message).__name__)
            d = defer.maybeDeferred(getattr(self, name), message)
        d.addCallbacks(self.sendMessage, self._failed, errbackArgs=(message,))
        return d

    def _open(self, message):
        self.opened = False     # a failed open leaves the connection unopened, even one opened before
        self.node.check_open(message.cluster_key, message.num_partitions)
        self.opened = True
        return self.success(message)

    def _failed(self, failure, message):
        exc = failure.value
        self.node.metrics.failures.inc(1, type(message).__name__)
        if isinstance(exc, StorageError):
            self.log.info("{request} from {peer} failed: {reason}", request=type(message).__name__,
                          peer=self.peer, reason=exc)
        else:
            self.log.failure("{request} from {peer} failed", failure, request=type(message).__name__,
                             peer=self.peer)
        self.sendMessage(self.failure_response(message, sm.ExceptionInfo.from_exception(exc, failure.tb)))


class StorageServerProtocol(_RequestServerProtocol):
    """A Waltz server's connection to this storage node (family ``S``)."""

    codec = sm.STORAGE_CODEC
    hello_name = "Waltz Storage"
    open_type = sm.OpenRequest
    handlers = {cls: "_partition_request" for cls in (
        sm.LastSessionInfoRequest, sm.MaxTransactionIdRequest, sm.SetLowWaterMarkRequest, sm.TruncateRequest,
        sm.AppendRequest)}
    handlers.update({cls: "_record_read" for cls in (
        sm.RecordHeaderRequest, sm.RecordRequest, sm.RecordHeaderListRequest, sm.RecordListRequest)})

    def success(self, message):
        return sm.SuccessResponse(message.session_id, message.seq_num, message.partition_id)

    def failure_response(self, message, info):
        return sm.FailureResponse(message.session_id, message.seq_num, message.partition_id, info)

    def _partition_request(self, message):
        d = self.node.partition(message.partition_id).handle(message)
        if isinstance(message, sm.AppendRequest):
            started = time.monotonic()
            d.addCallback(self._append_done, message.partition_id, started)
        return d

    def _record_read(self, message):
        return self._gated(self._partition_request, message)

    def _append_done(self, response, partition_id, started):
        self.node.metrics.append_seconds.observe(time.monotonic() - started, partition_id)
        return response


class AdminServerProtocol(_RequestServerProtocol):
    """An admin tool's connection to this storage node (family ``A``)."""

    codec = am.ADMIN_CODEC
    hello_name = "Waltz Storage Admin"
    open_type = am.OpenRequest
    handlers = {
        am.PartitionAssignmentRequest: "_assign",
        am.PartitionAvailableRequest: "_available",
        am.PartitionReadRequest: "_readable",
        am.PartitionWriteRequest: "_writable",
        am.RecordListRequest: "_record_list",
        am.LastSessionInfoRequest: "_last_session_info",
        am.MetricsRequest: "_metrics",
        am.AssignedPartitionStatusRequest: "_assigned_status",
    }

    def success(self, message):
        return am.SuccessResponse(message.seq_num)

    def failure_response(self, message, info):
        return am.FailureResponse(message.seq_num, info)

    def _then_success(self, d, message):
        return d.addCallback(lambda _: self.success(message))

    def _assign(self, message):
        return self._then_success(self.node.assign(message.partition_ids, message.assign, message.delete_files),
                                  message)

    def _available(self, message):
        return self._then_success(
            self.node.set_flag(message.partition_ids, PartitionFlags.AVAILABLE, message.available), message)

    def _readable(self, message):
        return self._then_success(
            self.node.set_flag(message.partition_ids, PartitionFlags.UNREADABLE, not message.readable), message)

    def _writable(self, message):
        return self._then_success(
            self.node.set_flag(message.partition_ids, PartitionFlags.UNWRITABLE, not message.writable), message)

    def _record_list(self, message):
        return self._gated(self._read_record_list, message)

    def _read_record_list(self, message):
        d = self.node.partition(message.partition_id).read_records(message.transaction_id, message.max_records)
        return d.addCallback(lambda records: am.RecordListResponse(message.seq_num, message.partition_id, records))

    def _last_session_info(self, message):
        info = self.node.partition(message.partition_id).info
        return am.LastSessionInfoResponse(message.seq_num, message.partition_id, info.session_id,
                                          info.low_water_mark, info.local_low_water_mark)

    def _metrics(self, message):
        return am.MetricsResponse(message.seq_num, self.node.registry.to_json())

    def _assigned_status(self, message):
        return am.AssignedPartitionStatusResponse(message.seq_num, self.node.assigned_status())


class NodeFactory(Factory):
    """Builds protocols of one port for a :class:`StorageNode`."""

    noisy = False

    def __init__(self, protocol_class, node, max_frame_size=None, liveness=None):
        self.protocol_class = protocol_class
        self.node = node
        self.max_frame_size = max_frame_size
        self.liveness = liveness        # a waltz.protocols.base.Liveness, or None

    def buildProtocol(self, addr):
        proto = self.protocol_class(self.node)
        proto.factory = self
        if self.max_frame_size is not None:
            proto.max_frame_size = self.max_frame_size
        if self.liveness is not None:
            self.liveness.apply(proto)
        return proto
