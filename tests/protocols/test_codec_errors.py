"""What the codecs do with bad input: precise errors for each kind of damage, and
nothing but ProtocolError subclasses for arbitrary bytes."""

import attr
import pytest
from hypothesis import strategies as st

from waltz.protocols import admin_messages as A
from waltz.protocols import client_messages as L
from waltz.protocols import codec as C
from waltz.protocols import storage_messages as S
from waltz.protocols.errors import ChecksumError, DecodeError, ProtocolError, UnknownMessageType
from waltz.protocols.values import Record, ReqId, checksum

from tests.protocols.test_messages import CODECS, RID, check_property, instances_of, versions_of

REQ_ID_HEX = "00000001 00000002 00000003 00000004"


def payload(hexdump: str) -> bytes:
    return bytes.fromhex(hexdump)


def codec_versions():
    return [pytest.param(codec, version, id="%s-v%d" % (codec.family, version))
            for codec in CODECS for version in codec.versions]


def decode_or_protocol_error(codec, data, version):
    """Decode ``data``; a ProtocolError is fine, but never one from the internal-error safety net."""
    try:
        return codec.decode(data, version)
    except ProtocolError as exc:
        assert exc.__cause__ is None, "decoder defect: %r" % exc
        assert "internal decoder error" not in str(exc)
        return None


# ---------------------------------------------------------------------------
# Arbitrary input
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("codec,version", codec_versions())
def test_arbitrary_bytes_raise_only_protocol_errors(codec, version):
    def check(data):
        message = decode_or_protocol_error(codec, data, version)
        if message is not None:  # whatever decodes must encode and decode back the same
            assert codec.decode(codec.encode(message, version), version) == message

    check_property(st.binary(max_size=120), check, max_examples=150)


@pytest.mark.parametrize("codec,version", codec_versions())
def test_bytes_after_a_known_type_code_raise_only_protocol_errors(codec, version):
    codes = [spec.code for spec in codec.specs]
    typed = st.tuples(st.sampled_from(codes), st.binary(max_size=160)).map(
        lambda t: bytes([t[0]]) + t[1])

    check_property(typed, lambda data: decode_or_protocol_error(codec, data, version),
                   max_examples=300)


def _valid_payloads(codec):
    """(version, payload) for arbitrary messages of every type of ``codec``."""
    def encoded(spec):
        return st.tuples(st.sampled_from(versions_of(codec, spec)), instances_of(spec.layout)).map(
            lambda t: (t[0], codec.encode(t[1], t[0])))

    return st.one_of([encoded(spec) for spec in codec.specs])


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.family)
def test_corrupted_valid_payloads_raise_only_protocol_errors(codec):
    """Overwrite bytes of valid payloads (same length), so field values go bad, not just lengths."""
    def check(args):
        (version, data), patches = args
        damaged = bytearray(data)
        for position, value in patches:
            damaged[position] = value
        message = decode_or_protocol_error(codec, bytes(damaged), version)
        if message is not None:
            assert codec.decode(codec.encode(message, version), version) == message

    def with_patches(encoded):
        patch = st.tuples(st.integers(0, len(encoded[1]) - 1), st.integers(0, 255))
        return st.tuples(st.just(encoded), st.lists(patch, min_size=1, max_size=4))

    check_property(_valid_payloads(codec).flatmap(with_patches), check, max_examples=400)


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.family)
def test_truncated_valid_payloads_raise_decode_error(codec):
    def check(args):
        (version, data), cut = args
        with pytest.raises(DecodeError) as info:
            codec.decode(data[:cut], version)
        assert "internal decoder error" not in str(info.value)
        assert not isinstance(info.value, (UnknownMessageType, ChecksumError))

    def with_cut(encoded):
        return st.tuples(st.just(encoded), st.integers(0, len(encoded[1]) - 1))

    check_property(_valid_payloads(codec).flatmap(with_cut), check, max_examples=200)


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.family)
def test_extended_valid_payloads_raise_overlong_body(codec):
    def check(args):
        (version, data), extra = args
        with pytest.raises(DecodeError, match="overlong body: %d unread bytes" % len(extra)):
            codec.decode(data + extra, version)

    strategy = st.tuples(_valid_payloads(codec), st.binary(min_size=1, max_size=20))
    check_property(strategy, check, max_examples=200)


