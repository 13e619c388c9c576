"""``waltz disk``: inspect a storage directory's files while no storage daemon runs.

Subcommands:

* ``dump-control-file --dir D``: header and both control structs of every partition;
* ``dump-segment --file F.seg [--from N] [--count K] [--data]``: a segment's header and records;
* ``verify-segment --file F.seg``: every record's CRCs, the transaction id sequence and the
  index; exit status 1 with the first problem found;
* ``segment-stats --dir D [--partition P]``: segments, records, bytes, first/last transaction.

Everything is opened read-only and nothing is repaired: recovery is the daemon's job.
"""

import contextlib
import datetime
import os
from contextlib import closing

from waltz.cli.common import CliError, non_negative_int
from waltz.storage.controlfile import ControlFile, PartitionFlags, shared_directory_lock
from waltz.storage.errors import StorageDirectoryInUse, StorageError
from waltz.storage.index import FILE_HEADER_SIZE
from waltz.storage.segment import RecordScanner, Segment, list_segments, parse_data_file_name


def register(subparsers):
    """Add the ``disk`` command and its subcommands."""
    parser = subparsers.add_parser("disk", help="inspect storage files (control file, segments) offline",
                                   description="Inspect a storage directory's files while no storage daemon runs. "
                                               "Everything is opened read-only; nothing is repaired.")
    commands = parser.add_subparsers(dest="disk_command", metavar="SUBCOMMAND")
    commands.required = True

    dump_control = commands.add_parser("dump-control-file", help="print the control file of a storage directory")
    dump_control.add_argument("--dir", required=True, help="the storage directory (storage.directory)")
    dump_control.set_defaults(func=run_dump_control_file)

    dump_segment = commands.add_parser("dump-segment", help="print a segment's header and records")
    dump_segment.add_argument("--file", required=True, help="the segment data file (.seg)")
    dump_segment.add_argument("--from", dest="from_txn", type=non_negative_int, default=None, metavar="N",
                              help="first transaction id to print (default: the segment's first)")
    dump_segment.add_argument("--count", type=non_negative_int, default=None, metavar="K",
                              help="print at most K records (default: all)")
    dump_segment.add_argument("--data", action="store_true", help="also print each record's data")
    dump_segment.set_defaults(func=run_dump_segment)

    verify = commands.add_parser("verify-segment",
                                 help="check a segment's record CRCs, transaction sequence and index")
    verify.add_argument("--file", required=True, help="the segment data file (.seg)")
    verify.set_defaults(func=run_verify_segment)

    stats = commands.add_parser("segment-stats", help="segments, records and bytes per partition")
    stats.add_argument("--dir", required=True, help="the storage directory (storage.directory)")
    stats.add_argument("--partition", type=non_negative_int, default=None, metavar="P", help="only this partition")
    stats.set_defaults(func=run_segment_stats)


# -- dump-control-file -----------------------------------------------------------------------------

def run_dump_control_file(args) -> int:
    """Print the control file's header and, per partition, the current state and both structs."""
    _require_directory(args.dir)
    try:
        control = ControlFile.open(args.dir, read_only=True)
    except StorageDirectoryInUse as exc:
        raise CliError("%s: stop the storage daemon first" % exc) from None
    except StorageError as exc:
        raise CliError(str(exc)) from None
    with control:
        header = control.header
        print("control file %s" % control.path)
        print("  version %d, created %s, cluster key %s, %d partitions"
              % (header.version, _format_time(header.creation_time_ms), header.key, header.num_partitions))
        for pid in range(control.num_partitions):
            _print_partition(control, pid)
    return 0


def _print_partition(control, pid: int) -> None:
    try:
        info = control.partition_info(pid)
    except StorageError as exc:
        print("partition %d: CORRUPTED: %s" % (pid, exc))
    else:
        print("partition %d: session %d, lwm %d, local lwm %d, flags %s"
              % (pid, info.session_id, info.low_water_mark, info.local_low_water_mark, format_flags(info.flags)))
    stored_id = control.stored_partition_id(pid)
    if stored_id != pid:
        print("  partition id field: %d (expected %d)" % (stored_id, pid))
    for slot, struct in enumerate(control.partition_structs(pid)):
        print("  struct %d: seq %d, session %d, lwm %d, local lwm %d, flags %s, crc %d %s"
              % (slot, struct.seq_no, struct.session_id, struct.low_water_mark, struct.local_low_water_mark,
                 format_flags(struct.flags), struct.crc, "ok" if struct.valid else "BAD"))
    print("  session fence: %d (the highest session adopted)" % control.session_fence(pid))


