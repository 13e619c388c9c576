"""Big-endian primitive encodings shared by every Waltz wire format.

The encodings follow the original (riff's ByteBufMessageAttributeWriter):

* ``bool``: one byte, only ``1`` reads as true;
* ``byte[]``: i32 length then the bytes, ``-1`` meaning null;
* ``int[]``: i32 count then that many i32 values;
* ``String``: UTF-8 bytes encoded like a ``byte[]``;
* ``UUID``: two i64, most significant first.

:class:`Writer` builds a payload in one ``bytearray``; :class:`Reader` walks a
payload without copying it and raises :class:`DecodeError` naming the field
when the bytes run out or a value is out of range.
"""

import struct
import uuid

from waltz.protocols.errors import DecodeError

_I8 = struct.Struct(">b")
_U8 = struct.Struct(">B")
_I16 = struct.Struct(">h")
_I32 = struct.Struct(">i")
_I64 = struct.Struct(">q")
_UUID = struct.Struct(">QQ")

I32_MIN, I32_MAX = -(2 ** 31), 2 ** 31 - 1
I64_MIN, I64_MAX = -(2 ** 63), 2 ** 63 - 1

#: The largest count any array or byte string may claim; a frame can never hold more.
MAX_ARRAY_LENGTH = I32_MAX


class Writer:
    """Appends big-endian primitives to a growing buffer."""

    __slots__ = ("_buf",)

    def __init__(self):
        self._buf = bytearray()

    def getvalue(self) -> bytes:
        """Return everything written so far as ``bytes``."""
        return bytes(self._buf)

    def __len__(self):
        return len(self._buf)

    def u8(self, value: int) -> "Writer":
        self._buf += _U8.pack(value)
        return self

    def i8(self, value: int) -> "Writer":
        self._buf += _I8.pack(value)
        return self

    def i16(self, value: int) -> "Writer":
        self._buf += _I16.pack(value)
        return self

    def i32(self, value: int) -> "Writer":
        self._buf += _I32.pack(value)
        return self

    def i64(self, value: int) -> "Writer":
        self._buf += _I64.pack(value)
        return self

    def boolean(self, value: bool) -> "Writer":
        self._buf.append(1 if value else 0)
        return self

    def pack(self, fmt: struct.Struct, *values) -> "Writer":
        """Append several fixed-size fields at once (a hot-path shortcut for records)."""
        self._buf += fmt.pack(*values)
        return self

    def raw(self, data) -> "Writer":
        """Append bytes with no length prefix."""
        self._buf += data
        return self

    def byte_array(self, data) -> "Writer":
        """Append an i32 length and the bytes; ``None`` is written as length -1."""
        if data is None:
            return self.i32(-1)
        self.i32(len(data))
        self._buf += data
        return self

    def string(self, text) -> "Writer":
        """Append a UTF-8 string as a ``byte[]``; ``None`` is written as null."""
        return self.byte_array(None if text is None else text.encode("utf-8"))

    def int_array(self, values) -> "Writer":
        """Append an i32 count followed by that many i32 values."""
        return self._array(values, "i")

    def long_array(self, values) -> "Writer":
        """Append an i32 count followed by that many i64 values."""
        return self._array(values, "q")

    def _array(self, values, code):
        values = tuple(values)
        self.i32(len(values))
        if values:
            self._buf += struct.pack(">%d%s" % (len(values), code), *values)
        return self

    def uuid(self, value: uuid.UUID) -> "Writer":
        self._buf += value.bytes  # 16 bytes, most significant first
        return self


