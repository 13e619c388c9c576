"""PartitionLog: appends, validation, roll-over, truncation, the segment cache, and a model check."""

import os
import shutil
import tempfile

import attr
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from waltz.storage import fileio as fileio_module
from waltz.storage import partition_log as partition_log_module
from waltz.storage import segment as segment_module
from waltz.storage.errors import (
    CorruptedRecord, RecordChecksumMismatch, SegmentError, StorageClosed, StorageError, SyncFailed,
    TransactionIdOutOfSequence)
from waltz.storage.partition_log import PartitionLog
from waltz.storage.segment import RECORD_OVERHEAD, data_file_name, index_file_name

from tests.storage.test_segment import KEY, PARTITION, make_record, make_records, open_log

#: Records of 60 bytes on disk; with this threshold a segment holds 4 of them (128 + 3 * 60 <= 350 < 128 + 4 * 60).
RECORD_SIZE = 60 - RECORD_OVERHEAD
SMALL = 350


def small_records(first, count):
    return make_records(first, count, size=RECORD_SIZE)


def directory_bytes(log):
    return {name: os.path.getsize(os.path.join(log.directory, name)) for name in os.listdir(log.directory)}


@pytest.fixture
def log(tmp_path):
    log = open_log(tmp_path)
    yield log
    log.close()


@pytest.fixture
def small_log(tmp_path):
    log = open_log(tmp_path, segment_size_threshold=SMALL)
    yield log
    log.close()


# -- append and read -------------------------------------------------------------------------------

def test_append_and_read_back(log):
    records = make_records(0, 30)
    log.append(records[:1])
    log.append(records[1:30])
    log.sync()
    assert log.max_transaction_id == 29
    assert log.read_record(17) == records[17]
    assert log.read_header(17) == records[17].record_header
    assert log.read_records(0, 100) == records
    assert log.read_records(25, 3) == records[25:28]
    assert log.read_headers(28, 10) == [r.record_header for r in records[28:]]
    assert log.read_record(30) is None
    assert log.read_header(-1) is None
    assert log.read_records(30, 5) == []
    assert log.read_records(3, 0) == []


def test_records_survive_close_and_reopen(tmp_path):
    records = make_records(0, 50)
    log = open_log(tmp_path, segment_size_threshold=1000)
    log.append(records)
    log.close()
    reopened = open_log(tmp_path, segment_size_threshold=1000)
    assert reopened.segment_ids == log.segment_ids
    assert reopened.max_transaction_id == 49
    assert reopened.read_records(0, 100) == records
    reopened.close()


@pytest.mark.parametrize("bad_batch, error", [
    (lambda: make_records(6, 3), TransactionIdOutOfSequence),                       # a gap
    (lambda: make_records(4, 3), TransactionIdOutOfSequence),                       # overlaps the log
    (lambda: make_records(5, 2) + make_records(8, 1), TransactionIdOutOfSequence),  # a gap inside
    (lambda: make_records(5, 2) + [attr.evolve(make_record(7), checksum=1)], RecordChecksumMismatch),
    (lambda: [attr.evolve(make_record(5), data=b"tampered")], RecordChecksumMismatch),
])
def test_rejected_batches_write_nothing(small_log, bad_batch, error):
    small_log.append(small_records(0, 5))
    before = directory_bytes(small_log)
    with pytest.raises(error, match="partition %d" % PARTITION):
        small_log.append(bad_batch())
    assert small_log.max_transaction_id == 4
    assert directory_bytes(small_log) == before
    small_log.append(small_records(5, 1))  # the log still takes the right continuation
    assert small_log.max_transaction_id == 5


def test_an_empty_log_starts_at_transaction_zero(log):
    with pytest.raises(TransactionIdOutOfSequence, match="expected 0"):
        log.append(make_records(1, 1))
    log.append([])
    assert log.max_transaction_id == -1
    assert log.segment_ids == ()


