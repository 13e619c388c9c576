"""Table-driven codecs for the three Waltz message families (``L``, ``S``, ``A``).

A message class is a frozen attrs class whose every field is declared with
:func:`wire`, naming the :class:`WireType` that carries it. Field order is wire
order, and the family's common header fields come first because they live on
the family's base class (attrs puts inherited fields first).

A :class:`MessageCodec` is a table from type code to :class:`MessageSpec`
(code, class, :class:`Layout`). The layouts are built once from the field
declarations, so encoding and decoding are the same loop for every message and
nothing branches on the message type.

A payload is ``type u8 | common header | body``. :meth:`MessageCodec.decode`
raises only :class:`~waltz.protocols.errors.ProtocolError` subclasses, whatever
the bytes; :meth:`MessageCodec.encode` raises :class:`ValueError` for a message
the negotiated version cannot carry or a field value the wire cannot hold.
"""

import struct
import uuid
from collections.abc import Mapping

import attr

from waltz.protocols.compiled import compile_message
from waltz.protocols.errors import (
    ChecksumError, DecodeError, ProtocolError, UnexpectedMessageType, UnknownMessageType)
from waltz.protocols.primitives import Reader, Writer
from waltz.protocols.values import Record, RecordHeader, ReqId, checksum

#: attrs metadata key holding a field's :class:`FieldSpec` arguments.
_WIRE = "waltz.wire"

#: What a broken field value can raise inside a Writer; encode turns them into ValueError.
_ENCODE_ERRORS = (ValueError, TypeError, AttributeError, OverflowError, struct.error)


# ---------------------------------------------------------------------------
# Wire types: how one field travels.
#
# Every wire type has ``doc`` (its name in docs/protocol.md), ``min_size`` (the
# fewest bytes it can occupy, used to bound hostile counts), ``write(w, value)``,
# ``read(r, what)`` and ``convert(value)`` (the attrs converter for the field).
# ---------------------------------------------------------------------------

def _identity(value):
    return value


@attr.s(frozen=True, slots=True, auto_attribs=True)
class Scalar:
    """A primitive from :mod:`waltz.protocols.primitives` (``i32``, ``String``...)."""

    doc: str
    min_size: int
    writer: object  # unbound Writer method
    reader: object  # unbound Reader method
    nullable: bool = True
    converter: object = _identity
    #: For ``int[]``: the most items a decoder accepts (None: as many as the frame holds).
    max_count: object = None

    def write(self, w: Writer, value):
        if value is None and not self.nullable:
            raise ValueError("%s must not be null" % self.doc)
        self.writer(w, value)

    def read(self, r: Reader, what: str):
        value = self.reader(r, what)
        if value is None and not self.nullable:
            raise DecodeError("%s is null" % what)
        return value

    def convert(self, value):
        return None if value is None else self.converter(value)


def _to_uuid(value):
    return value if isinstance(value, uuid.UUID) else uuid.UUID(str(value))


def _to_int_tuple(values):
    return None if values is None else tuple(map(int, values))


def _to_bytes(value):
    return value if type(value) is bytes else None if value is None else bytes(value)


I32 = Scalar("i32", 4, Writer.i32, Reader.i32, nullable=False)
I64 = Scalar("i64", 8, Writer.i64, Reader.i64, nullable=False)
BOOL = Scalar("bool", 1, Writer.boolean, Reader.boolean, nullable=False, converter=bool)
UUID = Scalar("UUID", 16, Writer.uuid, Reader.uuid, nullable=False, converter=_to_uuid)
INT_LIST = Scalar("int[]", 4, Writer.int_array, Reader.int_array, nullable=False,
                  converter=_to_int_tuple)


#: The most partitions a cluster has (``waltz.zk.metadata.MAX_PARTITIONS``, which is checked to agree).
MAX_PARTITION_IDS = 10_000


def bounded_long_list(max_count: int) -> Scalar:
    """``i32 n, n × i64`` read in one struct call, whose decoders refuse a count above ``max_count`` before
    reading an item (ids the receiver answers one by one: a frame full of them would cost far more than
    its bytes)."""
    def read(r: Reader, what: str) -> tuple:
        return r.long_array(what, max_count)
    return Scalar("i32 n, n × i64", 4, Writer.long_array, read, nullable=False, converter=_to_int_tuple,
                  max_count=max_count)