class Reader:
    """Reads big-endian primitives from a payload, checking every bound."""

    __slots__ = ("_view", "_pos", "_end")

    def __init__(self, data, offset: int = 0, end: int = None):
        self._view = memoryview(data)
        self._pos = offset
        self._end = len(self._view) if end is None else end

    @property
    def position(self) -> int:
        return self._pos

    @property
    def remaining(self) -> int:
        return self._end - self._pos

    def _take(self, size: int, what: str) -> memoryview:
        if size > self._end - self._pos:
            raise DecodeError(
                "short body: %s needs %d bytes at offset %d, %d left"
                % (what, size, self._pos, self._end - self._pos))
        start = self._pos
        self._pos += size
        return self._view[start:self._pos]

    def _unpack(self, fmt: struct.Struct, what: str):
        start = self._pos
        self._take(fmt.size, what)
        return fmt.unpack_from(self._view, start)[0]

    def u8(self, what: str = "u8") -> int:
        return self._unpack(_U8, what)

    def i8(self, what: str = "i8") -> int:
        return self._unpack(_I8, what)

    def i16(self, what: str = "i16") -> int:
        return self._unpack(_I16, what)

    def i32(self, what: str = "i32") -> int:
        return self._unpack(_I32, what)

    def i64(self, what: str = "i64") -> int:
        return self._unpack(_I64, what)

    def boolean(self, what: str = "bool") -> bool:
        """``00`` false, ``01`` true; any other byte is a :class:`DecodeError` (a corrupted flag is
        caught rather than read as one or the other)."""
        value = self._unpack(_U8, what)
        if value > 1:
            raise DecodeError("bad %s byte 0x%02x (expected 00 or 01)" % (what, value))
        return value == 1

    def raw(self, size: int, what: str = "bytes") -> bytes:
        return bytes(self._take(size, what))

    def unpack(self, fmt: struct.Struct, what: str) -> tuple:
        """Read several fixed-size fields at once (a hot-path shortcut for records)."""
        start = self._pos
        self._take(fmt.size, what)
        return fmt.unpack_from(self._view, start)

    def byte_array(self, what: str = "byte[]"):
        """Read an i32 length and the bytes; length -1 gives ``None``."""
        length = self.i32(what + " length")
        if length == -1:
            return None
        if length < 0:
            raise DecodeError("bad %s length %d" % (what, length))
        return bytes(self._take(length, what))

    def string(self, what: str = "string"):
        data = self.byte_array(what)
        if data is None:
            return None
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DecodeError("%s is not valid UTF-8: %s" % (what, exc)) from None

    def int_array(self, what: str = "int[]", max_count: int = None) -> tuple:
        """An i32 count and that many i32; a count above ``max_count`` (when given) is refused
        before any item is read."""
        return self._array(what, max_count, 4, "i")

    def long_array(self, what: str = "long[]", max_count: int = None) -> tuple:
        """An i32 count and that many i64 (the wire's ``i32 n, n × i64``), in one struct call; a count
        above ``max_count`` (when given) is refused before any item is read."""
        return self._array(what, max_count, 8, "q")

    def _array(self, what, max_count, size, code):
        count = self.i32(what + " count")
        if count < 0:
            raise DecodeError("bad %s count %d" % (what, count))
        if max_count is not None and count > max_count:
            raise DecodeError("%s count %d is over the limit of %d" % (what, count, max_count))
        start = self._pos
        self._take(size * count, what)
        return struct.unpack_from(">%d%s" % (count, code), self._view, start) if count else ()

    def uuid(self, what: str = "uuid") -> uuid.UUID:
        return uuid.UUID(bytes=bytes(self._take(_UUID.size, what)))

    def count(self, what: str, item_size: int = 1) -> int:
        """Read an i32 element count and check that the remaining bytes could hold it.

        ``item_size`` is the smallest encoded size of one element, so a hostile
        count cannot make the decoder allocate or loop beyond the frame.
        """
        n = self.i32(what + " count")
        if n < 0:
            raise DecodeError("bad %s count %d" % (what, n))
        if n * item_size > self.remaining:
            raise DecodeError("%s count %d exceeds the %d bytes left" % (what, n, self.remaining))
        return n

    def expect_end(self, what: str = "message"):
        """Raise :class:`DecodeError` when bytes are left over after a message body."""
        if self._pos != self._end:
            raise DecodeError("overlong body: %d unread bytes after %s" % (self._end - self._pos, what))
