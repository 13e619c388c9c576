"""The storage directory's control file, ``<dir>/waltz-storage.ctl``.

Layout (big-endian, see ``docs/storage-format.md``)::

    header (128 bytes): version i32 = 0 | creation time i64 (ms) | cluster key UUID |
                        numPartitions i32 | zero padding
    numPartitions x PartitionInfo (76 bytes each, partition p at 128 + 76 * p):
        partitionId i32 | struct 0 (36 bytes) | struct 1 (36 bytes)
    struct: sessionId i64 | lwm i64 | localLwm i64 | flags i32 | seqNo i32 | crc i32
            (crc = CRC32C over the first 32 bytes of the struct)
    numPartitions x session fence (32 bytes each, partition p at 128 + 76 * numPartitions + 32 * p):
        slot 0 (16 bytes) | slot 1 (16 bytes)
    slot: sessionId i64 | seqNo i32 | crc i32 (CRC32C over the first 12 bytes of the slot)

A partition's state is updated by writing the *other* struct with ``seqNo + 1``
and fsyncing, so a torn write can only damage the struct that was being
written: on open the valid struct with the higher ``seqNo`` wins, and when the
newest one is damaged the partition rolls back to the previous state. Both
structs invalid makes that one partition fail (:class:`PartitionInfoCorrupted`)
while the others keep working.

A partition's *session fence* is the highest store session it adopted: the storage records it, the same
way in two slots, before it answers that session's first request, so after a restart it still refuses
the sessions it fenced off. A file written before fences existed gets the section when it is first opened
for writing; a fence with no valid slot reads as -1 (none recorded).

While a :class:`ControlFile` is open it holds an OS lock (``flock``) on the
file: exclusive for the daemon, shared for read-only tools, so two daemons can
never share a storage directory.

The object is blocking and thread-confined: the storage runs it on a worker
thread, never on the reactor.
"""

import contextlib
import enum
import fcntl
import os
import struct
import tempfile
import time
import uuid

import attr

from waltz.protocols.values import checksum
from waltz.storage.errors import (
    ControlFileError, ControlFileMismatch, PartitionInfoCorrupted, StorageClosed,
    StorageDirectoryInUse, StorageError, SyncFailed, UnknownPartition,
)
from waltz.storage.fileio import (
    datasync, file_size, fsync_directory, make_directory_durably, pread_upto, pwrite_all)

CONTROL_FILE_NAME = "waltz-storage.ctl"
FORMAT_VERSION = 0
HEADER_SIZE = 128
STRUCT_SIZE = 36
PARTITION_INFO_SIZE = 4 + 2 * STRUCT_SIZE  # 76

_HEADER = struct.Struct(">iq16si")        # version, creation ms, key, numPartitions
_STRUCT_BODY = struct.Struct(">qqqii")    # sessionId, lwm, localLwm, flags, seqNo: the 32 checksummed bytes
_I32 = struct.Struct(">i")

#: Sequence numbers given to struct 0 and struct 1 of a freshly formatted
#: partition (as the original): both valid, struct 1 current.
_INITIAL_SEQ_NOS = (-1, 0)
FENCE_SLOT_SIZE = 16
FENCE_RECORD_SIZE = 2 * FENCE_SLOT_SIZE
_FENCE_BODY = struct.Struct(">qi")        # sessionId, seqNo: the 12 checksummed bytes of a fence slot


class PartitionFlags(enum.IntFlag):
    """Bits of a partition's ``flags``.

    ``AVAILABLE`` and ``ASSIGNED`` are the original's. ``UNREADABLE`` and
    ``UNWRITABLE`` carry seed 003's read/write toggles; they are negative so
    that zero bits (every file written before they existed) mean readable and
    writable.
    """

    AVAILABLE = 1
    ASSIGNED = 4
    UNREADABLE = 8
    UNWRITABLE = 16


@attr.s(frozen=True, slots=True, auto_attribs=True)
class ControlFileHeader:
    """The first 128 bytes of the control file."""

    version: int
    creation_time_ms: int
    key: uuid.UUID
    num_partitions: int

    def encode(self) -> bytes:
        fields = _HEADER.pack(self.version, self.creation_time_ms, self.key.bytes, self.num_partitions)
        return fields.ljust(HEADER_SIZE, b"\0")

    @classmethod
    def decode(cls, data: bytes) -> "ControlFileHeader":
        version, created, key, num_partitions = _HEADER.unpack_from(data)
        return cls(version, created, uuid.UUID(bytes=key), num_partitions)


