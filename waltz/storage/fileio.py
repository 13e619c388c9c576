"""Small blocking file helpers shared by the control file and the segments.

All of them work on raw file descriptors (``os.pread``/``os.pwrite``), so a
read never moves a shared file position and a partial write is retried.
"""

import os

#: ``fdatasync`` where the platform has it (Linux); ``fsync`` elsewhere.
datasync = getattr(os, "fdatasync", os.fsync)


def pwrite_all(fd: int, data, offset: int) -> None:
    """Write all of ``data`` at ``offset``, retrying short writes."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written


def pread_upto(fd: int, size: int, offset: int) -> bytes:
    """Read up to ``size`` bytes at ``offset``; fewer only at the end of the file."""
    chunks = []
    while size > 0:
        chunk = os.pread(fd, size, offset)
        if not chunk:
            break
        chunks.append(chunk)
        size -= len(chunk)
        offset += len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def fsync_directory(path: str) -> None:
    """Make a directory's entries (created, renamed or deleted files) durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_size(fd: int) -> int:
    """The current size of an open file."""
    return os.fstat(fd).st_size
