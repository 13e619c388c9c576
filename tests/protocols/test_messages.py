"""Every message of families L, S and A: explicit round trips, property round trips,
golden byte vectors (shared with docs/protocol.md) and the documented tables."""

import pathlib
import re
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from waltz.protocols import admin_messages as A
from waltz.protocols import client_messages as L
from waltz.protocols import codec as C
from waltz.protocols import storage_messages as S
from waltz.protocols.primitives import I32_MAX, I32_MIN, I64_MAX, I64_MIN
from waltz.protocols.values import Record, RecordHeader, ReqId, checksum

CODECS = (L.CLIENT_CODEC, S.STORAGE_CODEC, A.ADMIN_CODEC)
DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "protocol.md"

RID = ReqId(1, 2, 3, 4)
KEY = uuid.UUID("00112233-4455-6677-8899-aabbccddeeff")
REC = Record.create(42, RID, 9, b"abc")
BAD_REC = Record(43, RID, 9, b"abc", 12345)  # checksum deliberately wrong
EXC = S.ExceptionInfo("boom", [S.StackFrame("m.C", "f", None, 12), S.StackFrame("m", "g", "m.py", 3)])


# ---------------------------------------------------------------------------
# Strategies derived from the wire types of each layout
# ---------------------------------------------------------------------------

i32s = st.integers(I32_MIN, I32_MAX)
i64s = st.integers(I64_MIN, I64_MAX)
texts = st.text(max_size=12)
req_ids = st.builds(ReqId, i32s, i32s, i32s, i32s)
small_bytes = st.binary(max_size=40)

SCALARS = {
    C.I32: i32s,
    C.I64: i64s,
    C.BOOL: st.booleans(),
    C.UUID: st.uuids(),
    C.INT_LIST: st.lists(i32s, max_size=5).map(tuple),
    L.LOCK_LIST: st.lists(i32s, max_size=5).map(tuple),
    L.BATCH_IDS: st.lists(i64s, max_size=5).map(tuple),
    C.PARTITION_IDS: st.lists(i32s, max_size=5).map(tuple),
    C.BYTES: small_bytes,
    C.STRING: texts,
    C.OPT_STRING: st.none() | texts,
    C.REQ_ID: req_ids,
    C.RECORD_HEADER: st.builds(RecordHeader, i64s, req_ids, i32s),
    # arbitrary checksums: families S and A must carry bad records untouched
    C.RECORD: st.builds(Record, i64s, req_ids, i32s, small_bytes, i32s),
}

COMPOSITES = {
    C.EnumOf: lambda t: st.sampled_from(list(t.enum)),
    C.ListOf: lambda t: st.lists(strategy_for(t.item), max_size=4).map(tuple),
    C.PairOf: lambda t: st.tuples(strategy_for(t.first), strategy_for(t.second)),
    C.OptionalOf: lambda t: st.none() | strategy_for(t.item),
    C.StructOf: lambda t: instances_of(t.layout),
}


def strategy_for(wire_type):
    """A strategy for any value ``wire_type`` can carry."""
    if wire_type in SCALARS:
        return SCALARS[wire_type]
    return COMPOSITES[type(wire_type)](wire_type)


@st.composite
def instances_of(draw, layout):
    """Arbitrary instances of a layout's class: absent conditional fields are None, checksums match."""
    values = {}
    for f in layout.fields:
        if f.condition is not None and bool(values[f.condition[0]]) != f.condition[1]:
            values[f.name] = None
        else:
            values[f.name] = draw(strategy_for(f.wire_type))
    for f in layout.fields:
        if f.checksum_of and values[f.checksum_of] is not None:
            values[f.name] = checksum(values[f.checksum_of])
    return layout.cls(**values)


