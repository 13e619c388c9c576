"""Planning a read: per-partition transaction id ranges from the options and the high-water marks, and
the input partitions (:class:`WaltzSplit`) Spark hands to its executors.

A range is ``start..end``, both inclusive (``end = start - 1`` is empty). Starting ids
resolve as ``-2`` (earliest) → 0, ``-1`` (latest) → high-water mark + 1 (only what
comes after planning); ending ids as ``-1`` (latest) → the high-water mark at planning
time. Streaming offsets are per-partition high-water marks: the offset ``{"0": 41}``
means "partition 0 read up to transaction 41", and a micro-batch from offset ``a`` to
``b`` reads ``a[p] + 1 .. b[p]``.
"""

from dataclasses import dataclass

from pyspark.sql.datasource import InputPartition

from waltz.partition_list import PartitionListError, check_partitions_exist
from waltz.spark.options import EARLIEST, LATEST, OptionError


@dataclass(frozen=True)
class WaltzSplit(InputPartition):
    """One input partition: transactions ``start..end`` (inclusive) of Waltz partition ``partition_id``."""

    partition_id: int
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start + 1


def selected_partitions(options, num_partitions):
    """The partition ids the ``partitions`` option selects (all by default); checks they exist."""
    if options.partitions is None:
        return tuple(range(num_partitions))
    try:
        check_partitions_exist(options.partitions, num_partitions)
    except PartitionListError as exc:
        raise OptionError("partitions", str(exc)) from None
    return options.partitions


def _check_spec_partitions(name, spec, num_partitions):
    for pid in spec.per_partition:
        if pid >= num_partitions:
            raise OptionError(name, "partition %d does not exist (the cluster has %d partitions)"
                              % (pid, num_partitions))


def resolve_start(spec, partition_id, high_water_mark):
    """The first transaction id to read of a partition (``startingTransactionIds``)."""
    value = spec.value_for(partition_id)
    start = 0 if value == EARLIEST else high_water_mark + 1 if value == LATEST else value
    if start > high_water_mark + 1:
        raise OptionError("startingTransactionIds", "partition %d: transaction %d is not committed yet (its "
                          "high-water mark is %d)" % (partition_id, start, high_water_mark))
    return start


def resolve_end(spec, partition_id, high_water_mark):
    """The last transaction id to read of a partition (``endingTransactionIds``)."""
    value = spec.value_for(partition_id)
    end = high_water_mark if value == LATEST else value
    if end > high_water_mark:
        raise OptionError("endingTransactionIds", "partition %d: transaction %d is not committed yet (its "
                          "high-water mark is %d)" % (partition_id, end, high_water_mark))
    return end


def plan_ranges(options, num_partitions, high_water_marks):
    """``{partition id: (start, end)}`` of a batch read; raises :class:`OptionError` for an impossible range."""
    _check_spec_partitions("startingTransactionIds", options.starting, num_partitions)
    _check_spec_partitions("endingTransactionIds", options.ending, num_partitions)
    ranges = {}
    for pid in selected_partitions(options, num_partitions):
        hwm = high_water_marks[pid]
        start, end = resolve_start(options.starting, pid, hwm), resolve_end(options.ending, pid, hwm)
        if end < start - 1:
            raise OptionError("endingTransactionIds", "partition %d: the range ends at transaction %d, before "
                              "it starts at %d" % (pid, end, start))
        ranges[pid] = (start, end)
    return ranges


#: The value of a partition in a streaming query's first offset when it starts at ``latest``: resolved to
#: the high-water mark by the first :func:`next_offset`, which Spark writes to its checkpoint. The first
#: offset itself is never written there (Spark asks for it again on every restart before the first batch
#: completes), so it must not depend on when it is asked.
UNRESOLVED_LATEST = "latest"


def initial_offsets(options, num_partitions, high_water_marks):
    """A streaming query's first offset: per partition, the transaction before the first one to read, or
    :data:`UNRESOLVED_LATEST`."""
    _check_spec_partitions("startingTransactionIds", options.starting, num_partitions)
    first = {}
    for pid in selected_partitions(options, num_partitions):
        if options.starting.value_for(pid) == LATEST:
            first[pid] = UNRESOLVED_LATEST
        else:
            first[pid] = resolve_start(options.starting, pid, high_water_marks[pid]) - 1
    return offsets(first)


def next_offset(start, partition_ids, high_water_marks):
    """The end offset of the micro-batch starting at offset ``start``: the current high-water marks of
    ``partition_ids``, never behind ``start``. :class:`OptionError` when ``start`` (the query's checkpoint)
    covers other partitions than the ``partitions`` option selects now."""
    previous = offset_marks(start)
    if set(previous) != set(partition_ids):
        raise OptionError("partitions", "selects partitions %s, but the streaming query's checkpoint has "
                          "partitions %s; a query's partitions cannot change (start a new query, with a new "
                          "checkpoint location, to read others)"
                          % (_id_list(partition_ids), _id_list(previous)))
    return offsets({pid: high_water_marks[pid] if mark == UNRESOLVED_LATEST else max(high_water_marks[pid], mark)
                    for pid, mark in previous.items()})


def _id_list(partition_ids):
    return ",".join(str(pid) for pid in sorted(partition_ids))


def offsets(marks):
    """A streaming offset (JSON object: string keys) from ``{partition id: last transaction id}``."""
    return {str(pid): mark if mark == UNRESOLVED_LATEST else int(mark) for pid, mark in sorted(marks.items())}


def offset_marks(offset):
    """``{partition id: last transaction id or UNRESOLVED_LATEST}`` from a streaming offset."""
    return {int(pid): mark if mark == UNRESOLVED_LATEST else int(mark) for pid, mark in offset.items()}


def stream_ranges(start, end):
    """The ranges of a micro-batch from offset ``start`` to offset ``end`` (empty for a partition whose
    start is :data:`UNRESOLVED_LATEST`: its end is where the query starts). A range that would start after
    its end plus one (offsets from another query) raises ``ValueError``."""
    first, last = offset_marks(start), offset_marks(end)
    ranges = {}
    for pid, mark in last.items():
        before = first.get(pid, -1)
        if before == UNRESOLVED_LATEST:
            before = mark
        if mark == UNRESOLVED_LATEST or before > mark:
            raise ValueError("partition %d: a micro-batch from offset %r to offset %r would go backwards"
                             % (pid, start, end))
        ranges[pid] = (before + 1, mark)
    return ranges


def plan_splits(ranges, max_per_split):
    """The :class:`WaltzSplit` list of ``ranges``: each range cut into pieces of at most ``max_per_split``
    transactions; empty ranges give no split."""
    splits = []
    for pid, (start, end) in sorted(ranges.items()):
        for first in range(start, end + 1, max_per_split):
            splits.append(WaltzSplit(pid, first, min(end, first + max_per_split - 1)))
    return splits
