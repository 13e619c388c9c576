"""The one-struct fast path for runs of fixed-size fields gives the generic loop's bytes and errors."""

import pytest

from waltz.protocols import client_messages as L
from waltz.protocols.codec import _FieldStep, _FixedRun
from waltz.protocols.errors import DecodeError
from waltz.protocols.values import ReqId

RID = ReqId(7, 2, 0, 99)
MESSAGES = [L.FeedData(RID, 12345, -3), L.MountRequest(RID, -1, 4),
            L.AppendRequest.create(RID, 10, 0, b"data", write_locks=(5, -6))]


def generic(layout):
    """The layout's steps without fixed runs (the per-field loop)."""
    return tuple(_FieldStep(i) for i in range(len(layout.fields)))


def test_feed_data_is_one_fixed_run():
    steps = L.CLIENT_CODEC.spec_for(L.FeedData).layout._steps
    assert len(steps) == 1 and isinstance(steps[0], _FixedRun)


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_fixed_runs_encode_and_decode_like_the_generic_loop(message, monkeypatch):
    codec = L.CLIENT_CODEC
    fast = codec.encode(message, 4)
    assert codec.decode(fast, 4) == message
    monkeypatch.setattr(codec.spec_for(message).layout, "_steps", generic(codec.spec_for(message).layout))
    assert codec.encode(message, 4) == fast
    assert codec.decode(fast, 4) == message


def test_a_value_out_of_range_names_its_field():
    with pytest.raises(ValueError, match="FeedData.transaction_id"):
        L.CLIENT_CODEC.encode(L.FeedData(RID, 2 ** 63, 0), 4)
    with pytest.raises(ValueError, match="FeedData.header"):
        L.CLIENT_CODEC.encode(L.FeedData(RID, 1, 2 ** 31), 4)


def test_a_short_body_names_its_field():
    data = L.CLIENT_CODEC.encode(L.FeedData(RID, 1, 0), 4)
    with pytest.raises(DecodeError, match="FeedData.header"):
        L.CLIENT_CODEC.decode(data[:-2], 4)
