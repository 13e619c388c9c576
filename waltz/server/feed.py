"""The transaction feed of one partition: who gets which committed record headers, and when.

A :class:`FeedContext` is one client's feed: the next transaction id to send,
how many items it may still receive (its *credit*), the connection, and the
message that ends it (``MountResponse(READY)`` for a mount's catch-up,
``FeedSuspended`` for a feed request). A connection has at most one feed per
partition; a new one replaces the old.

The :class:`FeedScheduler` plays the original's realtime and catch-up feed
tasks on the reactor (reference section 6):

* each *turn* (scheduled with ``callLater(0)`` whenever something may have
  become sendable: a commit, a new feed, a writable connection, a read from
  the store) sends at most ``items_per_turn`` items, then yields to the
  reactor and runs again;
* **realtime** feeds (fewer than ``realtime_threshold`` transactions behind
  the high-water mark) are served first, the furthest behind first; then
  **catch-up** feeds in FIFO order, each at most ``catch_up_chunk`` items
  per visit before going to the back of the line. While a catch-up feed can
  send, the realtime feeds' first pass of a turn leaves it a quarter of the
  turn (``catch_up_share``), so steady commits cannot starve a mount's
  catch-up; what the catch-up feeds leave goes to a second pass;
* headers come from the :class:`~waltz.server.caches.FeedCache`; on a miss
  one block-filling read (``store.get_headers``) is made at a time, for the
  first feed in service order that needs it; after an empty or failed read
  that feed goes to the back of the line and is not read for again for
  ``retry_interval`` seconds (the others are: a range no replica can serve
  stalls only the feeds that need it);
* a feed whose connection is not ``writable`` (the peer reads slowly:
  outbound back pressure) is skipped until :meth:`FeedScheduler.wake` is
  called for it; a feed whose connection closed is dropped.

Every ``FeedData`` carries the original append's ``ReqId``. ``on_sent(count,
from_cache)`` is told how many items went out and whether they came from the
cache or from a store read.
"""

import enum
import itertools

import attr
from twisted.internet import defer
from twisted.logger import Logger

from waltz.server.caches import FeedCache, feed_payload


class FeedKind(enum.Enum):
    """How a feed is served: realtime feeds first, then catch-up feeds FIFO."""

    REALTIME = "realtime"
    CATCH_UP = "catch-up"


@attr.s(slots=True, eq=False)
class FeedContext:
    """One client's feed of one partition (mutable: it advances as items are sent)."""

    req_id = attr.ib()
    connection = attr.ib()
    next_transaction_id = attr.ib()
    remaining = attr.ib()
    end_message = attr.ib()
    #: Position in the catch-up line (set by the scheduler).
    turn = attr.ib(default=0)
    #: Reactor time before which no store read is made for this feed (after an empty or failed one).
    read_again_at = attr.ib(default=None)

    def behind(self, high_water_mark: int) -> int:
        """How many committed transactions this feed has not sent yet."""
        return high_water_mark - self.next_transaction_id + 1

    @property
    def connection_open(self) -> bool:
        return not getattr(self.connection, "closed", False)


