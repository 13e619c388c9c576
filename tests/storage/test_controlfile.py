"""The control file: layout, alternating durable writes, rollback on a torn struct, locking."""

import os
import struct
import uuid

import pytest

from waltz.protocols.values import checksum
from waltz.storage.controlfile import (
    CONTROL_FILE_NAME, HEADER_SIZE, PARTITION_INFO_SIZE, STRUCT_SIZE, ControlFile, PartitionFlags, PartitionInfo,
)
from waltz.storage.errors import (
    ControlFileError, ControlFileMismatch, PartitionInfoCorrupted, StorageDirectoryInUse, SyncFailed,
    UnknownPartition,
)

KEY = uuid.UUID("12345678-1234-5678-1234-567812345678")


def fixed_clock():
    return 1_700_000_000.123


@pytest.fixture
def control(tmp_path):
    control = ControlFile.create(str(tmp_path), KEY, 3, clock=fixed_clock)
    yield control
    control.close()


def struct_offset(partition_id, slot):
    return HEADER_SIZE + PARTITION_INFO_SIZE * partition_id + 4 + STRUCT_SIZE * slot


def flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        value = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([value ^ 0xFF]))


def test_layout_is_header_then_76_byte_partition_records_then_32_byte_fences(control, tmp_path):
    raw = (tmp_path / CONTROL_FILE_NAME).read_bytes()
    assert len(raw) == 128 + 3 * 76 + 3 * 32
    version, created, key, num_partitions = struct.unpack_from(">iq16si", raw)
    assert (version, created, uuid.UUID(bytes=key), num_partitions) == (0, 1_700_000_000_123, KEY, 3)
    assert raw[32:128] == bytes(96)
    record = raw[128 + 76:128 + 2 * 76]
    assert struct.unpack_from(">i", record)[0] == 1
    for slot, seq in ((0, -1), (1, 0)):
        body = record[4 + 36 * slot:4 + 36 * slot + 32]
        assert struct.unpack(">qqqii", body) == (-1, -1, -1, 1, seq)
        assert struct.unpack_from(">i", record, 4 + 36 * slot + 32)[0] == checksum(body)
    fence = raw[128 + 3 * 76 + 32:128 + 3 * 76 + 64]
    for slot, seq in ((0, -1), (1, 0)):
        body = fence[16 * slot:16 * slot + 12]
        assert struct.unpack(">qi", body) == (-1, seq)
        assert struct.unpack_from(">i", fence, 16 * slot + 12)[0] == checksum(body)


def fence_offset(partition_id, slot):
    return HEADER_SIZE + PARTITION_INFO_SIZE * 3 + 32 * partition_id + 16 * slot


def test_a_session_fence_is_durable_alternates_slots_and_never_goes_back(control, tmp_path):
    assert [control.session_fence(p) for p in range(3)] == [-1, -1, -1]
    assert control.raise_session_fence(1, 5) == 5
    assert control.raise_session_fence(1, 4) == 5          # not higher: nothing written
    assert control.raise_session_fence(1, 7) == 7
    control.close()
    raw = (tmp_path / CONTROL_FILE_NAME).read_bytes()
    slots = [struct.unpack_from(">qi", raw, fence_offset(1, slot)) for slot in (0, 1)]
    assert slots == [(5, 1), (7, 2)]
    with ControlFile.open(str(tmp_path)) as reopened:
        assert [reopened.session_fence(p) for p in range(3)] == [-1, 7, -1]
        assert reopened.partition_info(1).session_id == -1  # the partition's session info is another matter


def test_a_torn_fence_slot_rolls_back_and_a_fence_without_valid_slot_reads_as_none(control, tmp_path):
    control.raise_session_fence(0, 3)      # slot 0, seq 1
    control.raise_session_fence(0, 4)      # slot 1, seq 2
    control.raise_session_fence(2, 9)
    control.close()
    path = str(tmp_path / CONTROL_FILE_NAME)
    flip_byte(path, fence_offset(0, 1) + 2)
    flip_byte(path, fence_offset(2, 0) + 2)
    flip_byte(path, fence_offset(2, 1) + 13)
    with ControlFile.open(str(tmp_path)) as reopened:
        assert reopened.session_fence(0) == 3
        assert reopened.session_fence(2) == -1
        assert reopened.raise_session_fence(2, 10) == 10
    with ControlFile.open(str(tmp_path)) as again:
        assert again.session_fence(2) == 10


