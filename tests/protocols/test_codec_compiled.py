"""The compiled fast path gives exactly the generic loop's bytes, values and errors.

For every message class the compiler handles, random messages encode to the same
bytes and decode to the same values both ways; and every truncation, extension and
single-byte change of a valid payload decodes to the same value or fails with the
same error as the generic loop alone.
"""

import copy
import random

import attr
import pytest

from waltz.protocols import admin_messages as A
from waltz.protocols import client_messages as L
from waltz.protocols import storage_messages as S
from waltz.protocols.codec import BOOL, BYTES, I32, I64, INT_LIST, PARTITION_IDS, REQ_ID, ListOf
from waltz.protocols.errors import ChecksumError, DecodeError
from waltz.protocols.values import Record, ReqId, checksum

CODECS = [L.CLIENT_CODEC, S.STORAGE_CODEC, A.ADMIN_CODEC]
RID = ReqId(7, 2, 0, 99)


def generic(codec):
    """A copy of ``codec`` with the compiled functions removed (the generic loop only)."""
    plain = copy.copy(codec)
    plain._by_code = {code: attr.evolve(spec, fast_encode=None, fast_decode=None)
                      for code, spec in codec._by_code.items()}
    plain._by_class = {spec.cls: spec for spec in plain._by_code.values()}
    return plain


def random_value(rng, wire_type):
    if wire_type is I32:
        return rng.randint(-2 ** 31, 2 ** 31 - 1)
    if wire_type is I64:
        return rng.randint(-2 ** 63, 2 ** 63 - 1)
    if wire_type is REQ_ID:
        return ReqId(*(rng.randint(-2 ** 31, 2 ** 31 - 1) for _ in range(4)))
    if wire_type is BOOL:
        return rng.random() < 0.5
    if wire_type is BYTES:
        return rng.randbytes(rng.choice([0, 1, 100, 1000]))
    if wire_type in (INT_LIST, L.LOCK_LIST, PARTITION_IDS):
        return tuple(rng.randint(-2 ** 31, 2 ** 31 - 1) for _ in range(rng.choice([0, 1, 3])))
    if isinstance(wire_type, ListOf):
        records = [Record.create(rng.randint(0, 2 ** 40), RID, rng.randint(-5, 5), rng.randbytes(rng.randint(0, 50)))
                   for _ in range(rng.choice([0, 1, 4]))]
        return tuple(r if wire_type.item.cls is Record else r.record_header for r in records)
    raise AssertionError("no generator for %r" % (wire_type,))


def random_message(rng, spec):
    values = [random_value(rng, f.wire_type) for f in spec.layout.fields]
    for crc, data in spec.layout.checks:
        values[crc] = checksum(values[data])
    return spec.cls(*values)


def compiled_specs():
    return [(codec, spec) for codec in CODECS for spec in codec.specs if spec.fast_encode is not None]


def outcome(codec, payload, version):
    try:
        return codec.decode(payload, version)
    except (DecodeError, ChecksumError) as exc:
        return type(exc), str(exc)


def outcome_of(decode, payload):
    """What one of a connection's decode functions (``codec.decoder(version)``) makes of ``payload``."""
    try:
        return decode(payload)
    except (DecodeError, ChecksumError) as exc:
        return type(exc), str(exc)


def test_the_hot_messages_are_compiled():
    for cls in (L.AppendRequest, L.FeedData, L.MountRequest, S.AppendRequest, S.SuccessResponse,
                S.RecordListResponse):
        spec = (L.CLIENT_CODEC if cls.__module__ == L.__name__ else S.STORAGE_CODEC).spec_for(cls)
        assert spec.fast_encode is not None and spec.fast_decode is not None, cls.__name__


@pytest.mark.parametrize("codec,spec", compiled_specs(), ids=lambda x: getattr(x, "name", getattr(x, "family", "")))
def test_compiled_and_generic_agree(codec, spec):
    rng = random.Random(spec.code)
    plain = generic(codec)
    version = codec.versions[-1]
    encode, decode = codec.encoder(version), codec.decoder(version)     # a connection's functions
    for _ in range(30):
        message = random_message(rng, spec)
        payload = plain.encode(message, version)
        assert spec.fast_encode(message) == payload  # the shortcut itself handles valid messages
        assert spec.fast_decode(payload) == message
        assert codec.encode(message, version) == payload == encode(message)
        assert codec.decode(payload, version) == message == plain.decode(payload, version) == decode(payload)
        variants = [payload[:cut] for cut in range(1, len(payload))] + [payload + b"\x00", payload + b"\x01\x02"]
        for _ in range(20):
            at = rng.randrange(1, len(payload)) if len(payload) > 1 else 0
            variants.append(payload[:at] + bytes([rng.randrange(256)]) + payload[at + 1:])
        for variant in variants:
            expected = outcome(plain, variant, version)
            assert outcome(codec, variant, version) == expected == outcome_of(decode, variant), variant.hex()