def bounded_int_list(max_count: int) -> Scalar:
    """``int[]`` whose decoders refuse a count above ``max_count`` before reading an item: for lists
    the receiver works through item by item (lock hashes), where a frame full of items would cost
    far more than its bytes."""
    def read(r: Reader, what: str) -> tuple:
        return r.int_array(what, max_count)
    return attr.evolve(INT_LIST, reader=read, max_count=max_count)
#: Non-null byte array (transaction data).
BYTES = Scalar("byte[]", 4, Writer.byte_array, Reader.byte_array, nullable=False, converter=_to_bytes)
#: Non-null UTF-8 string.
STRING = Scalar("String", 4, Writer.string, Reader.string, nullable=False)
#: UTF-8 string that may be null (length -1).
OPT_STRING = Scalar("String?", 4, Writer.string, Reader.string)


#: A list of partition ids: at most MAX_PARTITION_IDS (a message naming more names partitions no cluster has).
PARTITION_IDS = bounded_int_list(MAX_PARTITION_IDS)


@attr.s(frozen=True, slots=True, auto_attribs=True)
class Value:
    """A value class of :mod:`waltz.protocols.values` with its own ``encode``/``decode``."""

    cls: type
    min_size: int

    @property
    def doc(self) -> str:
        return self.cls.__name__

    def write(self, w: Writer, value):
        if not isinstance(value, self.cls):
            raise TypeError("expected %s, got %r" % (self.cls.__name__, value))
        value.encode(w)

    def read(self, r: Reader, what: str):
        return self.cls.decode(r)

    def convert(self, value):
        return value


@attr.s(frozen=True, slots=True, auto_attribs=True)
class _RecordValue(Value):
    """A :class:`Record`; null data is refused both ways (Record.decode refuses it on read)."""

    def write(self, w: Writer, value):
        if isinstance(value, Record) and value.data is None:
            raise ValueError("record %d has null data" % value.transaction_id)
        Value.write(self, w, value)


REQ_ID = Value(ReqId, ReqId.SIZE)
RECORD_HEADER = Value(RecordHeader, RecordHeader.SIZE)
RECORD = _RecordValue(Record, Record.MIN_SIZE)


@attr.s(frozen=True, slots=True, auto_attribs=True)
class EnumOf:
    """An ``IntEnum`` carried as an i32; an undefined value is a decode error."""

    enum: type
    min_size: int = 4

    @property
    def doc(self) -> str:
        return "i32 %s" % self.enum.__name__

    def write(self, w: Writer, value):
        w.i32(self.enum(value))

    def read(self, r: Reader, what: str):
        raw = r.i32(what)
        try:
            return self.enum(raw)
        except ValueError:
            raise DecodeError("bad %s value %d" % (what, raw)) from None

    def convert(self, value):
        return self.enum(value)


@attr.s(frozen=True, slots=True, auto_attribs=True)
class ListOf:
    """An i32 count then that many items; the count is checked against the bytes left."""

    item: object

    @property
    def doc(self) -> str:
        return "i32 n, n × %s" % self.item.doc

    @property
    def min_size(self) -> int:
        return 4

    def write(self, w: Writer, values):
        w.i32(len(values))
        for value in values:
            self.item.write(w, value)

    def read(self, r: Reader, what: str):
        n = r.count(what, max(1, self.item.min_size))
        item_what = what + " item"
        return tuple(self.item.read(r, item_what) for _ in range(n))

    def convert(self, values):
        if values is None:          # a conditional list absent from the wire (as Scalar.convert)
            return None
        if type(values) is tuple and _converter(self.item) is None:
            return values           # items that need no conversion: keep the very tuple (see compiled.py)
        if isinstance(values, Mapping):
            values = values.items()
        return tuple(self.item.convert(value) for value in values)


