"""One segment of a partition: a data file ``%019d.seg`` and its index ``%019d.idx``.

Both files are named after the segment's first transaction id and begin with
the same 128-byte header (big-endian)::

    version i32 = 0 | creation time i64 (ms) | cluster key UUID | partitionId i32 |
    firstTxnId i64 | zero padding

The data file then holds the records back to back::

    txnId i64 | ReqId (clientId, generation, partitionId, seqNum: 4 x i32) | header i32 |
    dataLen i32 | dataCrc i32 | data (dataLen bytes) | crc i32

``dataCrc`` is the CRC32C of the data (the record's checksum as sent by the
server); ``crc`` is the CRC32C over the 36-byte record header and the data.
The index file's body is described in :mod:`waltz.storage.index`.

Durability: appends go to the OS; :meth:`Segment.sync` fdatasyncs the data file
(and the index when asked). Before the record of a transaction id that is a
multiple of :data:`CHECKPOINT_INTERVAL` is written, data and index are synced,
so every index entry below the last checkpoint present in the index file is
durable: :meth:`Segment.recover` trusts those and rescans the rest.

Segments are blocking and thread-confined (one worker thread per partition).
"""

import bisect
import os
import re
import struct
import time
import uuid

import attr

from waltz.protocols.values import Record, ReqId, checksum, checksum_update
from waltz.storage.errors import CorruptedRecord, SegmentError, StorageClosed, StorageError, SyncFailed
from waltz.storage.fileio import datasync, file_size, fsync_directory, pread_upto, pwrite_all, truncate_durably
from waltz.storage.index import FILE_HEADER_SIZE, SegmentIndex

FORMAT_VERSION = 0
CHECKPOINT_INTERVAL = 1000
RECORD_HEADER_SIZE = 36
RECORD_CRC_SIZE = 4
#: Bytes a record takes on disk besides its data.
RECORD_OVERHEAD = RECORD_HEADER_SIZE + RECORD_CRC_SIZE

DATA_SUFFIX = ".seg"
INDEX_SUFFIX = ".idx"
_SEGMENT_NAME = re.compile(r"^(\d{19})\.seg$")

_FILE_HEADER = struct.Struct(">iq16siq")        # version, creation ms, key, partitionId, firstTxnId
_RECORD_HEADER = struct.Struct(">qiiiiiii")     # txnId, ReqId (4 x i32), header, dataLen, dataCrc
_CRC = struct.Struct(">i")
_SCAN_BUFFER_SIZE = 1 << 20


# -- names ---------------------------------------------------------------------------------------

def data_file_name(first_transaction_id: int) -> str:
    return "%019d%s" % (first_transaction_id, DATA_SUFFIX)


def index_file_name(first_transaction_id: int) -> str:
    return "%019d%s" % (first_transaction_id, INDEX_SUFFIX)


def parse_data_file_name(path: str):
    """The first transaction id a ``.seg`` file name encodes, or None for another name."""
    match = _SEGMENT_NAME.match(os.path.basename(path))
    return int(match.group(1)) if match else None


def list_segments(partition_dir: str) -> list:
    """First transaction ids of the segments (``.seg`` files) in a directory, ascending."""
    try:
        names = os.listdir(partition_dir)
    except FileNotFoundError:
        return []
    return sorted(tid for tid in map(parse_data_file_name, names) if tid is not None)


# -- header --------------------------------------------------------------------------------------

@attr.s(frozen=True, slots=True, auto_attribs=True)
class SegmentHeader:
    """The 128-byte header of a segment's data and index files."""

    version: int
    creation_time_ms: int
    key: uuid.UUID
    partition_id: int
    first_transaction_id: int

    def encode(self) -> bytes:
        fields = _FILE_HEADER.pack(self.version, self.creation_time_ms, self.key.bytes,
                                   self.partition_id, self.first_transaction_id)
        return fields.ljust(FILE_HEADER_SIZE, b"\0")

    @classmethod
    def decode(cls, data: bytes) -> "SegmentHeader":
        version, created, key, partition_id, first = _FILE_HEADER.unpack_from(data)
        return cls(version, created, uuid.UUID(bytes=key), partition_id, first)


