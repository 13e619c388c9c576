"""Shared pieces of the ``waltz`` command: the user-error type and option helpers."""


class CliError(Exception):
    """A user-facing error: printed as one line ``waltz: error: <message>``, exit status 1."""

    def __init__(self, message, exit_code=1):
        super().__init__(message)
        self.exit_code = exit_code


def parse_partition_list(text, num_partitions=None):
    """Parse a partition list such as ``0-3,7`` into a sorted tuple of ids.

    Raises :class:`CliError` naming the bad item; with ``num_partitions`` every id
    must be below it.
    """
    ids = set()
    for item in str(text).split(","):
        item = item.strip()
        if not item:
            raise CliError("bad partition list %r: empty item" % text)
        low, sep, high = item.partition("-")
        try:
            first = int(low)
            last = int(high) if sep else first
        except ValueError:
            raise CliError("bad partition list %r: %r is not a number or a range like 0-3" % (text, item)) from None
        if first < 0 or last < first:
            raise CliError("bad partition list %r: bad range %r" % (text, item))
        if num_partitions is not None and last >= num_partitions:
            raise CliError("bad partition list %r: partition %d does not exist (the cluster has %d)"
                           % (text, last, num_partitions))
        ids.update(range(first, last + 1))
    return tuple(sorted(ids))