@pytest.mark.parametrize("when", ["checkpoint", "roll", "group commit"])
def test_a_failed_fdatasync_makes_the_log_refuse_everything_after_it(tmp_path, monkeypatch, when):
    # The kernel reports a writeback error to one fdatasync, then marks the pages clean: a later
    # fdatasync succeeds with the data lost. So one failure must be final.
    log = open_log(tmp_path, segment_size_threshold=SMALL) if when == "roll" else open_log(tmp_path)
    first = {"checkpoint": 996, "roll": 3, "group commit": 0}[when]
    if first:
        log.append(small_records(0, first))
        log.sync()
    real_datasync, failures = segment_module.datasync, []

    def datasync_failing_once(fd):
        if not failures:
            failures.append(fd)
            raise OSError(5, "Input/output error")
        real_datasync(fd)

    monkeypatch.setattr(segment_module, "datasync", datasync_failing_once)
    log.append(small_records(first, 1))          # written, not synced yet
    with pytest.raises(SyncFailed, match="Input/output error"):
        if when == "group commit":
            log.sync()
        else:                                     # crosses checkpoint 1000, or fills the segment and rolls
            log.append(small_records(first + 1, 4 if when == "checkpoint" else 3))
    assert failures
    for attempt in (log.sync, lambda: log.append(small_records(log.max_transaction_id + 1, 1)),
                    lambda: log.read_records(0, 1), lambda: log.truncate(0)):
        with pytest.raises(SyncFailed, match="restart the storage node"):
            attempt()
    log.close()


def test_reads_stop_before_the_record_that_would_pass_max_bytes(tmp_path):
    log = open_log(tmp_path, segment_size_threshold=SMALL)
    log.append(small_records(0, 12))                      # several segments
    size = RECORD_OVERHEAD + len(small_records(0, 1)[0].data)
    assert [r.transaction_id for r in log.read_records(0, 12, max_bytes=5 * size)] == [0, 1, 2, 3, 4]
    assert [r.transaction_id for r in log.read_records(2, 12, max_bytes=5 * size + size - 1)] == [2, 3, 4, 5, 6]
    assert [r.transaction_id for r in log.read_records(0, 12, max_bytes=1)] == [0]    # the first always
    assert len(log.read_records(0, 12)) == 12
    log.close()


def test_a_failed_directory_fsync_makes_the_log_refuse_everything_after_it(tmp_path, monkeypatch):
    # Whether the deleted segments' directory entries are gone is unknown after it: as final as a data sync.
    log = open_log(tmp_path, segment_size_threshold=SMALL)
    log.append(small_records(0, 12))
    log.sync()
    assert len(log.segment_ids) > 2
    real_fsync = fileio_module.os.fsync

    def failing_fsync(fd):
        raise OSError(5, "Input/output error")
    monkeypatch.setattr(fileio_module.os, "fsync", failing_fsync)
    with pytest.raises(SyncFailed, match="Input/output error"):
        log.truncate(1)
    monkeypatch.setattr(fileio_module.os, "fsync", real_fsync)
    for attempt in (lambda: log.truncate(1), log.check_usable, lambda: log.read_records(0, 1)):
        with pytest.raises(SyncFailed, match="restart the storage node"):
            attempt()
    log.close()


def test_truncate_makes_the_deleted_segments_durable_before_cutting_the_kept_one(tmp_path, monkeypatch):
    # Otherwise a crash after the cut could bring the deleted segments back, past a gap in the ids.
    log = open_log(tmp_path, segment_size_threshold=SMALL)
    log.append(small_records(0, 12))
    log.sync()
    events = []
    real_fsync_directory, real_truncate = partition_log_module.fsync_directory, segment_module.Segment.truncate
    monkeypatch.setattr(partition_log_module, "fsync_directory",
                        lambda path: (events.append("directory fsync"), real_fsync_directory(path)))
    monkeypatch.setattr(segment_module.Segment, "truncate",
                        lambda segment, txn: (events.append("cut"), real_truncate(segment, txn)))
    log.truncate(1)
    assert events == ["directory fsync", "cut"] and log.max_transaction_id == 1
    log.close()


def test_a_new_partition_directory_is_made_durable_in_its_parent(tmp_path, monkeypatch):
    synced = []
    real = fileio_module.fsync_directory
    monkeypatch.setattr(fileio_module, "fsync_directory", lambda path: (synced.append(path), real(path)))
    log = PartitionLog.open(str(tmp_path / "storage"), KEY, PARTITION)
    assert str(tmp_path) in synced and str(tmp_path / "storage") in synced
    log.close()
    synced.clear()
    PartitionLog.open(str(tmp_path / "storage"), KEY, PARTITION).close()
    assert synced == []                  # nothing created: nothing to sync


