"""Lock hashes: the one ``int`` per lock a client sends in an ``AppendRequest``.

A lock is named by the application with a string and a 64-bit id (for
example ``("account", 42)``). The client sends only a signed 32-bit hash of
it; the server's lock table (:mod:`waltz.server.locks`) derives its slots
from that hash. The hash is deterministic and language-neutral, so a client
written in any language computes the same value (``docs/protocol.md``,
"Lock hashes")::

    lock_hash(name, id) = CRC32C(UTF-8(name) || id as 8 bytes big-endian two's complement)

carried as a signed ``i32``. The original used Java's ``String.hashCode`` and
``Long.hashCode``; this project uses CRC32C like every other checksum.
"""

import struct

from waltz.protocols.values import checksum

_LOCK_ID = struct.Struct(">q")

#: The most locks of each kind (write, read, append) one transaction may carry. The client refuses
#: to build more, and the server's decoder refuses a list over it (closing that connection) before
#: reading it: every lock costs the server's append task a slot computation, and a frame full of
#: them would hold its reactor for seconds. The original had no limit; see ``docs/protocol.md``.
MAX_LOCKS_PER_KIND = 10_000


def lock_hash(name: str, lock_id: int) -> int:
    """The signed 32-bit hash of the lock ``(name, lock_id)``.

    Raises :class:`ValueError` when ``lock_id`` does not fit in a signed
    64-bit integer and :class:`TypeError` when ``name`` is not a string.
    """
    if not isinstance(name, str):
        raise TypeError("a lock name must be a str, not %s" % type(name).__name__)
    try:
        packed_id = _LOCK_ID.pack(lock_id)
    except struct.error as exc:
        raise ValueError("lock id %r does not fit in a signed 64-bit integer" % (lock_id,)) from exc
    return checksum(name.encode("utf-8") + packed_id)
