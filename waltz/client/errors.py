"""Exceptions the client reports to applications (through ``on_exception``, ``uncaught_exception``
or a failed Deferred)."""


class WaltzClientError(Exception):
    """Base of the client's errors."""


class ClientClosedError(WaltzClientError):
    """The client was closed before the operation completed."""


class ClientAheadError(WaltzClientError):
    """The client's high-water mark is beyond the partition's: the application has applied
    transactions the log does not have (a mount answered CLIENT_AHEAD)."""

    def __init__(self, partition_id, client_high_water_mark):
        super().__init__(
            "partition %d: the client high-water mark %d is ahead of the server's; the application "
            "state holds transactions the Waltz log does not have" % (partition_id, client_high_water_mark))
        self.partition_id = partition_id
        self.client_high_water_mark = client_high_water_mark


class PartitionInactiveError(WaltzClientError):
    """The partition is not mounted by this client (``client.autoMount`` is off and it was not
    given to ``set_partitions``)."""

    def __init__(self, partition_id):
        super().__init__("partition %d is not active in this client" % partition_id)
        self.partition_id = partition_id


class ContextInFlightError(WaltzClientError):
    """``execute`` of a transaction context whose earlier execution has not ended: running both could
    append its transaction twice."""

    def __init__(self, context):
        super().__init__("transaction context %r is already being executed; execute a context again only "
                         "once its execution ended (or execute a new context)" % (context,))
        self.context = context


class PartitionNotFoundError(WaltzClientError):
    """A partition id outside ``0..num_partitions-1``."""

    def __init__(self, partition_id, num_partitions):
        super().__init__("partition %d does not exist (the cluster has %d partitions)"
                         % (partition_id, num_partitions))
        self.partition_id = partition_id


class TransactionDataError(WaltzClientError):
    """The server could not return a transaction's data."""


class DataChecksumError(TransactionDataError):
    """Transaction data kept arriving with a checksum that does not match (after the retries)."""


class HighWaterMarkTimeout(WaltzClientError, TimeoutError):
    """Some partitions' high-water marks did not come in time; the message names them."""


class ReadError(WaltzClientError):
    """A ``read_transactions`` range cannot be read (for example it starts beyond the log)."""