@pytest.mark.parametrize("failing_write", [
    1,  # the first record, into the existing segment
    2,  # creating the next segment's index file
    3,  # creating its data file
    4,  # the records that go into the new segment
])
def test_io_error_in_the_middle_of_a_batch_leaves_nothing_of_it(small_log, monkeypatch, failing_write):
    small_log.append(small_records(0, 3))
    before = directory_bytes(small_log)
    real_pwrite_all, calls = segment_module.pwrite_all, []

    def failing_pwrite_all(fd, data, offset):
        calls.append(offset)
        if len(calls) == failing_write:
            raise OSError(28, "No space left on device")
        real_pwrite_all(fd, data, offset)

    monkeypatch.setattr(segment_module, "pwrite_all", failing_pwrite_all)
    with pytest.raises(OSError, match="No space"):
        small_log.append(small_records(3, 6))
    monkeypatch.undo()
    assert small_log.max_transaction_id == 2
    assert directory_bytes(small_log) == before
    assert small_log.cached_segment_ids == ()
    small_log.append(small_records(3, 6))
    assert small_log.read_records(0, 20) == small_records(0, 9)
    assert small_log.segment_ids == (0, 4, 8)


# -- roll-over -------------------------------------------------------------------------------------

def test_a_roll_that_failed_to_open_its_new_segment_is_tried_again(small_log, monkeypatch):
    # The new segment's files were created but it could not be opened (out of file descriptors): they
    # used to stay, and every later append failed with "segment file ... already exists" until a restart.
    small_log.append(small_records(0, 4))
    real_open = segment_module.Segment.open.__func__
    failures = []

    def open_failing_once(cls, *args, **kwargs):
        if not failures:
            failures.append(args)
            raise OSError(24, "Too many open files")
        return real_open(cls, *args, **kwargs)
    monkeypatch.setattr(segment_module.Segment, "open", classmethod(open_failing_once))
    with pytest.raises(OSError, match="Too many open files"):
        small_log.append(small_records(4, 1))       # the segment is full: this append rolls
    monkeypatch.undo()
    small_log.append(small_records(4, 1))
    assert small_log.segment_ids == (0, 4) and small_log.read_records(0, 10) == small_records(0, 5)


def test_rolls_to_new_segments_at_the_threshold(small_log):
    records = small_records(0, 10)
    small_log.append(records[:3])
    small_log.append(records[3:])     # rolls between records, in the middle of the batch
    assert small_log.segment_ids == (0, 4, 8)
    names = sorted(os.listdir(small_log.directory))
    assert names == sorted(data_file_name(first)[:-4] + suffix for first in (0, 4, 8) for suffix in (".seg", ".idx"))
    for first in (0, 4):
        size = os.path.getsize(os.path.join(small_log.directory, data_file_name(first)))
        assert size == 128 + 4 * 60 and size > SMALL
    assert small_log.read_records(0, 100) == records
    assert small_log.read_records(3, 2) == records[3:5]  # a read across a segment boundary


def test_a_record_larger_than_the_threshold_gets_a_segment_of_its_own(tmp_path):
    log = open_log(tmp_path, segment_size_threshold=100)
    records = make_records(0, 3, size=500)
    log.append(records)
    assert log.segment_ids == (0, 1, 2)
    assert log.read_records(0, 3) == records
    log.close()


# -- truncate --------------------------------------------------------------------------------------

def test_truncate_inside_a_segment(small_log):
    records = small_records(0, 10)
    small_log.append(records)
    small_log.truncate(5)
    assert small_log.max_transaction_id == 5
    assert small_log.segment_ids == (0, 4)
    assert small_log.read_records(0, 100) == records[:6]
    size = os.path.getsize(os.path.join(small_log.directory, data_file_name(4)))
    assert size == 128 + 2 * 60
    small_log.append(small_records(6, 1))
    assert small_log.read_record(6) == records[6]


def test_truncate_exactly_at_a_segment_boundary(small_log):
    records = small_records(0, 10)
    small_log.append(records)
    small_log.truncate(7)
    assert small_log.segment_ids == (0, 4)
    assert small_log.max_transaction_id == 7
    assert not os.path.exists(os.path.join(small_log.directory, data_file_name(8)))
    small_log.append(small_records(8, 3))   # the full segment rolls again to a new 8
    assert small_log.segment_ids == (0, 4, 8)
    assert small_log.read_records(0, 100) == small_records(0, 11)


