"""Straight-line encoders and decoders generated from a message's layout (the codec's fast path).

The table-driven loop of :mod:`waltz.protocols.codec` costs several Python calls
per field. The messages sent once or more per transaction (``AppendRequest``,
``FeedData``, the storage appends and their responses) are decoded and encoded
millions of times, so for each message class whose fields are all of the simple
kinds below, :func:`compile_message` generates one function that encodes it and
one that decodes it, with no loop and no per-field call: a run of fixed-size
fields is one struct call, a byte array is a length and a slice.

The generated functions are only a shortcut. They raise on anything unusual (a
short or overlong body, a bad length, a checksum mismatch, a value the wire cannot
hold, an unexpected type), and the codec then runs the generic loop on the same
input, which gives the result or the precise, field-naming error. So the two paths
cannot disagree on what a valid message is: the generic loop stays the definition,
and ``tests/protocols/test_codec_compiled.py`` checks that both give the same bytes
and values.

A layout is described to :func:`compile_message` as a *plan*, a list of steps:

* ``("fixed", [(name, fmt), ...])``: consecutive fixed-size fields; ``fmt`` is a
  struct format, ``"iiii"`` for a :class:`~waltz.protocols.values.ReqId`;
* ``("bool", name)``: one byte, 1 true and 0 false (anything else refused);
* ``("bytes", name)``: an i32 length and that many bytes (never null here);
* ``("ints", name, max_count)``: an i32 count (at most ``max_count`` unless None) and that many i32;
* ``("values", name, cls, min_size)``: an i32 count and that many ``cls`` values,
  each with its own ``encode(writer)`` / ``decode(reader)``.

and ``checks``: ``(crc field, data field)`` pairs whose CRC32C is verified on decode.
"""

import struct

import attr

from waltz.protocols.primitives import Reader, Writer
from waltz.protocols.values import RECORD_PREFIX, Record, ReqId, checksum

_I32 = struct.Struct(">i")
#: Counts whose struct is kept: lock lists are short. Longer ones (rare; the count comes off the
#: wire, so the cache must not grow with what a peer sends) get a struct each time.
_CACHED_INT_RUNS = 64
_INT_RUNS = [struct.Struct(">%di" % count) for count in range(_CACHED_INT_RUNS + 1)]


def _ints_struct(count):
    """The struct of ``count`` big-endian i32."""
    return _INT_RUNS[count] if count <= _CACHED_INT_RUNS else struct.Struct(">%di" % count)


class _Invalid(Exception):
    """Raised by generated code for input it leaves to the generic loop."""


#: ``(values, item class, their encoding)`` of the last list encoded: a batch goes to every replica in
#: its own message, so the same records tuple is encoded several times in a row (tuples of frozen
#: values do not change, and the memo holds the tuple, so its identity cannot be reused meanwhile).
_last_encoded = (None, None, None)
#: Encodings larger than this are not kept (the memo would pin a large response until the next list).
_MEMO_MAX_BYTES = 1024 * 1024


def _encode_values(values, cls):
    global _last_encoded
    memo = _last_encoded
    if memo[0] is values and memo[1] is cls:
        return memo[2]
    if cls is Record:
        body = _encode_records(values)
    else:
        w = Writer()
        for value in values:
            if type(value) is not cls:
                raise _Invalid()
            value.encode(w)
        body = w.getvalue()
    if len(body) <= _MEMO_MAX_BYTES:
        _last_encoded = (values, cls, body)
    return body


def _encode_records(records):
    """:meth:`Record.encode` of every record, inline (a batch holds up to hundreds)."""
    parts = []
    pack, pack_i32 = RECORD_PREFIX.pack, _I32.pack
    for record in records:
        req_id, data = record.req_id, record.data
        if type(record) is not Record or type(req_id) is not ReqId or type(data) is not bytes:
            raise _Invalid()
        parts.append(pack(record.transaction_id, req_id.client_id, req_id.generation, req_id.partition_id,
                          req_id.seq_num, record.header, len(data)))
        parts.append(data)
        parts.append(pack_i32(record.checksum))
    return b"".join(parts)