# ---------------------------------------------------------------------------
# Each kind of damage gets the right error and a message naming it
# ---------------------------------------------------------------------------

def test_short_body_names_the_missing_field():
    data = payload("00" + REQ_ID_HEX + "00000000")  # MountRequest cut inside client_hwm
    with pytest.raises(DecodeError, match=r"short body: MountRequest\.client_hwm needs 8 bytes"):
        L.CLIENT_CODEC.decode(data, 4)


def test_empty_payload_is_a_short_body():
    for codec in CODECS:
        with pytest.raises(DecodeError, match="short body: message type"):
            codec.decode(b"", codec.versions[-1])


def test_overlong_body_names_the_message():
    data = L.CLIENT_CODEC.encode(L.FlushRequest(RID), 4) + b"\x00\x00"
    with pytest.raises(DecodeError, match="overlong body: 2 unread bytes after FlushRequest"):
        L.CLIENT_CODEC.decode(data, 4)


@pytest.mark.parametrize("codec,code", [(L.CLIENT_CODEC, 25), (L.CLIENT_CODEC, 255),
                                        (S.STORAGE_CODEC, 0), (S.STORAGE_CODEC, 19),
                                        (A.ADMIN_CODEC, 0), (A.ADMIN_CODEC, 16)],
                         ids=lambda v: getattr(v, "family", v))
def test_unknown_type_code(codec, code):
    version = codec.versions[-1]
    with pytest.raises(UnknownMessageType,
                       match="unknown message type %d for family %s" % (code, codec.family)):
        codec.decode(bytes([code]) + bytes(40), version)


def test_version_3_does_not_know_the_partition_health_messages():
    for message in (L.PartitionsHealthRequest(RID), L.PartitionsHealthResponse(RID, [(1, True)])):
        data = L.CLIENT_CODEC.encode(message, 4)
        with pytest.raises(UnknownMessageType, match="unknown message type %d for family L version 3"
                           % message.TYPE):
            L.CLIENT_CODEC.decode(data, 3)
        with pytest.raises(ValueError, match="needs L version 4 or later, not 3"):
            L.CLIENT_CODEC.encode(message, 3)


def test_bad_append_checksum():
    request = L.AppendRequest(RID, 1, (), (), (), 0, b"data", checksum(b"data") ^ 1)
    data = L.CLIENT_CODEC.encode(request, 4)
    with pytest.raises(ChecksumError, match="checksum mismatch in AppendRequest"):
        L.CLIENT_CODEC.decode(data, 4)


def test_bad_transaction_data_checksum():
    response = L.TransactionDataResponse(RID, 1, True, b"data", 0)
    with pytest.raises(ChecksumError, match="checksum mismatch in TransactionDataResponse"):
        L.CLIENT_CODEC.decode(L.CLIENT_CODEC.encode(response, 3), 3)


def test_storage_and_admin_codecs_carry_bad_record_checksums_untouched():
    bad = Record(7, RID, 0, b"data", 0)
    assert not bad.is_valid()
    for codec, message in [(S.STORAGE_CODEC, S.RecordResponse(1, 2, 3, bad)),
                           (S.STORAGE_CODEC, S.AppendRequest(1, 2, 3, [bad], True)),
                           (A.ADMIN_CODEC, A.RecordListResponse(1, 3, [bad]))]:
        assert codec.decode(codec.encode(message, 0), 0) == message