def read_header(path: str, fd: int) -> SegmentHeader:
    """Read and decode a segment file's header; :class:`SegmentError` if it is short."""
    data = pread_upto(fd, FILE_HEADER_SIZE, 0)
    if len(data) < FILE_HEADER_SIZE:
        raise SegmentError("segment file %s is truncated: %d bytes, the header alone is %d"
                           % (path, len(data), FILE_HEADER_SIZE))
    return SegmentHeader.decode(data)


def check_header(path: str, header: SegmentHeader, first_transaction_id: int,
                 key: uuid.UUID = None, partition_id: int = None) -> None:
    """Raise :class:`SegmentError` unless the header matches its file name and owner."""
    problems = []
    if header.version != FORMAT_VERSION:
        problems.append("format version %d (this storage reads %d)" % (header.version, FORMAT_VERSION))
    if header.first_transaction_id != first_transaction_id:
        problems.append("first transaction id %d (the file name says %d)"
                        % (header.first_transaction_id, first_transaction_id))
    if key is not None and header.key != key:
        problems.append("cluster key %s (expected %s)" % (header.key, key))
    if partition_id is not None and header.partition_id != partition_id:
        problems.append("partition %d (expected %d)" % (header.partition_id, partition_id))
    if problems:
        raise SegmentError("segment file %s has a bad header: %s" % (path, ", ".join(problems)))


# -- records -------------------------------------------------------------------------------------

def encode_record(record: Record) -> bytes:
    """The on-disk bytes of a record (header, data, crc)."""
    rid = record.req_id
    head = _RECORD_HEADER.pack(record.transaction_id, rid.client_id, rid.generation, rid.partition_id,
                               rid.seq_num, record.header, len(record.data), record.checksum)
    return b"".join((head, record.data, _CRC.pack(checksum_update(checksum(head), record.data))))


class BadRecord(Exception):
    """A record failed validation; the message says why (internal to storage code and tools)."""


def decode_record(buf, pos: int, available: int, expected_transaction_id: int,
                  check_data_crc: bool = False):
    """Validate and decode the record at ``buf[pos:]``; returns ``(record, size)``.

    ``available`` bytes from ``pos`` belong to the record area. Raises
    :class:`BadRecord` for a short record, an unexpected transaction id, a bad
    length or a checksum mismatch. ``check_data_crc`` also recomputes the data
    checksum (the record crc covers it already, so only tools ask for this).
    """
    if available < RECORD_HEADER_SIZE:
        raise BadRecord("truncated record header (%d of %d bytes)" % (max(available, 0), RECORD_HEADER_SIZE))
    txn, client_id, generation, partition_id, seq_num, header, length, data_crc = \
        _RECORD_HEADER.unpack_from(buf, pos)
    if txn != expected_transaction_id:
        raise BadRecord("transaction id %d where %d was expected" % (txn, expected_transaction_id))
    if length < 0:
        raise BadRecord("negative data length %d" % length)
    size = RECORD_OVERHEAD + length
    if available < size:
        raise BadRecord("truncated record (%d of %d bytes)" % (available, size))
    view = memoryview(buf)
    data_start = pos + RECORD_HEADER_SIZE
    data = view[data_start:data_start + length]
    stored_crc = _CRC.unpack_from(buf, data_start + length)[0]
    if checksum_update(checksum(view[pos:data_start]), data) != stored_crc:
        raise BadRecord("record checksum mismatch")
    if check_data_crc and checksum(data) != data_crc:
        raise BadRecord("data checksum mismatch")
    req_id = ReqId(client_id, generation, partition_id, seq_num)
    return Record(txn, req_id, header, bytes(data), data_crc), size


@attr.s(frozen=True, slots=True, auto_attribs=True)
class ScannedRecord:
    """A valid record found by :class:`RecordScanner`, with its place in the data file."""

    offset: int
    size: int
    record: Record


