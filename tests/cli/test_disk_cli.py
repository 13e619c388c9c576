"""``waltz disk``: dump and verify storage files offline."""

import argparse
import os
import struct
import subprocess
import sys
import uuid

import pytest

from waltz.cli import disk
from waltz.cli.common import CliError
from waltz.storage.controlfile import CONTROL_FILE_NAME, HEADER_SIZE, PARTITION_INFO_SIZE, ControlFile, PartitionFlags
from waltz.storage.partition_log import PartitionLog, partition_directory
from waltz.storage.segment import RECORD_OVERHEAD, data_file_name, index_file_name

from tests.storage.test_segment import make_records

KEY = uuid.UUID("5e0f2a5c-1111-4222-8333-944455556666")


def run(*argv):
    """Parse ``waltz <argv>`` with only the disk commands registered and run it."""
    parser = argparse.ArgumentParser(prog="waltz")
    disk.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(list(argv))
    return args.func(args)


@pytest.fixture
def storage(tmp_path):
    """A storage directory with 2 partitions; partition 1 holds records 0..29 in segments 0, 10, 20."""
    directory = str(tmp_path / "storage")
    with ControlFile.create(directory, KEY, 2, clock=lambda: 1_600_000_000) as control:
        control.update_partition_info(1, session_id=4, low_water_mark=29, local_low_water_mark=29)
        control.set_flag(1, PartitionFlags.ASSIGNED, True)
        control.raise_session_fence(1, 6)
    records = make_records(0, 30, size=20)
    log = PartitionLog.open(directory, KEY, 1, segment_size_threshold=128 + 9 * (RECORD_OVERHEAD + 20))
    log.append(records)
    assert log.segment_ids == (0, 10, 20)
    log.close()
    return directory


def segment_file(storage, first=0, partition=1):
    return os.path.join(partition_directory(storage, partition), data_file_name(first))


def record_offset(i):
    return 128 + i * (RECORD_OVERHEAD + 20)