def test_truncate_across_several_segments(small_log, tmp_path):
    small_log.append(small_records(0, 20))
    assert small_log.segment_ids == (0, 4, 8, 12, 16)
    small_log.read_records(0, 20)   # fill the cache with older segments
    small_log.truncate(2)
    assert small_log.segment_ids == (0,)
    assert small_log.max_transaction_id == 2
    assert sorted(os.listdir(small_log.directory)) == ["0000000000000000000.idx", "0000000000000000000.seg"]
    assert small_log.read_records(0, 100) == small_records(0, 3)
    small_log.close()
    reopened = open_log(tmp_path, segment_size_threshold=SMALL)
    assert reopened.max_transaction_id == 2
    reopened.close()


def test_truncate_into_an_older_segment_recovers_it_first(small_log):
    small_log.append(small_records(0, 12))   # segments 0, 4, 8
    os.unlink(os.path.join(small_log.directory, index_file_name(4)))  # an old segment lost its index
    small_log.truncate(6)
    assert small_log.max_transaction_id == 6
    assert small_log.read_records(0, 100) == small_records(0, 7)


def test_truncate_into_an_older_segment_keeps_a_damaged_record_below_the_cut(small_log):
    # Segment 4 was synced when the log rolled past it: its index is trusted, not rescanned and cut at
    # the damage (which dropped records up to the cut that were acknowledged). Reads find the damage.
    small_log.append(small_records(0, 12))   # segments 0, 4, 8
    path = os.path.join(small_log.directory, data_file_name(4))
    with open(path, "r+b") as f:
        f.seek(128 + 60 + 40)                 # a data byte of record 5
        byte = f.read(1)
        f.seek(128 + 60 + 40)
        f.write(bytes([byte[0] ^ 1]))
    small_log.truncate(6)
    assert small_log.max_transaction_id == 6
    assert small_log.read_records(6, 1) == small_records(6, 1)
    with pytest.raises(CorruptedRecord):
        small_log.read_records(5, 1)


def test_a_truncation_cuts_a_damaged_record_it_drops_without_reading_it(small_log, tmp_path):
    # Segment 4's last record (7), synced at the roll, is damaged, and the truncation to 6 drops it. Reopening
    # segment 4 read and checked that record first, and failed: the log was unusable until a restart, and the
    # truncation, asked again, failed again.
    small_log.append(small_records(0, 12))   # segments 0, 4, 8
    damage_record(small_log, 4, 3)            # record 7
    small_log.truncate(6)
    assert small_log.max_transaction_id == 6 and small_log.segment_ids == (0, 4)
    assert small_log.read_records(0, 100) == small_records(0, 7)
    small_log.append(small_records(7, 2))
    small_log.close()
    reopened = open_log(tmp_path, segment_size_threshold=SMALL)
    assert reopened.read_records(0, 100) == small_records(0, 9)
    reopened.close()


def test_a_truncation_that_cannot_reopen_a_damaged_segment_makes_the_log_unusable(small_log):
    # Segment 8 is deleted first; segment 4's record 6, the last one kept and synced at the roll, is damaged,
    # so it cannot be reopened to write after it. The log used to go on without an active segment, reporting
    # itself empty: a replica voting -1.
    small_log.append(small_records(0, 12))   # segments 0, 4, 8
    damage_record(small_log, 4, 2)            # record 6
    with pytest.raises(CorruptedRecord):
        small_log.truncate(6)
    for attempt in (small_log.check_usable, lambda: small_log.append(small_records(8, 1)),
                    lambda: small_log.read_records(0, 1)):
        with pytest.raises(StorageError, match="unusable: truncation to 6 could not reopen segment 4"):
            attempt()


def open_descriptors():
    return len(os.listdir("/proc/self/fd"))


def damage_record(log, first, position):
    """Flip a data byte of the record at ``position`` in segment ``first`` (records of 60 bytes)."""
    path = os.path.join(log.directory, data_file_name(first))
    with open(path, "r+b") as f:
        f.seek(128 + position * 60 + 40)
        byte = f.read(1)
        f.seek(128 + position * 60 + 40)
        f.write(bytes([byte[0] ^ 1]))


@pytest.mark.parametrize("failing", ["open", "truncation"])
def test_a_segment_that_fails_its_recovery_is_closed(tmp_path, failing):
    # Its data and index files stayed open: two descriptors per failed attempt to open the partition (each
    # re-assignment of a damaged partition tries again), and per truncation that could not reopen a segment.
    before = open_descriptors()
    log = open_log(tmp_path, segment_size_threshold=SMALL)
    log.append(small_records(0, 12))          # segments 0, 4, 8
    if failing == "open":
        damage_record(log, 8, 1)              # record 9, in the middle of the newest segment: damage, not torn
        log.close()
        for _ in range(3):
            with pytest.raises(CorruptedRecord):
                open_log(tmp_path, segment_size_threshold=SMALL)
    else:
        damage_record(log, 4, 2)              # record 6: segment 4 cannot be reopened to truncate to 6
        with pytest.raises(CorruptedRecord):
            log.truncate(6)
        log.close()
    assert open_descriptors() == before


