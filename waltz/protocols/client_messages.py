"""Client-server messages (frame magic ``L``, versions 3, 4 and 5).

Every payload is ``type u8 | ReqId (16 bytes) | body``; the ReqId is the
:attr:`ClientMessage.req_id` field of every message. Type codes follow the
original's ``MessageType``; the body of each message is its field list, in
order (see ``docs/protocol.md`` for the byte layouts).

Transaction data travels with its CRC32C (:func:`waltz.protocols.values.checksum`);
decoding an :class:`AppendRequest` or a successful :class:`TransactionDataResponse`
verifies it and raises :class:`~waltz.protocols.errors.ChecksumError` on a mismatch.
Use :meth:`AppendRequest.create` and :meth:`TransactionDataResponse.success` to
build them without computing the checksum by hand.

Version 5 is this project's addition: version 4 plus the batched transaction-data
request (codes 23 and 24) that bulk readers such as the Spark data source use. A
:class:`TransactionDataBatchResponse` carries whole :class:`~waltz.protocols.values.Record`
values, whose checksums the decoder does not verify: the reader checks each one and
fetches again what fails (see ``waltz.client.reader``).
"""

import enum

import attr

from waltz.protocols.codec import (
    BOOL, BYTES, I32, I64, OPT_STRING, PARTITION_IDS, RECORD, REQ_ID, STRING, EnumOf, ListOf, MessageCodec,
    PairOf, bounded_int_list, bounded_long_list, wire)
from waltz.protocols.locks import MAX_LOCKS_PER_KIND
from waltz.protocols.values import ReqId, checksum

#: Protocol versions of family ``L`` this implementation speaks (the original's V3 and V4 layouts).
VERSIONS = (3, 4, 5)


#: Most transaction ids one TransactionDataBatchRequest may name; a request naming more is refused when
#: decoded (the connection closes), before the server reads any of them.
MAX_BATCH_TRANSACTIONS = 10_000
#: A ``TransactionDataBatchRequest``'s ids: at most MAX_BATCH_TRANSACTIONS.
BATCH_IDS = bounded_long_list(MAX_BATCH_TRANSACTIONS)
#: An ``AppendRequest``'s lock hashes: at most MAX_LOCKS_PER_KIND of each kind.
LOCK_LIST = bounded_int_list(MAX_LOCKS_PER_KIND)


class MountState(enum.IntEnum):
    """Outcome of a mount, carried by :class:`MountResponse` as an i32."""

    READY = 0          #: the feed reached the client's high-water mark
    NOT_READY = 1      #: the partition is not (yet) served here; retry elsewhere/later
    CLIENT_AHEAD = 2   #: the client's high-water mark is beyond the partition's


@attr.s(frozen=True, slots=True, auto_attribs=True)
class ClientMessage:
    """Base of family ``L``: the common header is the request id."""

    req_id: ReqId = wire(REQ_ID)


_message = attr.s(frozen=True, slots=True, auto_attribs=True)


@_message
class MountRequest(ClientMessage):
    """Mount a partition: start the feed after ``client_hwm``.

    ``seq_num`` numbers the client's network clients so the server can drop
    messages from older connections.
    """

    TYPE = 0
    client_hwm: int = wire(I64)
    seq_num: int = wire(I64)


@_message
class MountResponse(ClientMessage):
    """Answer to a mount, once the feed has caught up with the client (or cannot)."""

    TYPE = 1
    state: MountState = wire(EnumOf(MountState))


@_message
class AppendRequest(ClientMessage):
    """Submit a transaction, with the lock hashes it writes, reads and appends."""

    TYPE = 2
    client_hwm: int = wire(I64)
    write_locks: tuple = wire(LOCK_LIST)
    read_locks: tuple = wire(LOCK_LIST)
    append_locks: tuple = wire(LOCK_LIST)
    header: int = wire(I32)
    data: bytes = wire(BYTES)
    checksum: int = wire(I32, checksum_of="data")

    @classmethod
    def create(cls, req_id: ReqId, client_hwm: int, header: int, data: bytes,
               write_locks=(), read_locks=(), append_locks=()) -> "AppendRequest":
        """An append request whose checksum is computed from ``data``."""
        return cls(req_id, client_hwm, write_locks, read_locks, append_locks, header, data,
                   checksum(data))


