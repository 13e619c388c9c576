"""Server-storage messages (frame magic ``S``, version 0).

Every payload is ``type u8 | session_id i64 | seq_num i64 | partition_id i32 | body``.
``session_id`` is the store session, ``seq_num`` a per-connection request number
that matches a response to its request, ``partition_id`` the partition. Type
codes follow the original's ``StorageMessageType``.

Record checksums are *not* verified here: the storage reports a bad record
with a :class:`FailureResponse` and the server checks what it reads. Null record
data is still refused (:meth:`waltz.protocols.values.Record.decode`).

:class:`ExceptionInfo` (the original's ``StorageRpcException``) is shared with
the admin family.
"""

import traceback
import uuid

import attr

from waltz.protocols.codec import (
    BOOL, I32, I64, OPT_STRING, RECORD, RECORD_HEADER, STRING, UUID, ListOf, MessageCodec,
    OptionalOf, StructOf, wire)
from waltz.protocols.primitives import I32_MAX, I32_MIN
from waltz.protocols.values import Record, RecordHeader

#: Protocol versions of family ``S``.
VERSIONS = (0,)

#: Header value of the fields an :class:`OpenRequest` does not use.
NO_SESSION = -1


@attr.s(frozen=True, slots=True, auto_attribs=True)
class StackFrame:
    """One stack trace element of an :class:`ExceptionInfo`."""

    class_name: str = wire(STRING)
    method_name: str = wire(STRING)
    file_name: str = wire(OPT_STRING)
    line_number: int = wire(I32)

    def format(self) -> str:
        return "at %s.%s(%s:%d)" % (self.class_name, self.method_name, self.file_name,
                                     self.line_number)


def _frame_of(frame, line_number) -> StackFrame:
    """Describe a Python frame the way Java names a stack element: class, method, file, line."""
    code = frame.f_code
    module = (getattr(frame, "f_globals", None) or {}).get("__name__", "?")
    # Twisted's stand-in frames (failure.py) have no co_qualname
    owner, _, method = getattr(code, "co_qualname", code.co_name).rpartition(".")
    class_name = "%s.%s" % (module, owner) if owner else module
    line = line_number if line_number is not None else -1
    return StackFrame(class_name, method, code.co_filename, min(max(line, I32_MIN), I32_MAX))


@attr.s(frozen=True, slots=True, auto_attribs=True)
class ExceptionInfo:
    """An exception reported by a storage node: message and stack trace, innermost call first."""

    message: str = wire(OPT_STRING)
    stack_trace: tuple = wire(ListOf(StructOf(StackFrame)))

    @classmethod
    def from_exception(cls, exc: BaseException, tb=None) -> "ExceptionInfo":
        """Describe ``exc`` (``"Type: text"``) and ``tb`` (default: ``exc.__traceback__``)."""
        message = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        tb = exc.__traceback__ if tb is None else tb
        frames = [_frame_of(frame, line) for frame, line in traceback.walk_tb(tb)]
        frames.reverse()  # Java order: where it was raised first
        return cls(message, frames)

    def format(self) -> str:
        """Message then one ``at class.method(file:line)`` line per frame, for logs."""
        return "\n".join([str(self.message)] + ["    " + f.format() for f in self.stack_trace])


#: The wire type of an :class:`ExceptionInfo` field (also used by the admin family).
EXCEPTION_INFO = StructOf(ExceptionInfo)


@attr.s(frozen=True, slots=True, auto_attribs=True)
class StorageMessage:
    """Base of family ``S``: the common header."""

    session_id: int = wire(I64)
    seq_num: int = wire(I64)
    partition_id: int = wire(I32)


_message = attr.s(frozen=True, slots=True, auto_attribs=True)


@_message
class OpenRequest(StorageMessage):
    """First request on a connection: the storage checks the cluster key and partition count.

    The header fields are -1 (:data:`NO_SESSION`); build with :meth:`create`.
    """

    TYPE = 1
    cluster_key: uuid.UUID = wire(UUID)
    num_partitions: int = wire(I32)

    @classmethod
    def create(cls, cluster_key, num_partitions: int) -> "OpenRequest":
        return cls(NO_SESSION, NO_SESSION, NO_SESSION, cluster_key, num_partitions)


