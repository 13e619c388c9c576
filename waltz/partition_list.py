"""Partition lists such as ``0-3,7``: the one syntax the command line tools and the Spark source take."""

from waltz.zk.metadata import MAX_PARTITIONS


class PartitionListError(ValueError):
    """A partition list that is not one, or that names a partition the cluster does not have."""


def parse_partition_list(text):
    """``"0-3,7"`` -> ``(0, 1, 2, 3, 7)``: sorted, without repeats.

    Raises :class:`PartitionListError` naming the bad item. Whether the partitions exist is
    :func:`check_partitions_exist`'s question: the syntax is checked before any cluster is asked.
    """
    ids = set()
    for item in str(text).split(","):
        item = item.strip()
        if not item:
            raise PartitionListError("%r has an empty item" % (text,))
        low, dash, high = item.partition("-")
        try:
            first = int(low)
            last = int(high) if dash else first
        except ValueError:
            raise PartitionListError("%r is not a partition id or a range like 0-3" % (item,)) from None
        if first < 0 or last < first:
            raise PartitionListError("%r is not a partition id or an increasing range" % (item,))
        if last >= MAX_PARTITIONS:      # checked before the range is expanded: no cluster has more
            raise PartitionListError("%d is not a partition id (a cluster has at most %d partitions)"
                                     % (last, MAX_PARTITIONS))
        ids.update(range(first, last + 1))
    return tuple(sorted(ids))


def check_partitions_exist(ids, num_partitions):
    """Raise :class:`PartitionListError` naming the highest of ``ids`` when a cluster of ``num_partitions``
    partitions does not have it."""
    if ids and max(ids) >= num_partitions:
        raise PartitionListError("partition %d does not exist (the cluster has %d)" % (max(ids), num_partitions))