class FeedScheduler:
    """Serves the feeds of one partition from the feed cache and the store (see the module doc)."""

    log = Logger()

    def __init__(self, partition_id, cache: FeedCache, store, reactor, realtime_threshold=1000,
                 items_per_turn=1000, catch_up_chunk=FeedCache.BLOCK_SIZE, retry_interval=0.5,
                 on_sent=None):
        self.partition_id = partition_id
        self.cache = cache
        self.store = store
        self.reactor = reactor
        self.realtime_threshold = realtime_threshold
        self.items_per_turn = items_per_turn
        self.catch_up_chunk = catch_up_chunk
        self.retry_interval = retry_interval
        self._on_sent = on_sent or (lambda count, from_cache: None)
        self.high_water_mark = -1
        self.closed = False
        self._feeds = {}                  # connection -> FeedContext
        self._turns = itertools.count()
        self._pump_call = None
        self._retry_call = None
        self._reading = False

    # -- what the partition calls ----------------------------------------------------------

    @property
    def feeds(self) -> list:
        """The running feeds."""
        return list(self._feeds.values())

    def feed_of(self, connection):
        """The feed of ``connection``, or None."""
        return self._feeds.get(connection)

    def kind_of(self, feed: FeedContext) -> FeedKind:
        """Realtime when fewer than ``realtime_threshold`` committed transactions are still unsent."""
        return FeedKind.REALTIME if feed.behind(self.high_water_mark) < self.realtime_threshold \
            else FeedKind.CATCH_UP

    def add(self, feed: FeedContext):
        """Start ``feed`` (replacing its connection's previous one); an empty credit ends it at once."""
        if self.closed:
            return
        if feed.remaining <= 0:
            self._feeds.pop(feed.connection, None)
            feed.connection.sendMessage(feed.end_message)
            return
        feed.turn = next(self._turns)
        self._feeds[feed.connection] = feed
        self.wake()

    def remove_connection(self, connection):
        """Stop the feed of ``connection`` (closed, or replaced by a newer mount)."""
        self._feeds.pop(connection, None)

    def advance(self, high_water_mark: int):
        """Transactions up to ``high_water_mark`` are committed."""
        if high_water_mark > self.high_water_mark:
            self.high_water_mark = high_water_mark
            self.wake()

    def wake(self):
        """Something may have become sendable: run a turn soon."""
        if self._pump_call is None and not self.closed:
            self._pump_call = self.reactor.callLater(0, self._pump)

    def close(self):
        """Stop every feed (the partition closed); nothing more is sent."""
        self.closed = True
        self._feeds.clear()
        for call in (self._pump_call, self._retry_call):
            if call is not None and call.active():
                call.cancel()
        self._pump_call = self._retry_call = None

    # -- a turn -------------------------------------------------------------------------------

    def _pump(self):
        """One turn: passes over the feeds in service order until the budget or the sendable data runs out."""
        self._pump_call = None
        if self.closed:
            return
        budget = self.items_per_turn
        needs_read = None
        read_later = False      # a feed needs a read but waits after a failed one
        progress = True
        first_pass = True
        while progress and budget > 0:
            progress = False
            realtime, catch_up = self._in_service_order()
            # On a turn's first pass, realtime feeds leave a share of it to a catch-up feed that can send:
            # commits that keep them busy for whole turns would otherwise never let a mount's catch-up through.
            held = self.catch_up_share if first_pass and any(map(self._sendable, catch_up)) else 0
            first_pass = False
            for feed in realtime + catch_up:
                if budget <= 0:
                    break
                if not self._sendable(feed):
                    continue
                limit = budget - held if self.kind_of(feed) is FeedKind.REALTIME else min(budget, self.catch_up_chunk)
                if limit <= 0:
                    continue
                sent, missed = self._send_cached(feed, limit)
                budget -= sent
                progress = progress or sent > 0
                if self._feeds.get(feed.connection) is not feed:
                    continue                          # it ended
                if missed and needs_read is None:
                    if self._may_read_for(feed):
                        needs_read = feed
                    else:
                        read_later = True
                if sent and self.kind_of(feed) is FeedKind.CATCH_UP:
                    feed.turn = next(self._turns)     # to the back of the catch-up line
        if needs_read is not None:
            self._read_for(needs_read)
        if read_later:
            self._retry_later()
        if budget <= 0 and any(self._sendable(feed) for feed in self._feeds.values()):
            self.wake()

    @property
    def catch_up_share(self) -> int:
        """Items of a turn's first pass the realtime feeds leave to the catch-up feeds while one can send."""
        return max(1, self.items_per_turn // 4)

    def _may_read_for(self, feed) -> bool:
        return feed.read_again_at is None or feed.read_again_at <= self.reactor.seconds()

    def _in_service_order(self) -> tuple:
        """``(realtime, catch_up)``: the open feeds of each kind in the order they are served."""
        realtime, catch_up = [], []
        for feed in list(self._feeds.values()):
            if not feed.connection_open:
                self._feeds.pop(feed.connection, None)
                continue
            (realtime if self.kind_of(feed) is FeedKind.REALTIME else catch_up).append(feed)
        realtime.sort(key=lambda f: (f.next_transaction_id, f.turn))
        catch_up.sort(key=lambda f: f.turn)
        return realtime, catch_up

    def _sendable(self, feed) -> bool:
        return feed.connection.writable and feed.next_transaction_id <= self.high_water_mark

    def _send_cached(self, feed, limit) -> tuple:
        """Send up to ``limit`` cached items; ``(sent, missed)`` where missed means the cache had a gap."""
        wanted = min(limit, feed.remaining, feed.behind(self.high_water_mark))
        run = self.cache.get_run(self.partition_id, feed.next_transaction_id, wanted)
        return self._send_run(feed, run, wanted, True)

    def _send_run(self, feed, run, wanted, from_cache) -> tuple:
        """Send ``run`` (consecutive feed payloads from the feed's next id) if the connection is writable.

        The run goes out in one write: a turn can fill the transport past its buffer size by at
        most one run (``items_per_turn`` items of 36 bytes), and the next turn waits until it drains.
        """
        connection = feed.connection
        sent = len(run) if connection.writable else 0
        if sent:
            connection.sendPayloads(run)
            feed.next_transaction_id += sent
            feed.remaining -= sent
            self._on_sent(sent, from_cache)
        if feed.remaining <= 0:
            self._feeds.pop(connection, None)
            connection.sendMessage(feed.end_message)
            return sent, False
        return sent, len(run) < wanted and connection.writable

    # -- reading from the store ---------------------------------------------------------------

    def _read_for(self, feed):
        if self._reading:
            return
        self._reading = True
        first = feed.next_transaction_id
        d = defer.maybeDeferred(self.store.get_headers, first, FeedCache.block_remainder(first))
        d.addCallbacks(self._read_done, self._read_failed, callbackArgs=(feed,), errbackArgs=(first, feed))
        d.addErrback(self._unexpected)

    def _read_done(self, headers, feed):
        """Cache what was read and send it to the feed that asked (even if the cache cannot keep it)."""
        self._reading = False
        if self.closed:
            return
        headers = list(headers)
        self.cache.add_all(self.partition_id, headers)
        if not headers:
            self._read_later(feed)
            return
        feed.read_again_at = None
        if self._feeds.get(feed.connection) is feed and self._sendable(feed):
            start = feed.next_transaction_id - headers[0].transaction_id
            if 0 <= start < len(headers):
                limit = self.items_per_turn if self.kind_of(feed) is FeedKind.REALTIME else self.catch_up_chunk
                wanted = min(limit, feed.remaining, feed.behind(self.high_water_mark))
                run = [feed_payload(h) for h in headers[start:start + wanted]]
                sent, _ = self._send_run(feed, run, wanted, False)
                if sent and self.kind_of(feed) is FeedKind.CATCH_UP:
                    # To the back of the catch-up line, as after a cached run: otherwise a long replay
                    # that misses the cache at every block is read for again and again, and the other
                    # catch-up feeds (mounts among them) wait until it has finished.
                    feed.turn = next(self._turns)
        self.wake()

    def _unexpected(self, failure):
        self._reading = False
        self.log.failure("partition {pid}: feed error", failure, pid=self.partition_id)
        self.wake()   # the feeds go on (reading again if needed)

    def _read_failed(self, failure, first, feed):
        self._reading = False
        if self.closed:
            return
        self.log.warn("partition {pid}: reading record headers from {first} failed: {reason}; retrying",
                      pid=self.partition_id, first=first, reason=failure.getErrorMessage())
        self._read_later(feed)

    def _read_later(self, feed):
        """Read for ``feed`` again after the retry interval, at the back of the line; the others go on."""
        feed.read_again_at = self.reactor.seconds() + self.retry_interval
        feed.turn = next(self._turns)
        self._retry_later()
        self.wake()

    def _retry_later(self):
        """Wake when the first feed waiting to be read for again may be."""
        now = self.reactor.seconds()
        due = [feed.read_again_at for feed in self._feeds.values()
               if feed.read_again_at is not None and feed.read_again_at > now]
        if not due:
            return
        when = min(due)
        if self._retry_call is not None:
            if self._retry_call.active() and self._retry_call.getTime() <= when:
                return
            if self._retry_call.active():
                self._retry_call.cancel()
        self._retry_call = self.reactor.callLater(when - now, self._retry)

    def _retry(self):
        self._retry_call = None
        self.wake()
