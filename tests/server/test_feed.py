"""The feed scheduler on its own: credit, end messages, turns, reads from the store, closing."""

from twisted.internet import defer
from twisted.internet.task import Clock

from waltz.protocols.client_messages import FeedData, FeedSuspended, MountResponse, MountState
from waltz.protocols.values import RecordHeader, ReqId
from waltz.server.caches import FeedCache
from waltz.server.feed import FeedContext, FeedKind, FeedScheduler

from tests.server.test_partition import DummyConnection, DummyStore

PID = 3


def rid(client=1):
    return ReqId(client, 1, PID, 0)


class Setup:
    def __init__(self, records=0, **kwargs):
        self.clock = Clock()
        self.store = DummyStore(records, partition_id=PID)
        self.cache = FeedCache()
        self.sent = []
        self.feeds = FeedScheduler(PID, self.cache, self.store, self.clock,
                                   on_sent=lambda n, cached: self.sent.append((n, cached)), **kwargs)
        self.feeds.advance(self.store.high_water_mark)

    def feed(self, conn, first, credit, end=None, client=1):
        feed = FeedContext(rid(client), conn, first, credit, end or FeedSuspended(rid(client)))
        self.feeds.add(feed)
        return feed

    def turns(self, limit=100):
        """Run the turns due now; how many ran."""
        for count in range(limit):
            if not [c for c in self.clock.getDelayedCalls() if c.getTime() <= self.clock.seconds()]:
                return count
            self.clock.advance(0)
        raise AssertionError("never idle")


def ids(conn):
    return [m.transaction_id for m in conn.of(FeedData)]


def test_zero_credit_ends_at_once():
    s = Setup()
    conn = DummyConnection()
    s.feed(conn, 0, 0, end=MountResponse(rid(), MountState.READY))
    assert conn.sent == [MountResponse(rid(), MountState.READY)]
    assert s.feeds.feeds == []


def test_credit_then_end_message_and_items_come_from_store_then_cache():
    s = Setup(records=10)
    conn = DummyConnection()
    s.feed(conn, 2, 5)
    s.turns()
    assert ids(conn) == [2, 3, 4, 5, 6] and conn.sent[-1] == FeedSuspended(rid())
    assert s.store.header_reads == [(2, 62)]
    other = DummyConnection("other")
    s.feed(other, 2, 8, client=2)
    s.turns()
    assert ids(other) == list(range(2, 10)) and s.store.header_reads == [(2, 62)]
    assert s.sent == [(5, False), (8, True)]


def test_a_new_feed_replaces_the_connection_s_previous_one():
    s = Setup(records=10)
    conn = DummyConnection()
    s.feed(conn, 0, 3)
    s.feed(conn, 7, 100)
    s.turns()
    assert ids(conn) == [7, 8, 9] and conn.of(FeedSuspended) == []
    assert len(s.feeds.feeds) == 1


def test_a_realtime_feed_waits_for_commits():
    s = Setup(records=1)
    conn = DummyConnection()
    feed = s.feed(conn, 1, 2)
    assert s.feeds.kind_of(feed) is FeedKind.REALTIME
    s.turns()
    assert conn.sent == []
    for txn in (1, 2, 3):
        s.cache.add(PID, RecordHeader(txn, rid(9), txn))
    s.feeds.advance(3)
    s.turns()
    assert ids(conn) == [1, 2] and conn.sent[-1] == FeedSuspended(rid())
    assert s.store.header_reads == []


def test_feeds_far_behind_are_catch_up_feeds():
    s = Setup(records=50, realtime_threshold=20)
    assert s.feeds.kind_of(FeedContext(rid(), None, 10, 5, None)) is FeedKind.CATCH_UP
    assert s.feeds.kind_of(FeedContext(rid(), None, 31, 5, None)) is FeedKind.REALTIME


