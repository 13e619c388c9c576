"""The server's two caches: record headers for the feed, transaction data for the RPC.

Both are least-recently-used caches bounded by an estimate of the bytes they
hold, keyed by partition id so that one instance can serve every partition
of a server (reference section 6: a 64 MiB feed cache in blocks of 64
headers, a 128 MiB transaction data cache).

* :class:`FeedCache` keeps committed record headers (the original ``ReqId``,
  transaction id, header) as encoded ``FeedData`` payloads, in blocks of
  :attr:`FeedCache.BLOCK_SIZE` consecutive transaction ids; a block
  is the unit of eviction and of a catch-up read from the store
  (:meth:`FeedCache.block_remainder`). Each header is charged
  :data:`HEADER_BYTES` whether or not its place in the block is filled.
* :class:`TransactionDataCache` keeps ``(data, checksum)`` per transaction,
  charged ``len(data) +`` :data:`DATA_ENTRY_OVERHEAD`; an entry larger than
  the whole cache is not kept.

Only committed transactions are ever put in, and a committed transaction
never changes, so entries need no invalidation. Those of a partition that moved
away are left to age out of the LRU order: dropping them at once meant walking
every key of the server's caches on the reactor thread, 0.4 s per partition
closed with a full data cache.

**No garbage-collector work per entry.** A full cache holds hundreds of
thousands of entries for as long as the server runs. Were each one an object
the cycle collector tracks (an attrs instance, a ``ReqId``), every full
collection would walk all of them: with a few hundred thousand entries that
was a pause of about 80 ms of the whole server (every append and feed of every
partition waiting), growing with the cache. So entries are bytes (the
encoded ``FeedData``) and exact tuples of bytes and ints, which CPython stops
tracking at their first collection; :class:`CachedData` is built when an entry
is read.
"""

import collections

from waltz.protocols.client_messages import CLIENT_CODEC, FeedData

#: Bytes charged per header slot of a feed cache block (a rough bound: the 62-byte bytes object of an
#: encoded FeedData, its slot in the block, and the block's share of the LRU bookkeeping).
HEADER_BYTES = 160
#: Bytes charged per transaction data entry on top of the data itself: measured (tracemalloc) at 380 to 390
#: bytes for the key and value tuples, the ints, the bytes object's header and the LRU dict's entry.
DATA_ENTRY_OVERHEAD = 400


class LruBytes:
    """An LRU map from key to value where each entry has a cost in bytes; the total stays ≤ ``max_bytes``."""

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError("a cache size cannot be negative (%d)" % max_bytes)
        self.max_bytes = max_bytes
        self.size_bytes = 0
        self._entries = collections.OrderedDict()   # key -> (value, cost)
        self.hits = 0
        self.misses = 0

    def __len__(self):
        return len(self._entries)

    def lookup(self, key):
        """The value of ``key`` (now most recently used), or None; counted as a hit or a miss."""
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return entry[0]

    def peek(self, key):
        """The value of ``key`` without touching its recency or the hit counts."""
        entry = self._entries.get(key)
        return None if entry is None else entry[0]

    def store(self, key, value, cost: int) -> bool:
        """Keep ``value`` under ``key``; False (and nothing kept) when ``cost`` exceeds the whole cache."""
        old = self._entries.pop(key, None)
        if old is not None:
            self.size_bytes -= old[1]
        if cost > self.max_bytes:
            return False
        self._entries[key] = (value, cost)
        self.size_bytes += cost
        while self.size_bytes > self.max_bytes:
            _, (_, evicted_cost) = self._entries.popitem(last=False)
            self.size_bytes -= evicted_cost
        return True