@attr.s(frozen=True, slots=True, auto_attribs=True)
class PartitionInfo:
    """The durable state of one partition: the fields of its current control struct."""

    partition_id: int
    session_id: int = -1
    low_water_mark: int = -1
    local_low_water_mark: int = -1
    flags: int = int(PartitionFlags.AVAILABLE)

    def has_flag(self, flag: PartitionFlags) -> bool:
        return self.flags & flag == flag

    def with_flag(self, flag: PartitionFlags, enabled: bool) -> "PartitionInfo":
        """A copy with ``flag`` set (``enabled``) or cleared."""
        flags = self.flags | flag if enabled else self.flags & ~flag
        return attr.evolve(self, flags=int(flags))

    @property
    def available(self) -> bool:
        return self.has_flag(PartitionFlags.AVAILABLE)

    @property
    def assigned(self) -> bool:
        return self.has_flag(PartitionFlags.ASSIGNED)

    @property
    def readable(self) -> bool:
        return not self.has_flag(PartitionFlags.UNREADABLE)

    @property
    def writable(self) -> bool:
        return not self.has_flag(PartitionFlags.UNWRITABLE)


@attr.s(frozen=True, slots=True, auto_attribs=True)
class PartitionInfoStruct:
    """One 36-byte control struct as found on disk, valid or not."""

    session_id: int
    low_water_mark: int
    local_low_water_mark: int
    flags: int
    seq_no: int
    crc: int
    valid: bool

    @staticmethod
    def encode(info: PartitionInfo, seq_no: int) -> bytes:
        """The 36 bytes storing ``info`` with ``seq_no`` and a fresh checksum."""
        body = _STRUCT_BODY.pack(info.session_id, info.low_water_mark, info.local_low_water_mark,
                                 info.flags, seq_no)
        return body + _I32.pack(checksum(body))

    @classmethod
    def decode(cls, data: bytes) -> "PartitionInfoStruct":
        body = data[:_STRUCT_BODY.size]
        crc = _I32.unpack_from(data, _STRUCT_BODY.size)[0]
        return cls(*_STRUCT_BODY.unpack(body), crc=crc, valid=checksum(body) == crc)

    def to_info(self, partition_id: int) -> PartitionInfo:
        return PartitionInfo(partition_id, self.session_id, self.low_water_mark,
                             self.local_low_water_mark, self.flags)


@attr.s(frozen=True, slots=True, auto_attribs=True)
class _Current:
    """Which struct of a partition is current, and what it holds."""

    slot: int
    seq_no: int
    info: PartitionInfo


def control_file_path(directory: str) -> str:
    return os.path.join(directory, CONTROL_FILE_NAME)


def _partition_offset(partition_id: int) -> int:
    return HEADER_SIZE + PARTITION_INFO_SIZE * partition_id


def _struct_offset(partition_id: int, slot: int) -> int:
    return _partition_offset(partition_id) + 4 + STRUCT_SIZE * slot


def _fence_offset(num_partitions: int, partition_id: int, slot: int = 0) -> int:
    return _partition_offset(num_partitions) + FENCE_RECORD_SIZE * partition_id + FENCE_SLOT_SIZE * slot


def _encode_fence_slot(session_id: int, seq_no: int) -> bytes:
    body = _FENCE_BODY.pack(session_id, seq_no)
    return body + _I32.pack(checksum(body))


def _decode_fence_slot(data: bytes):
    """``(seq_no, session_id)`` of a valid slot, or None."""
    if len(data) < FENCE_SLOT_SIZE:
        return None
    body = data[:_FENCE_BODY.size]
    if checksum(body) != _I32.unpack_from(data, _FENCE_BODY.size)[0]:
        return None
    session_id, seq_no = _FENCE_BODY.unpack(body)
    return seq_no, session_id


#: A partition's fence before any session: both slots hold session -1.
_INITIAL_FENCE = b"".join(_encode_fence_slot(-1, seq) for seq in _INITIAL_SEQ_NOS)


def _fences_size(num_partitions: int) -> int:
    """The size of a control file with its fence section."""
    return _fence_offset(num_partitions, num_partitions)


@attr.s(frozen=True, slots=True, auto_attribs=True)
class _Fence:
    """Which fence slot of a partition is current, and the session it holds."""

    slot: int
    seq_no: int
    session_id: int


def _format_partition(partition_id: int) -> bytes:
    """The 76 bytes of a freshly formatted partition: both structs hold the initial state."""
    info = PartitionInfo(partition_id)
    return (_I32.pack(partition_id)
            + b"".join(PartitionInfoStruct.encode(info, seq) for seq in _INITIAL_SEQ_NOS))