def test_a_truncation_that_fails_to_open_the_segment_to_keep_makes_the_log_unusable(small_log, monkeypatch):
    small_log.append(small_records(0, 12))   # segments 0, 4, 8

    def out_of_descriptors(cls, *args, **kwargs):
        raise OSError(24, "Too many open files")
    monkeypatch.setattr(segment_module.Segment, "open", classmethod(out_of_descriptors))
    with pytest.raises(OSError, match="Too many open files"):
        small_log.truncate(6)
    monkeypatch.undo()
    with pytest.raises(StorageError, match="unusable: truncation to 6 could not reopen segment 4"):
        small_log.check_usable()


def test_a_truncation_that_fails_to_delete_a_newer_segment_makes_the_log_unusable(small_log, monkeypatch):
    # The newest segment was taken out of the log before its files were deleted: an unlink failing (EIO,
    # EROFS) left a log without an active segment, still usable, reporting itself empty: a replica voting
    # -1 while it holds records 0..7.
    small_log.append(small_records(0, 12))   # segments 0, 4, 8

    def eio(directory, first):
        raise OSError(5, "Input/output error")
    monkeypatch.setattr(segment_module, "remove_segment_files", eio)
    with pytest.raises(OSError, match="Input/output error"):
        small_log.truncate(6)
    monkeypatch.undo()
    for attempt in (small_log.check_usable, lambda: small_log.append(small_records(8, 1))):
        with pytest.raises(StorageError, match="unusable: truncation to 6 could not delete segment 8"):
            attempt()


def test_a_truncation_that_fails_to_cut_the_segment_to_keep_makes_the_log_unusable(small_log, monkeypatch):
    small_log.append(small_records(0, 12))   # segments 0, 4, 8

    def eio(fd, size, name):
        raise OSError(5, "Input/output error")
    monkeypatch.setattr(segment_module, "truncate_durably", eio)
    with pytest.raises(OSError, match="Input/output error"):
        small_log.truncate(6)
    monkeypatch.undo()
    with pytest.raises(StorageError, match="unusable: truncation to 6 could not cut segment 4"):
        small_log.check_usable()


def test_a_batch_whose_roll_is_refused_writes_nothing(small_log):
    # Before: only an OSError undid the batch; a roll refused with SegmentError (a stray segment file with the
    # next segment's name) left the records written before the roll in the log, while the append failed.
    small_log.append(small_records(0, 4))                   # segment 0 is full: the next record rolls
    stray = os.path.join(small_log.directory, data_file_name(8))
    small_log.append(small_records(4, 2))                   # segment 4: records 6 and 7 fit, 8 rolls
    open(stray, "wb").close()
    with pytest.raises(SegmentError, match="already exists"):
        small_log.append(small_records(6, 3))
    assert small_log.max_transaction_id == 5 and small_log.read_records(0, 20) == small_records(0, 6)
    os.unlink(stray)
    small_log.append(small_records(6, 3))
    assert small_log.read_records(0, 20) == small_records(0, 9)


def test_truncate_to_minus_one_empties_the_partition(small_log):
    small_log.append(small_records(0, 9))
    small_log.truncate(-1)
    assert small_log.max_transaction_id == -1
    assert small_log.segment_ids == ()
    assert os.listdir(small_log.directory) == []
    assert small_log.read_record(0) is None
    small_log.append(small_records(0, 2))
    assert small_log.read_records(0, 5) == small_records(0, 2)


def test_truncate_past_the_end_changes_nothing(small_log):
    small_log.append(small_records(0, 5))
    before = directory_bytes(small_log)
    small_log.truncate(4)
    small_log.truncate(100)
    assert small_log.max_transaction_id == 4
    assert directory_bytes(small_log) == before


# -- segment cache ---------------------------------------------------------------------------------