@_message
class LastSessionInfoRequest(StorageMessage):
    """Ask for the last store session of the partition on this storage."""

    TYPE = 2
    offline: bool = wire(BOOL)


@_message
class LastSessionInfoResponse(StorageMessage):
    """The last session id, its low-water mark and the storage's local low-water mark."""

    TYPE = 3
    last_session_id: int = wire(I64)
    low_water_mark: int = wire(I64)
    local_low_water_mark: int = wire(I64)


@_message
class SetLowWaterMarkRequest(StorageMessage):
    """Record the low-water mark of the new session (the high-water mark when it started)."""

    TYPE = 4
    low_water_mark: int = wire(I64)
    offline: bool = wire(BOOL)


@_message
class TruncateRequest(StorageMessage):
    """Drop every transaction after ``transaction_id``; answered by :class:`MaxTransactionIdResponse`."""

    TYPE = 5
    transaction_id: int = wire(I64)
    offline: bool = wire(BOOL)


@_message
class AppendRequest(StorageMessage):
    """Append records to the partition."""

    TYPE = 6
    records: tuple = wire(ListOf(RECORD))
    offline: bool = wire(BOOL)


@_message
class SuccessResponse(StorageMessage):
    """The request succeeded."""

    TYPE = 7


@_message
class FailureResponse(StorageMessage):
    """The request failed with ``exception``."""

    TYPE = 8
    exception: ExceptionInfo = wire(EXCEPTION_INFO)


@_message
class RecordHeaderRequest(StorageMessage):
    """Ask for the header of one record."""

    TYPE = 9
    transaction_id: int = wire(I64)


@_message
class RecordHeaderResponse(StorageMessage):
    """The record header, or ``None`` when the storage does not have it."""

    TYPE = 10
    record_header: RecordHeader = wire(OptionalOf(RECORD_HEADER))


@_message
class RecordRequest(StorageMessage):
    """Ask for one record."""

    TYPE = 11
    transaction_id: int = wire(I64)


@_message
class RecordResponse(StorageMessage):
    """The record, or ``None`` when the storage does not have it."""

    TYPE = 12
    record: Record = wire(OptionalOf(RECORD))


@_message
class MaxTransactionIdRequest(StorageMessage):
    """Ask for the highest transaction id stored (committed or not)."""

    TYPE = 13
    offline: bool = wire(BOOL)


@_message
class MaxTransactionIdResponse(StorageMessage):
    """The highest transaction id stored in the partition."""

    TYPE = 14
    transaction_id: int = wire(I64)


@_message
class RecordHeaderListRequest(StorageMessage):
    """Ask for up to ``max_records`` record headers from ``transaction_id`` on."""

    TYPE = 15
    transaction_id: int = wire(I64)
    max_records: int = wire(I32)


@_message
class RecordHeaderListResponse(StorageMessage):
    """Record headers, in transaction id order."""

    TYPE = 16
    record_headers: tuple = wire(ListOf(RECORD_HEADER))


@_message
class RecordListRequest(StorageMessage):
    """Ask for up to ``max_records`` records from ``transaction_id`` on."""

    TYPE = 17
    transaction_id: int = wire(I64)
    max_records: int = wire(I32)


@_message
class RecordListResponse(StorageMessage):
    """Records, in transaction id order."""

    TYPE = 18
    records: tuple = wire(ListOf(RECORD))


MESSAGE_CLASSES = (
    OpenRequest, LastSessionInfoRequest, LastSessionInfoResponse, SetLowWaterMarkRequest,
    TruncateRequest, AppendRequest, SuccessResponse, FailureResponse, RecordHeaderRequest,
    RecordHeaderResponse, RecordRequest, RecordResponse, MaxTransactionIdRequest,
    MaxTransactionIdResponse, RecordHeaderListRequest, RecordHeaderListResponse,
    RecordListRequest, RecordListResponse,
)

#: The codec of family ``S``.
STORAGE_CODEC = MessageCodec(b"S", VERSIONS, StorageMessage, MESSAGE_CLASSES)