def _remove_leftover_temporary_files(directory):
    """Delete the temporary files a crash during :meth:`ControlFile.create` left (``<control file>.*.tmp``):
    nothing reads them. Called with the directory's exclusive lock held."""
    prefix = CONTROL_FILE_NAME + "."
    for name in os.listdir(directory):
        if name.startswith(prefix) and name.endswith(".tmp"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))


class ControlFile:
    """An open control file. Use :meth:`create`, :meth:`open` or :meth:`open_or_create`."""

    def __init__(self, path: str, fd: int, header: ControlFileHeader, read_only: bool):
        self.path = path
        self.header = header
        self.read_only = read_only
        self._fd = fd
        self._current = {}  # partition id -> _Current, filled on first use
        self._fences = {}   # partition id -> _Fence, filled on first use
        self._sync_failure = None   # a failed fdatasync makes the file unusable (see SyncFailed)

    # -- opening -----------------------------------------------------------------------------

    @classmethod
    def create(cls, directory: str, key: uuid.UUID, num_partitions: int,
               clock=time.time) -> "ControlFile":
        """Format a new control file in ``directory`` (created if needed) and open it.

        The file is written under a temporary name, fsynced and then linked into
        place, so a crash never leaves a half-written control file, and an
        existing one is never overwritten (:class:`ControlFileError`).
        """
        if num_partitions < 0:
            raise ControlFileError("the number of partitions must not be negative, got %d" % num_partitions)
        make_directory_durably(directory)
        path = control_file_path(directory)
        header = ControlFileHeader(FORMAT_VERSION, int(clock() * 1000), key, num_partitions)
        content = (header.encode() + b"".join(_format_partition(p) for p in range(num_partitions))
                   + _INITIAL_FENCE * num_partitions)
        fd, tmp_path = tempfile.mkstemp(prefix=CONTROL_FILE_NAME + ".", suffix=".tmp", dir=directory)
        try:
            pwrite_all(fd, content, 0)
            os.fsync(fd)
            os.close(fd)
            fd = None
            try:
                os.link(tmp_path, path)  # atomic, and fails if the file exists
            except FileExistsError:
                raise ControlFileError("control file %s already exists" % path) from None
        finally:
            if fd is not None:
                os.close(fd)
            with contextlib.suppress(FileNotFoundError):    # (an open holding the lock may have removed it)
                os.unlink(tmp_path)
        fsync_directory(directory)
        return cls.open(directory)

    @classmethod
    def open(cls, directory: str, key: uuid.UUID = None, num_partitions: int = None,
             read_only: bool = False) -> "ControlFile":
        """Open and lock the existing control file of ``directory``.

        With ``key`` / ``num_partitions`` the file must belong to that cluster
        (:class:`ControlFileMismatch`). ``read_only`` takes a shared lock and
        refuses updates; otherwise the lock is exclusive. A held lock raises
        :class:`StorageDirectoryInUse`.
        """
        path = control_file_path(directory)
        try:
            fd = os.open(path, os.O_RDONLY if read_only else os.O_RDWR)
        except FileNotFoundError:
            raise ControlFileError("no control file %s" % path) from None
        try:
            _lock(fd, directory, shared=read_only)
            header = _read_header(fd, path)
            control = cls(path, fd, header, read_only)
            if key is not None or num_partitions is not None:
                control.verify(key, num_partitions)     # (before anything is written to another cluster's file)
            if not read_only:
                _remove_leftover_temporary_files(directory)
                control._add_missing_fences()
            return control
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def open_or_create(cls, directory: str, key: uuid.UUID, num_partitions: int,
                       clock=time.time) -> "ControlFile":
        """Open the control file of ``directory`` for this cluster, formatting it on first start."""
        if not os.path.exists(control_file_path(directory)):
            try:
                control = cls.create(directory, key, num_partitions, clock)
            except ControlFileError:
                if not os.path.exists(control_file_path(directory)):
                    raise
                # another process created it meanwhile: fall through to a verified open
            else:
                return control
        return cls.open(directory, key, num_partitions)

    # -- header ------------------------------------------------------------------------------

    @property
    def key(self) -> uuid.UUID:
        return self.header.key

    @property
    def num_partitions(self) -> int:
        return self.header.num_partitions

    @property
    def creation_time_ms(self) -> int:
        return self.header.creation_time_ms

    def verify(self, key: uuid.UUID = None, num_partitions: int = None) -> None:
        """Raise :class:`ControlFileMismatch` naming both values when the cluster differs."""
        problems = []
        if key is not None and key != self.key:
            problems.append("cluster key %s (expected %s)" % (self.key, key))
        if num_partitions is not None and num_partitions != self.num_partitions:
            problems.append("%d partitions (expected %d)" % (self.num_partitions, num_partitions))
        if problems:
            raise ControlFileMismatch("control file %s belongs to another cluster: it has %s"
                                      % (self.path, " and ".join(problems)))

    # -- partitions --------------------------------------------------------------------------

    def partition_info(self, partition_id: int) -> PartitionInfo:
        """The current state of a partition; :class:`PartitionInfoCorrupted` if unreadable."""
        return self._load(partition_id).info

    def partition_structs(self, partition_id: int):
        """Both on-disk structs of a partition, valid or not (for inspection tools)."""
        self._check_partition(partition_id)
        data = self._read_partition(partition_id)
        return tuple(PartitionInfoStruct.decode(data[4 + STRUCT_SIZE * slot:]) for slot in (0, 1))

    def stored_partition_id(self, partition_id: int) -> int:
        """The partition id field of record ``partition_id`` as stored (for inspection tools)."""
        self._check_partition(partition_id)
        return _I32.unpack_from(self._read_partition(partition_id))[0]

    def update_partition_info(self, partition_id: int, **changes) -> PartitionInfo:
        """Durably change some fields of a partition's state; returns the new state.

        ``changes`` are :class:`PartitionInfo` fields (``session_id``,
        ``low_water_mark``, ``local_low_water_mark``, ``flags``). The other
        struct is written with ``seqNo + 1`` and fsynced before returning.
        """
        current = self._load(partition_id)
        info = attr.evolve(current.info, **changes)
        slot, seq_no = 1 - current.slot, current.seq_no + 1
        self._write(_struct_offset(partition_id, slot), PartitionInfoStruct.encode(info, seq_no))
        self._current[partition_id] = _Current(slot, seq_no, info)
        return info

    def set_flag(self, partition_id: int, flag: PartitionFlags, enabled: bool) -> PartitionInfo:
        """Durably set or clear one flag of a partition."""
        info = self.partition_info(partition_id).with_flag(flag, enabled)
        return self.update_partition_info(partition_id, flags=info.flags)

    def reset_partition_info(self, partition_id: int) -> PartitionInfo:
        """Durably return a partition's record to the initial state (also repairs a corrupted one).

        A readable record is reset like any update, by writing the other struct with the next
        sequence number, so one valid struct survives a torn write; only a record that cannot be
        read is reformatted whole."""
        initial = PartitionInfo(partition_id)
        try:
            return self.update_partition_info(
                partition_id, session_id=initial.session_id, low_water_mark=initial.low_water_mark,
                local_low_water_mark=initial.local_low_water_mark, flags=initial.flags)
        except PartitionInfoCorrupted:
            self._write(_partition_offset(partition_id), _format_partition(partition_id))
            self._current.pop(partition_id, None)
            return self.partition_info(partition_id)

    # -- session fences -----------------------------------------------------------------------

    def session_fence(self, partition_id: int) -> int:
        """The highest store session the partition durably adopted (-1: none recorded)."""
        return self._load_fence(partition_id).session_id

    def raise_session_fence(self, partition_id: int, session_id: int) -> int:
        """Durably record that the partition adopted ``session_id`` (nothing is written unless it is higher
        than the fence); returns the fence. The other slot is written with ``seqNo + 1`` and fdatasynced."""
        current = self._load_fence(partition_id)
        if session_id <= current.session_id:
            return current.session_id
        slot, seq_no = 1 - current.slot, current.seq_no + 1
        self._write(_fence_offset(self.num_partitions, partition_id, slot), _encode_fence_slot(session_id, seq_no))
        self._fences[partition_id] = _Fence(slot, seq_no, session_id)
        return session_id

    def _load_fence(self, partition_id: int) -> _Fence:
        self._check_partition(partition_id)
        fence = self._fences.get(partition_id)
        if fence is None:
            data = pread_upto(self._fd, FENCE_RECORD_SIZE, _fence_offset(self.num_partitions, partition_id))
            valid = []
            for slot in (0, 1):
                decoded = _decode_fence_slot(data[FENCE_SLOT_SIZE * slot:])
                if decoded is not None:
                    valid.append((decoded, slot))
            if valid:
                (seq_no, session_id), slot = max(valid)
                fence = _Fence(slot, seq_no, session_id)
            else:   # (a read-only open of a file from before fences, or damage: the next write takes slot 0)
                fence = _Fence(1, -1, -1)
            self._fences[partition_id] = fence
        return fence

    def _add_missing_fences(self) -> None:
        """Give a file written before session fences existed its fence section (every fence -1)."""
        if file_size(self._fd) < _fences_size(self.num_partitions):
            self._write(_fence_offset(self.num_partitions, 0), _INITIAL_FENCE * self.num_partitions)

    # -- closing -----------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._fd is None

    def close(self) -> None:
        """Release the lock and close the file (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    # -- internals ---------------------------------------------------------------------------

    def _check_partition(self, partition_id: int) -> None:
        if self._fd is None:
            raise StorageClosed("control file %s is closed" % self.path)
        if not 0 <= partition_id < self.num_partitions:
            raise UnknownPartition("partition %d does not exist: control file %s has %d partitions (0-%d)"
                                   % (partition_id, self.path, self.num_partitions, self.num_partitions - 1))

    def _read_partition(self, partition_id: int) -> bytes:
        return pread_upto(self._fd, PARTITION_INFO_SIZE, _partition_offset(partition_id))

    def _load(self, partition_id: int) -> _Current:
        self._check_partition(partition_id)
        current = self._current.get(partition_id)
        if current is None:
            current = self._current[partition_id] = self._choose_current(partition_id)
        return current

    def _choose_current(self, partition_id: int) -> _Current:
        stored_id = self.stored_partition_id(partition_id)
        if stored_id != partition_id:
            raise PartitionInfoCorrupted(
                partition_id, "partition %d's record in control file %s is corrupted: it names partition %d"
                % (partition_id, self.path, stored_id))
        structs = self.partition_structs(partition_id)
        valid = [(s.seq_no, slot) for slot, s in enumerate(structs) if s.valid]
        if not valid:
            raise PartitionInfoCorrupted(
                partition_id, "partition %d's info in control file %s is corrupted: both structs fail "
                "their checksum" % (partition_id, self.path))
        seq_no, slot = max(valid)
        return _Current(slot, seq_no, structs[slot].to_info(partition_id))

    def _write(self, offset: int, data: bytes) -> None:
        if self._fd is None:
            raise StorageClosed("control file %s is closed" % self.path)
        if self.read_only:
            raise StorageError("control file %s is open read-only" % self.path)
        self.check_usable()
        pwrite_all(self._fd, data, offset)
        try:
            datasync(self._fd)
        except OSError as exc:
            # As for a segment: the kernel reports the error once, and the page cache now holds a
            # state that may not be on disk. Nothing more is written; a restart reads what is there.
            self._sync_failure = exc
            raise SyncFailed("fdatasync of control file %s failed: %s" % (self.path, exc)) from exc

    @property
    def sync_failure(self):
        """The OSError of a failed fdatasync that made the file refuse writes, or None."""
        return self._sync_failure

    def check_usable(self) -> None:
        """Raise :class:`SyncFailed` once an fdatasync of the file has failed."""
        if self._sync_failure is not None:
            raise SyncFailed("control file %s is unusable after a failed fdatasync (%s); restart the storage "
                             "node" % (self.path, self._sync_failure))


@contextlib.contextmanager
def shared_directory_lock(directory: str):
    """Hold the storage directory's lock, shared, for the block (read-only tools):
    :class:`StorageDirectoryInUse` while a storage node holds it, since its files change under a reader.
    A directory without a control file (segments copied elsewhere) has no lock to take."""
    try:
        fd = os.open(control_file_path(directory), os.O_RDONLY)
    except FileNotFoundError:
        yield
        return
    try:
        _lock(fd, directory, shared=True)
        yield
    finally:
        os.close(fd)


def _lock(fd: int, directory: str, shared: bool) -> None:
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        raise StorageDirectoryInUse("storage directory %s is in use by another process" % directory) from None


def _read_header(fd: int, path: str) -> ControlFileHeader:
    size = file_size(fd)
    if size < HEADER_SIZE:
        raise ControlFileError("control file %s is truncated: %d bytes, the header alone is %d"
                               % (path, size, HEADER_SIZE))
    header = ControlFileHeader.decode(pread_upto(fd, HEADER_SIZE, 0))
    if header.version != FORMAT_VERSION:
        raise ControlFileError("control file %s has format version %d, this storage reads version %d"
                               % (path, header.version, FORMAT_VERSION))
    expected = _partition_offset(header.num_partitions)
    if header.num_partitions < 0 or size < expected:
        raise ControlFileError("control file %s is truncated or corrupted: %d bytes for %d partitions "
                               "(expected %d)" % (path, size, header.num_partitions, expected))
    return header