@_message
class FeedRequest(ClientMessage):
    """Start (or resume) the transaction feed after ``client_hwm``."""

    TYPE = 3
    client_hwm: int = wire(I64)


@_message
class FeedData(ClientMessage):
    """One committed transaction in the feed; ``req_id`` is the original append's."""

    TYPE = 4
    transaction_id: int = wire(I64)
    header: int = wire(I32)


@_message
class FeedSuspended(ClientMessage):
    """The server paused the feed (the client has caught up); it resumes on a new FeedRequest."""

    TYPE = 5


@_message
class TransactionDataRequest(ClientMessage):
    """Fetch the data of one transaction (sent on the RPC connection)."""

    TYPE = 6
    transaction_id: int = wire(I64)


@_message
class TransactionDataResponse(ClientMessage):
    """The data of a transaction when ``ok``, otherwise the error that prevented the fetch.

    Build with :meth:`success` or :meth:`failure`.
    """

    TYPE = 7
    transaction_id: int = wire(I64)
    ok: bool = wire(BOOL)
    data: bytes = wire(BYTES, only_if="ok")
    checksum: int = wire(I32, only_if="ok", checksum_of="data")
    error: str = wire(OPT_STRING, only_if_not="ok")

    @classmethod
    def success(cls, req_id: ReqId, transaction_id: int, data: bytes) -> "TransactionDataResponse":
        """A successful response whose checksum is computed from ``data``."""
        return cls(req_id, transaction_id, True, data, checksum(data))

    @classmethod
    def failure(cls, req_id: ReqId, transaction_id: int, error: str) -> "TransactionDataResponse":
        """A failed response carrying ``error``."""
        return cls(req_id, transaction_id, False, error=error)


@_message
class FlushRequest(ClientMessage):
    """Ask to be told when every append sent before this one has resolved."""

    TYPE = 8


@_message
class FlushResponse(ClientMessage):
    """Every earlier append has resolved; ``high_water_mark`` is the partition's at that point."""

    TYPE = 9
    high_water_mark: int = wire(I64)


@_message
class LockFailure(ClientMessage):
    """The append ``req_id`` failed a lock check; ``transaction_id`` is the estimated lock high-water mark."""

    TYPE = 10
    transaction_id: int = wire(I64)


@_message
class HighWaterMarkRequest(ClientMessage):
    """Ask for the partition's current high-water mark."""

    TYPE = 11


@_message
class HighWaterMarkResponse(ClientMessage):
    """The partition's current high-water mark."""

    TYPE = 12
    high_water_mark: int = wire(I64)


@_message
class CheckStorageConnectivityRequest(ClientMessage):
    """Ask the server whether it can reach each storage node."""

    TYPE = 13


@_message
class CheckStorageConnectivityResponse(ClientMessage):
    """``(storage connect string, reachable)`` per storage node (a mapping is accepted too)."""

    TYPE = 14
    connectivity: tuple = wire(ListOf(PairOf(STRING, BOOL)))


@_message
class ServerPartitionsAssignmentRequest(ClientMessage):
    """Ask which partitions the server is assigned."""

    TYPE = 15


@_message
class ServerPartitionsAssignmentResponse(ClientMessage):
    """The partitions assigned to the server."""

    TYPE = 16
    partition_ids: tuple = wire(PARTITION_IDS)


@_message
class AddPreferredPartitionRequest(ClientMessage):
    """Ask the server to prefer (take) these partitions."""

    TYPE = 17
    partition_ids: tuple = wire(PARTITION_IDS)


@_message
class AddPreferredPartitionResponse(ClientMessage):
    """Whether the preferred partitions were added."""

    TYPE = 18
    result: bool = wire(BOOL)