def patch_file(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


# -- dump-control-file -----------------------------------------------------------------------------

def test_dump_control_file(storage, capsys):
    assert run("disk", "dump-control-file", "--dir", storage) == 0
    out = capsys.readouterr().out
    assert "version 0, created 2020-09-13T12:26:40.000+00:00, cluster key %s, 2 partitions" % KEY in out
    assert "partition 0: session -1, lwm -1, local lwm -1, flags AVAILABLE (1)" in out
    assert "partition 1: session 4, lwm 29, local lwm 29, flags AVAILABLE|ASSIGNED (5)" in out
    assert "struct 0: seq 1, session 4, lwm 29, local lwm 29, flags AVAILABLE (1)" in out
    assert "struct 1: seq 2, session 4, lwm 29, local lwm 29, flags AVAILABLE|ASSIGNED (5)" in out
    assert "  session fence: 6 (the highest session adopted)" in out
    assert "  session fence: -1 (the highest session adopted)" in out      # partition 0
    assert "BAD" not in out


def test_dump_control_file_shows_corrupted_structs(storage, capsys):
    path = os.path.join(storage, CONTROL_FILE_NAME)
    for slot in (0, 1):
        patch_file(path, HEADER_SIZE + PARTITION_INFO_SIZE + 4 + 36 * slot + 32, b"\0\0\0\0")
    assert run("disk", "dump-control-file", "--dir", storage) == 0
    out = capsys.readouterr().out
    assert "partition 1: CORRUPTED: partition 1's info in control file" in out
    assert out.count("BAD") == 2
    assert "partition 0: session -1" in out


def test_every_disk_command_refuses_a_directory_in_use(storage):
    # The segment commands used to read a running node's files, and could report damage that was not there
    # (the index read before the data while appends went on).
    with ControlFile.open(storage):
        for argv in (("dump-control-file", "--dir", storage), ("segment-stats", "--dir", storage),
                     ("verify-segment", "--file", segment_file(storage, 0)),
                     ("dump-segment", "--file", segment_file(storage, 0))):
            with pytest.raises(CliError, match="in use by another process: stop the storage daemon first"):
                run("disk", *argv)


def test_dump_control_file_errors(tmp_path):
    with pytest.raises(CliError, match="no such directory"):
        run("disk", "dump-control-file", "--dir", str(tmp_path / "missing"))
    with pytest.raises(CliError, match="no control file"):
        run("disk", "dump-control-file", "--dir", str(tmp_path))


# -- dump-segment ----------------------------------------------------------------------------------

def test_dump_segment(storage, capsys):
    assert run("disk", "dump-segment", "--file", segment_file(storage, 10)) == 0
    out = capsys.readouterr().out
    assert "partition 1, first transaction 10" in out
    assert "index 10 entries (transactions 10..19)" in out
    lines = [line for line in out.splitlines() if line.startswith("txn ")]
    assert [int(line.split()[1].rstrip(":")) for line in lines] == list(range(10, 20))
    assert lines[0].startswith("txn 10: offset 128, size 60, reqId (client 11, generation 2, partition 3, seq 10), "
                               "header 30, data 20 bytes, data crc")
    assert "data: " not in out


def test_dump_segment_from_count_and_data(storage, capsys):
    assert run("disk", "dump-segment", "--file", segment_file(storage, 10), "--from", "13", "--count", "2",
               "--data") == 0
    out = capsys.readouterr().out
    assert [line.split(":")[0] for line in out.splitlines() if line.startswith("txn ")] == ["txn 13", "txn 14"]
    assert "  data: %r" % make_records(13, 1, size=20)[0].data in out


def test_dump_segment_stops_at_a_bad_record(storage, capsys):
    path = segment_file(storage, 0)
    patch_file(path, record_offset(3) + 45, b"!")
    assert run("disk", "dump-segment", "--file", path) == 1
    out = capsys.readouterr().out
    assert [line.split(":")[0] for line in out.splitlines() if line.startswith("txn ")] == ["txn 0", "txn 1",
                                                                                         "txn 2"]
    assert "STOPPED: record 3 at offset %d: record checksum mismatch" % record_offset(3) in out


# -- verify-segment --------------------------------------------------------------------------------

def test_verify_segment_ok(storage, capsys):
    assert run("disk", "verify-segment", "--file", segment_file(storage, 20)) == 0
    assert "OK, 10 records (transactions 20..29)" in capsys.readouterr().out


def test_verify_segment_reports_a_bad_crc(storage):
    path = segment_file(storage, 0)
    patch_file(path, record_offset(7) + 40, b"?")
    with pytest.raises(CliError, match="record 7 at offset %d: record checksum mismatch" % record_offset(7)):
        run("disk", "verify-segment", "--file", path)


def test_verify_segment_reports_a_transaction_out_of_sequence(storage):
    path = segment_file(storage, 0)
    patch_file(path, record_offset(4), struct.pack(">q", 99))
    with pytest.raises(CliError, match="record 4 at offset .*: transaction id 99 where 4 was expected"):
        run("disk", "verify-segment", "--file", path)


def test_verify_segment_reports_a_partial_record(storage):
    path = segment_file(storage, 0)
    os.truncate(path, record_offset(9) + 10)
    with pytest.raises(CliError, match="record 9 at offset .*: truncated record header"):
        run("disk", "verify-segment", "--file", path)


def test_verify_segment_reports_index_problems(storage):
    index_path = os.path.join(partition_directory(storage, 1), index_file_name(10))
    patch_file(index_path, 128 + 8 * 2, struct.pack(">q", 5))
    with pytest.raises(CliError, match="index entry of record 12 says offset 5, the record is at %d"
                       % record_offset(2)):
        run("disk", "verify-segment", "--file", segment_file(storage, 10))
    os.truncate(index_path, 128 + 8 * 2)
    with pytest.raises(CliError, match="index has 2 entries but the data file holds more records"):
        run("disk", "verify-segment", "--file", segment_file(storage, 10))


def test_verify_segment_errors_for_missing_or_misnamed_files(storage, tmp_path):
    with pytest.raises(CliError, match="no such file: .*missing.seg"):
        run("disk", "verify-segment", "--file", str(tmp_path / "missing.seg"))
    other = tmp_path / "notes.txt"
    other.write_text("hello")
    with pytest.raises(CliError, match="not a segment data file"):
        run("disk", "verify-segment", "--file", str(other))
    os.unlink(os.path.join(partition_directory(storage, 1), index_file_name(0)))
    with pytest.raises(CliError, match="index file .* does not exist"):
        run("disk", "verify-segment", "--file", segment_file(storage, 0))


# -- segment-stats ---------------------------------------------------------------------------------

def test_segment_stats(storage, capsys):
    assert run("disk", "segment-stats", "--dir", storage) == 0
    out = capsys.readouterr().out
    assert "partition 1: 3 segments, 30 records, transactions 0..29, %d bytes" % (3 * (128 + 600 + 128 + 80)) in out
    assert "  0000000000000000010                   19         10            728          208" in out
    run("disk", "segment-stats", "--dir", storage, "--partition", "1")
    assert capsys.readouterr().out.startswith("partition 1: 3 segments")
    with pytest.raises(CliError, match="partition 0 has no directory"):
        run("disk", "segment-stats", "--dir", storage, "--partition", "0")


# -- the real command ------------------------------------------------------------------------------

def test_waltz_disk_command_as_a_subprocess(storage):
    command = [sys.executable, "-m", "waltz.cli.main", "disk"]
    ok = subprocess.run(command + ["verify-segment", "--file", segment_file(storage, 0)],
                        capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0, ok.stderr
    assert "OK, 10 records" in ok.stdout
    patch_file(segment_file(storage, 0), record_offset(1) + 50, b"#")
    bad = subprocess.run(command + ["verify-segment", "--file", segment_file(storage, 0)],
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 1
    assert bad.stderr.startswith("waltz: error: segment ") and "record 1 at offset" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
    missing = subprocess.run(command + ["dump-control-file", "--dir", storage + "-nope"],
                             capture_output=True, text=True, timeout=30)
    assert (missing.returncode, missing.stderr.strip()) == (1, "waltz: error: no such directory: %s-nope" % storage)