def test_a_control_file_from_before_fences_gets_them_when_opened_for_writing(control, tmp_path):
    control.update_partition_info(1, session_id=6, low_water_mark=60)
    control.close()
    path = tmp_path / CONTROL_FILE_NAME
    os.truncate(path, 128 + 3 * 76)
    with ControlFile.open(str(tmp_path), read_only=True) as tool:
        assert tool.session_fence(1) == -1 and os.path.getsize(path) == 128 + 3 * 76
    with ControlFile.open(str(tmp_path), KEY, 3) as reopened:
        assert os.path.getsize(path) == 128 + 3 * 76 + 3 * 32
        assert reopened.partition_info(1).session_id == 6 and reopened.session_fence(1) == -1
        reopened.raise_session_fence(1, 8)
    with ControlFile.open(str(tmp_path)) as again:
        assert again.session_fence(1) == 8


def test_create_then_open_round_trip(control, tmp_path):
    control.update_partition_info(2, session_id=7, low_water_mark=100, local_low_water_mark=90)
    control.close()
    with ControlFile.open(str(tmp_path), KEY, 3) as reopened:
        assert reopened.key == KEY
        assert reopened.num_partitions == 3
        assert reopened.creation_time_ms == 1_700_000_000_123
        assert reopened.partition_info(0) == PartitionInfo(0, -1, -1, -1, PartitionFlags.AVAILABLE)
        assert reopened.partition_info(2) == PartitionInfo(2, 7, 100, 90, PartitionFlags.AVAILABLE)


def test_writes_alternate_between_the_two_structs_with_increasing_seq_no(control):
    seen = []
    for session in range(1, 5):
        control.update_partition_info(1, session_id=session)
        seen.append([(s.seq_no, s.session_id) for s in control.partition_structs(1)])
    assert seen == [
        [(1, 1), (0, -1)],
        [(1, 1), (2, 2)],
        [(3, 3), (2, 2)],
        [(3, 3), (4, 4)],
    ]
    assert control.partition_info(0).session_id == -1  # neighbours untouched


def test_corrupt_newest_struct_rolls_back_to_the_other(control, tmp_path):
    control.update_partition_info(1, session_id=1, low_water_mark=10)   # slot 0, seq 1
    control.update_partition_info(1, session_id=2, low_water_mark=20)   # slot 1, seq 2 (newest)
    control.close()
    flip_byte(str(tmp_path / CONTROL_FILE_NAME), struct_offset(1, 1) + 5)
    with ControlFile.open(str(tmp_path)) as reopened:
        assert reopened.partition_info(1).session_id == 1
        assert reopened.partition_info(1).low_water_mark == 10
        # the next write goes over the damaged struct and wins again
        reopened.update_partition_info(1, session_id=3)
        assert [s.valid for s in reopened.partition_structs(1)] == [True, True]
    with ControlFile.open(str(tmp_path)) as again:
        assert again.partition_info(1).session_id == 3
        assert again.partition_info(1).low_water_mark == 10


def test_both_structs_corrupted_fails_only_that_partition(control, tmp_path):
    control.close()
    path = str(tmp_path / CONTROL_FILE_NAME)
    flip_byte(path, struct_offset(2, 0) + 1)
    flip_byte(path, struct_offset(2, 1) + 33)  # in the crc itself
    with ControlFile.open(str(tmp_path)) as reopened:
        with pytest.raises(PartitionInfoCorrupted, match="partition 2") as caught:
            reopened.partition_info(2)
        assert caught.value.partition_id == 2
        with pytest.raises(PartitionInfoCorrupted):
            reopened.update_partition_info(2, session_id=1)
        assert reopened.partition_info(0).session_id == -1
        assert reopened.update_partition_info(1, session_id=9).session_id == 9
        assert reopened.reset_partition_info(2) == PartitionInfo(2)  # an explicit reset repairs it


def test_a_reset_writes_one_struct_so_a_torn_write_leaves_the_other(control):
    control.update_partition_info(1, session_id=5, low_water_mark=50)        # slot 0, seq 1
    assert control.reset_partition_info(1) == PartitionInfo(1)
    # The reset went to the other struct with the next sequence number; the previous state is intact
    # beside it, so a write torn half-way still leaves one valid struct.
    assert [(s.valid, s.seq_no, s.session_id) for s in control.partition_structs(1)] == [
        (True, 1, 5), (True, 2, -1)]


def test_a_failed_fdatasync_makes_the_control_file_refuse_writes(control, monkeypatch):
    # The kernel reports the error once; the page cache then holds a state that may not be on disk.
    import waltz.storage.controlfile as controlfile_module

    def failing_datasync(fd):
        raise OSError(5, "Input/output error")
    monkeypatch.setattr(controlfile_module, "datasync", failing_datasync)
    with pytest.raises(SyncFailed, match="Input/output error"):
        control.update_partition_info(0, session_id=1)
    monkeypatch.undo()
    assert control.partition_info(0).session_id == -1 and control.sync_failure is not None
    for attempt in (lambda: control.update_partition_info(1, session_id=2), lambda: control.reset_partition_info(2)):
        with pytest.raises(SyncFailed, match="restart the storage node"):
            attempt()


