"""All segments of one partition: the partition's durable, dense log of records.

A partition lives in ``<storage dir>/<partitionId>/`` as segments named after
their first transaction id (see :mod:`waltz.storage.segment`). The newest
segment is open for writing; older ones are opened read-only on demand and kept
in an LRU cache of ``segment_cache_capacity`` open segments.

:meth:`PartitionLog.open` runs recovery on the newest segment. :meth:`append`
validates a whole batch before writing any of it and only hands the bytes to
the OS; :meth:`sync` makes them durable, so the caller can group several
appends into one fdatasync.

Blocking and thread-confined: the storage daemon runs each partition's log on
that partition's worker thread; nothing here takes a lock.
"""

import bisect
import collections
import functools
import os
import shutil
import time
import uuid

from waltz.storage.errors import (
    CorruptedRecord, RecordChecksumMismatch, SegmentError, StorageClosed, StorageError, SyncFailed,
    TransactionIdOutOfSequence,
)
from waltz.storage.fileio import fsync_directory, make_directory_durably
from waltz.storage.segment import (
    RECORD_OVERHEAD, Segment, encode_record, list_segments, remove_segment_files, remove_stray_files,
)

#: Data read at a time by :meth:`PartitionLog.read_headers` (the first record of each read may exceed it).
HEADER_READ_CHUNK_BYTES = 8 * 1024 * 1024


def _final_on_sync_failure(method):
    """A :class:`SyncFailed` raised by ``method`` fails every later use of the log (see SyncFailed)."""
    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except SyncFailed as exc:
            if self._sync_failure is None:
                self._sync_failure = exc
            raise
    return guarded


DEFAULT_SEGMENT_SIZE_THRESHOLD = 1_000_000_000
DEFAULT_SEGMENT_CACHE_CAPACITY = 5


def partition_directory(storage_dir: str, partition_id: int) -> str:
    """``<storage dir>/<partitionId>``."""
    return os.path.join(storage_dir, str(partition_id))


#: Suffix of a partition directory being deleted: it is renamed first, in one durable step, so that a
#: crash never leaves part of a log where the partition's directory is.
DELETING_SUFFIX = ".deleting"


def delete_partition_directory(storage_dir: str, partition_id: int) -> None:
    """Remove a partition's directory durably: renamed to ``<id>.deleting`` (the directory fsynced), then
    deleted. A crash in between leaves that name, which :func:`remove_deleted_directories` clears."""
    directory = partition_directory(storage_dir, partition_id)
    if not os.path.isdir(directory):
        return
    tombstone = directory + DELETING_SUFFIX
    if os.path.isdir(tombstone):
        shutil.rmtree(tombstone)
    os.rename(directory, tombstone)
    fsync_directory(storage_dir)
    shutil.rmtree(tombstone)
    fsync_directory(storage_dir)


def remove_deleted_directories(storage_dir: str) -> list:
    """Finish the deletions a crash interrupted: remove the ``<id>.deleting`` directories; their names."""
    names = [name for name in os.listdir(storage_dir)
             if name.endswith(DELETING_SUFFIX) and os.path.isdir(os.path.join(storage_dir, name))]
    for name in names:
        shutil.rmtree(os.path.join(storage_dir, name))
    if names:
        fsync_directory(storage_dir)
    return names


