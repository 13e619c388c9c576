"""Small blocking file helpers shared by the control file and the segments.

All of them work on raw file descriptors (``os.pread``/``os.pwrite``), so a
read never moves a shared file position and a partial write is retried.
"""

import os

from waltz.storage.errors import SyncFailed

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
    """Make a directory's entries (created, renamed or deleted files) durable; a failed fsync raises
    :class:`SyncFailed` (whether those entries are on disk is then unknown, as for data)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as exc:
        raise SyncFailed("fsync of directory %s failed: %s" % (path, exc)) from exc
    finally:
        os.close(fd)


def make_directory_durably(path: str) -> None:
    """Create ``path`` (and missing parents) if it does not exist, and make its entry durable in its
    parent: a directory created and then lost in a crash would take every file in it along."""
    if os.path.isdir(path):
        return
    parent = os.path.dirname(os.path.abspath(path))
    make_directory_durably(parent)
    os.makedirs(path, exist_ok=True)
    fsync_directory(parent)


#: The unit in which a file system writes a file's data back (a page).
PAGE_SIZE = 4096


def truncate_durably(fd: int, size: int, name: str) -> None:
    """Cut the file to ``size`` bytes and make that durable, never leaving zeros before the old end.

    Cutting inside a page zeroes the rest of that page, and a power loss may keep those zeros on disk
    without the new size: the bytes after the cut, up to the page's end, would read as zeros while the
    file kept its old length. So the file is first cut at the end of that page and synced (a cut on a
    page boundary zeroes nothing), then at ``size``: after a power loss, zeros can stand only between
    ``size`` and the end of the file."""
    old_size = file_size(fd)
    page_end = -(-size // PAGE_SIZE) * PAGE_SIZE
    for cut in ((page_end, size) if size < page_end < old_size else (size,)):
        os.ftruncate(fd, cut)
        try:
            datasync(fd)
        except OSError as exc:
            raise SyncFailed("fdatasync of %s failed: %s" % (name, exc)) from exc


def file_size(fd: int) -> int:
    """The current size of an open file."""
    return os.fstat(fd).st_size