def test_null_record_data_is_refused_both_ways():
    with pytest.raises(ValueError, match="null data"):
        S.STORAGE_CODEC.encode(S.RecordResponse(1, 2, 3, Record(7, RID, 0, None, 0)), 0)
    data = payload("0c 0000000000000001 0000000000000002 00000003 01"
                   "0000000000000007" + REQ_ID_HEX + "00000000 ffffffff 00000000")
    with pytest.raises(DecodeError, match="record 7 has null data"):
        S.STORAGE_CODEC.decode(data, 0)


def test_null_append_data_is_a_decode_error():
    data = payload("02" + REQ_ID_HEX + "0000000000000001 00000000 00000000 00000000 00000000"
                   "ffffffff 00000000")
    with pytest.raises(DecodeError, match=r"AppendRequest\.data is null"):
        L.CLIENT_CODEC.decode(data, 4)


def test_null_where_a_string_is_required():
    with pytest.raises(DecodeError, match=r"MetricsResponse\.metrics_json is null"):
        A.ADMIN_CODEC.decode(payload("0c 0000000000000001 ffffffff"), 0)
    with pytest.raises(ValueError, match="must not be null"):
        A.ADMIN_CODEC.encode(A.MetricsResponse(1, None), 0)


def test_negative_and_oversized_counts():
    head = "10 0000000000000001 0000000000000002 00000003"  # RecordHeaderListResponse
    with pytest.raises(DecodeError, match="bad RecordHeaderListResponse.record_headers count -1"):
        S.STORAGE_CODEC.decode(payload(head + "ffffffff"), 0)
    with pytest.raises(DecodeError, match="count 2147483647 exceeds the 0 bytes left"):
        S.STORAGE_CODEC.decode(payload(head + "7fffffff"), 0)
    with pytest.raises(DecodeError, match=r"bad AddPreferredPartitionRequest\.partition_ids count"):
        L.CLIENT_CODEC.decode(payload("11" + REQ_ID_HEX + "80000000"), 4)
    with pytest.raises(DecodeError, match="short body"):  # int[] of 1000 with 4 bytes of values
        L.CLIENT_CODEC.decode(payload("11" + REQ_ID_HEX + "000003e8 00000001"), 4)


def test_counts_are_bounded_by_the_smallest_item_size():
    # 10 records need at least 360 bytes: refused before reading any of them
    data = payload("12 0000000000000001 0000000000000002 00000003 0000000a") + bytes(40)
    with pytest.raises(DecodeError, match=r"RecordListResponse\.records count 10 exceeds the 40 bytes"):
        S.STORAGE_CODEC.decode(data, 0)


def test_invalid_utf8_is_a_decode_error():
    with pytest.raises(DecodeError, match="not valid UTF-8"):
        A.ADMIN_CODEC.decode(payload("0c 0000000000000001 00000002 c328"), 0)


def test_undefined_mount_state_is_a_decode_error():
    with pytest.raises(DecodeError, match=r"bad MountResponse\.state value 7"):
        L.CLIENT_CODEC.decode(payload("01" + REQ_ID_HEX + "00000007"), 4)


def test_a_bool_is_00_or_01_and_anything_else_is_refused():
    # A corrupted flag must not be read as one or the other: 02 read as false turned a data response's
    # "ok" into a failure without an error text, and re-encoded to other bytes.
    assert A.ADMIN_CODEC.decode(payload("05 0000000000000001 00000000 01"), 0) == A.PartitionReadRequest(1, (), True)
    assert A.ADMIN_CODEC.decode(payload("05 0000000000000001 00000000 00"), 0) == A.PartitionReadRequest(1, (), False)
    with pytest.raises(DecodeError, match="byte 0x02"):
        A.ADMIN_CODEC.decode(payload("05 0000000000000001 00000000 02"), 0)
    ok = L.CLIENT_CODEC.encode(L.TransactionDataResponse.success(RID, 5, b"x"), 3)
    flag = 1 + 16 + 8                                # type, ReqId, transaction id: then the ok flag
    assert ok[flag] == 1
    corrupted = ok[:flag] + b"\x02" + ok[flag + 1:]
    with pytest.raises(DecodeError, match="byte 0x02"):  # the compiled decoder defers to the precise error
        L.CLIENT_CODEC.decode(corrupted, 3)