def test_a_connections_functions_refuse_what_its_version_does_not_carry():
    # Version 3 of family L has no batched data request (version 5): the encoder refuses to send one and
    # the decoder refuses one received, as the codec's generic methods do for that version.
    request = L.TransactionDataBatchRequest(RID, (1, 2))
    payload = L.CLIENT_CODEC.encode(request, 5)
    encode, decode = L.CLIENT_CODEC.encoder(3), L.CLIENT_CODEC.decoder(3)
    with pytest.raises(ValueError, match="needs L version 5"):
        encode(request)
    assert outcome_of(decode, payload) == outcome(L.CLIENT_CODEC, payload, 3)
    assert outcome_of(decode, payload)[0].__name__ == "UnknownMessageType"
    assert L.CLIENT_CODEC.decoder(5)(payload) == request
    with pytest.raises(ValueError, match="no version 9"):
        L.CLIENT_CODEC.decoder(9)


def test_a_value_out_of_range_names_its_field():
    with pytest.raises(ValueError, match="FeedData.transaction_id"):
        L.CLIENT_CODEC.encode(L.FeedData(RID, 2 ** 63, 0), 4)
    with pytest.raises(ValueError, match="FeedData.header"):
        L.CLIENT_CODEC.encode(L.FeedData(RID, 1, 2 ** 31), 4)


def test_a_short_body_names_its_field():
    data = L.CLIENT_CODEC.encode(L.FeedData(RID, 1, 0), 4)
    with pytest.raises(DecodeError, match="FeedData.header"):
        L.CLIENT_CODEC.decode(data[:-2], 4)


def test_a_wrong_value_type_is_refused_as_by_the_generic_loop():
    message = attr.evolve(L.FeedData(RID, 1, 0))
    object.__setattr__(message, "req_id", (7, 2, 0, 99))  # a tuple is not a ReqId
    with pytest.raises(ValueError, match="FeedData.req_id"):
        L.CLIENT_CODEC.encode(message, 4)


def test_a_bad_checksum_is_a_checksum_error():
    payload = bytearray(L.CLIENT_CODEC.encode(L.AppendRequest.create(RID, 10, 0, b"data", write_locks=(5,)), 4))
    payload[-1] ^= 1
    with pytest.raises(ChecksumError):
        L.CLIENT_CODEC.decode(bytes(payload), 4)


def test_only_classes_without_validators_or_hooks_are_built_field_by_field():
    from waltz.protocols.compiled import trusted_construction

    @attr.s(frozen=True, slots=True)
    class Checked:
        value = attr.ib(validator=attr.validators.instance_of(int))

    @attr.s(frozen=True, slots=True)
    class Hooked:
        value = attr.ib()

        def __attrs_post_init__(self):
            pass

    assert trusted_construction(L.FeedData) and trusted_construction(L.AppendRequest)
    assert not trusted_construction(Checked) and not trusted_construction(Hooked)


def test_a_batch_is_encoded_once_for_all_its_replicas():
    from waltz.protocols import compiled

    records = tuple(Record.create(t, RID, 0, b"data %d" % t) for t in range(5))
    version = S.STORAGE_CODEC.versions[-1]
    first = S.STORAGE_CODEC.encode(S.AppendRequest(1, 7, 0, records, False), version)
    assert compiled._last_encoded[0] is records           # the message kept the very tuple it was given
    second = S.STORAGE_CODEC.encode(S.AppendRequest(2, 8, 0, records, False), version)
    again = generic(S.STORAGE_CODEC).encode(S.AppendRequest(2, 8, 0, records, False), version)
    assert second == again and first[17:] == second[17:]   # same records bytes after the header fields


def test_the_batch_memo_is_per_item_class():
    records = tuple(Record.create(t, RID, 0, b"x") for t in range(3))
    version = S.STORAGE_CODEC.versions[-1]
    S.STORAGE_CODEC.encode(S.AppendRequest(1, 7, 0, records, False), version)
    with pytest.raises(ValueError, match="expected RecordHeader"):
        S.STORAGE_CODEC.encode(S.RecordHeaderListResponse(1, 7, 0, records), version)


@pytest.mark.parametrize("codec,spec", [(c, s) for c, s in compiled_specs() if any(
    f.wire_type is BOOL for f in s.layout.fields)], ids=lambda x: getattr(x, "name", getattr(x, "family", "")))