class StepReactor:
    """callLater that runs nothing until the test calls :meth:`step` (one call at a time)."""

    class Call:
        def __init__(self, calls, f, args):
            self.calls, self.f, self.args = calls, f, args

        def active(self):
            return self in self.calls

        def cancel(self):
            self.calls.remove(self)

    def __init__(self):
        self.calls = []

    def callLater(self, delay, f, *args):
        call = self.Call(self.calls, f, args)
        self.calls.append(call)
        return call

    def step(self):
        call = self.calls.pop(0)
        call.f(*call.args)


def test_a_turn_sends_at_most_items_per_turn_then_yields():
    reactor = StepReactor()
    cache = FeedCache()
    store = DummyStore(64, partition_id=PID)
    cache.add_all(PID, [r.record_header for r in store.records])
    feeds = FeedScheduler(PID, cache, store, reactor, items_per_turn=10)
    feeds.advance(63)
    conn = DummyConnection()
    feeds.add(FeedContext(rid(), conn, 0, 64, FeedSuspended(rid())))
    per_turn = []
    while reactor.calls:
        reactor.step()
        per_turn.append(len(ids(conn)))
    assert per_turn == [10, 20, 30, 40, 50, 60, 64]
    assert ids(conn) == list(range(64)) and conn.sent[-1] == FeedSuspended(rid())


def test_an_empty_read_is_retried_later_not_spun_on():
    s = Setup(records=5)
    conn = DummyConnection()
    s.feeds.advance(7)                   # the partition knows of commits the store does not serve yet
    s.feed(conn, 5, 2)
    s.turns()
    assert s.store.header_reads == [(5, 59)] and conn.sent == []
    assert [c.getTime() for c in s.clock.getDelayedCalls()] == [0.5]
    for txn in (5, 6, 7):
        s.cache.add(PID, RecordHeader(txn, rid(9), txn))
    s.clock.advance(0.5)
    s.turns()
    assert ids(conn) == [5, 6]


def test_a_closed_scheduler_sends_nothing_even_when_a_read_completes_late():
    s = Setup(records=5)
    late = defer.Deferred()
    s.store.get_headers = lambda first, count: late
    conn = DummyConnection()
    s.feed(conn, 0, 5)
    s.turns()
    s.feeds.close()
    late.callback(tuple(r.record_header for r in s.store.records))
    s.turns()
    assert conn.sent == [] and s.clock.getDelayedCalls() == []
    s.feeds.add(FeedContext(rid(), conn, 0, 0, FeedSuspended(rid())))
    assert conn.sent == []


def test_a_single_catch_up_feed_is_served_chunk_after_chunk_to_the_end_of_its_credit():
    reactor = StepReactor()
    cache = FeedCache()
    store = DummyStore(300, partition_id=PID)
    cache.add_all(PID, [r.record_header for r in store.records])
    feeds = FeedScheduler(PID, cache, store, reactor, realtime_threshold=100, catch_up_chunk=64,
                          items_per_turn=100)
    feeds.advance(299)
    conn = DummyConnection()
    feed = FeedContext(rid(), conn, 0, 300, FeedSuspended(rid()))
    feeds.add(feed)
    assert feeds.kind_of(feed) is FeedKind.CATCH_UP
    per_turn = []
    while reactor.calls:
        reactor.step()
        per_turn.append(len(ids(conn)))
    assert per_turn == [100, 200, 300]
    assert store.header_reads == [] and conn.sent[-1] == FeedSuspended(rid())