def format_flags(flags: int) -> str:
    """``AVAILABLE|ASSIGNED (5)``; unknown bits are shown in hex."""
    names = [flag.name for flag in PartitionFlags if flags & flag]
    unknown = flags & ~sum(PartitionFlags)
    if unknown:
        names.append("0x%x" % unknown)
    return "%s (%d)" % ("|".join(names) or "none", flags)


# -- dump-segment ----------------------------------------------------------------------------------

def run_dump_segment(args) -> int:
    """Print a segment's header and its records from ``--from``; status 1 if a bad record stops it."""
    with _segment_of(args.file) as segment:
        _print_segment_header(segment)
        first = segment.first_transaction_id
        start_txn = first if args.from_txn is None else max(args.from_txn, first)
        scanner = _scanner_from(segment, start_txn)
        printed = 0
        for scanned in scanner:
            if scanned.record.transaction_id < start_txn:
                continue
            if args.count is not None and printed >= args.count:
                break
            _print_record(scanned, args.data)
            printed += 1
        else:
            if scanner.problem:
                print("STOPPED: %s" % scanner.problem)
                return 1
    return 0


def _scanner_from(segment: Segment, start_txn: int) -> RecordScanner:
    """A scanner positioned by the index at ``start_txn`` when the index entry checks out."""
    i = start_txn - segment.first_transaction_id
    offsets = segment.index_offsets(i, 1) if i > 0 else []
    if offsets:
        probe = RecordScanner(segment.data_path, offsets[0], start_txn)
        if next(iter(probe), None) is not None:
            return RecordScanner(segment.data_path, offsets[0], start_txn)
    return RecordScanner(segment.data_path, FILE_HEADER_SIZE, segment.first_transaction_id)


def _print_segment_header(segment: Segment) -> None:
    header = segment.header
    print("segment %s" % segment.data_path)
    print("  version %d, created %s, cluster key %s, partition %d, first transaction %d"
          % (header.version, _format_time(header.creation_time_ms), header.key, header.partition_id,
             header.first_transaction_id))
    print("  data file %d bytes, index %d entries (transactions %d..%d)"
          % (segment.data_size, segment.record_count, segment.first_transaction_id, segment.max_transaction_id))


def _print_record(scanned, with_data: bool) -> None:
    record = scanned.record
    rid = record.req_id
    print("txn %d: offset %d, size %d, reqId (client %d, generation %d, partition %d, seq %d), header %d, "
          "data %d bytes, data crc %d"
          % (record.transaction_id, scanned.offset, scanned.size, rid.client_id, rid.generation,
             rid.partition_id, rid.seq_num, record.header, len(record.data), record.checksum))
    if with_data:
        print("  data: %r" % (record.data,))


# -- verify-segment --------------------------------------------------------------------------------

def run_verify_segment(args) -> int:
    """Check every record and index entry; :class:`CliError` (status 1) names the first problem."""
    with _segment_of(args.file) as segment:
        problem, records = verify_segment(segment)
    if problem:
        raise CliError("segment %s: %s" % (args.file, problem))
    last = segment.first_transaction_id + records - 1
    print("segment %s: OK, %d records (transactions %d..%d), %d bytes"
          % (args.file, records, segment.first_transaction_id, last, segment.data_size))
    return 0


def verify_segment(segment: Segment):
    """``(first problem or None, number of good records)`` for an open segment."""
    partition_dir = os.path.basename(os.path.dirname(os.path.abspath(segment.data_path)))
    if partition_dir.isdigit() and int(partition_dir) != segment.header.partition_id:
        return ("header says partition %d but the file is in directory %s"
                % (segment.header.partition_id, partition_dir)), 0
    index = segment.index_offsets()
    scanner = RecordScanner(segment.data_path, FILE_HEADER_SIZE, segment.first_transaction_id, check_data_crc=True)
    count = 0
    for scanned in scanner:
        if count >= len(index):
            return ("index has %d entries but the data file holds more records (record %d at offset %d)"
                    % (len(index), scanned.record.transaction_id, scanned.offset)), count
        if index[count] != scanned.offset:
            return ("index entry of record %d says offset %d, the record is at %d"
                    % (scanned.record.transaction_id, index[count], scanned.offset)), count
        count += 1
    if scanner.problem:
        return scanner.problem, count
    if count != len(index):
        return "index has %d entries but the data file holds %d records" % (len(index), count), count
    return None, count


