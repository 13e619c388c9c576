"""The feed cache (LRU blocks of headers) and the transaction data cache (LRU by bytes)."""

import gc

import pytest

from waltz.protocols.client_messages import CLIENT_CODEC, FeedData
from waltz.protocols.values import RecordHeader, ReqId
from waltz.server.caches import (
    DATA_ENTRY_OVERHEAD, HEADER_BYTES, CachedData, FeedCache, LruBytes, TransactionDataCache, feed_payload)

BLOCK_BYTES = FeedCache.BLOCK_SIZE * HEADER_BYTES


def header(txn, client=1):
    return RecordHeader(txn, ReqId(client, 1, 0, txn), 100 + txn)


def test_lru_evicts_least_recently_used_first_and_stays_under_its_bound():
    lru = LruBytes(100)
    lru.store("a", 1, 40)
    lru.store("b", 2, 40)
    assert lru.lookup("a") == 1            # a is now the most recent
    lru.store("c", 3, 40)
    assert lru.peek("b") is None and lru.peek("a") == 1 and lru.peek("c") == 3
    assert lru.size_bytes == 80
    assert not lru.store("huge", 4, 101) and lru.peek("huge") is None
    lru.store("a", 5, 10)                  # replacing an entry re-costs it
    assert lru.size_bytes == 50
    assert (lru.hits, lru.misses) == (1, 0)
    assert lru.lookup("zzz") is None and lru.misses == 1


def test_feed_cache_returns_feed_data_and_runs_stop_at_gaps():
    cache = FeedCache(10 * BLOCK_BYTES)
    cache.add_all(0, [header(t) for t in range(60, 70)])
    cache.add(0, header(71))
    assert cache.get(0, 65) == FeedData(ReqId(1, 1, 0, 65), 65, 165)
    assert cache.get(0, 70) is None and cache.get(1, 65) is None
    run = [CLIENT_CODEC.decode(payload, version) for payload in cache.get_run(0, 60, 100)
           for version in CLIENT_CODEC.versions]   # a feed payload is the same in every version
    assert [f.transaction_id for f in run] == [t for t in range(60, 70) for _ in CLIENT_CODEC.versions]
    assert run[5 * len(CLIENT_CODEC.versions)] == FeedData(ReqId(1, 1, 0, 65), 65, 165)
    assert cache.get_run(0, 62, 3) == [feed_payload(header(t)) for t in (62, 63, 64)]
    assert cache.get_run(0, 59, 10) == []


def test_feed_cache_is_bounded_in_blocks_and_partitions_are_separate():
    cache = FeedCache(2 * BLOCK_BYTES)
    for t in (0, 64, 128):                 # three blocks, room for two
        cache.add(0, header(t))
    assert cache.get(0, 0) is None and cache.get(0, 64) is not None and cache.get(0, 128) is not None
    assert cache.size_bytes == 2 * BLOCK_BYTES
    cache.add(1, header(0))                # partitions share the bound
    assert cache.get(0, 64) is None and cache.get(0, 128) is not None and cache.get(1, 0) is not None
    assert cache.size_bytes == 2 * BLOCK_BYTES


def test_block_remainder_aligns_reads_to_blocks():
    assert FeedCache.block_remainder(0) == 64
    assert FeedCache.block_remainder(65) == 63
    assert FeedCache.block_remainder(127) == 1


def test_a_feed_cache_smaller_than_a_block_keeps_nothing():
    cache = FeedCache(BLOCK_BYTES - 1)
    cache.add(0, header(0))
    assert cache.get(0, 0) is None and cache.size_bytes == 0


def test_transaction_data_cache_is_bounded_by_bytes():
    cache = TransactionDataCache(2 * (100 + DATA_ENTRY_OVERHEAD))
    cache.put(0, 1, b"a" * 100, 11)
    cache.put(0, 2, b"b" * 100, 22)
    assert cache.get(0, 1).data == b"a" * 100          # 1 becomes the most recent
    cache.put(0, 3, b"c" * 100, 33)
    assert cache.get(0, 2) is None and cache.get(0, 1).checksum == 11 and cache.get(0, 3).checksum == 33
    cache.put(0, 4, b"x" * 1000, 44)                    # larger than the whole cache: not kept, nothing lost
    assert cache.get(0, 4) is None and cache.get(0, 3) is not None
    cache.put(5, 1, b"p5", 55)                          # partitions share the bound
    assert cache.get(0, 1) is None and cache.get(0, 3).checksum == 33 and cache.get(5, 1).data == b"p5"
    assert cache.hits > 0 and cache.misses > 0


def test_negative_sizes_are_refused():
    with pytest.raises(ValueError):
        TransactionDataCache(-1)


def _tracked_objects_after_filling(fill):
    gc.collect()
    before = len(gc.get_objects())
    keep = fill()
    gc.collect()    # entries are untracked by collections (a tuple in a tuple may take a second one)
    gc.collect()
    grown = len(gc.get_objects()) - before
    return grown, keep


def test_cached_entries_cost_the_garbage_collector_nothing():
    """A full cache lives as long as the server: had every entry been an object the cycle collector
    tracks, each full collection would walk them all (an 80 ms stall of the whole server at a few
    hundred thousand entries, longer as the cache grows)."""
    count = 20 * FeedCache.BLOCK_SIZE

    def fill():
        feed, data = FeedCache(64 * 1024 * 1024), TransactionDataCache(64 * 1024 * 1024)
        for t in range(count):
            feed.add(3, RecordHeader(t, ReqId(7, 2, 3, 1000 + t), t % 5))
            data.put(3, t, b"payload %d" % t, 1234567 + t)
        return feed, data

    grown, (feed, data) = _tracked_objects_after_filling(fill)
    assert grown < count // 10, "%d objects tracked for %d cached transactions" % (grown, count)
    # and what comes out is unchanged
    assert feed.get(3, 77) == FeedData(ReqId(7, 2, 3, 1077), 77, 2)
    assert [CLIENT_CODEC.decode(p, 5) for p in feed.get_run(3, 63, 2)] == [
        FeedData(ReqId(7, 2, 3, 1063), 63, 3), FeedData(ReqId(7, 2, 3, 1064), 64, 4)]
    cached = data.get(3, 5)
    assert cached == CachedData(b"payload 5", 1234572)
    assert (cached.data, cached.checksum) == (b"payload 5", 1234572)


def test_a_transaction_committed_here_is_cached_as_the_same_payload_as_its_header_read_from_storage():
    # The append path caches the committed transaction from its request's fields, without a RecordHeader;
    # a catch-up read caches RecordHeaders. A client must get the same FeedData either way.
    committed, read = FeedCache(), FeedCache()
    rid = ReqId(3, 2, 5, 77)
    committed.add_committed(5, 130, rid, -9)
    read.add(5, RecordHeader(130, rid, -9))
    assert committed.get_run(5, 130, 1) == read.get_run(5, 130, 1) == [feed_payload(RecordHeader(130, rid, -9))]
    assert committed.get(5, 130) == FeedData(rid, 130, -9)