class PartitionLog:
    """The log of one partition. Use :meth:`open`."""

    def __init__(self, storage_dir: str, key: uuid.UUID, partition_id: int, segment_size_threshold: int,
                 segment_cache_capacity: int, clock):
        if segment_cache_capacity < 1:
            raise ValueError("segment_cache_capacity must be at least 1, got %d" % segment_cache_capacity)
        self.key = key
        self.partition_id = partition_id
        self.directory = partition_directory(storage_dir, partition_id)
        self.segment_size_threshold = segment_size_threshold
        self.segment_cache_capacity = segment_cache_capacity
        self.recovery = None  #: the newest segment's RecoveryReport from open()
        self._clock = clock
        self._segment_ids = []  # first transaction ids, ascending
        self._active = None     # the newest segment, open for writing
        self._cache = collections.OrderedDict()  # first txn id -> older Segment, least recently used first
        self._closed = False
        self._sync_failure = None   # the SyncFailed that made the log unusable (see SyncFailed)
        self._unusable = None       # why else it is unusable (a truncation that could not reopen a segment)

    @classmethod
    def open(cls, storage_dir: str, key: uuid.UUID, partition_id: int, local_low_water_mark: int = -1,
             segment_size_threshold: int = DEFAULT_SEGMENT_SIZE_THRESHOLD,
             segment_cache_capacity: int = DEFAULT_SEGMENT_CACHE_CAPACITY, clock=time.time) -> "PartitionLog":
        """Open (creating its directory if needed) and recover a partition's log.

        ``local_low_water_mark`` is the partition's local LWM from the control
        file: records up to it were synced with their index when it was set, so
        recovery need not rescan them. The newest segment's records after the
        trusted point are validated; the log is cut at the first bad one
        (``self.recovery`` reports what happened).
        """
        log = cls(storage_dir, key, partition_id, segment_size_threshold, segment_cache_capacity, clock)
        make_directory_durably(log.directory)
        remove_stray_files(log.directory)
        log._segment_ids = list_segments(log.directory)
        if log._segment_ids:
            log._active, log.recovery = log._open_recovered(log._segment_ids[-1], local_low_water_mark)
        end = log.max_transaction_id
        if end < local_low_water_mark:
            # The mark is the log's end when it was set, synced first, and no truncation goes below it.
            log.close()
            raise CorruptedRecord("partition %d: the log ends at transaction %d, below its local low-water mark %d "
                                  "(the records up to it were synced): damage or lost segment files; refusing to "
                                  "open a shorter log" % (partition_id, end, local_low_water_mark))
        return log

    # -- state -------------------------------------------------------------------------------

    @property
    def max_transaction_id(self) -> int:
        """The last transaction id stored (-1 for an empty log)."""
        return self._active.max_transaction_id if self._active is not None else -1

    @property
    def segment_ids(self) -> tuple:
        """First transaction ids of the segments, ascending."""
        return tuple(self._segment_ids)

    @property
    def cached_segment_ids(self) -> tuple:
        """First transaction ids of the older segments currently open, least recently used first."""
        return tuple(self._cache)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def sync_failure(self):
        """The :class:`SyncFailed` that made the log unusable, or None."""
        return self._sync_failure

    @property
    def unusable(self):
        """Why the log is unusable besides a failed sync (a truncation that could not reopen a segment), or
        None."""
        return self._unusable

    def check_usable(self) -> None:
        """Raise unless the log is open and no sync failed: what it holds beyond the last successful
        sync may not be on disk, so not even its end may be reported."""
        self._check_open()

    # -- writing -----------------------------------------------------------------------------

    @_final_on_sync_failure
    def append(self, records) -> None:
        """Append a batch of records, or raise and write nothing of it.

        The first record must have id ``max_transaction_id + 1`` and each next
        one the following id (:class:`TransactionIdOutOfSequence`); each data
        checksum must match (:class:`RecordChecksumMismatch`). The bytes go to
        the OS only: call :meth:`sync` before acknowledging. The log rolls to a
        new segment between records once the current data file exceeds
        ``segment_size_threshold``.
        """
        self._check_open()
        records = list(records)
        self._validate(records)
        encoded = [(record.transaction_id, encode_record(record)) for record in records]
        before = self.max_transaction_id
        try:
            pos = 0
            while pos < len(encoded):
                segment = self._segment_for_append(encoded[pos][0])
                end = self._fitting(segment, encoded, pos)
                segment.append(encoded[pos:end])
                pos = end
        except (OSError, SegmentError):
            # A batch is all or nothing, even on I/O errors, or a roll refused (a stray segment file in the way).
            self.truncate(before)
            raise

    def _validate(self, records) -> None:
        expected = self.max_transaction_id + 1
        for record in records:
            if record.transaction_id != expected:
                raise TransactionIdOutOfSequence(
                    "partition %d: append of transaction %d rejected, expected %d (the log ends at %d)"
                    % (self.partition_id, record.transaction_id, expected, self.max_transaction_id))
            if not record.is_valid():
                raise RecordChecksumMismatch(
                    "partition %d: append rejected, record %d's data does not match its checksum"
                    % (self.partition_id, record.transaction_id))
            expected += 1

    def _segment_for_append(self, transaction_id: int) -> Segment:
        active = self._active
        if active is None or (active.record_count and active.data_size > self.segment_size_threshold):
            self._roll(transaction_id)
        return self._active

    def _fitting(self, segment: Segment, encoded, pos: int) -> int:
        """End of the run of ``encoded[pos:]`` that goes to ``segment``: at least one record, then
        more while the data file has not exceeded the threshold (the check is between records)."""
        size = segment.data_size + len(encoded[pos][1])
        end = pos + 1
        while end < len(encoded) and size <= self.segment_size_threshold:
            size += len(encoded[end][1])
            end += 1
        return end

    def _roll(self, first_transaction_id: int) -> None:
        """Seal the active segment (synced, kept open in the cache) and start a new one."""
        if self._active is not None:
            self._active.sync(index=True)
        segment = Segment.create(self.directory, self.key, self.partition_id, first_transaction_id, self._clock)
        if self._active is not None:
            self._cache_put(self._active)
        self._active = segment
        self._segment_ids.append(first_transaction_id)

    @_final_on_sync_failure
    def sync(self, index: bool = False) -> None:
        """Make every append so far durable: fdatasync the active data file.

        ``index=True`` also syncs the index (before the local low-water mark is
        recorded, at close). Checkpoint and roll syncs happen inside
        :meth:`append`.
        """
        self._check_open()
        if self._active is not None:
            self._active.sync(index=index)

    @_final_on_sync_failure
    def truncate(self, transaction_id: int) -> None:
        """Keep the records up to ``transaction_id`` and delete the rest, durably.

        Later segments are deleted newest first, then the segment holding
        ``transaction_id`` is cut; -1 (or anything below the first record)
        empties the log. Nothing happens when ``transaction_id`` is at or past
        the end.
        """
        self._check_open()
        if transaction_id >= self.max_transaction_id:
            return
        # Newer segments go first, and the active one is closed on the way: a failure before the segment
        # to keep is open again would leave a log without its active segment, reporting itself empty (a
        # replica voting -1), and one during the cut a segment whose end is unknown. The log is unusable
        # then, until a restart reads it again from disk.
        step = "failed"
        try:
            deleted = False
            while self._segment_ids and self._segment_ids[-1] > transaction_id:
                step = "could not delete segment %d" % self._segment_ids[-1]
                self._delete_newest_segment()
                deleted = True
            if deleted:
                # Durable before the cut: a crash after the cut must not bring deleted segments back past
                # a gap in the transaction ids.
                step = "could not sync the partition directory"
                fsync_directory(self.directory)
            if self._segment_ids:
                step = "could not reopen segment %d" % self._segment_ids[-1]
                self._active = self._reopen_for_writing(self._segment_ids[-1], transaction_id)
                step = "could not cut segment %d" % self._segment_ids[-1]
                self._active.truncate(transaction_id)
        except Exception as exc:    # damage, or an OSError (EIO, EROFS, EMFILE) deleting, syncing, opening, cutting
            self._unusable = "truncation to %d %s: %s" % (transaction_id, step, exc)
            raise

    def _delete_newest_segment(self) -> None:
        first = self._segment_ids.pop()
        segment = self._active if self._active is not None and self._active.first_transaction_id == first \
            else self._cache.pop(first, None)
        if segment is self._active:
            self._active = None
        if segment is not None:
            segment.delete_files()
        else:
            remove_segment_files(self.directory, first)

    def _reopen_for_writing(self, first: int, through: int) -> Segment:
        """Segment ``first`` as the active one, for a truncation keeping records up to ``through``."""
        if self._active is not None and self._active.first_transaction_id == first:
            return self._active
        cached = self._cache.pop(first, None)
        if cached is not None:
            cached.close()
        # The newest segment is always a recovered one. This one was synced, index included, when the log
        # rolled past it: its index is trusted (a record damaged since is found by reads, not cut here), and
        # what follows ``through`` is cut unread (damage there is dropped with it).
        segment, _ = self._open_recovered(first, sealed=True, through=through)
        return segment

    def _open_recovered(self, first: int, *args, **kwargs):
        """Open segment ``first`` for writing and recover it (``Segment.recover``'s arguments): the segment and
        what its recovery reports. A segment that fails its recovery is closed (its files stayed open, two
        descriptors per failed attempt to open the partition)."""
        segment = self._open_segment(first, read_only=False)
        try:
            return segment, segment.recover(*args, **kwargs)
        except BaseException:
            segment.close_without_sync()
            raise

    # -- reading -----------------------------------------------------------------------------

    def read_records(self, transaction_id: int, max_count: int, max_bytes: int = None) -> list:
        """Up to ``max_count`` records from ``transaction_id`` on (fewer or none past the end).

        Every record is CRC-checked: a damaged one raises
        :class:`~waltz.storage.errors.CorruptedRecord`, never returns bad data. With
        ``max_bytes``, stops before the record that would bring their encoded size past
        it; the first record is returned whatever its size.
        """
        self._check_open()
        records, remaining = [], max_bytes
        while len(records) < max_count and 0 <= transaction_id <= self.max_transaction_id:
            segment = self._segment_containing(transaction_id)
            if segment is None:
                break
            got = segment.read_records(transaction_id, max_count - len(records), remaining,
                                       first_may_exceed=not records)
            if not got:
                break
            records.extend(got)
            transaction_id += len(got)
            if remaining is not None:
                remaining -= sum(RECORD_OVERHEAD + len(record.data) for record in got)
                if remaining <= 0:
                    break
        return records

    def read_record(self, transaction_id: int):
        """The record of ``transaction_id``, or None if the log does not hold it."""
        records = self.read_records(transaction_id, 1)
        return records[0] if records else None

    def read_headers(self, transaction_id: int, max_count: int, chunk_bytes: int = HEADER_READ_CHUNK_BYTES) -> list:
        """Like :meth:`read_records` but only the :class:`RecordHeader` of each (CRC-checked too).

        The records are read about ``chunk_bytes`` of data at a time and only their headers are kept, so the
        memory a read takes does not grow with the size of the transactions (a header is 28 bytes on the
        wire, a record's data up to 15 MiB).
        """
        headers = []
        while len(headers) < max_count:
            records = self.read_records(transaction_id + len(headers), max_count - len(headers), chunk_bytes)
            if not records:
                break
            headers.extend(record.record_header for record in records)
        return headers

    def read_header(self, transaction_id: int):
        """The :class:`RecordHeader` of ``transaction_id``, or None."""
        record = self.read_record(transaction_id)
        return record.record_header if record is not None else None

    def _segment_containing(self, transaction_id: int):
        i = bisect.bisect_right(self._segment_ids, transaction_id) - 1
        if i < 0:
            return None
        first = self._segment_ids[i]
        if self._active is not None and first == self._active.first_transaction_id:
            return self._active
        segment = self._cache.get(first)
        if segment is not None:
            self._cache.move_to_end(first)
            return segment
        segment = self._open_segment(first, read_only=True)
        expected_max = self._segment_ids[i + 1] - 1
        if segment.max_transaction_id != expected_max:
            segment.close()
            raise SegmentError("partition %d: segment %s ends at transaction %d but the next segment "
                               "starts at %d" % (self.partition_id, segment.data_path,
                                                 segment.max_transaction_id, expected_max + 1))
        self._cache_put(segment)
        return segment

    def _cache_put(self, segment: Segment) -> None:
        while len(self._cache) >= self.segment_cache_capacity:
            _first, evicted = self._cache.popitem(last=False)
            evicted.close()
        self._cache[segment.first_transaction_id] = segment

    def _open_segment(self, first: int, read_only: bool) -> Segment:
        return Segment.open(self.directory, first, self.key, self.partition_id, read_only=read_only)

    # -- closing -----------------------------------------------------------------------------

    def close(self) -> None:
        """Sync and close every open segment (idempotent). After a failed sync nothing is synced: the files
        are only closed (a later fdatasync can succeed on pages whose writeback failed)."""
        if self._closed:
            return
        self._closed = True
        segments = list(self._cache.values()) + ([self._active] if self._active is not None else [])
        self._cache.clear()
        self._active = None
        errors = []
        for segment in segments:
            try:
                if self._sync_failure is not None:
                    segment.close_without_sync()
                else:
                    segment.close()
            except (OSError, StorageError) as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    def delete_files(self) -> None:
        """Close the log and remove the partition's directory with all its segments (partition removal)."""
        self._closed = True
        for segment in list(self._cache.values()) + ([self._active] if self._active is not None else []):
            segment.delete_files()
        self._cache.clear()
        self._active = None
        self._segment_ids = []
        delete_partition_directory(os.path.dirname(self.directory) or ".", self.partition_id)

    def _check_open(self) -> None:
        if self._closed:
            raise StorageClosed("partition %d's log is closed" % self.partition_id)
        if self._sync_failure is not None:
            raise SyncFailed("partition %d's log is unusable after a failed fdatasync (%s); restart the storage "
                             "node to recover it from disk" % (self.partition_id, self._sync_failure))
        if self._unusable is not None:
            raise StorageError("partition %d's log is unusable: %s; restart the storage node to judge it again "
                               "from disk" % (self.partition_id, self._unusable))

    def __repr__(self):
        return "<PartitionLog %d in %s, max %d, %d segments>" % (
            self.partition_id, self.directory, self.max_transaction_id, len(self._segment_ids))