@attr.s(frozen=True, slots=True, auto_attribs=True)
class PairOf:
    """Two wire types back to back, held as a Python 2-tuple."""

    first: object
    second: object

    @property
    def doc(self) -> str:
        return "(%s, %s)" % (self.first.doc, self.second.doc)

    @property
    def min_size(self) -> int:
        return self.first.min_size + self.second.min_size

    def write(self, w: Writer, value):
        first, second = value
        self.first.write(w, first)
        self.second.write(w, second)

    def read(self, r: Reader, what: str):
        return (self.first.read(r, what), self.second.read(r, what))

    def convert(self, value):
        first, second = value
        return (self.first.convert(first), self.second.convert(second))


@attr.s(frozen=True, slots=True, auto_attribs=True)
class OptionalOf:
    """``bool present`` then the item when present; ``None`` when absent."""

    item: object

    @property
    def doc(self) -> str:
        return "bool present, then %s if present" % self.item.doc

    @property
    def min_size(self) -> int:
        return 1

    def write(self, w: Writer, value):
        w.boolean(value is not None)
        if value is not None:
            self.item.write(w, value)

    def read(self, r: Reader, what: str):
        return self.item.read(r, what) if r.boolean(what + " present") else None

    def convert(self, value):
        return None if value is None else self.item.convert(value)


class StructOf:
    """A nested attrs class declared with :func:`wire` fields, encoded field by field."""

    __slots__ = ("layout",)

    def __init__(self, cls):
        self.layout = Layout(cls)

    @property
    def doc(self) -> str:
        return self.layout.name

    @property
    def min_size(self) -> int:
        return self.layout.min_size

    def write(self, w: Writer, value):
        if not isinstance(value, self.layout.cls):
            raise TypeError("expected %s, got %r" % (self.layout.name, value))
        self.layout.write(w, value)

    def read(self, r: Reader, what: str):
        return self.layout.read(r)

    def convert(self, value):
        return value


# ---------------------------------------------------------------------------
# Field declarations and layouts
# ---------------------------------------------------------------------------

def wire(wire_type, *, only_if: str = None, only_if_not: str = None, checksum_of: str = None,
         **kwargs):
    """Declare an attrs field carried on the wire as ``wire_type``.

    ``only_if`` / ``only_if_not`` name an earlier bool field: the field is on the
    wire only when that flag is true / false, and is ``None`` otherwise.
    ``checksum_of`` names the byte field this i32 is the CRC32C of; decoding
    verifies it and raises :class:`ChecksumError` on a mismatch.
    """
    if only_if and only_if_not:
        raise TypeError("give only_if or only_if_not, not both")
    condition = (only_if, True) if only_if else (only_if_not, False) if only_if_not else None
    if condition is not None:
        kwargs.setdefault("default", None)
    metadata = {_WIRE: (wire_type, condition, checksum_of)}
    return attr.ib(converter=_converter(wire_type), metadata=metadata, **kwargs)


#: Scalar converters that pass None through themselves, so attrs can call them directly.
_NONE_SAFE_CONVERTERS = (_to_int_tuple, _to_bytes)


def _converter(wire_type):
    """The attrs converter for a field of ``wire_type``; None where conversion is the identity
    (a message is built once per transaction per hop, and a converter call per field shows)."""
    if isinstance(wire_type, Scalar) and wire_type.converter is _identity:
        return None
    if isinstance(wire_type, Scalar) and wire_type.converter in _NONE_SAFE_CONVERTERS:
        return wire_type.converter
    if isinstance(wire_type, (Value, StructOf)):
        return None
    return wire_type.convert


@attr.s(frozen=True, slots=True, auto_attribs=True)
class FieldSpec:
    """One wire field of a class: name, wire type, presence condition, checksum role."""

    name: str
    wire_type: object
    #: ``(flag field name, flag value for which this field is present)`` or ``None``.
    condition: tuple = None
    #: Name of the byte field this field is the CRC32C of, or ``None``.
    checksum_of: str = None

    def describe(self) -> str:
        """This field as one entry of a body layout in docs/protocol.md."""
        text = "%s %s" % (self.name, self.wire_type.doc)
        if self.checksum_of:
            text += " (CRC32C of %s)" % self.checksum_of
        if self.condition:
            flag, value = self.condition
            text += " if %s%s" % ("" if value else "not ", flag)
        return text


