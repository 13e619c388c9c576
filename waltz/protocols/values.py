"""Value classes shared by several message families and by the storage files.

* :class:`ReqId` identifies an append (client id, generation, partition, sequence).
* :class:`RecordHeader` and :class:`Record` are one transaction as the storage
  keeps it and as server and storage exchange it.

All checksums of transaction data are CRC32C (``crc32c`` package), computed over
the data only. The original used zlib CRC-32 on the wire; see ``docs/protocol.md``.
"""

import struct

import attr
import crc32c as _crc32c

from waltz.protocols.errors import DecodeError
from waltz.protocols.primitives import Reader, Writer


def checksum(data) -> int:
    """CRC32C of ``data`` as a signed 32-bit int (the wire and disk representation)."""
    value = _crc32c.crc32c(data)
    return value - (1 << 32) if value >= (1 << 31) else value


def checksum_update(crc: int, data) -> int:
    """Continue a signed CRC32C ``crc`` over more ``data`` (for checksums over several parts)."""
    value = _crc32c.crc32c(data, crc & 0xFFFFFFFF)
    return value - (1 << 32) if value >= (1 << 31) else value


@attr.s(frozen=True, slots=True, auto_attribs=True)
class ReqId:
    """The request id of an append: unique per client, partition and sequence number."""

    client_id: int
    generation: int
    partition_id: int
    seq_num: int

    SIZE = 16

    def encode(self, w: Writer) -> Writer:
        return w.i32(self.client_id).i32(self.generation).i32(self.partition_id).i32(self.seq_num)

    @classmethod
    def decode(cls, r: Reader) -> "ReqId":
        return cls(r.i32("reqId.clientId"), r.i32("reqId.generation"),
                   r.i32("reqId.partitionId"), r.i32("reqId.seqNum"))


@attr.s(frozen=True, slots=True, auto_attribs=True)
class RecordHeader:
    """Transaction id, request id and application header of one record."""

    transaction_id: int
    req_id: ReqId
    header: int

    #: Encoded size: i64 + ReqId + i32.
    SIZE = 8 + ReqId.SIZE + 4

    def encode(self, w: Writer) -> Writer:
        w.i64(self.transaction_id)
        self.req_id.encode(w)
        return w.i32(self.header)

    @classmethod
    def decode(cls, r: Reader) -> "RecordHeader":
        return cls(r.i64("transactionId"), ReqId.decode(r), r.i32("header"))


@attr.s(frozen=True, slots=True, auto_attribs=True)
class Record:
    """One transaction: header fields, the opaque data and the CRC32C of the data.

    Decoding does not verify the checksum: the storage and the server check it
    where a mismatch must be reported (see :meth:`verify`).
    """

    transaction_id: int
    req_id: ReqId
    header: int
    data: bytes
    checksum: int

    #: Smallest encoded size: header fields, data length, crc.
    MIN_SIZE = RecordHeader.SIZE + 4 + 4

    @classmethod
    def create(cls, transaction_id: int, req_id: ReqId, header: int, data: bytes) -> "Record":
        """A record whose checksum is computed from ``data``."""
        return cls(transaction_id, req_id, header, bytes(data), checksum(data))

    def is_valid(self) -> bool:
        """True when the checksum matches the data."""
        return checksum(self.data) == self.checksum

    @property
    def record_header(self) -> RecordHeader:
        return RecordHeader(self.transaction_id, self.req_id, self.header)

    def encode(self, w: Writer) -> Writer:
        r = self.req_id
        w.pack(RECORD_PREFIX, self.transaction_id, r.client_id, r.generation, r.partition_id, r.seq_num,
               self.header, len(self.data))
        w.raw(self.data)
        return w.i32(self.checksum)

    @classmethod
    def decode(cls, r: Reader) -> "Record":
        txn, client_id, generation, partition_id, seq_num, header, length = r.unpack(RECORD_PREFIX, "record")
        if length < 0:
            raise DecodeError("record %d has null data" % txn if length == -1
                              else "record %d has a bad data length %d" % (txn, length))
        data = r.raw(length, "record %d data" % txn)
        return cls(txn, ReqId(client_id, generation, partition_id, seq_num), header, data, r.i32("checksum"))


#: Record fields up to the data: transaction id, ReqId, header, data length (one struct call, not seven).
RECORD_PREFIX = struct.Struct(">qiiiiii")
