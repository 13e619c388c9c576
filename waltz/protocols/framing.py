"""Frames and the Hello handshake, shared by every Waltz connection.

Every frame is ``magic u8 | version i16 | length i32 | payload`` (big-endian).
A frame with length 0 is a keep-alive. Right after connecting, both peers send
a Hello frame (magic ``H``, version 0) whose payload lists the protocol
versions they support and names them; each side then uses the highest version
both support. See ``docs/protocol.md``.
"""

import struct

import attr

from waltz.protocols.errors import DecodeError, HandshakeError
from waltz.protocols.primitives import Reader, Writer

HEADER = struct.Struct(">chi")
HEADER_SIZE = HEADER.size  # 7 bytes

HELLO_MAGIC = b"H"
HELLO_VERSION = 0
#: The largest Hello accepted: a few versions and a name. Checked before the frame is read, so a peer
#: cannot make a process buffer and decode megabytes before it has even said hello.
MAX_HELLO_SIZE = 1024

#: Frames whose payload is larger than this close the connection (configurable per protocol).
DEFAULT_MAX_FRAME_SIZE = 16 * 1024 * 1024

#: The most data one transaction may carry. The client refuses to build a bigger one and the server
#: closes a connection that appends one, so that every frame carrying one transaction's data (the
#: append, a record read back from storage, a data response) fits in DEFAULT_MAX_FRAME_SIZE with room
#: to spare for its other fields.
MAX_TRANSACTION_DATA_SIZE = 15 * 1024 * 1024

#: A message carrying several records (a store batch to the storages, a storage's record list) stops
#: taking records once the next one would bring its data past this; the first is always taken. With
#: MAX_TRANSACTION_DATA_SIZE, every such message fits in DEFAULT_MAX_FRAME_SIZE.
MAX_BATCH_DATA_SIZE = 8 * 1024 * 1024


def encode_frame_header(magic: bytes, version: int, length: int) -> bytes:
    """The 7-byte header of a frame carrying ``length`` payload bytes."""
    return HEADER.pack(magic, version, length)


def encode_frame(magic: bytes, version: int, payload: bytes) -> bytes:
    """A whole frame: header and payload."""
    return HEADER.pack(magic, version, len(payload)) + payload


def decode_frame_header(data, offset: int = 0):
    """Return ``(magic, version, length)`` of the header at ``offset``."""
    return HEADER.unpack_from(data, offset)


@attr.s(frozen=True, slots=True, auto_attribs=True)
class Hello:
    """A peer's Hello: the versions it supports and its name (e.g. ``"Waltz Server"``)."""

    versions: tuple
    name: str

    def encode(self) -> bytes:
        w = Writer().i32(len(self.versions))
        for version in self.versions:
            w.i16(version)
        return w.string(self.name).getvalue()

    def to_frame(self) -> bytes:
        return encode_frame(HELLO_MAGIC, HELLO_VERSION, self.encode())

    @classmethod
    def decode(cls, payload) -> "Hello":
        r = Reader(payload)
        count = r.count("hello versions", 2)
        versions = tuple(r.i16("hello version") for _ in range(count))
        name = r.string("hello name")
        r.expect_end("hello")
        if name is None:
            raise DecodeError("hello name is null")
        return cls(versions, name)


def negotiate(ours, theirs) -> int:
    """The highest version both sides support; :class:`HandshakeError` when none."""
    common = set(ours) & set(theirs)
    if not common:
        raise HandshakeError("no common protocol version: we support %s, the peer supports %s"
                             % (sorted(ours), sorted(theirs)))
    return max(common)