def check_property(strategy, check, max_examples=40):
    """Run ``check`` on values drawn from ``strategy``.

    The ``@given`` function is built per call because pytest-twisted re-wraps a
    hypothesis test's ``inner_test`` once per parametrized case (they share one
    function object), which breaks from the second case on. ``database=None``
    keeps failures of one case from being replayed in another.
    """
    @settings(max_examples=max_examples, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(strategy)
    def run(value):
        check(value)

    run()


def all_specs():
    return [pytest.param(codec, spec, id="%s-%s" % (codec.family, spec.name))
            for codec in CODECS for spec in codec.specs]


def versions_of(codec, spec):
    return [v for v in codec.versions if v >= spec.min_version]


# ---------------------------------------------------------------------------
# One explicit example per message type
# ---------------------------------------------------------------------------

EXAMPLES = [
    L.MountRequest(RID, 100, 3),
    L.TransactionDataBatchRequest(RID, [12, 13]),
    L.TransactionDataBatchResponse.success(RID, [Record.create(12, RID, 3, b"data")]),
    L.TransactionDataBatchResponse.failure(RID, "gone"),
    L.MountResponse(RID, L.MountState.CLIENT_AHEAD),
    L.AppendRequest.create(RID, 99, 7, b"payload", write_locks=[1, 2], read_locks=[3],
                           append_locks=[4, 5, 6]),
    L.FeedRequest(RID, -1),
    L.FeedData(RID, 12, -7),
    L.FeedSuspended(RID),
    L.TransactionDataRequest(RID, 12),
    L.TransactionDataResponse.success(RID, 12, b"data"),
    L.TransactionDataResponse.failure(RID, 13, "not found"),
    L.FlushRequest(RID),
    L.FlushResponse(RID, 77),
    L.LockFailure(RID, 76),
    L.HighWaterMarkRequest(RID),
    L.HighWaterMarkResponse(RID, 75),
    L.CheckStorageConnectivityRequest(RID),
    L.CheckStorageConnectivityResponse(RID, {"storage-1:55280": True, "storage-2:55280": False}),
    L.ServerPartitionsAssignmentRequest(RID),
    L.ServerPartitionsAssignmentResponse(RID, [0, 2, 4]),
    L.AddPreferredPartitionRequest(RID, [1]),
    L.AddPreferredPartitionResponse(RID, True),
    L.RemovePreferredPartitionRequest(RID, [1, 3]),
    L.RemovePreferredPartitionResponse(RID, False),
    L.PartitionsHealthRequest(RID),
    L.PartitionsHealthResponse(RID, [(0, True), (1, False)]),
    S.OpenRequest.create(KEY, 16),
    S.LastSessionInfoRequest(5, 1, 2, True),
    S.LastSessionInfoResponse(5, 2, 2, 4, 100, 90),
    S.SetLowWaterMarkRequest(5, 3, 2, 100, False),
    S.TruncateRequest(5, 4, 2, 99, True),
    S.AppendRequest(5, 5, 2, [REC, Record.create(44, RID, 0, b"")], False),
    S.SuccessResponse(5, 6, 2),
    S.FailureResponse(5, 7, 2, EXC),
    S.RecordHeaderRequest(5, 8, 2, 42),
    S.RecordHeaderResponse(5, 9, 2, REC.record_header),
    S.RecordHeaderResponse(5, 9, 2, None),
    S.RecordRequest(5, 10, 2, 42),
    S.RecordResponse(5, 11, 2, BAD_REC),
    S.RecordResponse(5, 11, 2, None),
    S.MaxTransactionIdRequest(5, 12, 2, False),
    S.MaxTransactionIdResponse(5, 13, 2, 43),
    S.RecordHeaderListRequest(5, 14, 2, 40, 20),
    S.RecordHeaderListResponse(5, 15, 2, [REC.record_header, BAD_REC.record_header]),
    S.RecordListRequest(5, 16, 2, 40, 20),
    S.RecordListResponse(5, 17, 2, [REC, BAD_REC]),
    A.SuccessResponse(1),
    A.FailureResponse(2, EXC),
    A.OpenRequest(3, KEY, 16),
    A.PartitionAvailableRequest(4, [0, 1], True),
    A.PartitionReadRequest(5, [2], False),
    A.PartitionAssignmentRequest(6, [3, 4], False, True),
    A.RecordListRequest(7, 2, 40, 20),
    A.RecordListResponse(8, 2, [REC, BAD_REC]),
    A.LastSessionInfoRequest(9, 2),
    A.LastSessionInfoResponse(10, 2, 4, 100, 90),
    A.MetricsRequest(11),
    A.MetricsResponse(12, '{"counters": {"appends": 3}}'),
    A.AssignedPartitionStatusRequest(13),
    A.AssignedPartitionStatusResponse(14, {0: True, 5: False}),
    A.PartitionWriteRequest(15, [1, 2, 3], True),
]


def codec_of(message):
    return next(codec for codec in CODECS if isinstance(message, codec.base))


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.family)
def test_every_type_code_has_an_explicit_example(codec):
    covered = {codec.spec_for(m).code for m in EXAMPLES if isinstance(m, codec.base)}
    assert covered == {spec.code for spec in codec.specs}


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: "%s-%s" % (
    codec_of(m).family, type(m).__name__))