def _decode_values(view, pos, end, count, cls):
    if cls is Record:
        return _decode_records(view, pos, end, count)
    r = Reader(view, pos, end)
    return tuple([cls.decode(r) for _ in range(count)]), r.position


def _decode_records(view, pos, end, count):
    """:meth:`Record.decode` of ``count`` records from ``pos``, inline; ``(records, next position)``."""
    records = []
    unpack, unpack_i32, prefix = RECORD_PREFIX.unpack_from, _I32.unpack_from, RECORD_PREFIX.size
    for _ in range(count):
        txn, client_id, generation, partition_id, seq_num, header, length = unpack(view, pos)
        pos += prefix
        if length < 0 or length + 4 > end - pos:
            raise _Invalid()
        data = bytes(view[pos:pos + length])
        pos += length
        crc, = unpack_i32(view, pos)
        pos += 4
        records.append(Record(txn, ReqId(client_id, generation, partition_id, seq_num), header, data, crc))
    return tuple(records), pos


def compile_message(cls, code: int, plan, checks):
    """``(encode, decode)`` for ``cls``: ``encode(message) -> payload`` (type code first) and
    ``decode(payload) -> message`` for a payload whose first byte is ``code``.

    Both raise (any exception) where the caller must use the generic loop instead.
    """
    namespace = {"cls": cls, "ReqId": ReqId, "Invalid": _Invalid, "I32": _I32, "ints_struct": _ints_struct,
                 "checksum": checksum, "encode_values": _encode_values, "decode_values": _decode_values,
                 "CODE": bytes([code])}
    # Field values live in f_/v_ locals, so a field named like a helper (AppendRequest.checksum) cannot
    # shadow it. Step k's constants are S<k> (a struct) and T<k> (a value class).
    enc, dec = [], []
    for k, step in enumerate(plan):
        emit_enc, emit_dec = _EMITTERS[step[0]](k, step, code, namespace)
        enc += emit_enc
        dec += emit_dec
    if not plan or plan[0][0] != "fixed":
        enc.insert(0, "parts.append(CODE)")
    for crc_field, data_field in checks:
        dec.append("if checksum(f_%s) != f_%s: raise Invalid()" % (data_field, crc_field))
    dec.append("if pos != end: raise Invalid()")
    dec += _construct(cls, [field for step in plan for field in _step_fields(step)], namespace)
    start = 0 if plan and plan[0][0] == "fixed" else 1  # the first run's struct reads the type code too
    source = "def encode(m):\n    parts = []\n%s\n    return b''.join(parts)\n\n" % _indent(enc)
    source += "def decode(view):\n    pos = %d\n    end = len(view)\n%s\n" % (start, _indent(dec))
    exec(compile(source, "<waltz codec for %s>" % cls.__name__, "exec"), namespace)  # noqa: S102 (our own source)
    return namespace["encode"], namespace["decode"]


def _step_fields(step):
    return [field for field, _ in step[1]] if step[0] == "fixed" else [step[1]]


_REQ_ID_PARTS = ("client_id", "generation", "partition_id", "seq_num")


def _emit_fixed(k, step, code, namespace):
    """A run of fixed-size fields: one struct (the first run also carries the type code)."""
    fmt = "".join(f for _, f in step[1])
    packed, targets = [], []
    if k == 0:
        fmt, packed, targets = "B" + fmt, ["%d" % code], ["_code"]
    namespace["S%d" % k] = run = struct.Struct(">" + fmt)
    enc, req_ids = [], []
    for field, f in step[1]:
        enc.append("v_%s = m.%s" % (field, field))
        if f == "iiii":
            enc.append("if type(v_%s) is not ReqId: raise Invalid()" % field)
            packed += ["v_%s.%s" % (field, part) for part in _REQ_ID_PARTS]
            targets += ["f_%s_%d" % (field, i) for i in range(4)]
            req_ids.append(field)
        else:
            packed.append("v_" + field)
            targets.append("f_" + field)
    enc.append("parts.append(S%d.pack(%s))" % (k, ", ".join(packed)))
    dec = ["%s, = S%d.unpack_from(view, pos)" % (", ".join(targets), k), "pos += %d" % run.size]
    dec += ["f_%s = ReqId(%s)" % (field, ", ".join("f_%s_%d" % (field, i) for i in range(4))) for field in req_ids]
    return enc, dec