@_message
class RemovePreferredPartitionRequest(ClientMessage):
    """Ask the server to stop preferring these partitions."""

    TYPE = 19
    partition_ids: tuple = wire(PARTITION_IDS)


@_message
class RemovePreferredPartitionResponse(ClientMessage):
    """Whether the preferred partitions were removed."""

    TYPE = 20
    result: bool = wire(BOOL)


@_message
class PartitionsHealthRequest(ClientMessage):
    """Ask for the health of the server's partitions (version 4 and later)."""

    TYPE = 21
    MIN_VERSION = 4


@_message
class PartitionsHealthResponse(ClientMessage):
    """``(partition id, healthy)`` per partition of the server (version 4 and later)."""

    TYPE = 22
    MIN_VERSION = 4
    partition_health: tuple = wire(ListOf(PairOf(I32, BOOL)))


@_message
class TransactionDataBatchRequest(ClientMessage):
    """Fetch the records of several transactions at once (version 5, this project's addition).

    The answer is a :class:`TransactionDataBatchResponse` with the records of a prefix of
    ``transaction_ids``, in the same order; the server may stop early to bound the
    response's size, and the client asks again for the rest.
    """

    TYPE = 23
    MIN_VERSION = 5
    transaction_ids: tuple = wire(BATCH_IDS)


#: In a failed data response's error: the server does not serve the partition (not, or not yet): the
#: client looks the partition up again and resends.
NOT_SERVED_MARK = "is not served here"
#: In a failed data response's error: the failure is transient (the store could not read right now,
#: e.g. no replica reachable); the client may send the request again later.
RETRY_LATER_MARK = "try again later"


def not_served_error(partition_id) -> str:
    """The error a server answers a request for a partition it does not serve."""
    return "partition %d %s" % (partition_id, NOT_SERVED_MARK)


def is_not_served(error) -> bool:
    """Whether a failed data response's error says the server does not serve the partition."""
    return bool(error) and NOT_SERVED_MARK in error


def is_retry_later(error) -> bool:
    """Whether a failed data response's error says the failure is transient."""
    return bool(error) and RETRY_LATER_MARK in error


@_message
class TransactionDataBatchResponse(ClientMessage):
    """The records of a prefix (at least one) of a batch request's transaction ids when ``ok``,
    otherwise the error naming the transaction that could not be read (version 5).

    Build with :meth:`success` or :meth:`failure`. Record checksums are not verified on decode.
    """

    TYPE = 24
    MIN_VERSION = 5
    ok: bool = wire(BOOL)
    records: tuple = wire(ListOf(RECORD), only_if="ok")
    error: str = wire(OPT_STRING, only_if_not="ok")

    @classmethod
    def success(cls, req_id: ReqId, records) -> "TransactionDataBatchResponse":
        return cls(req_id, True, tuple(records))

    @classmethod
    def failure(cls, req_id: ReqId, error: str) -> "TransactionDataBatchResponse":
        return cls(req_id, False, error=error)


MESSAGE_CLASSES = (
    MountRequest, MountResponse, AppendRequest, FeedRequest, FeedData, FeedSuspended,
    TransactionDataRequest, TransactionDataResponse, FlushRequest, FlushResponse, LockFailure,
    HighWaterMarkRequest, HighWaterMarkResponse, CheckStorageConnectivityRequest,
    CheckStorageConnectivityResponse, ServerPartitionsAssignmentRequest,
    ServerPartitionsAssignmentResponse, AddPreferredPartitionRequest,
    AddPreferredPartitionResponse, RemovePreferredPartitionRequest,
    RemovePreferredPartitionResponse, PartitionsHealthRequest, PartitionsHealthResponse,
    TransactionDataBatchRequest, TransactionDataBatchResponse,
)

#: The codec of family ``L``.
CLIENT_CODEC = MessageCodec(b"L", VERSIONS, ClientMessage, MESSAGE_CLASSES)