def test_example_round_trips_at_every_version_that_carries_it(message):
    codec = codec_of(message)
    spec = codec.spec_for(message)
    versions = versions_of(codec, spec)
    assert versions
    for version in versions:
        payload = codec.encode(message, version)
        assert payload[0] == spec.code == type(message).TYPE
        assert codec.decode(payload, version) == message
        assert codec.decode(memoryview(payload), version) == message


@pytest.mark.parametrize("codec,spec", all_specs())
def test_arbitrary_field_values_round_trip(codec, spec):
    def round_trips(message):
        for version in versions_of(codec, spec):
            payload = codec.encode(message, version)
            assert codec.decode(payload, version) == message

    check_property(instances_of(spec.layout), round_trips)


def test_family_tables_match_the_reference_codes():
    assert [s.code for s in L.CLIENT_CODEC.specs] == list(range(25))
    assert [s.code for s in S.STORAGE_CODEC.specs] == list(range(1, 19))
    assert [s.code for s in A.ADMIN_CODEC.specs] == list(range(1, 16))
    assert (L.CLIENT_CODEC.magic, S.STORAGE_CODEC.magic, A.ADMIN_CODEC.magic) == (b"L", b"S", b"A")
    assert (L.CLIENT_CODEC.versions, S.STORAGE_CODEC.versions, A.ADMIN_CODEC.versions) == (
        (3, 4, 5), (0,), (0,))
    assert L.CLIENT_CODEC.supports(L.PartitionsHealthResponse, 4)
    assert not L.CLIENT_CODEC.supports(L.PartitionsHealthResponse, 3)
    assert L.CLIENT_CODEC.supports(L.AppendRequest, 3)


def test_common_headers_lead_every_payload():
    assert L.CLIENT_CODEC.encode(L.FlushRequest(RID), 4) == bytes.fromhex(
        "08 00000001 00000002 00000003 00000004")
    assert S.STORAGE_CODEC.encode(S.SuccessResponse(-2, 3, 4), 0) == bytes.fromhex(
        "07 fffffffffffffffe 0000000000000003 00000004")
    assert A.ADMIN_CODEC.encode(A.MetricsRequest(258), 0) == bytes.fromhex("0b 0000000000000102")


# ---------------------------------------------------------------------------
# Convenience constructors and value helpers
# ---------------------------------------------------------------------------

def test_append_request_create_computes_the_crc32c():
    request = L.AppendRequest.create(RID, 1, 2, b"hello")
    assert request.checksum == checksum(b"hello") == 0x9A71BB4C - (1 << 32)
    assert request.write_locks == request.read_locks == request.append_locks == ()