def _emit_bool(k, step, code, namespace):
    name = step[1]
    enc = ["v_%s = m.%s" % (name, name),
           "if v_%s is None: raise Invalid()" % name,     # null: the generic loop refuses it by name
           "parts.append(b'\\x01' if v_%s else b'\\x00')" % name]
    dec = ["f_%s = view[pos]" % name,
           "if f_%s > 1: raise Invalid()" % name,           # the generic loop names the bad byte
           "f_%s = f_%s == 1" % (name, name), "pos += 1"]
    return enc, dec


def _emit_bytes(k, step, code, namespace):
    name = step[1]
    enc = _write_count(name) + ["if type(v_%s) is not bytes: raise Invalid()" % name, "parts.append(v_%s)" % name]
    dec = _read_count(1) + ["f_%s = bytes(view[pos:pos + n])" % name, "pos += n"]
    return enc, dec


def _emit_ints(k, step, code, namespace):
    name, max_count = step[1], step[2]
    enc = _write_count(name) + ["parts.append(ints_struct(len(v_%s)).pack(*v_%s))" % (name, name)]
    dec = _read_count(4)
    if max_count is not None:
        dec.append("if n > %d: raise Invalid()" % max_count)     # the generic loop names the limit
    dec += ["f_%s = ints_struct(n).unpack_from(view, pos)" % name, "pos += 4 * n"]
    return enc, dec


def _emit_values(k, step, code, namespace):
    name, value_cls, min_size = step[1], step[2], step[3]
    namespace["T%d" % k] = value_cls
    enc = _write_count(name) + ["parts.append(encode_values(v_%s, T%d))" % (name, k)]
    dec = _read_count(max(1, min_size)) + ["f_%s, pos = decode_values(view, pos, end, n, T%d)" % (name, k)]
    return enc, dec


_EMITTERS = {"fixed": _emit_fixed, "bool": _emit_bool, "bytes": _emit_bytes, "ints": _emit_ints,
             "values": _emit_values}


def _write_count(name):
    """Lines that take field ``name`` into ``v_<name>`` and write its i32 length."""
    return ["v_%s = m.%s" % (name, name), "parts.append(I32.pack(len(v_%s)))" % name]


def _read_count(item_size):
    """Lines that read an i32 count into ``n``, refusing one the bytes left cannot hold."""
    needed = "n" if item_size == 1 else "%d * n" % item_size
    return ["n, = I32.unpack_from(view, pos)", "pos += 4", "if n < 0 or %s > end - pos: raise Invalid()" % needed]


def _construct(cls, fields, namespace):
    """The lines that build and return the decoded message from its ``f_`` locals."""
    if not trusted_construction(cls):
        return ["return cls(%s)" % ", ".join("f_" + field for field in fields)]
    # Decoded values already have their exact types (ints, tuples of ints, bytes): set them
    # directly instead of running the class's converters again.
    namespace["new"], namespace["setattr"] = object.__new__, object.__setattr__
    return (["o = new(cls)"] + ["setattr(o, %r, f_%s)" % (field, field) for field in fields] + ["return o"])


def trusted_construction(cls) -> bool:
    """True when ``cls`` can be built field by field from decoded values: an attrs class with slots
    whose ``__init__`` only converts (no validators, no post-init hook, no other field)."""
    fields = attr.fields(cls)
    return (hasattr(cls, "__slots__") and not hasattr(cls, "__attrs_post_init__")
            and all(f.validator is None and f.init for f in fields))


def _indent(lines):
    return "\n".join("    " + line for line in lines)
