"""Java DataOutput encodings: modified UTF-8, ranges, truncation."""

import uuid

import pytest
from hypothesis import given, strategies as st

from waltz.zk.encoding import (DataReader, DataWriter, EncodingError, decode_modified_utf8,
                               encode_modified_utf8)


@pytest.mark.parametrize("text, expected", [
    ("abc", b"abc"),
    ("\x00", b"\xc0\x80"),                       # NUL is two bytes, never a zero byte
    ("\u00e9", b"\xc3\xa9"),
    ("\u20ac", b"\xe2\x82\xac"),
    ("\U0001F600", b"\xed\xa0\xbd\xed\xb8\x80"),  # a surrogate pair, three bytes each (CESU-8)
])
def test_modified_utf8_matches_java(text, expected):
    assert encode_modified_utf8(text) == expected
    assert decode_modified_utf8(expected) == text


@given(st.text())
def test_modified_utf8_round_trips(text):
    data = encode_modified_utf8(text)
    assert b"\x00" not in data
    assert decode_modified_utf8(data) == text


def test_write_utf_has_a_two_byte_length():
    assert DataWriter().utf("h:1").getvalue() == b"\x00\x03h:1"


def test_write_utf_refuses_more_than_65535_bytes():
    DataWriter().utf("x" * 65535)
    with pytest.raises(EncodingError, match="too long"):
        DataWriter().utf("x" * 65536)


@pytest.mark.parametrize("method, value", [
    ("byte", 128), ("int", 2 ** 31), ("int", -(2 ** 31) - 1), ("long", 2 ** 63), ("int", True), ("int", "1"),
])
def test_out_of_range_values_are_refused(method, value):
    with pytest.raises(EncodingError, match="out of range"):
        getattr(DataWriter(), method)(value)


def test_primitives_are_big_endian():
    key = uuid.UUID("00112233-4455-6677-8899-aabbccddeeff")
    data = DataWriter().byte(-1).int(1).long(-2).uuid(key).ints([7]).getvalue()
    assert data.hex() == ("ff" "00000001" "fffffffffffffffe" "00112233445566778899aabbccddeeff"
                          "00000001" "00000007")
    reader = DataReader(data)
    assert (reader.byte(), reader.int(), reader.long(), reader.uuid(), reader.ints()) == (-1, 1, -2, key, (7,))
    reader.finish()


def test_truncated_input_names_the_field():
    with pytest.raises(EncodingError, match="truncated: need 8 bytes for sessionId"):
        DataReader(b"\x00\x00").long("sessionId")


def test_counts_larger_than_the_data_are_refused_before_allocating():
    with pytest.raises(EncodingError, match="bad partitionId count 2147483647"):
        DataReader(b"\x7f\xff\xff\xff").ints("partitionId")


def test_trailing_bytes_are_refused():
    reader = DataReader(b"\x01\x02")
    reader.byte()
    with pytest.raises(EncodingError, match="1 unexpected trailing bytes"):
        reader.finish()


def test_malformed_utf8_is_an_encoding_error():
    with pytest.raises(EncodingError, match="malformed modified UTF-8"):
        DataReader(b"\x00\x02\xff\xfe").utf()
