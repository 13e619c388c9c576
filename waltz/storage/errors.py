"""Errors raised by the storage node's on-disk structures.

Every error carries a message that names the file, partition or transaction
concerned, because the storage logs it and sends it to the server as the
reason of a FAILURE response.
"""


class StorageError(Exception):
    """Base class of every error raised by ``waltz.storage``."""


class StorageDirectoryInUse(StorageError):
    """Another process holds the lock on the storage directory's control file."""


class ControlFileError(StorageError):
    """The control file is missing, truncated, of an unknown version or already exists."""


class ControlFileMismatch(ControlFileError):
    """The control file belongs to another cluster (key or partition count differ)."""


class UnknownPartition(StorageError):
    """A partition id outside ``0 .. numPartitions-1`` of the control file."""


class PartitionInfoCorrupted(StorageError):
    """Neither of a partition's two control structs is valid: the partition cannot open."""

    def __init__(self, partition_id: int, message: str):
        super().__init__(message)
        self.partition_id = partition_id


class SegmentError(StorageError):
    """A segment's files are unusable: bad header, wrong owner, or a gap between segments."""


class CorruptedRecord(StorageError):
    """A stored record fails its checksum or does not sit where the index says."""


class InvalidAppend(StorageError):
    """An append batch was rejected before anything was written."""


class TransactionIdOutOfSequence(InvalidAppend):
    """The batch does not continue the partition's dense sequence of transaction ids."""


class RecordChecksumMismatch(InvalidAppend):
    """A record's data does not match its data checksum."""


class SyncFailed(StorageError):
    """An fdatasync failed. What was written since the last successful one may not be on disk, and no
    later fdatasync can tell: the kernel reports a writeback error once, then marks the pages clean.
    So the partition's log refuses everything after it (fail-stop); restarting the storage node
    recovers the partition from what is on disk."""


class StorageClosed(StorageError):
    """The object was used after ``close()``."""