def test_unsupported_version():
    with pytest.raises(DecodeError, match="family L has no version 2"):
        L.CLIENT_CODEC.decode(L.CLIENT_CODEC.encode(L.FlushRequest(RID), 3), 2)
    with pytest.raises(ValueError, match="family S has no version 1"):
        S.STORAGE_CODEC.encode(S.SuccessResponse(1, 2, 3), 1)


# ---------------------------------------------------------------------------
# Encoding refuses what the wire cannot carry
# ---------------------------------------------------------------------------

def test_encode_refuses_a_message_of_another_family():
    with pytest.raises(ValueError, match="SuccessResponse is not a message of family S"):
        S.STORAGE_CODEC.encode(A.SuccessResponse(1), 0)


@pytest.mark.parametrize("message,field", [
    (L.MountRequest(RID, 2 ** 63, 0), r"MountRequest\.client_hwm"),
    (L.FeedData(RID, 1, 2 ** 31), r"FeedData\.header"),
    (L.AddPreferredPartitionRequest(RID, [2 ** 31]), r"AddPreferredPartitionRequest\.partition_ids"),
    (L.MountRequest(ReqId(2 ** 31, 0, 0, 0), 0, 0), r"MountRequest\.req_id"),
    (L.FeedRequest(RID, None), r"FeedRequest\.client_hwm"),
])
def test_encode_refuses_out_of_range_values_naming_the_field(message, field):
    with pytest.raises(ValueError, match="cannot encode " + field):
        L.CLIENT_CODEC.encode(message, 4)


def test_encode_refuses_fields_that_contradict_their_flag():
    with pytest.raises(ValueError, match=r"TransactionDataResponse\.data must be None when ok is False"):
        L.CLIENT_CODEC.encode(L.TransactionDataResponse(RID, 1, False, b"x"), 4)
    with pytest.raises(ValueError, match=r"TransactionDataResponse\.data"):
        L.CLIENT_CODEC.encode(L.TransactionDataResponse(RID, 1, True, None, None), 4)


# ---------------------------------------------------------------------------
# The table itself
# ---------------------------------------------------------------------------

@attr.s(frozen=True, slots=True, auto_attribs=True)
class _Base:
    seq: int = C.wire(C.I32)


class _Exploding:
    """A wire type with a defect: reading it raises a non-protocol exception."""

    doc, min_size = "boom", 1

    def write(self, w, value):
        w.u8(value)

    def read(self, r, what):
        raise KeyError(what)

    def convert(self, value):
        return value


@attr.s(frozen=True, slots=True, auto_attribs=True)
class _Broken(_Base):
    TYPE = 1
    value: int = C.wire(_Exploding())


def test_a_decoder_defect_still_surfaces_as_decode_error():
    codec = C.MessageCodec(b"T", (0,), _Base, [_Broken])
    data = codec.encode(_Broken(1, 2), 0)
    with pytest.raises(DecodeError, match="internal decoder error in family T") as info:
        codec.decode(data, 0)
    assert isinstance(info.value.__cause__, KeyError)


def test_table_construction_rejects_bad_declarations():
    @attr.s(frozen=True, slots=True, auto_attribs=True)
    class Twin(_Base):
        TYPE = 1

    @attr.s(frozen=True, slots=True, auto_attribs=True)
    class Undeclared(_Base):
        TYPE = 2
        plain: int = 0

    class Foreign:
        TYPE = 3

    with pytest.raises(ValueError, match="duplicate type code 1"):
        C.MessageCodec(b"T", (0,), _Base, [_Broken, Twin])
    with pytest.raises(TypeError, match="Undeclared.plain is not declared with wire"):
        C.MessageCodec(b"T", (0,), _Base, [Undeclared])
    with pytest.raises(TypeError, match="Foreign is not a _Base"):
        C.MessageCodec(b"T", (0,), _Base, [Foreign])