#: Fixed-size wire types the compiled fast path packs in one struct call: their format characters.
#: ``bool`` is left out on purpose: a struct ``?`` reads any non-zero byte as true, the wire only ``1``.
_FIXED_FORMATS = {id(I32): "i", id(I64): "q", id(REQ_ID): "iiii"}


def _plan_step(field):
    """The :mod:`~waltz.protocols.compiled` step of one field, or None when only the generic loop handles it."""
    if field.condition is not None:
        return None
    wire_type = field.wire_type
    fmt = _FIXED_FORMATS.get(id(wire_type))
    if fmt is not None:
        return ("fixed", [(field.name, fmt)])
    if wire_type is BOOL:
        return ("bool", field.name)
    if wire_type is BYTES:
        return ("bytes", field.name)
    if isinstance(wire_type, Scalar) and wire_type.writer is Writer.int_array:
        return ("ints", field.name, wire_type.max_count)
    if isinstance(wire_type, ListOf) and type(wire_type.item) in (Value, _RecordValue):
        return ("values", field.name, wire_type.item.cls, wire_type.item.min_size)
    return None


def compile_plan(layout):
    """The layout as a :func:`~waltz.protocols.compiled.compile_message` plan (consecutive fixed
    fields merged into one run), or None when a field needs the generic loop."""
    plan = []
    for field in layout.fields:
        step = _plan_step(field)
        if step is None:
            return None
        if step[0] == "fixed" and plan and plan[-1][0] == "fixed":
            plan[-1][1].extend(step[1])
        else:
            plan.append(step)
    return plan


class Layout:
    """The wire fields of one attrs class, in order, with the loops that encode and decode them."""

    __slots__ = ("cls", "name", "fields", "min_size", "checks", "_whats", "_conditions")

    def __init__(self, cls):
        self.cls = cls
        self.name = cls.__name__
        fields = []
        for a in attr.fields(cls):
            if _WIRE not in a.metadata:
                raise TypeError("%s.%s is not declared with wire()" % (self.name, a.name))
            wire_type, condition, checksum_of = a.metadata[_WIRE]
            fields.append(FieldSpec(a.name, wire_type, condition, checksum_of))
        self.fields = tuple(fields)
        names = [f.name for f in fields]
        self.min_size = sum(f.wire_type.min_size for f in fields if f.condition is None)
        self._whats = tuple("%s.%s" % (self.name, f.name) for f in fields)
        # (field index, flag index, flag value) for conditional fields, by field index
        self._conditions = tuple(
            None if f.condition is None else (names.index(f.condition[0]), f.condition[1])
            for f in fields)
        #: (checksum field index, data field index) pairs verified on decode.
        self.checks = tuple(
            (i, names.index(f.checksum_of)) for i, f in enumerate(fields) if f.checksum_of)

    def write(self, w: Writer, obj):
        """Append ``obj``'s fields to ``w``; ``ValueError`` names a field the wire cannot hold."""
        for index in range(len(self.fields)):
            self.write_field(index, w, obj)

    def write_field(self, index, w: Writer, obj):
        """Append field ``index`` of ``obj`` (nothing when its condition leaves it off the wire)."""
        f, what = self.fields[index], self._whats[index]
        value = getattr(obj, f.name)
        if f.condition is not None and bool(getattr(obj, f.condition[0])) != f.condition[1]:
            if value is not None:
                raise ValueError("%s must be None when %s is %s"
                                 % (what, f.condition[0], not f.condition[1]))
            return
        try:
            f.wire_type.write(w, value)
        except _ENCODE_ERRORS as exc:
            raise ValueError("cannot encode %s = %r: %s" % (what, value, exc)) from None

    def read(self, r: Reader):
        """Read one instance; verifies declared checksums."""
        values = []
        for index in range(len(self.fields)):
            self.read_field(index, r, values)
        for crc_index, data_index in self.checks:
            self._verify(values[crc_index], values[data_index])
        try:
            return self.cls(*values)
        except (ValueError, TypeError) as exc:
            raise DecodeError("bad %s: %s" % (self.name, exc)) from None

    def read_field(self, index, r: Reader, values):
        """Read field ``index`` onto ``values`` (None when its condition leaves it off the wire)."""
        cond = self._conditions[index]
        if cond is not None and bool(values[cond[0]]) != cond[1]:
            values.append(None)
        else:
            values.append(self.fields[index].wire_type.read(r, self._whats[index]))

    def _verify(self, carried, data):
        if carried is None or data is None:
            return
        computed = checksum(data)
        if computed != carried:
            raise ChecksumError("checksum mismatch in %s: carried %08x, data has %08x"
                                % (self.name, carried & 0xFFFFFFFF, computed & 0xFFFFFFFF))

    def describe(self, skip: int = 0) -> str:
        """The body layout (fields after the first ``skip``) as written in docs/protocol.md."""
        parts = [f.describe() for f in self.fields[skip:]]
        return ", ".join(parts) if parts else "(empty)"


