"""Java ``DataOutput`` / ``DataInput`` encodings, as the original writes znode data.

Everything is big-endian. Strings are Java's ``writeUTF``: an unsigned 16-bit
byte count followed by *modified UTF-8* — UTF-8 except that U+0000 is the two
bytes ``C0 80`` and characters above U+FFFF are written as their two UTF-16
surrogates, three bytes each (so at most 65535 bytes per string).

:class:`DataReader` raises :class:`EncodingError` (a ``ValueError``) when the
bytes run out or are malformed; :func:`waltz.zk.znodes.decode` turns that into
a :class:`~waltz.zk.errors.ZnodeDecodeError` naming the znode.
"""

import struct
import uuid

_I8 = struct.Struct(">b")
_U16 = struct.Struct(">H")
_I32 = struct.Struct(">i")
_I64 = struct.Struct(">q")
_UUID = struct.Struct(">QQ")

I32_MIN, I32_MAX = -(2 ** 31), 2 ** 31 - 1
I64_MIN, I64_MAX = -(2 ** 63), 2 ** 63 - 1
MAX_UTF_BYTES = 0xFFFF


class EncodingError(ValueError):
    """Bytes that do not decode, or a value that cannot be encoded."""


def encode_modified_utf8(text):
    """Java's modified UTF-8 for ``text`` (without the length prefix)."""
    units = []
    for char in text:
        code = ord(char)
        if code > 0xFFFF:
            code -= 0x10000
            units.append(chr(0xD800 + (code >> 10)))
            units.append(chr(0xDC00 + (code & 0x3FF)))
        else:
            units.append(char)
    # 'surrogatepass' writes each surrogate as its own 3-byte sequence, as Java does.
    return "".join(units).encode("utf-8", "surrogatepass").replace(b"\x00", b"\xc0\x80")


def decode_modified_utf8(data):
    """The string encoded by :func:`encode_modified_utf8`; raises :class:`EncodingError`."""
    try:
        # C0 is never a continuation byte, so C0 80 can only be Java's encoded NUL.
        units = bytes(data).replace(b"\xc0\x80", b"\x00").decode("utf-8", "surrogatepass")
        return units.encode("utf-16-be", "surrogatepass").decode("utf-16-be", "surrogatepass")
    except UnicodeError as exc:
        raise EncodingError("malformed modified UTF-8: %s" % exc) from None


class DataWriter:
    """Appends Java ``DataOutput`` primitives to a buffer."""

    __slots__ = ("_buf",)

    def __init__(self):
        self._buf = bytearray()

    def getvalue(self):
        """Everything written so far, as ``bytes``."""
        return bytes(self._buf)

    def _pack(self, codec, value, low, high, what):
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise EncodingError("%s out of range: %r" % (what, value))
        self._buf += codec.pack(value)
        return self

    def byte(self, value):
        """``writeByte``: a signed 8-bit value."""
        return self._pack(_I8, value, -128, 127, "byte")

    def int(self, value):
        """``writeInt``: a signed 32-bit value."""
        return self._pack(_I32, value, I32_MIN, I32_MAX, "int")

    def long(self, value):
        """``writeLong``: a signed 64-bit value."""
        return self._pack(_I64, value, I64_MIN, I64_MAX, "long")

    def utf(self, text):
        """``writeUTF``: u16 byte count then modified UTF-8."""
        if not isinstance(text, str):
            raise EncodingError("expected a string, got %r" % (text,))
        data = encode_modified_utf8(text)
        if len(data) > MAX_UTF_BYTES:
            raise EncodingError("string too long for writeUTF: %d bytes" % len(data))
        self._buf += _U16.pack(len(data))
        self._buf += data
        return self

    def uuid(self, value):
        """A UUID as two longs, most significant first (``UUID.getMost/LeastSignificantBits``)."""
        self._buf += value.bytes  # the 16 bytes are exactly the two big-endian halves
        return self

    def ints(self, values):
        """An i32 count then that many i32 values."""
        values = tuple(values)
        self.int(len(values))
        for value in values:
            self.int(value)
        return self


class DataReader:
    """Reads Java ``DataInput`` primitives from ``bytes``."""

    __slots__ = ("_data", "_pos")

    def __init__(self, data):
        self._data = memoryview(bytes(data))
        self._pos = 0

    def _take(self, size, what):
        end = self._pos + size
        if size < 0 or end > len(self._data):
            raise EncodingError("truncated: need %d bytes for %s at offset %d, %d left"
                                % (size, what, self._pos, len(self._data) - self._pos))
        chunk = self._data[self._pos:end]
        self._pos = end
        return chunk

    def _unpack(self, codec, what):
        return codec.unpack(self._take(codec.size, what))[0]

    def byte(self, what="byte"):
        return self._unpack(_I8, what)

    def int(self, what="int"):
        return self._unpack(_I32, what)

    def long(self, what="long"):
        return self._unpack(_I64, what)

    def utf(self, what="string"):
        size = self._unpack(_U16, what + " length")
        return decode_modified_utf8(self._take(size, what))

    def uuid(self, what="uuid"):
        return uuid.UUID(bytes=bytes(self._take(_UUID.size, what)))

    def count(self, what, item_size):
        """An i32 element count, checked against the bytes left (each item >= ``item_size``)."""
        number = self.int(what + " count")
        if number < 0 or number * item_size > self.remaining():
            raise EncodingError("bad %s count %d at offset %d (%d bytes left)"
                                % (what, number, self._pos - 4, self.remaining()))
        return number

    def ints(self, what="int list"):
        return tuple(self.int(what) for _ in range(self.count(what, 4)))

    def version(self, expected, what="version"):
        """Read the version byte and insist on ``expected``."""
        found = self.byte(what)
        if found != expected:
            raise EncodingError("unsupported %s %d (expected %d)" % (what, found, expected))
        return found

    def remaining(self):
        return len(self._data) - self._pos

    def finish(self):
        """Insist that every byte was consumed."""
        if self.remaining():
            raise EncodingError("%d unexpected trailing bytes at offset %d" % (self.remaining(), self._pos))