def test_wrong_partition_id_field_is_corruption(control, tmp_path):
    control.close()
    with open(str(tmp_path / CONTROL_FILE_NAME), "r+b") as f:
        f.seek(HEADER_SIZE + PARTITION_INFO_SIZE)
        f.write(struct.pack(">i", 7))
    with ControlFile.open(str(tmp_path)) as reopened:
        with pytest.raises(PartitionInfoCorrupted, match="names partition 7"):
            reopened.partition_info(1)


def test_key_and_partition_count_mismatch_name_both_values(control, tmp_path):
    control.close()
    other = uuid.UUID(int=1)
    with pytest.raises(ControlFileMismatch) as caught:
        ControlFile.open(str(tmp_path), other, 4)
    message = str(caught.value)
    assert str(KEY) in message and str(other) in message
    assert "3 partitions (expected 4)" in message
    with pytest.raises(ControlFileMismatch, match="3 partitions"):
        ControlFile.open_or_create(str(tmp_path), KEY, 5)


def test_second_opener_is_refused_by_the_lock(control, tmp_path):
    with pytest.raises(StorageDirectoryInUse, match="in use by another process"):
        ControlFile.open(str(tmp_path))
    with pytest.raises(StorageDirectoryInUse):
        ControlFile.open(str(tmp_path), read_only=True)
    control.close()
    with ControlFile.open(str(tmp_path), read_only=True) as reader1, \
            ControlFile.open(str(tmp_path), read_only=True) as reader2:
        assert reader1.key == reader2.key == KEY  # readers share
        with pytest.raises(StorageDirectoryInUse):
            ControlFile.open(str(tmp_path))


def test_flags_default_and_toggles(control):
    info = control.partition_info(0)
    assert info.available and not info.assigned and info.readable and info.writable
    control.set_flag(0, PartitionFlags.ASSIGNED, True)
    info = control.set_flag(0, PartitionFlags.UNWRITABLE, True)
    assert info.assigned and info.readable and not info.writable
    assert info.flags == PartitionFlags.AVAILABLE | PartitionFlags.ASSIGNED | PartitionFlags.UNWRITABLE
    info = control.set_flag(0, PartitionFlags.AVAILABLE, False)
    assert not info.available and info.assigned


def test_create_refuses_an_existing_file_and_open_or_create_reopens(control, tmp_path):
    with pytest.raises(ControlFileError, match="already exists"):
        ControlFile.create(str(tmp_path), KEY, 3)
    control.close()
    with ControlFile.open_or_create(str(tmp_path), KEY, 3) as reopened:
        assert reopened.creation_time_ms == 1_700_000_000_123
    assert sorted(os.listdir(str(tmp_path))) == [CONTROL_FILE_NAME]  # no temporary file left


def test_open_or_create_formats_a_new_directory(tmp_path):
    directory = str(tmp_path / "new" / "storage")
    with ControlFile.open_or_create(directory, KEY, 2) as control:
        assert control.num_partitions == 2
        assert control.partition_info(1) == PartitionInfo(1)


def test_missing_truncated_and_bad_version_files(tmp_path):
    with pytest.raises(ControlFileError, match="no control file"):
        ControlFile.open(str(tmp_path))
    ControlFile.create(str(tmp_path), KEY, 2).close()
    path = str(tmp_path / CONTROL_FILE_NAME)
    with open(path, "r+b") as f:
        f.truncate(HEADER_SIZE + PARTITION_INFO_SIZE + 10)
    with pytest.raises(ControlFileError, match="truncated"):
        ControlFile.open(str(tmp_path))
    with open(path, "r+b") as f:
        f.write(struct.pack(">i", 3))
    with pytest.raises(ControlFileError, match="format version 3"):
        ControlFile.open(str(tmp_path))


def test_unknown_partition_and_read_only_updates(control, tmp_path):
    with pytest.raises(UnknownPartition, match="partition 3 does not exist"):
        control.partition_info(3)
    control.close()
    with ControlFile.open(str(tmp_path), read_only=True) as reader:
        with pytest.raises(Exception, match="read-only"):
            reader.update_partition_info(0, session_id=1)


def test_an_open_for_writing_removes_what_a_crash_during_create_left(tmp_path):
    ControlFile.create(str(tmp_path), KEY, 2).close()
    leftover = tmp_path / (CONTROL_FILE_NAME + ".x1y2z3.tmp")     # as mkstemp names them
    leftover.write_bytes(b"half a control file")
    unrelated = tmp_path / "notes.tmp"
    unrelated.write_bytes(b"")
    ControlFile.open(str(tmp_path), read_only=True).close()
    assert leftover.exists(), "a read-only open changes nothing"
    ControlFile.open(str(tmp_path)).close()
    assert not leftover.exists() and unrelated.exists()