class RecordScanner:
    """Reads a data file's records in order from ``offset``, stopping at the first bad one.

    Iterate it for :class:`ScannedRecord` items; afterwards ``end_offset`` is
    the offset after the last good record, ``next_transaction_id`` the id the
    next record should have had, and ``problem`` says why the scan stopped
    before the end of the file (None when it reached the end cleanly).
    """

    def __init__(self, path: str, offset: int, first_transaction_id: int, check_data_crc: bool = False):
        self.path = path
        self.end_offset = offset
        self.next_transaction_id = first_transaction_id
        self.check_data_crc = check_data_crc
        self.problem = None

    def __iter__(self):
        with open(self.path, "rb", buffering=_SCAN_BUFFER_SIZE) as f:
            file_end = os.fstat(f.fileno()).st_size
            f.seek(self.end_offset)
            while self.end_offset < file_end:
                try:
                    record, size = self._next(f, file_end - self.end_offset)
                except BadRecord as exc:
                    self.problem = "record %d at offset %d: %s" % (self.next_transaction_id, self.end_offset, exc)
                    return
                yield ScannedRecord(self.end_offset, size, record)
                self.end_offset += size
                self.next_transaction_id += 1

    def _next(self, f, available: int):
        head = f.read(min(RECORD_HEADER_SIZE, available))
        if len(head) == RECORD_HEADER_SIZE:
            length = _RECORD_HEADER.unpack_from(head)[6]
            if 0 <= length <= available - RECORD_OVERHEAD:  # never read past the file for a garbage length
                head += f.read(length + RECORD_CRC_SIZE)
        return decode_record(head, 0, len(head), self.next_transaction_id, self.check_data_crc)


@attr.s(frozen=True, slots=True, auto_attribs=True)
class RecoveryReport:
    """What :meth:`Segment.recover` found and did."""

    first_transaction_id: int
    scan_from: int              #: first transaction id rescanned
    records_scanned: int
    max_transaction_id: int     #: after recovery
    truncated_bytes: int        #: data bytes cut after the last good record
    problem: str = None         #: why the scan stopped before the end of the file


class _SearchTooLong(Exception):
    """A search for a sound record would check too many candidates or bytes."""


class _SearchBudget:
    """Bounds the work of one search for a sound record after a bad one."""

    MAX_CANDIDATES = 10_000
    MAX_BYTES = 256 * 1024 * 1024

    def __init__(self):
        self.candidates = 0
        self.bytes = 0

    def sound(self, segment, offset: int, txn: int) -> bool:
        """Whether a sound record ``txn`` is at ``offset``, counting the check against the budget."""
        self.candidates += 1
        if self.candidates > self.MAX_CANDIDATES:
            raise _SearchTooLong("over %d places hold record %d's id" % (self.MAX_CANDIDATES, txn))
        try:
            segment._read_at(offset, txn, self)
        except BadRecord:
            return False
        return True

    def spend(self, length: int) -> None:
        self.bytes += length
        if self.bytes > self.MAX_BYTES:
            raise _SearchTooLong("checking the places that hold it would read over %d MiB"
                                 % (self.MAX_BYTES >> 20))


# -- segment -------------------------------------------------------------------------------------

