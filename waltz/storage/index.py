"""The body of a segment's index file: an array of i64 record offsets.

Entry ``i`` (the record of transaction ``firstTxnId + i``) lives at byte
``FILE_HEADER_SIZE + 8 * i`` and holds the byte offset of that record in the
segment's data file. The number of entries, and so the segment's max
transaction id, derives from the file size. The 128-byte header is the
segment's and is written and checked by :mod:`waltz.storage.segment`.

Writes go to the OS; :meth:`SegmentIndex.sync` makes them durable (the segment
calls it at checkpoints, roll, truncate, set-LWM and close).
"""

import os
import struct

from waltz.storage.fileio import datasync, file_size, pread_upto, pwrite_all, truncate_durably

#: Size of the header shared by data and index files.
FILE_HEADER_SIZE = 128
ENTRY_SIZE = 8

_OFFSET = struct.Struct(">q")


class SegmentIndex:
    """The offsets of one segment's records, backed by its ``.idx`` file."""

    def __init__(self, path: str, fd: int):
        self.path = path
        self._fd = fd
        # a torn trailing entry (crash mid-write) is not counted; recovery rewrites it
        self._count = max(0, (file_size(fd) - FILE_HEADER_SIZE) // ENTRY_SIZE)
        self._dirty = False

    @property
    def count(self) -> int:
        """Number of entries (records) in the index."""
        return self._count

    def offset(self, i: int) -> int:
        """The data-file offset of entry ``i`` (``0 <= i < count``)."""
        return self.offsets(i, 1)[0]

    def offsets(self, i: int, n: int) -> list:
        """Entries ``i .. i+n-1``, fewer at the end of the index."""
        n = max(0, min(n, self._count - i))
        if n == 0:
            return []
        data = pread_upto(self._fd, ENTRY_SIZE * n, _position(i))
        return list(struct.unpack(">%dq" % (len(data) // ENTRY_SIZE), data))

    def write(self, i: int, offsets) -> None:
        """Write ``offsets`` as entries ``i, i+1, ...`` (``i <= count``); the index then ends there."""
        if i > self._count:
            raise ValueError("index entry %d would leave a gap after %d entries" % (i, self._count))
        offsets = list(offsets)
        if offsets:
            pwrite_all(self._fd, struct.pack(">%dq" % len(offsets), *offsets), _position(i))
            self._dirty = True
        end = i + len(offsets)
        if end < self._count:
            self.truncate(end)
        self._count = end

    def truncate(self, count: int) -> None:
        """Keep the first ``count`` entries (also cuts a torn trailing entry)."""
        os.ftruncate(self._fd, _position(count))
        self._count = count
        self._dirty = True

    def cut_durably(self, count: int) -> None:
        """Keep the first ``count`` entries, durably, never leaving zeroed entries before the old end
        (:func:`~waltz.storage.fileio.truncate_durably`)."""
        truncate_durably(self._fd, _position(count), self.path)
        self._count = count
        self._dirty = False

    def sync(self) -> None:
        """fdatasync the index file if anything was written since the last sync."""
        if self._dirty:
            datasync(self._fd)
            self._dirty = False

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _position(i: int) -> int:
    return FILE_HEADER_SIZE + ENTRY_SIZE * i