def test_steady_commits_that_fill_every_turn_with_realtime_items_leave_a_catch_up_its_share():
    # Three realtime feeds with 60 new items each per turn would take all of a 100-item turn, every turn, and a
    # mount's catch-up would wait for as long as the commits went on.
    reactor = StepReactor()
    cache = FeedCache()
    store = DummyStore(3000, partition_id=PID)
    cache.add_all(PID, [r.record_header for r in store.records])
    feeds = FeedScheduler(PID, cache, store, reactor, realtime_threshold=1000, items_per_turn=100, catch_up_chunk=64)
    high_water_mark = 1999
    feeds.advance(high_water_mark)
    followers = [DummyConnection("follower %d" % n) for n in range(3)]
    for client, conn in enumerate(followers, 1):
        feeds.add(FeedContext(rid(client), conn, high_water_mark + 1, 10 ** 6, FeedSuspended(rid(client))))
    mounting = DummyConnection("mounting")
    feeds.add(FeedContext(rid(9), mounting, 0, 1500, MountResponse(rid(9), MountState.READY)))
    for turn in range(10):
        high_water_mark += 60
        feeds.advance(high_water_mark)
        assert len(reactor.calls) == 1
        reactor.step()                          # one turn, then the next commits
        caught_up = len(ids(mounting))
        assert caught_up >= 25 * (turn + 1), "turn %d: the catch-up got %d items" % (turn, caught_up)
    assert all(feeds.kind_of(feeds.feed_of(conn)) is FeedKind.REALTIME for conn in followers)
    assert ids(mounting) == list(range(len(ids(mounting))))


class SlowStore(DummyStore):
    """Header reads answer one millisecond later, like a storage round trip."""

    def __init__(self, *args, clock, **kwargs):
        super().__init__(*args, **kwargs)
        self.clock = clock

    def get_headers(self, first, count):
        answer = defer.Deferred()
        super().get_headers(first, count).addCallback(lambda headers: self.clock.callLater(0.001, answer.callback,
                                                                                          headers))
        return answer


def feeds_of(store, clock, specs, **settings):
    """The connections of catch-up feeds ``(name, first id, credit)`` (client ids 1, 2, ...) of a scheduler
    over ``store`` at its high-water mark."""
    feeds = FeedScheduler(PID, FeedCache(), store, clock, **settings)
    feeds.advance(store.high_water_mark)
    connections = []
    for client, (name, first, credit) in enumerate(specs, 1):
        connection = DummyConnection(name)
        feeds.add(FeedContext(ReqId(client, 1, PID, 0), connection, first, credit,
                              FeedSuspended(ReqId(client, 1, PID, 0))))
        connections.append(connection)
    return connections


def test_a_long_replay_from_the_store_does_not_starve_the_other_catch_up_feeds():
    # A catch-up feed served from a store read must go to the back of the line, as one served from
    # the cache does; otherwise it misses again at its next block and is read for again, first.
    clock = Clock()
    store = SlowStore(20000, partition_id=PID, clock=clock)
    replay, mount = feeds_of(store, clock, [("replay", 0, 20000), ("mount", 10000, 10000)], realtime_threshold=1000)
    for _ in range(100):
        clock.advance(0.001)
    replayed, mounted = len(replay.of(FeedData)), len(mount.of(FeedData))
    assert replayed > 0 and mounted > 0 and mounted >= replayed // 4


class OneBadBlock(DummyStore):
    """A store whose block 64..127 no replica can serve (damaged everywhere)."""

    def get_headers(self, transaction_id, max_records):
        self.header_reads.append((transaction_id, max_records))
        if 64 <= transaction_id < 128:
            return defer.fail(OSError("no replica could read"))
        return super().get_headers(transaction_id, max_records)


def test_a_feed_whose_reads_fail_does_not_starve_the_others_and_is_read_for_again_later():
    clock = Clock()
    store = OneBadBlock(5000, partition_id=PID)
    stuck, other = feeds_of(store, clock, [("stuck", 64, 4000), ("other", 2000, 3000)], retry_interval=0.5)
    for _ in range(20):
        clock.advance(0.5)
    # before: every read was for 64 (the stuck feed first in line each time) and the other got nothing
    assert [m.transaction_id for m in other.of(FeedData)] == list(range(2000, 5000))
    assert stuck.of(FeedData) == []
    stuck_reads = [first for first, _ in store.header_reads if first == 64]
    assert 10 <= len(stuck_reads) <= 22                # about one every retry interval, no faster