class FeedCache:
    """Committed record headers (as ``FeedData``), in LRU blocks of :attr:`BLOCK_SIZE` consecutive ids."""

    BLOCK_SIZE = 64

    def __init__(self, max_bytes: int = 64 * 1024 * 1024):
        self._blocks = LruBytes(max_bytes)

    @property
    def size_bytes(self) -> int:
        return self._blocks.size_bytes

    @property
    def hits(self) -> int:
        return self._blocks.hits

    @property
    def misses(self) -> int:
        return self._blocks.misses

    @classmethod
    def block_remainder(cls, transaction_id: int) -> int:
        """How many ids from ``transaction_id`` to the end of its block (the size of a block-filling read)."""
        return cls.BLOCK_SIZE - transaction_id % cls.BLOCK_SIZE

    def add(self, partition_id: int, header):
        """Keep one committed ``RecordHeader`` of ``partition_id``."""
        self._put(partition_id, header.transaction_id, feed_payload(header))

    def add_committed(self, partition_id: int, transaction_id: int, req_id, header: int):
        """Keep the header of a transaction just committed (what :meth:`add` keeps, without a ``RecordHeader``)."""
        self._put(partition_id, transaction_id, _encode_feed_data(FeedData(req_id, transaction_id, header)))

    def _put(self, partition_id, transaction_id, payload):
        index, offset = divmod(transaction_id, self.BLOCK_SIZE)
        key = (partition_id, index)
        block = self._blocks.peek(key)
        if block is None:
            block = [None] * self.BLOCK_SIZE
            if not self._blocks.store(key, block, self.BLOCK_SIZE * HEADER_BYTES):
                return
        block[offset] = payload

    def add_all(self, partition_id: int, headers):
        for header in headers:
            self.add(partition_id, header)

    def get(self, partition_id: int, transaction_id: int):
        """The ``FeedData`` of ``transaction_id``, or None when it is not cached."""
        block = self._blocks.lookup((partition_id, transaction_id // self.BLOCK_SIZE))
        if block is None:
            return None
        entry = block[transaction_id % self.BLOCK_SIZE]
        return None if entry is None else CLIENT_CODEC.decode(entry, FEED_PAYLOAD_VERSION)

    def get_run(self, partition_id: int, transaction_id: int, max_count: int) -> list:
        """Up to ``max_count`` cached feed payloads (see :func:`feed_payload`) of consecutive ids from
        ``transaction_id`` (stops at a gap)."""
        run = []
        next_id = transaction_id
        while len(run) < max_count:
            block = self._blocks.lookup((partition_id, next_id // self.BLOCK_SIZE))
            if block is None:
                break
            offset = next_id % self.BLOCK_SIZE
            end = min(self.BLOCK_SIZE, offset + max_count - len(run))
            for entry in block[offset:end]:
                if entry is None:
                    return run
                run.append(entry)
            next_id += end - offset
        return run


#: The ``L`` version feed payloads are encoded with. A message's encoding is the same in every
#: version that carries it (versions only add message types), and ``FeedData`` is in all of them.
FEED_PAYLOAD_VERSION = CLIENT_CODEC.versions[0]
_encode_feed_data = CLIENT_CODEC.encoder(FEED_PAYLOAD_VERSION)


def feed_payload(header) -> bytes:
    """The encoded ``FeedData`` payload of a ``RecordHeader``, ready for any client's feed.

    A committed transaction goes to every mounted client: encoding it once, here, instead of
    once per client is most of what the feed costs per transaction.
    """
    return _encode_feed_data(FeedData(header.req_id, header.transaction_id, header.header))


class CachedData(collections.namedtuple("CachedData", "data checksum")):
    """The data of one committed transaction and its CRC32C (built on each read: the cache keeps a
    plain ``(data, checksum)`` tuple, which the cycle collector stops tracking)."""

    __slots__ = ()


class TransactionDataCache:
    """Data of committed transactions, LRU, bounded by bytes."""

    def __init__(self, max_bytes: int = 128 * 1024 * 1024):
        self._entries = LruBytes(max_bytes)

    @property
    def size_bytes(self) -> int:
        return self._entries.size_bytes

    @property
    def hits(self) -> int:
        return self._entries.hits

    @property
    def misses(self) -> int:
        return self._entries.misses

    def put(self, partition_id: int, transaction_id: int, data: bytes, checksum: int):
        self._entries.store((partition_id, transaction_id), (bytes(data), checksum),
                            len(data) + DATA_ENTRY_OVERHEAD)

    def get(self, partition_id: int, transaction_id: int):
        """The :class:`CachedData` of the transaction, or None."""
        entry = self._entries.lookup((partition_id, transaction_id))
        return None if entry is None else CachedData(*entry)