class Segment:
    """An open segment. Use :meth:`create` or :meth:`open`; the newest one of a partition is writable."""

    def __init__(self, partition_dir: str, header: SegmentHeader, data_fd: int, index: SegmentIndex,
                 read_only: bool):
        self.partition_dir = partition_dir
        self.header = header
        self.read_only = read_only
        self._data_fd = data_fd
        self._index = index
        self._data_size = file_size(data_fd)
        self._data_dirty = False

    @property
    def data_path(self) -> str:
        return os.path.join(self.partition_dir, data_file_name(self.first_transaction_id))

    @property
    def index_path(self) -> str:
        return os.path.join(self.partition_dir, index_file_name(self.first_transaction_id))

    # -- opening -----------------------------------------------------------------------------

    @classmethod
    def create(cls, partition_dir: str, key: uuid.UUID, partition_id: int, first_transaction_id: int,
               clock=time.time) -> "Segment":
        """Create an empty segment's two files durably and open it for writing.

        Both files are written and fsynced under temporary names, then renamed
        (index first), so a ``.seg`` file always has a complete header and a
        crash leaves at most ``.tmp`` files or an index without data file, which
        :func:`remove_stray_files` deletes.
        """
        header = SegmentHeader(FORMAT_VERSION, int(clock() * 1000), key, partition_id, first_transaction_id)
        paths = [os.path.join(partition_dir, name)
                 for name in (index_file_name(first_transaction_id), data_file_name(first_transaction_id))]
        for path in paths:
            if os.path.exists(path):
                raise SegmentError("segment file %s already exists" % path)
        try:
            for path in paths:
                _write_file_durably(path, header.encode())
            fsync_directory(partition_dir)
            return cls.open(partition_dir, first_transaction_id, key, partition_id)
        except BaseException:
            # Also when only the open failed (out of file descriptors): files left behind would make every
            # later attempt refuse ("already exists") until a restart.
            remove_segment_files(partition_dir, first_transaction_id)
            raise

    @classmethod
    def open(cls, partition_dir: str, first_transaction_id: int, key: uuid.UUID = None,
             partition_id: int = None, read_only: bool = False) -> "Segment":
        """Open a segment, checking both headers against its name (and ``key``/``partition_id`` if given).

        Opened for writing, a missing or headerless index file is recreated
        empty so that :meth:`recover` rebuilds it from the data file.
        """
        data_path = os.path.join(partition_dir, data_file_name(first_transaction_id))
        index_path = os.path.join(partition_dir, index_file_name(first_transaction_id))
        flags = os.O_RDONLY if read_only else os.O_RDWR
        try:
            data_fd = os.open(data_path, flags)
        except FileNotFoundError:
            raise SegmentError("segment file %s does not exist" % data_path) from None
        index_fd = None
        try:
            header = read_header(data_path, data_fd)
            check_header(data_path, header, first_transaction_id, key, partition_id)
            if not read_only:
                _repair_index_header(index_path, header)
            try:
                index_fd = os.open(index_path, flags)
            except FileNotFoundError:
                raise SegmentError("index file %s does not exist" % index_path) from None
            check_header(index_path, read_header(index_path, index_fd), first_transaction_id, key, partition_id)
            return cls(partition_dir, header, data_fd, SegmentIndex(index_path, index_fd), read_only)
        except BaseException:
            os.close(data_fd)
            if index_fd is not None:
                os.close(index_fd)
            raise

    # -- state -------------------------------------------------------------------------------

    @property
    def first_transaction_id(self) -> int:
        return self.header.first_transaction_id

    @property
    def record_count(self) -> int:
        return self._index.count

    @property
    def next_transaction_id(self) -> int:
        return self.first_transaction_id + self._index.count

    @property
    def max_transaction_id(self) -> int:
        """The last transaction id in the segment (``first - 1`` when empty), from the index."""
        return self.next_transaction_id - 1

    @property
    def data_size(self) -> int:
        """Size of the data file in bytes, header included."""
        return self._data_size

    @property
    def index_size(self) -> int:
        return FILE_HEADER_SIZE + 8 * self._index.count

    @property
    def closed(self) -> bool:
        return self._data_fd is None

    def index_offsets(self, i: int = 0, n: int = None) -> list:
        """Raw index entries ``i .. i+n-1`` (all from ``i`` when ``n`` is None), for tools."""
        self._check_open()
        return self._index.offsets(i, self._index.count - i if n is None else n)

    # -- recovery ----------------------------------------------------------------------------

    def recover(self, local_low_water_mark: int = -1, sealed: bool = False, through: int = None) -> RecoveryReport:
        """Make data and index consistent after an unclean stop, durably.

        Index entries below the last checkpoint in the index, and up to
        ``local_low_water_mark`` (synced when it was set), are trusted; every
        entry is when ``sealed`` (the segment was synced, index included, when
        the log rolled past it). The records after them are rescanned,
        validating transaction ids and CRCs; their index entries are rewritten,
        and data and index are truncated at the first bad record, the torn end
        of a write that was never acknowledged.

        Damage that cannot be such an end raises
        :class:`~waltz.storage.errors.CorruptedRecord` instead of cutting: a bad
        last trusted record (everything up to it was synced), a data file that ends
        cleanly before the last trusted record (a truncation cuts the index first,
        so no crash leaves that), or a bad record followed by a sound one (a
        complete record was written after it). Cutting
        there would drop records that may have been acknowledged, and the replica
        would report, and vote with, a shorter log than it was sent.

        With ``through`` (a truncation reopening a sealed segment to cut it after record ``through``), only the
        records up to ``through`` count: once record ``through`` is sound, nothing after it is read, and damage
        there, about to be cut, does not stop the truncation.
        """
        self._check_writable()
        trusted = self._index.count if sealed else self._trusted_entries(local_low_water_mark)
        if through is not None:
            trusted = min(trusted, max(0, through + 1 - self.first_transaction_id))
        offset, txn = self._scan_start(trusted)
        if through is not None and txn > through:
            return RecoveryReport(self.first_transaction_id, txn, 0, self.max_transaction_id, 0)
        scanner = RecordScanner(self.data_path, offset, txn)
        offsets = [scanned.offset for scanned in scanner]
        problem = scanner.problem
        last_trusted = self.first_transaction_id + trusted - 1
        if scanner.next_transaction_id <= last_trusted:
            if problem is not None:
                raise CorruptedRecord("%s: %s, but it was synced: damage, not a torn write; refusing to cut the "
                                      "log there" % (self.data_path, scanner.problem))
            raise CorruptedRecord("%s: the data ends after record %d, but records up to %d were synced: damage or "
                                  "a lost tail; refusing to open a shorter log"
                                  % (self.data_path, scanner.next_transaction_id - 1, last_trusted))
        if problem is not None:
            problem = self._check_torn_end(scanner.end_offset, scanner.next_transaction_id, problem)
        start = txn - self.first_transaction_id
        # The records scanned reach the disk before the index entries pointing at them: an entry at or above a
        # checkpoint makes the records below it trusted at the next open (_trusted_entries).
        self._data_dirty = True
        self.sync()
        self._index.write(start, offsets)
        self._index.truncate(start + len(offsets))  # also drops a torn trailing entry
        truncated = self._data_size - scanner.end_offset
        if truncated:
            os.ftruncate(self._data_fd, scanner.end_offset)
            self._data_size = scanner.end_offset
            self._data_dirty = True     # (the records kept were synced above)
        self.sync(index=True)
        return RecoveryReport(self.first_transaction_id, txn, len(offsets), self.max_transaction_id,
                              truncated, problem)

    def _trusted_entries(self, local_low_water_mark: int) -> int:
        first, count = self.first_transaction_id, self._index.count
        last_checkpoint = ((first + count - 1) // CHECKPOINT_INTERVAL) * CHECKPOINT_INTERVAL
        trusted = max(last_checkpoint - first, local_low_water_mark + 1 - first)
        return min(max(trusted, 0), count)

    def _scan_start(self, trusted: int):
        """Offset and transaction id after the last trusted entry; the segment start if it is not sound
        (a damaged index entry: the full rescan must then get past it, see :meth:`recover`)."""
        if trusted > 0:
            txn = self.first_transaction_id + trusted - 1
            offset = self._index.offset(trusted - 1)
            try:
                _record, size = self._read_at(offset, txn)
            except BadRecord:
                pass
            else:
                return offset + size, txn + 1
        return FILE_HEADER_SIZE, self.first_transaction_id

    def _check_torn_end(self, offset: int, txn: int, problem: str) -> str:
        """:class:`CorruptedRecord` when the bad record at ``offset`` is followed by a sound record ``txn + 1``
        anywhere after it. Not only where the bad record's own length points: a damaged length field points
        elsewhere, and the sound records after it would be cut as a torn end. Returns the problem to report
        for the cut."""
        try:
            following = self._find_record_after(offset, txn + 1)
        except _SearchTooLong as exc:
            # Data full of that number (a torn record's own payload, most likely): the places the bad record
            # and the index point to were checked, and a torn end is by far the likelier case.
            return "%s (the search for a sound record %d after it stopped: %s)" % (problem, txn + 1, exc)
        if following is None:
            return problem      # nothing sound after it: the torn end of an unacknowledged write
        raise CorruptedRecord("%s: %s, but record %d after it (at offset %d) is sound: damage, not a torn write; "
                              "refusing to cut the log there" % (self.data_path, problem, txn + 1, following))

    def _find_record_after(self, offset: int, txn: int, chunk_size: int = 1 << 20):
        """The offset of a sound record ``txn`` after ``offset``, or None. First where the bad record at
        ``offset`` says it ends and where the index puts ``txn`` (either may be damaged too), then any
        place holding ``txn``'s eight bytes (found in C, chunk by chunk), each candidate checked in full.
        :class:`_SearchTooLong` when that would check too many candidates or bytes (data full of that
        number)."""
        budget = _SearchBudget()
        for candidate in self._likely_positions(offset, txn):
            if candidate > offset and budget.sound(self, candidate, txn):
                return candidate
        pattern = struct.pack(">q", txn)
        position = offset + 1
        while position < self._data_size:
            chunk = pread_upto(self._data_fd, min(chunk_size, self._data_size - position), position)
            found = chunk.find(pattern)
            while found >= 0:
                if budget.sound(self, position + found, txn):
                    return position + found
                found = chunk.find(pattern, found + 1)
            if len(chunk) < len(pattern):
                return None
            position += len(chunk) - len(pattern) + 1     # a match may straddle two chunks
        return None

    def _likely_positions(self, offset: int, txn: int):
        head = pread_upto(self._data_fd, RECORD_HEADER_SIZE, offset)
        if len(head) == RECORD_HEADER_SIZE:
            length = _RECORD_HEADER.unpack_from(head)[6]
            if length >= 0:
                yield offset + RECORD_OVERHEAD + length
        entry = txn - self.first_transaction_id
        if entry < self._index.count:
            yield self._index.offset(entry)

    def _read_at(self, offset: int, txn: int, budget=None):
        if not FILE_HEADER_SIZE <= offset < self._data_size:
            # A damaged index entry: outside the record area (os.pread would fail on a negative offset).
            raise BadRecord("offset %d outside the record area (%d to %d)"
                            % (offset, FILE_HEADER_SIZE, self._data_size))
        head = pread_upto(self._data_fd, RECORD_HEADER_SIZE, offset)
        available = self._data_size - offset
        if len(head) == RECORD_HEADER_SIZE:
            txn_found, *_fields, length, _crc = _RECORD_HEADER.unpack_from(head)
            if txn_found == txn and 0 <= length <= available - RECORD_OVERHEAD:
                if budget is not None:
                    budget.spend(length)
                head += pread_upto(self._data_fd, length + RECORD_CRC_SIZE, offset + RECORD_HEADER_SIZE)
        return decode_record(head, 0, len(head), txn)

    # -- writing -----------------------------------------------------------------------------

    def append(self, encoded_records) -> None:
        """Write already validated records, given as ``(transaction_id, encoded bytes)`` in order.

        The ids must continue the segment. Writes go to the OS (no fsync),
        except that data and index are synced before a checkpoint record. An
        I/O error cuts both files back to where they were and re-raises.
        """
        self._check_writable()
        encoded_records = list(encoded_records)
        if encoded_records and encoded_records[0][0] != self.next_transaction_id:
            raise StorageError("segment %s: append of transaction %d, expected %d"
                               % (self.data_path, encoded_records[0][0], self.next_transaction_id))
        for run in _split_at_checkpoints(encoded_records):
            if run[0][0] % CHECKPOINT_INTERVAL == 0:
                self.sync(index=True)
            self._write(run)

    def _write(self, run) -> None:
        start, count = self._data_size, self._index.count
        offsets, position = [], start
        for _txn, data in run:
            offsets.append(position)
            position += len(data)
        try:
            pwrite_all(self._data_fd, b"".join(data for _txn, data in run), start)
            self._data_dirty = True
            self._index.write(count, offsets)
        except OSError:
            self._cut(count, start)
            raise
        self._data_size = position

    def truncate(self, transaction_id: int) -> None:
        """Keep the records up to ``transaction_id`` (``>= first - 1``), durably."""
        self._check_writable()
        keep = transaction_id - self.first_transaction_id + 1
        if keep < 0:
            raise StorageError("segment %s cannot be truncated to %d, before its first transaction %d"
                               % (self.data_path, transaction_id, self.first_transaction_id))
        if keep >= self._index.count:
            return
        data_size = self._index.offset(keep)
        # The kept records reach the disk first, then the index is cut, then the data file, each durably. After
        # a crash in between, the index never holds an entry past the data's end: a data file ending before
        # its last trusted entry is damage (see recover), never an unfinished truncation.
        self.sync()
        self._index.cut_durably(keep)
        truncate_durably(self._data_fd, data_size, self.data_path)
        self._data_size = data_size
        self._data_dirty = False

    def _cut(self, count: int, data_size: int) -> None:
        os.ftruncate(self._data_fd, data_size)
        self._data_size = data_size
        self._data_dirty = True
        self._index.truncate(count)

    def sync(self, index: bool = False) -> None:
        """fdatasync the data file (and the index with ``index=True``) if written since the last sync.

        Raises :class:`SyncFailed` when an fdatasync fails.
        """
        self._check_open()
        try:
            if self._data_dirty:
                datasync(self._data_fd)
                self._data_dirty = False
            if index:
                self._index.sync()
        except OSError as exc:
            raise SyncFailed("fdatasync of segment %s failed: %s" % (self.data_path, exc)) from exc

    # -- reading -----------------------------------------------------------------------------

    def read_records(self, transaction_id: int, max_count: int, max_bytes: int = None,
                     first_may_exceed: bool = True) -> list:
        """Up to ``max_count`` records from ``transaction_id``, each CRC-checked.

        Returns fewer (or none) past the end of the segment; raises
        :class:`CorruptedRecord` rather than return a damaged record. With
        ``max_bytes``, stops before the record that would bring the records' encoded
        size past it (the first one is returned anyway when ``first_may_exceed``).
        """
        self._check_open()
        i = transaction_id - self.first_transaction_id
        n = min(max_count, self._index.count - i)
        if i < 0 or n <= 0:
            return []
        offsets = self._index.offsets(i, n + 1)
        end = offsets.pop() if len(offsets) > n else self._data_size
        self._check_offsets(transaction_id, offsets, end)
        base = offsets[0]
        if max_bytes is not None and end - base > max_bytes:
            # records 0..k-1 span offsets[0]..offsets[k]: keep the longest run that fits
            fitting = bisect.bisect_right(offsets, base + max_bytes) - 1
            if fitting == 0 and not first_may_exceed:
                return []
            n = max(fitting, 1)
            end = offsets[n] if n < len(offsets) else end
            offsets = offsets[:n]
        buf = pread_upto(self._data_fd, end - base, base)
        records = []
        for k, offset in enumerate(offsets):
            next_offset = offsets[k + 1] if k + 1 < n else end
            txn = transaction_id + k
            try:
                record, size = decode_record(buf, offset - base, min(next_offset, base + len(buf)) - offset, txn)
                if size != next_offset - offset:
                    raise BadRecord("%d bytes long but the index gives it %d" % (size, next_offset - offset))
            except BadRecord as exc:
                raise CorruptedRecord("partition %d, segment %s: record %d at offset %d is corrupted: %s"
                                      % (self.header.partition_id, self.data_path, txn, offset, exc)) from None
            records.append(record)
        return records

    def _check_offsets(self, transaction_id: int, offsets: list, end: int) -> None:
        """:class:`CorruptedRecord` unless the index entries of a read lie within the record area, before the
        read's end: a damaged entry would make the read ask for a huge buffer, or a negative offset. (Entries
        out of order are found by the record checks: each record's size must match its entries.)"""
        if FILE_HEADER_SIZE <= min(offsets) and max(offsets) < end <= self._data_size:
            return
        previous = FILE_HEADER_SIZE - 1
        for k, offset in enumerate(offsets + [end]):
            if not previous < offset <= self._data_size:
                raise CorruptedRecord("partition %d, segment %s: the index entry of record %d (offset %d) is "
                                      "corrupted: not after %d and within the data file (%d bytes)"
                                      % (self.header.partition_id, self.data_path, transaction_id + k, offset,
                                         previous, self._data_size))
            previous = offset

    # -- closing -----------------------------------------------------------------------------

    def close(self) -> None:
        """Sync what was written (data and index) and close both files (idempotent)."""
        if self._data_fd is None:
            return
        try:
            if not self.read_only:
                self.sync(index=True)
        finally:
            self._close_files()

    def close_without_sync(self) -> None:
        """Close both files, syncing nothing (a segment that failed its recovery: nothing of it is trusted)."""
        self._close_files()

    def delete_files(self) -> None:
        """Close the segment (no sync: it is going away) and remove its two files.

        The caller fsyncs the directory.
        """
        self._close_files()
        remove_segment_files(self.partition_dir, self.first_transaction_id)

    def _close_files(self) -> None:
        if self._data_fd is not None:
            os.close(self._data_fd)
            self._data_fd = None
            self._index.close()

    def _check_open(self) -> None:
        if self._data_fd is None:
            raise StorageClosed("segment %s is closed" % self.data_path)

    def _check_writable(self) -> None:
        self._check_open()
        if self.read_only:
            raise StorageError("segment %s is open read-only" % self.data_path)

    def __repr__(self):
        return "<Segment %s txns %d..%d>" % (self.data_path, self.first_transaction_id, self.max_transaction_id)


# -- file helpers --------------------------------------------------------------------------------

def remove_segment_files(partition_dir: str, first_transaction_id: int) -> None:
    """Delete a segment's data file, then its index (missing files are fine)."""
    for name in (data_file_name(first_transaction_id), index_file_name(first_transaction_id)):
        try:
            os.unlink(os.path.join(partition_dir, name))
        except FileNotFoundError:
            pass


def remove_stray_files(partition_dir: str) -> list:
    """Delete leftovers of interrupted segment creation: ``*.tmp`` files and index files without data file.

    Returns the names removed.
    """
    names = os.listdir(partition_dir)
    data_names = {name for name in names if _SEGMENT_NAME.match(name)}
    removed = []
    for name in names:
        orphan_index = name.endswith(INDEX_SUFFIX) and name[:-len(INDEX_SUFFIX)] + DATA_SUFFIX not in data_names
        if name.endswith(".tmp") or orphan_index:
            os.unlink(os.path.join(partition_dir, name))
            removed.append(name)
    if removed:
        fsync_directory(partition_dir)
    return removed


def _write_file_durably(path: str, content: bytes) -> None:
    """Create ``path`` with ``content`` through a fsynced temporary file and a rename."""
    tmp_path = path + ".tmp"
    fd = os.open(tmp_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            pwrite_all(fd, content, 0)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp_path, path)
    except BaseException:
        if os.path.exists(tmp_path):
            os.unlink(tmp_path)
        raise


def _repair_index_header(index_path: str, header: SegmentHeader) -> None:
    """Recreate an index file that is missing or lost its header (its entries get rebuilt by recovery)."""
    try:
        size = os.path.getsize(index_path)
    except FileNotFoundError:
        size = -1
    if size < FILE_HEADER_SIZE:
        _write_file_durably(index_path, header.encode())
        fsync_directory(os.path.dirname(index_path))


def _split_at_checkpoints(encoded_records) -> list:
    """Split ``(txn, bytes)`` pairs into runs, a new run starting at each checkpoint transaction id."""
    runs = []
    for item in encoded_records:
        if not runs or item[0] % CHECKPOINT_INTERVAL == 0:
            runs.append([])
        runs[-1].append(item)
    return runs