# ---------------------------------------------------------------------------
# The codec table
# ---------------------------------------------------------------------------

@attr.s(frozen=True, slots=True, auto_attribs=True)
class MessageSpec:
    """One row of a codec table: type code, message class, layout, first version carrying it.

    ``fast_encode``/``fast_decode`` are the compiled shortcuts of :mod:`waltz.protocols.compiled`
    (None when the layout has a field only the generic loop handles).
    """

    code: int
    cls: type
    layout: Layout
    min_version: int
    fast_encode: object = None
    fast_decode: object = None

    @property
    def name(self) -> str:
        return self.cls.__name__


class MessageCodec:
    """Encodes and decodes the payloads of one message family through a table of :class:`MessageSpec`.

    ``base`` is the family's base class (its fields are the common header);
    ``classes`` are the message classes, each with a ``TYPE`` code and optionally
    a ``MIN_VERSION`` (default: the first supported version).
    """

    def __init__(self, magic: bytes, versions, base: type, classes):
        if len(magic) != 1:
            raise ValueError("magic must be one byte")
        self.magic = bytes(magic)
        self.versions = tuple(sorted(versions))
        self.base = base
        self.header_size = len(attr.fields(base))
        self._by_code = {}
        self._by_class = {}
        for cls in classes:
            self._add(cls)

    def _add(self, cls):
        code = cls.TYPE
        if not issubclass(cls, self.base):
            raise TypeError("%s is not a %s" % (cls.__name__, self.base.__name__))
        if not 0 <= code <= 255 or code in self._by_code:
            raise ValueError("bad or duplicate type code %r for %s" % (code, cls.__name__))
        layout = Layout(cls)
        plan = compile_plan(layout)
        fast = (None, None) if plan is None else compile_message(
            cls, code, plan, [(layout.fields[c].name, layout.fields[d].name) for c, d in layout.checks])
        spec = MessageSpec(code, cls, layout, getattr(cls, "MIN_VERSION", self.versions[0]), *fast)
        self._by_code[code] = spec
        self._by_class[cls] = spec

    @property
    def family(self) -> str:
        return self.magic.decode("ascii")

    @property
    def replies(self) -> frozenset:
        """The message classes the side that opened a connection receives: every class of the family but its
        requests (in each family, the classes named ``...Request``; the side that accepted the connection
        receives those). A client given ``decoder(version, codec.replies)`` refuses a request sent to it
        before decoding its body, as the servers refuse a reply."""
        return frozenset(cls for cls in self._by_class if not cls.__name__.endswith("Request"))

    @property
    def specs(self) -> tuple:
        """Every row of the table, by type code."""
        return tuple(self._by_code[code] for code in sorted(self._by_code))

    def spec_for(self, message_or_class) -> MessageSpec:
        """The table row of a message class (or of a message's class)."""
        cls = message_or_class if isinstance(message_or_class, type) else type(message_or_class)
        try:
            return self._by_class[cls]
        except KeyError:
            raise ValueError("%s is not a message of family %s"
                             % (cls.__name__, self.family)) from None

    def supports(self, message_or_class, version: int) -> bool:
        """True when ``version`` of this family can carry that message type."""
        return version in self.versions and version >= self.spec_for(message_or_class).min_version

    def encode(self, message, version: int) -> bytes:
        """The frame payload for ``message``: type u8, common header, body."""
        self._check_version(version)
        spec = self.spec_for(message)
        if version < spec.min_version:
            raise ValueError("%s (type %d) needs %s version %d or later, not %d"
                             % (spec.name, spec.code, self.family, spec.min_version, version))
        if spec.fast_encode is not None:
            try:
                return spec.fast_encode(message)
            except Exception:  # noqa: BLE001 - the generic loop gives the result or the precise error
                pass
        w = Writer().u8(spec.code)
        spec.layout.write(w, message)
        return w.getvalue()

    def _check_version(self, version):
        if version not in self.versions:
            raise ValueError("family %s has no version %r (supported: %s)" % (self.family, version, self.versions))

    def encoder(self, version: int):
        """``encode(message)`` for one negotiated ``version``: :meth:`encode` with the table look-ups done
        once. A connection encodes every message it sends with the same version."""
        self._check_version(version)
        fast = {spec.cls: spec.fast_encode for spec in self._by_code.values()
                if spec.fast_encode is not None and version >= spec.min_version}
        generic = self.encode

        def encode(message):
            fast_encode = fast.get(type(message))
            if fast_encode is not None:
                try:
                    return fast_encode(message)
                except Exception:  # noqa: BLE001 - the generic path gives the result or the precise error
                    pass
            return generic(message, version)
        return encode

    def decoder(self, version: int, accepted=None):
        """``decode(payload)`` for one negotiated ``version``: :meth:`decode` with the table look-ups
        done once (a connection decodes every frame it receives with the same version).

        With ``accepted`` (the message classes this side receives), a frame of any other type of the
        family fails with :class:`UnexpectedMessageType` before its body is decoded: a body is decoded item
        by item, and a peer could otherwise make the reactor decode a frame's worth of list items (seconds
        for a large frame) of a message that is refused anyway."""
        self._check_version(version)
        fast = {code: spec.fast_decode for code, spec in self._by_code.items()
                if spec.fast_decode is not None and version >= spec.min_version}
        generic = self.decode
        accepted = None if accepted is None else frozenset(accepted)
        refused = {} if accepted is None else {
            code: spec.name for code, spec in self._by_code.items() if spec.cls not in accepted}

        def decode(payload):
            if refused and payload and payload[0] in refused:
                raise UnexpectedMessageType("message type %d (%s) is not one this side of a family %s connection "
                                            "receives" % (payload[0], refused[payload[0]], self.family))
            fast_decode = fast.get(payload[0]) if payload else None
            if fast_decode is not None:
                try:
                    return fast_decode(payload)
                except Exception:  # noqa: BLE001 - the generic path gives the result or the precise error
                    pass
            return generic(payload, version)
        return decode

    def decode(self, payload, version: int):
        """The message in ``payload`` (bytes or memoryview); raises only ProtocolError subclasses."""
        try:
            return self._decode(payload, version)
        except ProtocolError:
            raise
        except Exception as exc:  # a defect in a decoder must still read as a bad frame
            raise DecodeError("internal decoder error in family %s: %r" % (self.family, exc)) from exc

    def _decode(self, payload, version):
        if version not in self.versions:
            raise DecodeError("family %s has no version %r" % (self.family, version))
        spec = self._by_code.get(payload[0]) if payload else None
        if spec is not None and spec.fast_decode is not None and version >= spec.min_version:
            try:
                return spec.fast_decode(payload)
            except Exception:  # noqa: BLE001 - the generic loop gives the result or the precise error
                pass
        r = Reader(payload)
        code = r.u8("message type")
        spec = self._by_code.get(code)
        if spec is None or version < spec.min_version:
            raise UnknownMessageType("unknown message type %d for family %s version %d"
                                     % (code, self.family, version))
        message = spec.layout.read(r)
        r.expect_end(spec.name)
        return message