def test_lru_cache_evicts_old_segments_and_reads_stay_correct(tmp_path):
    log = open_log(tmp_path, segment_size_threshold=SMALL, segment_cache_capacity=2)
    records = small_records(0, 24)   # segments 0, 4, ..., 20
    log.append(records)
    assert log.cached_segment_ids == (12, 16)  # rolled segments stay open, the oldest evicted
    assert log.read_record(1) == records[1]
    assert log.cached_segment_ids == (16, 0)
    assert log.read_record(5) == records[5]
    assert log.cached_segment_ids == (0, 4)
    assert log.read_record(2) == records[2]      # a hit moves to the back
    assert log.cached_segment_ids == (4, 0)
    assert log.read_record(9) == records[9]
    assert log.cached_segment_ids == (0, 8)
    assert log.read_records(0, 100) == records   # sweeps through every segment with two slots
    assert len(log.cached_segment_ids) == 2
    assert log.read_record(22) == records[22]    # the active segment is not cached
    assert 20 not in log.cached_segment_ids
    log.close()


# -- lifecycle -------------------------------------------------------------------------------------

def test_closed_log_refuses_use(log):
    log.append(make_records(0, 2))
    log.close()
    log.close()
    with pytest.raises(StorageClosed):
        log.read_record(0)
    with pytest.raises(StorageClosed):
        log.append(make_records(2, 1))


def test_delete_files_removes_the_partition_directory(small_log):
    small_log.append(small_records(0, 10))
    small_log.delete_files()
    assert not os.path.exists(small_log.directory)
    assert os.listdir(os.path.dirname(small_log.directory)) == []


def test_a_partition_directory_is_renamed_away_in_one_step_before_it_is_deleted(small_log, monkeypatch):
    small_log.append(small_records(0, 10))
    storage_dir = os.path.dirname(small_log.directory)

    def crash(path):
        raise OSError("crash while deleting %s" % path)
    monkeypatch.setattr(shutil, "rmtree", crash)
    with pytest.raises(OSError, match="crash while deleting"):
        partition_log_module.delete_partition_directory(storage_dir, PARTITION)
    monkeypatch.undo()
    # Nothing is left where the partition's log was; the next start finishes the deletion.
    assert os.listdir(storage_dir) == ["%d.deleting" % PARTITION]
    assert partition_log_module.remove_deleted_directories(storage_dir) == ["%d.deleting" % PARTITION]
    assert os.listdir(storage_dir) == []


# -- model check -----------------------------------------------------------------------------------

operations = st.lists(st.one_of(
    st.tuples(st.just("append"), st.lists(st.integers(0, 120), min_size=1, max_size=8)),
    st.tuples(st.just("truncate"), st.integers(-3, 40)),
    st.tuples(st.just("reopen"), st.none()),
), max_size=25)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operations)
def test_behaves_like_a_list(ops):
    directory = tempfile.mkdtemp()
    model = []   # model[i] is the record of transaction i
    log = PartitionLog.open(directory, KEY, PARTITION, segment_size_threshold=400, segment_cache_capacity=2)
    try:
        for op, arg in ops:
            if op == "append":
                batch = [make_record(len(model) + k, size) for k, size in enumerate(arg)]
                log.append(batch)
                model.extend(batch)
            elif op == "truncate":
                log.truncate(arg)
                del model[max(arg + 1, 0):]
            else:
                log.close()
                log = PartitionLog.open(directory, KEY, PARTITION, segment_size_threshold=400,
                                        segment_cache_capacity=2)
            assert log.max_transaction_id == len(model) - 1
            assert log.read_records(0, len(model) + 5) == model
            if model:
                middle = len(model) // 2
                assert log.read_headers(middle, 3) == [r.record_header for r in model[middle:middle + 3]]
    finally:
        log.close()
        shutil.rmtree(directory)


def test_header_reads_keep_only_headers_and_read_data_a_chunk_at_a_time(log, monkeypatch):
    # A header is 28 bytes on the wire; reading 1,000 records of 15 MiB at once to answer it took 30 GB.
    log.append(make_records(0, 10, size=100))
    expected = [record.record_header for record in log.read_records(0, 10)]
    reads, read_records = [], log.read_records

    def spying_read_records(transaction_id, max_count, max_bytes=None):
        records = read_records(transaction_id, max_count, max_bytes)
        reads.append((max_bytes, len(records)))
        return records
    monkeypatch.setattr(log, "read_records", spying_read_records)
    assert log.read_headers(0, 10, chunk_bytes=250) == expected
    assert reads and all(max_bytes == 250 and count <= 3 for max_bytes, count in reads if count)
    reads.clear()
    assert log.read_headers(4, 1000) == expected[4:]
    assert all(max_bytes is not None for max_bytes, _ in reads)
