"""Storage admin messages (frame magic ``A``, version 0).

Every payload is ``type u8 | seq_num i64 | body``. Type codes follow the
original's ``AdminMessageType``, plus two of this project's own: code 5
(:class:`PartitionReadRequest`, unused in the original) and code 15
(:class:`PartitionWriteRequest`), the read/write toggles of the design document
that the original dropped.
"""

import uuid

import attr

from waltz.protocols.codec import (
    BOOL, I32, I64, PARTITION_IDS, RECORD, STRING, UUID, ListOf, MessageCodec, PairOf, wire)
from waltz.protocols.storage_messages import EXCEPTION_INFO, ExceptionInfo

#: Protocol versions of family ``A``.
VERSIONS = (0,)


@attr.s(frozen=True, slots=True, auto_attribs=True)
class AdminMessage:
    """Base of family ``A``: the common header is a sequence number matching response to request."""

    seq_num: int = wire(I64)


_message = attr.s(frozen=True, slots=True, auto_attribs=True)


@_message
class SuccessResponse(AdminMessage):
    """The request succeeded."""

    TYPE = 1


@_message
class FailureResponse(AdminMessage):
    """The request failed with ``exception``."""

    TYPE = 2
    exception: ExceptionInfo = wire(EXCEPTION_INFO)


@_message
class OpenRequest(AdminMessage):
    """First request on an admin connection: the storage checks the cluster key and partition count."""

    TYPE = 3
    cluster_key: uuid.UUID = wire(UUID)
    num_partitions: int = wire(I32)


@_message
class PartitionAvailableRequest(AdminMessage):
    """Mark partitions available (online) or unavailable on the storage node."""

    TYPE = 4
    partition_ids: tuple = wire(PARTITION_IDS)
    available: bool = wire(BOOL)


@_message
class PartitionReadRequest(AdminMessage):
    """Mark partitions readable or unreadable (this project's addition, code unused in the original)."""

    TYPE = 5
    partition_ids: tuple = wire(PARTITION_IDS)
    readable: bool = wire(BOOL)


@_message
class PartitionAssignmentRequest(AdminMessage):
    """Assign (create) or unassign partitions, optionally deleting the unassigned partitions' files."""

    TYPE = 6
    partition_ids: tuple = wire(PARTITION_IDS)
    assign: bool = wire(BOOL)
    delete_files: bool = wire(BOOL)


@_message
class RecordListRequest(AdminMessage):
    """Ask for up to ``max_records`` records of a partition from ``transaction_id`` on."""

    TYPE = 7
    partition_id: int = wire(I32)
    transaction_id: int = wire(I64)
    max_records: int = wire(I32)


@_message
class RecordListResponse(AdminMessage):
    """Records of a partition, in transaction id order."""

    TYPE = 8
    partition_id: int = wire(I32)
    records: tuple = wire(ListOf(RECORD))


@_message
class LastSessionInfoRequest(AdminMessage):
    """Ask for the last store session of a partition."""

    TYPE = 9
    partition_id: int = wire(I32)


@_message
class LastSessionInfoResponse(AdminMessage):
    """The last session id, its low-water mark and the storage's local low-water mark."""

    TYPE = 10
    partition_id: int = wire(I32)
    last_session_id: int = wire(I64)
    low_water_mark: int = wire(I64)
    local_low_water_mark: int = wire(I64)


@_message
class MetricsRequest(AdminMessage):
    """Ask for the storage's metrics."""

    TYPE = 11


@_message
class MetricsResponse(AdminMessage):
    """The storage's metrics registry as a JSON document."""

    TYPE = 12
    metrics_json: str = wire(STRING)


@_message
class AssignedPartitionStatusRequest(AdminMessage):
    """Ask which partitions are assigned and whether each is available."""

    TYPE = 13


@_message
class AssignedPartitionStatusResponse(AdminMessage):
    """``(partition id, available)`` per assigned partition (a mapping is accepted too)."""

    TYPE = 14
    partition_status: tuple = wire(ListOf(PairOf(I32, BOOL)))


@_message
class PartitionWriteRequest(AdminMessage):
    """Mark partitions writable or unwritable (this project's addition)."""

    TYPE = 15
    partition_ids: tuple = wire(PARTITION_IDS)
    writable: bool = wire(BOOL)


MESSAGE_CLASSES = (
    SuccessResponse, FailureResponse, OpenRequest, PartitionAvailableRequest, PartitionReadRequest,
    PartitionAssignmentRequest, RecordListRequest, RecordListResponse, LastSessionInfoRequest,
    LastSessionInfoResponse, MetricsRequest, MetricsResponse, AssignedPartitionStatusRequest,
    AssignedPartitionStatusResponse, PartitionWriteRequest,
)

#: The codec of family ``A``.
ADMIN_CODEC = MessageCodec(b"A", VERSIONS, AdminMessage, MESSAGE_CLASSES)