# -- segment-stats ---------------------------------------------------------------------------------

def run_segment_stats(args) -> int:
    """Print, per partition, each segment's transactions, record count and file sizes (from the index)."""
    _require_directory(args.dir)
    if args.partition is None:
        partitions = sorted(int(name) for name in os.listdir(args.dir)
                            if name.isdigit() and os.path.isdir(os.path.join(args.dir, name)))
    else:
        if not os.path.isdir(os.path.join(args.dir, str(args.partition))):
            raise CliError("partition %d has no directory in %s" % (args.partition, args.dir))
        partitions = [args.partition]
    if not partitions:
        print("no partition directories in %s" % args.dir)
    with _node_stopped(args.dir):
        for pid in partitions:
            _print_partition_stats(os.path.join(args.dir, str(pid)), pid)
    return 0


def _print_partition_stats(partition_dir: str, pid: int) -> None:
    rows, records, data_bytes, first, last = [], 0, 0, None, None
    for first_txn in list_segments(partition_dir):
        try:
            segment = Segment.open(partition_dir, first_txn, partition_id=pid, read_only=True)
        except StorageError as exc:
            rows.append("  %019d  ERROR: %s" % (first_txn, exc))
            continue
        with closing(segment):
            rows.append("  %019d  %19d  %9d  %13d  %11d" % (first_txn, segment.max_transaction_id,
                                                          segment.record_count, segment.data_size,
                                                          segment.index_size))
            records += segment.record_count
            data_bytes += segment.data_size + segment.index_size
            if segment.record_count:
                first = segment.first_transaction_id if first is None else first
                last = segment.max_transaction_id
    span = "transactions %d..%d" % (first, last) if first is not None else "no transactions"
    print("partition %d: %d segments, %d records, %s, %d bytes" % (pid, len(rows), records, span, data_bytes))
    if rows:
        print("  %-19s  %19s  %9s  %13s  %11s" % ("first", "last", "records", "data bytes", "index bytes"))
        for row in rows:
            print(row)


# -- helpers ---------------------------------------------------------------------------------------

def _require_directory(path: str) -> None:
    if not os.path.isdir(path):
        raise CliError("no such directory: %s" % path)


@contextlib.contextmanager
def _node_stopped(directory):
    """The block runs while no storage node holds ``directory`` (its files would change under the tool,
    which could then report damage that is not there)."""
    try:
        with shared_directory_lock(directory):
            yield
    except StorageDirectoryInUse as exc:
        raise CliError("%s: stop the storage daemon first" % exc) from None


def _storage_directory_of(segment_path):
    """The storage directory of a segment file (``<dir>/<partition>/<id>.seg``)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(segment_path)))


@contextlib.contextmanager
def _segment_of(path):
    """The segment file at ``path``, open (read-only) for the block, while no storage node runs on it."""
    with _node_stopped(_storage_directory_of(path)):
        segment = _open_segment(path)
        with closing(segment):
            yield segment


def _open_segment(path: str) -> Segment:
    if not os.path.isfile(path):
        raise CliError("no such file: %s" % path)
    first = parse_data_file_name(path)
    if first is None:
        raise CliError("%s is not a segment data file (expected a name like 0000000000000000000.seg)" % path)
    try:
        return Segment.open(os.path.dirname(os.path.abspath(path)), first, read_only=True)
    except StorageError as exc:
        raise CliError(str(exc)) from None


def _format_time(ms: int) -> str:
    try:
        moment = datetime.datetime.fromtimestamp(ms / 1000, tz=datetime.timezone.utc)
    except (OverflowError, OSError, ValueError):
        return "%d ms (out of range)" % ms
    return moment.isoformat(timespec="milliseconds")