def test_transaction_data_response_success_and_failure():
    ok = L.TransactionDataResponse.success(RID, 5, bytearray(b"xy"))
    assert (ok.ok, ok.data, ok.checksum, ok.error) == (True, b"xy", checksum(b"xy"), None)
    failed = L.TransactionDataResponse.failure(RID, 5, "gone")
    assert (failed.ok, failed.data, failed.checksum, failed.error) == (False, None, None, "gone")


def test_lists_and_mappings_are_stored_as_tuples():
    response = L.CheckStorageConnectivityResponse(RID, {"a:1": 1})
    assert response.connectivity == (("a:1", True),)
    assert A.PartitionReadRequest(1, [3, 4], 1).partition_ids == (3, 4)
    assert hash(response) == hash(L.CheckStorageConnectivityResponse(RID, [("a:1", True)]))


def test_open_request_create_fills_the_header_with_minus_one():
    request = S.OpenRequest.create(str(KEY), 3)
    assert (request.session_id, request.seq_num, request.partition_id) == (-1, -1, -1)
    assert request.cluster_key == KEY


class _Thrower:
    def explode(self):
        raise KeyError("missing")


def test_exception_info_from_exception_names_class_method_file_and_line():
    try:
        _Thrower().explode()
    except KeyError as exc:
        info = S.ExceptionInfo.from_exception(exc)
    assert info.message == "KeyError: 'missing'"
    innermost = info.stack_trace[0]
    assert innermost.class_name == __name__ + "._Thrower"
    assert innermost.method_name == "explode"
    assert innermost.file_name == __file__
    assert innermost.line_number == _Thrower.explode.__code__.co_firstlineno + 1
    outer = info.stack_trace[-1]
    assert (outer.class_name, outer.method_name) == (
        __name__, "test_exception_info_from_exception_names_class_method_file_and_line")
    assert "at %s._Thrower.explode(" % __name__ in info.format()
    payload = S.STORAGE_CODEC.encode(S.FailureResponse(1, 2, 3, info), 0)
    assert S.STORAGE_CODEC.decode(payload, 0).exception == info


def test_exception_info_accepts_twisted_stand_in_frames():
    class Code:  # like twisted.python.failure._Code: no co_qualname
        co_name, co_filename = "handle", "h.py"

    class Frame:
        f_code, f_globals = Code(), {}

    class Traceback:
        tb_frame, tb_lineno, tb_next = Frame(), 5, None

    info = S.ExceptionInfo.from_exception(ValueError("v"), Traceback())
    assert info == S.ExceptionInfo("ValueError: v", [S.StackFrame("?", "handle", "h.py", 5)])


# ---------------------------------------------------------------------------
# Golden vectors: the same bytes here and in docs/protocol.md
# ---------------------------------------------------------------------------

