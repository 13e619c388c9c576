"""Segment files: byte layouts, header checks, checkpoint syncs, and recovery after crashes."""

import os
import struct
import uuid

import pytest

from waltz.protocols.values import Record, ReqId, checksum
from waltz.storage import index as index_module
from waltz.storage.errors import CorruptedRecord, SegmentError
from waltz.storage.partition_log import PartitionLog, partition_directory
from waltz.storage.segment import (
    CHECKPOINT_INTERVAL, RECORD_OVERHEAD, Segment, SegmentHeader, data_file_name, encode_record, index_file_name,
    list_segments,
)

KEY = uuid.UUID("0b6b1d3e-8c4a-4f5e-9a7d-2f1e0c9b8a76")
PARTITION = 3


def make_record(txn, size=None, partition=PARTITION):
    """A valid record whose data depends on ``txn`` (``size`` defaults to 10 + txn % 7)."""
    size = 10 + txn % 7 if size is None else size
    data = (b"%d:" % txn * (size // 2 + 1))[:size]
    return Record.create(txn, ReqId(11, 2, partition, txn), txn * 3, data)


def make_records(first, count, size=None):
    return [make_record(txn, size) for txn in range(first, first + count)]


def open_log(tmp_path, **kwargs):
    return PartitionLog.open(str(tmp_path), KEY, PARTITION, **kwargs)


def segment_paths(tmp_path, first=0):
    directory = partition_directory(str(tmp_path), PARTITION)
    return os.path.join(directory, data_file_name(first)), os.path.join(directory, index_file_name(first))


def written_log(tmp_path, count, **kwargs):
    """A closed log holding records 0..count-1; returns the records."""
    records = make_records(0, count)
    log = open_log(tmp_path, **kwargs)
    log.append(records)
    log.close()
    return records


def record_offsets(records, first_offset=128):
    offsets, offset = [], first_offset
    for record in records:
        offsets.append(offset)
        offset += RECORD_OVERHEAD + len(record.data)
    return offsets


def read_index(path):
    raw = open(path, "rb").read()[128:]
    return list(struct.unpack(">%dq" % (len(raw) // 8), raw[:len(raw) // 8 * 8]))


# -- layouts ---------------------------------------------------------------------------------------

def test_record_on_disk_layout():
    record = Record.create(7, ReqId(1, 2, 3, 4), 5, b"abc")
    encoded = encode_record(record)
    head = struct.pack(">qiiiiiii", 7, 1, 2, 3, 4, 5, 3, checksum(b"abc"))
    assert encoded == head + b"abc" + struct.pack(">i", checksum(head + b"abc"))
    assert len(encoded) == RECORD_OVERHEAD + 3 == 43


def test_segment_file_names_and_header_layout(tmp_path):
    log = open_log(tmp_path, clock=lambda: 1234.5)
    log.append(make_records(0, 3))
    log.close()
    data_path, index_path = segment_paths(tmp_path)
    assert os.path.basename(data_path) == "0000000000000000000.seg"
    assert os.path.basename(index_path) == "0000000000000000000.idx"
    expected = struct.pack(">iq16siq", 0, 1234500, KEY.bytes, PARTITION, 0).ljust(128, b"\0")
    assert open(data_path, "rb").read(128) == expected
    assert open(index_path, "rb").read(128) == expected
    assert SegmentHeader.decode(expected) == SegmentHeader(0, 1234500, KEY, PARTITION, 0)


def test_index_is_an_offset_array_after_the_header(tmp_path):
    records = written_log(tmp_path, 5)
    data_path, index_path = segment_paths(tmp_path)
    assert read_index(index_path) == record_offsets(records)
    assert os.path.getsize(index_path) == 128 + 8 * 5
    raw = open(data_path, "rb").read()
    assert raw[128:] == b"".join(encode_record(r) for r in records)


# -- header checks ---------------------------------------------------------------------------------

def test_segment_of_another_cluster_or_partition_is_refused(tmp_path):
    written_log(tmp_path, 2)
    directory = partition_directory(str(tmp_path), PARTITION)
    with pytest.raises(SegmentError, match="cluster key .*\\(expected 00000000-0000-0000-0000-000000000005\\)"):
        PartitionLog.open(str(tmp_path), uuid.UUID(int=5), PARTITION)
    with pytest.raises(SegmentError, match="partition 3 \\(expected 4\\)"):
        Segment.open(directory, 0, KEY, 4)


def test_segment_whose_name_disagrees_with_its_first_transaction_is_refused(tmp_path):
    written_log(tmp_path, 2)
    data_path, index_path = segment_paths(tmp_path)
    os.rename(data_path, data_path.replace("0000000000000000000", "0000000000000000005"))
    os.rename(index_path, index_path.replace("0000000000000000000", "0000000000000000005"))
    with pytest.raises(SegmentError, match="first transaction id 0 \\(the file name says 5\\)"):
        open_log(tmp_path)


def test_empty_partition_directory_is_an_empty_log(tmp_path):
    os.makedirs(partition_directory(str(tmp_path), PARTITION))
    log = open_log(tmp_path)
    assert log.max_transaction_id == -1
    assert log.segment_ids == ()
    assert log.read_record(0) is None
    assert list_segments(log.directory) == []
    log.close()


# -- checkpoints -----------------------------------------------------------------------------------

def test_index_is_synced_before_each_checkpoint_record(tmp_path, monkeypatch):
    log = open_log(tmp_path)
    log.append(make_records(0, 995))
    synced_counts = []
    real_datasync = index_module.datasync

    def recording_datasync(fd):
        synced_counts.append(os.fstat(fd).st_size)
        real_datasync(fd)

    monkeypatch.setattr(index_module, "datasync", recording_datasync)
    log.append(make_records(995, 10))      # crosses 1000: one index sync, holding entries 0..999
    assert synced_counts == [128 + 8 * CHECKPOINT_INTERVAL]
    log.sync()                             # the data only
    assert len(synced_counts) == 1
    log.sync(index=True)
    assert synced_counts[-1] == 128 + 8 * 1005
    log.close()


# -- recovery --------------------------------------------------------------------------------------

def test_recovery_after_a_partial_record_at_the_end(tmp_path):
    records = written_log(tmp_path, 20)
    data_path, index_path = segment_paths(tmp_path)
    cut = record_offsets(records)[12] + 17  # in the middle of record 12
    os.truncate(data_path, cut)
    log = open_log(tmp_path)
    assert log.max_transaction_id == 11
    assert log.recovery.truncated_bytes == 17
    assert "record 12" in log.recovery.problem
    assert log.read_records(0, 100) == records[:12]
    assert read_index(index_path) == record_offsets(records)[:12]
    assert os.path.getsize(data_path) == record_offsets(records)[12]
    log.append(make_records(12, 3))  # the log continues where it was cut
    assert log.read_records(10, 10) == records[10:15]
    log.close()


def flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 1]))


def test_recovery_cuts_a_bad_last_record_the_torn_end_of_a_write(tmp_path):
    records = written_log(tmp_path, 20)
    data_path, index_path = segment_paths(tmp_path)
    flip_byte(data_path, record_offsets(records)[19] + 40)  # a data byte of the last record
    log = open_log(tmp_path)
    assert log.max_transaction_id == 18
    assert "checksum mismatch" in log.recovery.problem
    assert log.read_records(0, 100) == records[:19]
    assert read_index(index_path) == record_offsets(records)[:19]
    log.close()


def test_recovery_refuses_to_cut_a_damaged_record_followed_by_sound_ones(tmp_path):
    # Records 8..19 were written after 7, so 7 is not the torn end of a write: they may all have been
    # acknowledged, and cutting at 7 would make the replica report (and vote) 6.
    records = written_log(tmp_path, 20)
    data_path, index_path = segment_paths(tmp_path)
    flip_byte(data_path, record_offsets(records)[7] + 40)
    size = os.path.getsize(data_path)
    with pytest.raises(CorruptedRecord, match="record 7 at offset .* checksum mismatch, but record 8 after it "
                                              r"\(at offset \d+\) is sound: damage, not a torn write"):
        open_log(tmp_path)
    assert os.path.getsize(data_path) == size and read_index(index_path) == record_offsets(records)


@pytest.mark.parametrize("bit", [0, 3, 17, 31])
def test_recovery_refuses_to_cut_a_record_whose_length_field_is_damaged(tmp_path, bit):
    # The bad length pointed past the sound record 8: nothing was found there, and records 7..19 (which may
    # all have been acknowledged) were cut as a torn end, silently.
    records = written_log(tmp_path, 20)
    data_path, index_path = segment_paths(tmp_path)
    length_field = record_offsets(records)[7] + 28      # txn id 8, ReqId 16, header 4, then the data length
    with open(data_path, "r+b") as f:
        f.seek(length_field)
        value = struct.unpack(">i", f.read(4))[0]
        f.seek(length_field)
        f.write(struct.pack(">I", (value ^ (1 << bit)) & 0xFFFFFFFF))
    size = os.path.getsize(data_path)
    with pytest.raises(CorruptedRecord, match=r"record 7 at offset .*, but record 8 after it \(at offset %d\) is "
                                              "sound" % record_offsets(records)[8]):
        open_log(tmp_path)
    assert os.path.getsize(data_path) == size and read_index(index_path) == record_offsets(records)


def test_a_damaged_length_field_is_found_by_searching_when_the_index_lost_the_entries_after_it(tmp_path):
    # Neither the bad length nor the index (its unsynced entries lost) leads to record 8: the search for
    # record 8's id over the rest of the file does.
    records = written_log(tmp_path, 20)
    data_path, index_path = segment_paths(tmp_path)
    length_field = record_offsets(records)[7] + 28
    with open(data_path, "r+b") as f:
        f.seek(length_field)
        f.write(struct.pack(">i", 10 ** 6))
    os.truncate(index_path, 128 + 8 * 7)
    with pytest.raises(CorruptedRecord, match=r"but record 8 after it \(at offset %d\) is sound"
                                              % record_offsets(records)[8]):
        open_log(tmp_path)


def test_a_torn_record_whose_data_repeats_the_next_id_is_cut_quickly(tmp_path):
    # The search for a sound record after a bad one is bounded: a torn record's own payload holding the
    # next id a million times made it check every place (seconds per megabyte).
    records = written_log(tmp_path, 5)
    data_path, _index_path = segment_paths(tmp_path)
    torn = encode_record(Record.create(5, ReqId(1, 1, PARTITION, 5), 0, struct.pack(">q", 6) * 500_000))
    with open(data_path, "ab") as f:
        f.write(torn[:len(torn) // 2])
    log = open_log(tmp_path)
    try:
        assert log.max_transaction_id == 4 and log.read_records(0, 5) == records
        assert "the search for a sound record 6 after it stopped" in log.recovery.problem
    finally:
        log.close()


def _set_index_entry(index_path, entry, value):
    with open(index_path, "r+b") as f:
        f.seek(128 + 8 * entry)
        f.write(struct.pack(">q", value))


@pytest.mark.parametrize("value", [-4096, 1 << 62])
def test_a_damaged_last_trusted_index_entry_makes_recovery_rescan_the_segment(tmp_path, value):
    # A negative entry made os.pread fail with EINVAL ("Invalid argument", naming no file): the partition
    # failed to open, where the rescan from the segment's start recovers it.
    records = written_log(tmp_path, 20)
    _data_path, index_path = segment_paths(tmp_path)
    _set_index_entry(index_path, 9, value)
    log = open_log(tmp_path, local_low_water_mark=9)    # entries 0..9 trusted: 9 is the one checked
    try:
        assert log.max_transaction_id == 19 and log.read_records(0, 20) == records
    finally:
        log.close()
    assert read_index(index_path) == record_offsets(records)


@pytest.mark.parametrize("entry, value", [(6, 1 << 62), (5, -4), (6, 129), (5, 10 ** 9)])
def test_a_read_through_a_damaged_index_entry_raises_corrupted_record(tmp_path, entry, value):
    # A huge next entry asked for a buffer of that size (MemoryError); a negative one failed in os.pread.
    records = written_log(tmp_path, 20)
    _data_path, index_path = segment_paths(tmp_path)
    _set_index_entry(index_path, entry, value)
    log = open_log(tmp_path, local_low_water_mark=19)   # every entry trusted: recovery checks only the last
    try:
        with pytest.raises(CorruptedRecord, match="index entry of record %d .* is corrupted" % entry):
            log.read_records(5, 1)
        assert log.read_records(8, 12) == records[8:]
    finally:
        log.close()


def test_recovery_refuses_to_cut_a_damaged_record_the_last_checkpoint_synced(tmp_path):
    records = written_log(tmp_path, 1005)
    data_path, _index_path = segment_paths(tmp_path)
    flip_byte(data_path, record_offsets(records)[999] + 40)   # synced before record 1000 was written
    with pytest.raises(CorruptedRecord, match="record 999 .* but it was synced"):
        open_log(tmp_path)


@pytest.mark.parametrize("kept_entries", [0, 5, 19])
def test_recovery_rebuilds_a_short_index(tmp_path, kept_entries):
    records = written_log(tmp_path, 20)
    _data_path, index_path = segment_paths(tmp_path)
    os.truncate(index_path, 128 + 8 * kept_entries + 3)  # lost writes, with a torn last entry
    log = open_log(tmp_path)
    assert log.max_transaction_id == 19
    assert log.read_records(0, 100) == records
    assert read_index(index_path) == record_offsets(records)
    log.close()


def test_recovery_trims_an_index_longer_than_the_data(tmp_path):
    records = written_log(tmp_path, 20)
    data_path, index_path = segment_paths(tmp_path)
    os.truncate(data_path, record_offsets(records)[15])  # data writes of 15.. lost, index writes kept
    log = open_log(tmp_path)
    assert log.max_transaction_id == 14
    assert log.recovery.truncated_bytes == 0
    assert read_index(index_path) == record_offsets(records)[:15]
    assert log.read_record(15) is None
    log.close()


def test_recovery_with_garbage_index_entries_after_the_checkpoint(tmp_path):
    records = written_log(tmp_path, 1010)
    _data_path, index_path = segment_paths(tmp_path)
    with open(index_path, "r+b") as f:  # entries 1000.. were never synced: pretend they are zeros
        f.seek(128 + 8 * 1000)
        f.write(bytes(8 * 10))
    log = open_log(tmp_path)
    assert log.recovery.scan_from == 1000
    assert log.recovery.records_scanned == 10
    assert log.read_records(995, 20) == records[995:]
    assert read_index(index_path) == record_offsets(records)
    log.close()


def test_recovery_scans_from_the_local_low_water_mark_or_the_checkpoint(tmp_path):
    written_log(tmp_path, 1500)
    log = open_log(tmp_path, local_low_water_mark=1300)
    assert (log.recovery.scan_from, log.recovery.records_scanned) == (1301, 199)
    log.close()
    log = open_log(tmp_path, local_low_water_mark=200)
    assert (log.recovery.scan_from, log.recovery.records_scanned) == (1000, 500)
    log.close()
    # Files behind their control record (restored, or lost segments): the log would vote shorter than it was.
    with pytest.raises(CorruptedRecord, match="partition 3: the log ends at transaction 1499, below its local "
                                              "low-water mark 5000 .*refusing to open a shorter log"):
        open_log(tmp_path, local_low_water_mark=5000)


def test_a_data_file_ending_cleanly_before_its_last_trusted_record_fails_the_open(tmp_path):
    # Before: a data file that lost its tail at a record boundary opened with the shorter log (499), which the
    # replica then reported and voted with, although records up to 999 had been synced (checkpoint 1000).
    records = written_log(tmp_path, 1005)
    data_path, _index_path = segment_paths(tmp_path)
    os.truncate(data_path, record_offsets(records)[500])
    with pytest.raises(CorruptedRecord, match="the data ends after record 499, but records up to 999 were synced: "
                                              "damage or a lost tail; refusing to open a shorter log"):
        open_log(tmp_path)


def test_a_truncation_stopped_after_cutting_the_index_reopens_as_before_it(tmp_path, monkeypatch):
    # The index is cut first: a crash before the data file is cut leaves every record (an unacknowledged
    # truncation, as if it had not started), never an index longer than the data, which opens as damage.
    from waltz.storage import segment as segment_module
    records = written_log(tmp_path, 1500)
    log = open_log(tmp_path)
    cut_durably = segment_module.truncate_durably

    def crash_before_the_data_cut(fd, size, name):
        if name.endswith(".seg"):
            raise OSError(5, "the machine stopped here")
        cut_durably(fd, size, name)
    monkeypatch.setattr(segment_module, "truncate_durably", crash_before_the_data_cut)
    with pytest.raises(OSError):
        log.truncate(1200)
    monkeypatch.undo()
    data_path, index_path = segment_paths(tmp_path)
    assert len(read_index(index_path)) == 1201 and os.path.getsize(data_path) > record_offsets(records)[1201]
    log.close()
    log = open_log(tmp_path)
    assert log.max_transaction_id == 1499 and log.read_records(1195, 10) == records[1195:1205]
    log.truncate(1200)
    log.close()
    log = open_log(tmp_path)
    assert log.max_transaction_id == 1200 and os.path.getsize(data_path) == record_offsets(records)[1201]
    log.close()


@pytest.mark.parametrize("old_size, size, cuts", [
    (12_000, 5_000, [8192, 5000]),      # inside a page: first at that page's end, then exactly
    (10_000, 9_000, [9000]),            # inside the last page: nothing after it to keep from zeros
    (12_000, 8192, [8192]),             # on a page boundary: no page is zeroed
])
def test_a_durable_cut_never_zeroes_bytes_before_the_old_end_without_the_new_size(tmp_path, monkeypatch,
                                                                                  old_size, size, cuts):
    # Cutting inside a page zeroes the rest of it; a power loss could keep those zeros and not the new size,
    # and records still synced there (a truncation's kept index entries, say) would read as damage.
    from waltz.storage import fileio
    path = tmp_path / "f"
    path.write_bytes(b"x" * old_size)
    calls, ftruncate, datasync = [], os.ftruncate, fileio.datasync
    monkeypatch.setattr(fileio.os, "ftruncate", lambda fd, n: (calls.append(("cut", n)), ftruncate(fd, n))[1])
    monkeypatch.setattr(fileio, "datasync", lambda fd: (calls.append(("sync",)), datasync(fd))[1])
    fd = os.open(path, os.O_RDWR)
    try:
        fileio.truncate_durably(fd, size, str(path))
    finally:
        os.close(fd)
    assert calls == [step for cut in cuts for step in (("cut", cut), ("sync",))]
    assert path.read_bytes() == b"x" * size


def test_a_truncation_cuts_index_and_data_each_durably_index_first(tmp_path, monkeypatch):
    from waltz.storage import segment as segment_module
    written_log(tmp_path, 1500)
    log = open_log(tmp_path)
    cuts, cut_durably = [], segment_module.truncate_durably
    monkeypatch.setattr(segment_module, "truncate_durably",
                        lambda fd, size, name: (cuts.append(os.path.splitext(name)[1]), cut_durably(fd, size, name))[1])
    monkeypatch.setattr(index_module, "truncate_durably",
                        lambda fd, size, name: (cuts.append(os.path.splitext(name)[1]), cut_durably(fd, size, name))[1])
    log.truncate(1200)
    assert cuts == [".idx", ".seg"]
    log.close()


def test_recovery_syncs_the_records_it_scanned_before_indexing_them(tmp_path, monkeypatch):
    # An index entry at or above a checkpoint makes the records below it trusted at the next open: written
    # before those records were synced, a power loss could leave it pointing past the data's end.
    from waltz.storage import segment as segment_module
    records = written_log(tmp_path, 1005)
    _data_path, index_path = segment_paths(tmp_path)
    with open(index_path, "r+b") as f:
        f.truncate(128 + 8 * 990)       # the index lost its last entries: recovery rewrites them
    events, datasync, pwrite = [], segment_module.datasync, index_module.pwrite_all

    def data_sync(fd):
        events.append("data sync")
        return datasync(fd)

    def index_write(fd, data, offset):
        events.append("index write")
        return pwrite(fd, data, offset)
    monkeypatch.setattr(segment_module, "datasync", data_sync)
    monkeypatch.setattr(index_module, "pwrite_all", index_write)
    log = open_log(tmp_path)
    assert log.max_transaction_id == 1004 and read_index(index_path) == record_offsets(records)
    assert "index write" in events and events.index("data sync") < events.index("index write")
    log.close()


def test_recovery_rescans_everything_when_the_trusted_record_is_damaged(tmp_path):
    records = written_log(tmp_path, 1005)
    _data_path, index_path = segment_paths(tmp_path)
    with open(index_path, "r+b") as f:  # entry 999 (the last trusted one) points into a record
        f.seek(128 + 8 * 999)
        f.write(struct.pack(">q", record_offsets(records)[999] + 1))
    log = open_log(tmp_path)
    assert log.recovery.scan_from == 0
    assert log.max_transaction_id == 1004
    assert read_index(index_path) == record_offsets(records)
    log.close()


def test_recovery_recreates_a_missing_index(tmp_path):
    records = written_log(tmp_path, 8)
    _data_path, index_path = segment_paths(tmp_path)
    os.unlink(index_path)
    log = open_log(tmp_path)
    assert log.read_records(0, 10) == records
    assert read_index(index_path) == record_offsets(records)
    log.close()


def test_open_removes_leftovers_of_an_interrupted_segment_creation(tmp_path):
    written_log(tmp_path, 3)
    directory = partition_directory(str(tmp_path), PARTITION)
    for name in ("0000000000000000003.seg.tmp", "0000000000000000003.idx"):
        with open(os.path.join(directory, name), "wb") as f:
            f.write(b"partial")
    log = open_log(tmp_path)
    assert sorted(os.listdir(directory)) == ["0000000000000000000.idx", "0000000000000000000.seg"]
    assert log.max_transaction_id == 2
    log.close()


# -- reads never return damaged data ---------------------------------------------------------------

def test_reading_a_damaged_record_raises(tmp_path):
    records = written_log(tmp_path, 10)
    log = open_log(tmp_path)
    data_path, _index_path = segment_paths(tmp_path)
    with open(data_path, "r+b") as f:  # damaged after recovery, while the log is open
        f.seek(record_offsets(records)[4] + 38)
        f.write(b"\xff")
    assert log.read_records(0, 4) == records[:4]
    with pytest.raises(CorruptedRecord, match="record 4 at offset .*checksum mismatch"):
        log.read_record(4)
    with pytest.raises(CorruptedRecord):
        log.read_headers(2, 5)
    assert log.read_records(5, 10) == records[5:]
    log.close()


def test_reading_through_a_wrong_index_entry_raises(tmp_path):
    records = written_log(tmp_path, 10)
    log = open_log(tmp_path)
    _data_path, index_path = segment_paths(tmp_path)
    with open(index_path, "r+b") as f:
        f.seek(128 + 8 * 6)
        f.write(struct.pack(">q", record_offsets(records)[5]))
    with pytest.raises(CorruptedRecord, match="record 6"):
        log.read_record(6)
    log.close()