def test_a_null_bool_is_refused_as_by_the_generic_loop(codec, spec):
    message = random_message(random.Random(1), spec)
    flag = next(f.name for f in spec.layout.fields if f.wire_type is BOOL)
    message = attr.evolve(message, **{flag: None})
    version = codec.versions[-1]
    with pytest.raises(ValueError) as fast:
        codec.encode(message, version)
    with pytest.raises(ValueError) as plain:
        generic(codec).encode(message, version)
    assert str(fast.value) == str(plain.value) and "must not be null" in str(fast.value)


def test_long_int_lists_round_trip_past_the_cached_structs():
    message = L.AppendRequest.create(RID, 10, 0, b"d", write_locks=tuple(range(200)))
    payload = L.CLIENT_CODEC.encode(message, 4)
    assert payload == generic(L.CLIENT_CODEC).encode(message, 4)
    assert L.CLIENT_CODEC.decode(payload, 4) == message


@pytest.mark.parametrize("field", ["write_locks", "read_locks", "append_locks"])
def test_a_lock_list_over_the_limit_is_refused_before_it_is_read(field):
    from waltz.protocols.locks import MAX_LOCKS_PER_KIND
    at_limit = L.AppendRequest.create(RID, 10, 0, b"d", **{field: tuple(range(MAX_LOCKS_PER_KIND))})
    assert L.CLIENT_CODEC.decode(L.CLIENT_CODEC.encode(at_limit, 4), 4) == at_limit
    over = attr.evolve(at_limit, **{field: tuple(range(MAX_LOCKS_PER_KIND + 1))})
    payload = generic(L.CLIENT_CODEC).encode(over, 4)
    for codec in (L.CLIENT_CODEC, generic(L.CLIENT_CODEC)):
        with pytest.raises(DecodeError, match="count %d is over the limit of %d"
                           % (MAX_LOCKS_PER_KIND + 1, MAX_LOCKS_PER_KIND)):
            codec.decode(payload, 4)
    # The count alone decides: a frame that only claims a huge list is refused without its items.
    claim = bytearray(L.CLIENT_CODEC.encode(attr.evolve(at_limit, **{field: ()}), 4))
    with pytest.raises(DecodeError, match="over the limit"):
        L.CLIENT_CODEC.decode(_with_count(claim, field, 2 ** 30), 4)


def _with_count(payload, field, count):
    """``payload`` (an AppendRequest with empty lock lists) with ``field``'s count replaced."""
    offset = 1 + 16 + 8 + 4 * ["write_locks", "read_locks", "append_locks"].index(field)
    payload[offset:offset + 4] = count.to_bytes(4, "big")
    return bytes(payload)


def test_batch_request_ids_over_the_limit_are_refused_before_they_are_read():
    # Before: the ids were read one by one through the generic loop, as many as the frame held (8 million in
    # 64 MiB: seconds of the reactor and hundreds of MB), then the request was answered ok = false.
    at_limit = L.TransactionDataBatchRequest(RID, tuple(range(L.MAX_BATCH_TRANSACTIONS)))
    assert L.CLIENT_CODEC.decode(L.CLIENT_CODEC.encode(at_limit, 5), 5) == at_limit
    over = L.CLIENT_CODEC.encode(L.TransactionDataBatchRequest(RID, tuple(range(L.MAX_BATCH_TRANSACTIONS + 1))), 5)
    with pytest.raises(DecodeError, match="count %d is over the limit of %d"
                       % (L.MAX_BATCH_TRANSACTIONS + 1, L.MAX_BATCH_TRANSACTIONS)):
        L.CLIENT_CODEC.decode(over, 5)
    claim = bytearray(L.CLIENT_CODEC.encode(L.TransactionDataBatchRequest(RID, ()), 5))
    claim[1 + 16:1 + 16 + 4] = (2 ** 30).to_bytes(4, "big")
    with pytest.raises(DecodeError, match="over the limit"):
        L.CLIENT_CODEC.decode(bytes(claim), 5)


def test_partition_id_lists_are_bounded_by_the_most_partitions_a_cluster_has():
    from waltz.protocols import admin_messages as am
    from waltz.protocols.codec import MAX_PARTITION_IDS
    from waltz.zk.metadata import MAX_PARTITIONS
    assert MAX_PARTITION_IDS == MAX_PARTITIONS
    over = tuple(range(MAX_PARTITION_IDS + 1))
    for codec, message, version in ((L.CLIENT_CODEC, L.AddPreferredPartitionRequest(RID, over), 4),
                                    (am.ADMIN_CODEC, am.PartitionAvailableRequest(1, over, True), 0)):
        with pytest.raises(DecodeError, match="over the limit of %d" % MAX_PARTITION_IDS):
            codec.decode(generic(codec).encode(message, version), version)