GOLDEN = {
    "L-mount": (L.CLIENT_CODEC, 4, L.MountRequest(RID, -1, 7),
                "00 00000001 00000002 00000003 00000004 ffffffffffffffff 0000000000000007"),
    "L-append": (L.CLIENT_CODEC, 3,
                 L.AppendRequest.create(RID, 41, 0x0A0B0C0D, b"hello", write_locks=[17],
                                        append_locks=[-2]),
                 "02 00000001 00000002 00000003 00000004 0000000000000029"
                 " 00000001 00000011 00000000 00000001 fffffffe"
                 " 0a0b0c0d 00000005 68656c6c6f 9a71bb4c"),
    "L-txn-data-error": (L.CLIENT_CODEC, 4, L.TransactionDataResponse.failure(RID, 42, "gone"),
                         "07 00000001 00000002 00000003 00000004 000000000000002a 00"
                         " 00000004 676f6e65"),
    "L-health": (L.CLIENT_CODEC, 4, L.PartitionsHealthResponse(RID, [(0, True), (3, False)]),
                 "16 00000001 00000002 00000003 00000004 00000002 00000000 01 00000003 00"),
    "S-open": (S.STORAGE_CODEC, 0, S.OpenRequest.create(KEY, 8),
               "01 ffffffffffffffff ffffffffffffffff ffffffff 00112233445566778899aabbccddeeff"
               " 00000008"),
    "S-append": (S.STORAGE_CODEC, 0, S.AppendRequest(5, 6, 2, [REC], False),
                 "06 0000000000000005 0000000000000006 00000002 00000001"
                 " 000000000000002a 00000001 00000002 00000003 00000004 00000009 00000003 616263"
                 " 364b3fb7 00"),
    "S-failure": (S.STORAGE_CODEC, 0,
                  S.FailureResponse(5, 7, 2, S.ExceptionInfo("boom", [S.StackFrame("m.C", "f", None,
                                                                                   12)])),
                  "08 0000000000000005 0000000000000007 00000002"
                  " 00000004 626f6f6d 00000001 00000003 6d2e43 00000001 66 ffffffff 0000000c"),
    "A-partition-read": (A.ADMIN_CODEC, 0, A.PartitionReadRequest(3, [1, 2], True),
                         "05 0000000000000003 00000002 00000001 00000002 01"),
    "A-partition-write": (A.ADMIN_CODEC, 0, A.PartitionWriteRequest(4, [7], False),
                          "0f 0000000000000004 00000001 00000007 00"),
    "A-last-session": (A.ADMIN_CODEC, 0, A.LastSessionInfoResponse(9, 1, 5, 100, 90),
                       "0a 0000000000000009 00000001 0000000000000005 0000000000000064"
                       " 000000000000005a"),
}


def _section(text, heading):
    """The body of the ``## heading`` section of a markdown text."""
    match = re.search(r"^## %s\n(.*?)(?=^## |\Z)" % re.escape(heading), text, re.M | re.S)
    assert match, "docs/protocol.md has no section %r" % heading
    return match.group(1)


def documented_vectors():
    """``name -> (family, version, payload bytes)`` from the doc's golden vector section."""
    section = _section(DOC.read_text(encoding="utf-8"), "Golden vectors")
    found = re.findall(r"^### (\S+) \((\w) v(\d+)\)\n.*?```hex\n(.*?)```", section, re.M | re.S)
    return {name: (family, int(version), bytes.fromhex(hexdump))
            for name, family, version, hexdump in found}


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_vector(name):
    codec, version, message, hexdump = GOLDEN[name]
    expected = bytes.fromhex(hexdump)
    assert codec.encode(message, version) == expected
    assert codec.decode(expected, version) == message


def test_docs_carry_exactly_the_tested_golden_vectors():
    documented = documented_vectors()
    assert sorted(documented) == sorted(GOLDEN)
    for name, (codec, version, _, hexdump) in GOLDEN.items():
        assert documented[name] == (codec.family, version, bytes.fromhex(hexdump)), name


def test_golden_vectors_cover_two_messages_per_family():
    families = [codec.family for codec, _, _, _ in GOLDEN.values()]
    assert all(families.count(f) >= 2 for f in "LSA")


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.family)
def test_docs_message_table_matches_the_codec_table(codec):
    text = DOC.read_text(encoding="utf-8")
    heading = next(h for h in re.findall(r"^## (.*)$", text, re.M)
                   if h.startswith("Family %s:" % codec.family))
    rows = re.findall(r"^\| (\d+) \| (\w+) \| (.*?) \|.*\|$", _section(text, heading), re.M)
    expected = [(str(s.code), s.name, s.layout.describe(codec.header_size)) for s in codec.specs]
    assert rows == expected


def test_docs_describe_lock_hashes_and_deviations():
    text = DOC.read_text(encoding="utf-8")
    assert "CRC32C" in _section(text, "Lock hashes")
    deviations = _section(text, "Deviations from the original")
    for needle in ("CRC32C", "versions 3 and 4", "codes 5 and 15"):
        assert needle in deviations
