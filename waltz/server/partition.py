"""The client-facing partition of a Waltz server: append task, lock table, feeds, caches, mount.

One :class:`ServerPartition` serves one partition of the log for one
generation (seed 000 "Partition Object", seed 001 "Waltz Server" and
"Concurrency Control", seed 004, reference sections 5 and 6). It sees the
replicated log only through :class:`~waltz.interfaces.IStorePartition`, and a
client connection only through what :class:`ClientConnection` names, so both
are replaced by dummies in tests.

**Life cycle** (:class:`PartitionState`): ``starting`` until the store
partition is writing (:meth:`ServerPartition.start` fires), then
``serving``, then ``closed`` (:meth:`ServerPartition.close`).

**The append task.** Appends and barriers (flushes and mounts) wait in one
queue in arrival order and are taken strictly in that order, because a
client judges its pending appends by the order in which they reach the feed.
The head of the queue waits (:class:`AppendTaskState`) while

* it is an append and ``max_pending_appends`` appends are already with the
  store (the store's pipeline is full),
* it is an append whose checked locks share a lock hash with an in-flight append
  (the lock table cannot decide yet; reference 5 "forces a store flush and
  then retries": here it simply waits for the in-flight appends to settle),
* it is a barrier and appends are still with the store (a barrier fires once
  every append received before it has settled).

An append is then checked against the lock table: a failure sends
``LockFailure(req_id, estimate)``; otherwise it goes to ``store.append``. On
commit the lock table is raised, the header goes to the feed cache and the
data to the transaction data cache, and the feeds wake. When the store fails
an append (``AppendFailed``, ``AppendFateUnknown``, ``PartitionNotOwned``)
nothing is sent: the client learns the outcome from the feed. The last two
mean the store partition is lost and the append's fate is the next owner's
to decide, so the partition closes at once: a barrier answered with its own
high-water mark would tell the client the append failed.

**Fencing.** Appends and feed requests are taken only from the connection
that holds the client's mount, and appends only for the partition's
generation; feed requests only with the ReqId of the client's current mount,
and not while that mount's catch-up still owes its READY; anything else is
dropped and logged. A mount replaces the
client's mounted connection only with a higher ``(generation, seq_num)``
(reference PR #167); the replaced connection stops receiving the feed. A
mount released because its connection closed leaves its key behind as the
client's floor: an older connection of the client still open cannot take the
mount back (the last :data:`RELEASED_MOUNTS_KEPT` clients' floors are kept).

**Back pressure.** :meth:`ServerPartition.handle` returns an unfired
Deferred for an append it could not hand on at once; it fires when the append
leaves the queue, so :class:`~waltz.protocols.base.WaltzProtocol` stops
reading from a connection once it has ``inbound_high_watermark`` of them.
"""

import collections
import enum

import attr
from twisted.internet import defer
from twisted.logger import Logger
from zope.interface import Attribute, Interface

from waltz.metrics import Registry
from waltz.protocols.client_messages import (
    RETRY_LATER_MARK, AppendRequest, FeedRequest, FeedSuspended, FlushRequest, FlushResponse, HighWaterMarkRequest,
    HighWaterMarkResponse, LockFailure, MountRequest, MountResponse, MountState, TransactionDataBatchRequest,
    TransactionDataBatchResponse, TransactionDataRequest, TransactionDataResponse, not_served_error)
from waltz.protocols.errors import ProtocolError
from waltz.server.caches import HEADER_BYTES, FeedCache, TransactionDataCache
from waltz.server.feed import FeedContext, FeedScheduler
from waltz.server.locks import LockOutcome, LockTable
from waltz.server.store.partition import AppendFailed, AppendFateUnknown, PartitionNotOwned


class ClientConnection(Interface):
    """What a partition uses of a client connection (``ServerProtocol`` provides it)."""

    writable = Attribute("False while the peer reads too slowly (outbound back pressure).")
    closed = Attribute("True once the connection is gone.")

    def sendMessage(message):
        """Send one ``L`` message."""

    def sendPayloads(payloads):
        """Send ``L`` messages already encoded (the feed encodes each ``FeedData`` once for every client)."""

    def run_data_read(read):
        """Call ``read()``, which starts a store read for a data request and answers it, when the connection
        admits it (:class:`~waltz.protocols.read_gate.ReadGate`); returns a Deferred firing once it ran."""


class PartitionClosed(Exception):
    """The partition closed (moved to another server) before the request could be served."""


def _positive(instance, attribute, value):
    if value <= 0:
        raise ValueError("%s must be positive, not %r" % (attribute.name, value))


def _not_negative(instance, attribute, value):
    if value < 0:
        raise ValueError("%s cannot be negative (%r)" % (attribute.name, value))


@attr.s(frozen=True, slots=True)
class PartitionSettings:
    """Per-partition knobs (server config keys in brackets; defaults are the original's).

    ``lock_table_size`` [server.optimisticLockTableSize], ``feed_cache_size`` and
    ``transaction_data_cache_size`` in bytes [server.feedCacheSize,
    server.transactionDataCacheSize] (used when no shared cache is given),
    ``min_fetch_size`` [server.minFetchSize] < ``realtime_threshold``
    [server.realtimeThreshold], ``max_pending_appends``: appends with the store at
    once before the append queue holds (back pressure).
    """

    lock_table_size = attr.ib(default=30000, validator=_positive)
    feed_cache_size = attr.ib(default=64 * 1024 * 1024)
    transaction_data_cache_size = attr.ib(default=128 * 1024 * 1024, validator=_not_negative)
    min_fetch_size = attr.ib(default=100, validator=_positive)     # 0: an idle feed would ping-pong
    realtime_threshold = attr.ib(default=1000, validator=_positive)
    max_pending_appends = attr.ib(default=300, validator=_positive)

    @feed_cache_size.validator
    def _check_feed_cache_size(self, attribute, value):
        if value < FeedCache.BLOCK_SIZE * HEADER_BYTES:
            raise ValueError("feed_cache_size must hold at least one block of %d headers (%d bytes), not %r"
                             % (FeedCache.BLOCK_SIZE, FeedCache.BLOCK_SIZE * HEADER_BYTES, value))

    @realtime_threshold.validator
    def _check_realtime_threshold(self, attribute, value):
        if self.min_fetch_size >= value:
            raise ValueError("min_fetch_size (%d) must be less than realtime_threshold (%d)"
                             % (self.min_fetch_size, value))


class PartitionState(enum.Enum):
    """The life of a server partition."""

    STARTING = "starting"   #: waiting for the store partition to be writing
    SERVING = "serving"
    CLOSED = "closed"


class AppendTaskState(enum.Enum):
    """What the head of the append queue is waiting for (``idle`` when nothing is queued)."""

    IDLE = "idle"
    WAITING_FOR_START = "waiting-for-start"
    WAITING_FOR_CAPACITY = "waiting-for-capacity"   #: max_pending_appends are with the store
    WAITING_FOR_LOCKS = "waiting-for-locks"         #: checked locks overlap in-flight appends
    WAITING_FOR_DRAIN = "waiting-for-drain"         #: a flush or mount waits for in-flight appends


class AppendDrop(enum.Enum):
    """Why an append was dropped without an answer."""

    NOT_SERVING = "not-serving"
    GENERATION = "generation"
    NOT_MOUNTED = "not-mounted"


class PartitionMetrics:
    """Metrics of every server partition, labelled by partition (create one per server)."""

    def __init__(self, registry: Registry):
        self.appends = registry.counter(
            "waltz_server_append_requests_total", "append requests received", ("partition",))
        self.dropped_appends = registry.counter(
            "waltz_server_dropped_appends_total", "append requests dropped unanswered", ("partition", "reason"))
        self.committed = registry.counter(
            "waltz_server_committed_appends_total", "appends committed", ("partition",))
        self.store_failures = registry.counter(
            "waltz_server_failed_appends_total", "appends the store did not commit (the feed tells the client)",
            ("partition",))
        self.lock_failures = registry.counter(
            "waltz_server_lock_failures_total", "appends refused by the lock table", ("partition",))
        self.feed_items = registry.counter(
            "waltz_server_feed_items_total", "FEED_DATA messages sent", ("partition",))
        self.mounts = registry.counter(
            "waltz_server_mounts_total", "mount responses sent", ("partition", "state"))
        self.data_served = registry.counter(
            "waltz_server_transaction_data_served_total",
            "transactions whose data was sent to a client (single and batched requests)", ("partition",))
        self.cache_lookups = registry.counter(
            "waltz_server_cache_lookups_total",
            "cache lookups: transaction data requests, and feed items (a miss was read from storage)",
            ("cache", "result"))
        self.high_water_mark = registry.gauge(
            "waltz_server_partition_high_water_mark", "high-water mark of the partition", ("partition",))
        self.append_seconds = registry.histogram(
            "waltz_server_append_seconds", "from an append request's arrival to its commit", ("partition",))


@attr.s(frozen=True, slots=True)
class MountedClient:
    """The connection that holds a client's mount of the partition, its ``(generation, seq_num)``, and
    the mount request's ReqId (the one its feed requests carry)."""

    client_id = attr.ib()
    key = attr.ib()
    connection = attr.ib()
    req_id = attr.ib()


@attr.s(slots=True, eq=False)
class _QueuedAppend:
    connection = attr.ib()
    request = attr.ib()             # the AppendRequest, which is also its lock request (the lock table's)
    received_at = attr.ib()
    released = attr.ib(default=None)   # back-pressure Deferred, created only if the append had to wait
    dequeued = attr.ib(default=False)


@attr.s(slots=True, eq=False)
class _Barrier:
    """A point in the append queue: its waiters fire with the high-water mark once every append queued
    before it has settled. Barriers requested back to back are one: a client sending FLUSH after FLUSH
    while appends are in flight adds waiters (none for a repeated FLUSH), not queue items."""

    waiters = attr.ib(factory=list)
    keys = attr.ib(factory=set)      # what the waiters answer, e.g. (connection, FLUSH ReqId)
    per_connection = attr.ib(factory=collections.Counter)   # connection -> its keys among them

    def wait(self) -> defer.Deferred:
        d = defer.Deferred()
        self.waiters.append(d)
        return d

    def release(self, high_water_mark):
        waiters, self.waiters = self.waiters, []
        for d in waiters:
            d.callback(high_water_mark)

    def abandon(self, error):
        waiters, self.waiters = self.waiters, []
        for d in waiters:
            d.errback(error)


#: Distinct FLUSH (and mount) requests of one connection that may wait at one point of a partition's append
#: queue. A client flushes the few ReqIds it is unsure of; thousands mean a client flooding the server, whose
#: connection is then closed (the waits would otherwise grow without bound, outside the back pressure).
MAX_WAITS_PER_CONNECTION = 1000

#: Data bytes after which a batch response stops (it always carries at least one record).
MAX_BATCH_RESPONSE_BYTES = 4 * 1024 * 1024


class BatchReadError(Exception):
    """A transaction of a batch request is missing or damaged in the store."""


def batch_request_problem(ids, partition_id, high_water_mark):
    """Why a batch request for ``ids`` cannot be served (None when it can)."""
    if not ids:
        return "a batch request must name at least one transaction"
    if ids[0] < 0 or any(b <= a for a, b in zip(ids, ids[1:])):
        return "a batch request's transaction ids must be increasing and not negative"
    if ids[-1] > high_water_mark:
        return "transaction %d of partition %d is not committed (high-water mark %d)" % (
            ids[-1], partition_id, high_water_mark)
    return None


def id_runs(ids):
    """``[(first, count), ...]``: the runs of consecutive ids in increasing ``ids``."""
    runs = []
    for txn in ids:
        if runs and runs[-1][0] + runs[-1][1] == txn:
            runs[-1][1] += 1
        else:
            runs.append([txn, 1])
    return [tuple(run) for run in runs]


def check_record(record, expected, partition_id):
    """``record`` if it is transaction ``expected`` with matching checksum, else :class:`BatchReadError`."""
    if record.transaction_id != expected:
        raise BatchReadError("partition %d: storage returned transaction %d for %d"
                             % (partition_id, record.transaction_id, expected))
    if not record.is_valid():
        raise BatchReadError("transaction %d of partition %d failed its checksum in storage"
                             % (expected, partition_id))
    return record


@defer.inlineCallbacks
def read_record_batch(store, ids, partition_id, max_bytes):
    """Fires with the checked records of a prefix of ``ids``: all of them, or as many as fit in
    ``max_bytes`` of data (at least one), read with ``store.get_records`` one run of consecutive ids at
    a time."""
    records, size = [], 0
    for first, count in id_runs(ids):
        while count > 0:
            got = yield store.get_records(first, count)
            if not got:
                raise BatchReadError("transaction %d of partition %d is missing from the store"
                                     % (first, partition_id))
            for record in got[:count]:
                if records and size + len(record.data) > max_bytes:
                    return records      # the client asks again for the rest
                records.append(check_record(record, first, partition_id))
                size += len(record.data)
                first += 1
                count -= 1
    return records


#: How many clients' released mount keys a partition remembers (see the module doc, "Fencing"). Client ids are
#: allocated once per client instance, so a floor matters only while an older connection of that client is
#: still open; the oldest floors are forgotten first.
RELEASED_MOUNTS_KEPT = 10_000


def _mount_key(request: MountRequest) -> tuple:
    return (request.req_id.generation, request.seq_num)


class ServerPartition:
    """One partition as clients see it (see the module doc).

    ``store`` provides :class:`~waltz.interfaces.IStorePartition` and must
    already be opening (``Store.partition`` opens it); ``close()`` closes it.
    ``metrics`` (:class:`PartitionMetrics`), ``feed_cache`` and ``data_cache``
    may be shared by all partitions of a server; by default each partition
    has its own, sized by ``settings``.
    """

    log = Logger()

    def __init__(self, partition_id: int, generation: int, store, settings: PartitionSettings = None,
                 reactor=None, metrics: PartitionMetrics = None, feed_cache: FeedCache = None,
                 data_cache: TransactionDataCache = None):
        if reactor is None:
            from twisted.internet import reactor
        self.partition_id = partition_id
        self.generation = generation
        self.store = store
        self.settings = settings if settings is not None else PartitionSettings()
        self.reactor = reactor
        self.metrics = metrics if metrics is not None else PartitionMetrics(Registry())
        self.feed_cache = feed_cache if feed_cache is not None else FeedCache(self.settings.feed_cache_size)
        self.data_cache = (data_cache if data_cache is not None
                           else TransactionDataCache(self.settings.transaction_data_cache_size))
        self.state = PartitionState.STARTING
        self.append_state = AppendTaskState.WAITING_FOR_START
        self.high_water_mark = -1
        self.locks = None
        self.feeds = FeedScheduler(partition_id, self.feed_cache, store, reactor,
                                   realtime_threshold=self.settings.realtime_threshold,
                                   on_sent=self._feed_items_sent)
        self._queue = collections.deque()
        self._in_flight = 0
        self._task_running = False
        self._mounts = {}                 # client id -> MountedClient
        self._released_keys = {}          # client id -> key of its mount released by a closed connection
        self._serving_waiters = []
        self._listening = False

    # -- life cycle ---------------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        """True while serving and the store partition is writing."""
        return self.state is PartitionState.SERVING and bool(self.store.healthy)

    @property
    def pending_appends(self) -> int:
        """Appends queued here or with the store, not yet settled."""
        return sum(isinstance(item, _QueuedAppend) for item in self._queue) + self._in_flight

    @property
    def mounted_clients(self) -> dict:
        """Client id -> :class:`MountedClient`."""
        return dict(self._mounts)

    def start(self) -> defer.Deferred:
        """Fires with this partition once it serves (the store partition is writing)."""
        if not self._listening and self.state is not PartitionState.CLOSED:
            self._listening = True
            self.store.add_listener(self._store_advanced)
        self._try_serving()
        return self._when_serving()

    def close(self) -> defer.Deferred:
        """Stop serving: feeds stop, queued requests are dropped (mounts get NOT_READY, those whose catch-up
        was under way too), the store closes."""
        if self.state is PartitionState.CLOSED:
            return defer.succeed(None)
        self._transition(PartitionState.CLOSED, "closed")
        owed_ready = [feed for feed in self.feeds.feeds if isinstance(feed.end_message, MountResponse)]
        self.feeds.close()
        for feed in owed_ready:
            # Unanswered, the client would wait in MOUNTING for ever; the items it has are kept (by id).
            self._send_mount_response(feed.connection, feed.req_id, MountState.NOT_READY)
        waiters, self._serving_waiters = self._serving_waiters, []
        for waiter in waiters:
            waiter.errback(PartitionClosed("partition %d closed before it served" % self.partition_id))
        queued, self._queue = list(self._queue), collections.deque()
        for item in queued:
            self._abandon(item)
        self._mounts.clear()
        # The partition may now be served elsewhere: a stale high-water mark here would mislead readers of /metrics.
        self.metrics.high_water_mark.remove(self.partition_id)
        return defer.maybeDeferred(self.store.close)

    def _transition(self, state, why):
        self.log.info("partition {pid} (generation {gen}): {old} -> {new} ({why})", pid=self.partition_id,
                      gen=self.generation, old=self.state.value, new=state.value, why=why)
        self.state = state

    def _try_serving(self):
        if self.state is not PartitionState.STARTING or not self.store.healthy:
            return
        self.high_water_mark = self.store.high_water_mark
        self.locks = LockTable(self.settings.lock_table_size, self.high_water_mark)
        self.metrics.high_water_mark.set(self.high_water_mark, self.partition_id)
        self._transition(PartitionState.SERVING, "store partition writing at high-water mark %d"
                         % self.high_water_mark)
        self.feeds.advance(self.high_water_mark)
        waiters, self._serving_waiters = self._serving_waiters, []
        for waiter in waiters:
            waiter.callback(self)
        self._run_append_task()

    def _when_serving(self) -> defer.Deferred:
        if self.state is PartitionState.SERVING:
            return defer.succeed(self)
        if self.state is PartitionState.CLOSED:
            return defer.fail(PartitionClosed("partition %d is closed" % self.partition_id))
        waiter = defer.Deferred()
        self._serving_waiters.append(waiter)
        return waiter

    def _store_advanced(self, high_water_mark):
        """The store's listener: called after each commit and each recovery."""
        if self.state is PartitionState.STARTING:
            self._try_serving()
        elif self.state is PartitionState.SERVING and high_water_mark > self.high_water_mark + self._in_flight:
            # Commits this partition did not make: its own are at most the in-flight ones, whose
            # results it may not have heard of yet (a store may fire listeners first).
            self.log.warn("partition {pid}: store high-water mark {hwm} is ahead of the partition's {own}; "
                          "lock table raised to it", pid=self.partition_id, hwm=high_water_mark,
                          own=self.high_water_mark)
            self.locks.reset(high_water_mark)
            self._advance(high_water_mark)

    def _advance(self, high_water_mark):
        if high_water_mark > self.high_water_mark:
            self.high_water_mark = high_water_mark
            if self.state is not PartitionState.CLOSED:
                self.metrics.high_water_mark.set(high_water_mark, self.partition_id)
            self.feeds.advance(high_water_mark)

    # -- messages -----------------------------------------------------------------------------

    #: Message class -> method handling it as ``method(connection, message)``.
    HANDLERS = {
        MountRequest: "_mount",
        AppendRequest: "_append",
        FeedRequest: "_feed",
        FlushRequest: "_flush",
        HighWaterMarkRequest: "_high_water_mark",
        TransactionDataRequest: "_transaction_data",
        TransactionDataBatchRequest: "_transaction_data_batch",
    }

    def handle(self, connection, message):
        """Serve one message of a client connection; returns None or a Deferred that never fails."""
        return getattr(self, self.HANDLERS[type(message)])(connection, message)

    def connection_closed(self, connection):
        """``connection`` is gone: its feed stops and its mounts are released."""
        self.feeds.remove_connection(connection)
        for client_id, mounted in list(self._mounts.items()):
            if mounted.connection is connection:
                del self._mounts[client_id]
                self._remember_released(client_id, mounted.key)

    def _remember_released(self, client_id, key):
        released = self._released_keys
        released.pop(client_id, None)
        released[client_id] = key
        if len(released) > RELEASED_MOUNTS_KEPT:
            del released[next(iter(released))]

    def connection_writable(self, connection):
        """``connection`` drained its write buffer: its feed may produce again."""
        self.feeds.wake()

    def is_mounted(self, connection, client_id) -> bool:
        """True when ``connection`` holds the mount of ``client_id``."""
        mounted = self._mounts.get(client_id)
        return mounted is not None and mounted.connection is connection

    # -- mount and feed -----------------------------------------------------------------------

    def _mount(self, connection, request):
        req_id = request.req_id
        if self.state is not PartitionState.SERVING or req_id.generation != self.generation:
            self.log.info("partition {pid}: mount by client {client} (generation {gen}) not ready: {state}, "
                          "generation {own}", pid=self.partition_id, client=req_id.client_id,
                          gen=req_id.generation, state=self.state.value, own=self.generation)
            self._send_mount_response(connection, req_id, MountState.NOT_READY)
            return None
        current = self._mounts.get(req_id.client_id)
        key = _mount_key(request)
        if current is not None:
            stale = not (key > current.key or (key == current.key and current.connection is connection))
            floor = current.key
        else:
            floor = self._released_keys.get(req_id.client_id)
            stale = floor is not None and key <= floor
        if stale:
            self.log.info("partition {pid}: stale mount by client {client} {key} ignored (mounted: {floor})",
                          pid=self.partition_id, client=req_id.client_id, key=key, floor=floor)
            return None
        self._released_keys.pop(req_id.client_id, None)
        if current is not None and current.connection is not connection:
            self.log.info("partition {pid}: client {client} remounts {key}, replacing {old}",
                          pid=self.partition_id, client=req_id.client_id, key=key, old=current.key)
            self.feeds.remove_connection(current.connection)
        self._mounts[req_id.client_id] = MountedClient(req_id.client_id, key, connection, req_id)
        # (Not returned: see _flush.) The same mount request sent again on the connection waits as one.
        d = self._enqueue_barrier(key=(connection, "mount", req_id))
        if d is not None:
            d.addCallbacks(self._mount_flushed, self._mount_abandoned,
                           callbackArgs=(connection, request), errbackArgs=(connection, request))
        return None

    def _is_current_mount(self, connection, request) -> bool:
        """Whether ``request`` on ``connection`` is still its client's current mount (not superseded)."""
        current = self._mounts.get(request.req_id.client_id)
        return current is not None and current.connection is connection and current.key == _mount_key(request)

    def _mount_flushed(self, high_water_mark, connection, request):
        req_id = request.req_id
        if not self._is_current_mount(connection, request):
            self.log.info("partition {pid}: mount of client {client} superseded while flushing",
                          pid=self.partition_id, client=req_id.client_id)
            return
        if request.client_hwm > high_water_mark:
            self.log.warn("partition {pid}: client {client} is ahead: its high-water mark {client_hwm} > {hwm}",
                          pid=self.partition_id, client=req_id.client_id, client_hwm=request.client_hwm,
                          hwm=high_water_mark)
            self._send_mount_response(connection, req_id, MountState.CLIENT_AHEAD)
            return
        self.metrics.mounts.inc(1, self.partition_id, MountState.READY.name)
        self.feeds.add(FeedContext(req_id, connection, request.client_hwm + 1,
                                   high_water_mark - request.client_hwm,
                                   MountResponse(req_id, MountState.READY)))

    def _mount_abandoned(self, failure, connection, request):
        failure.trap(PartitionClosed)
        if self._is_current_mount(connection, request):   # a superseded mount gets no answer, as ever
            self._send_mount_response(connection, request.req_id, MountState.NOT_READY)

    def _send_mount_response(self, connection, req_id, state):
        self.metrics.mounts.inc(1, self.partition_id, state.name)
        connection.sendMessage(MountResponse(req_id, state))

    def _feed(self, connection, request):
        req_id = request.req_id
        if self.state is not PartitionState.SERVING or not self.is_mounted(connection, req_id.client_id):
            self.log.debug("partition {pid}: feed request of client {client} from an unmounted connection dropped",
                           pid=self.partition_id, client=req_id.client_id)
            return None
        mount = self._mounts[req_id.client_id].req_id
        if req_id != mount or self._owes_mount_response(connection):
            # A feed request of an earlier mount on this connection, or one sent before the mount's
            # catch-up ended: taking it would replace that catch-up, and READY would never be sent.
            self.log.info("partition {pid}: feed request {req_id} of client {client} is not for its current "
                          "mount {mount}, or came before READY; dropped", pid=self.partition_id, req_id=req_id,
                          client=req_id.client_id, mount=mount)
            return None
        if request.client_hwm > self.high_water_mark:
            self.log.warn("partition {pid}: feed request of client {client} is ahead ({client_hwm} > {hwm}); dropped",
                          pid=self.partition_id, client=req_id.client_id, client_hwm=request.client_hwm,
                          hwm=self.high_water_mark)
            return None
        credit = max(self.high_water_mark - request.client_hwm, self.settings.min_fetch_size)
        self.feeds.add(FeedContext(req_id, connection, request.client_hwm + 1, credit, FeedSuspended(req_id)))
        return None

    def _owes_mount_response(self, connection) -> bool:
        feed = self.feeds.feed_of(connection)
        return feed is not None and isinstance(feed.end_message, MountResponse)

    def _feed_items_sent(self, count, from_cache):
        self.metrics.feed_items.inc(count, self.partition_id)
        self.metrics.cache_lookups.inc(count, "feed", "hit" if from_cache else "miss")

    # -- flush and high-water mark --------------------------------------------------------------

    def _flush(self, connection, request):
        if self.state is PartitionState.CLOSED:
            return None
        # Not returned to the connection: a FLUSH may wait for ever on a partition whose store cannot
        # recover, and counted toward the connection's back pressure, such waits would stop the reading of
        # every other partition on it. Repeated FLUSHes wait as one (see _Barrier).
        d = self._enqueue_barrier(key=(connection, request.req_id))
        if d is not None:
            d.addCallbacks(lambda hwm: connection.sendMessage(FlushResponse(request.req_id, hwm)),
                           lambda failure: failure.trap(PartitionClosed))
        return None

    def _high_water_mark(self, connection, request):
        self._when_serving().addCallbacks(
            lambda _: connection.sendMessage(HighWaterMarkResponse(request.req_id, self.high_water_mark)),
            lambda failure: failure.trap(PartitionClosed))
        return None

    # -- transaction data -----------------------------------------------------------------------

    def _transaction_data(self, connection, request):
        txn = request.transaction_id
        if self.state is PartitionState.CLOSED:
            connection.sendMessage(TransactionDataResponse.failure(
                request.req_id, txn, not_served_error(self.partition_id)))
            return None
        cached = self.data_cache.get(self.partition_id, txn)
        self.metrics.cache_lookups.inc(1, "transaction-data", "hit" if cached is not None else "miss")
        if cached is not None:
            self.metrics.data_served.inc(1, self.partition_id)
            connection.sendMessage(TransactionDataResponse(request.req_id, txn, True, cached.data, cached.checksum))
            return None
        return connection.run_data_read(lambda: self._read_record(connection, request))

    def _read_record(self, connection, request):
        d = defer.maybeDeferred(self.store.get_record, request.transaction_id)
        d.addCallback(self._record_read, connection, request)
        d.addErrback(self._record_read_failed, connection, request)
        return d

    def _record_read(self, record, connection, request):
        txn = request.transaction_id
        if record is None:
            error = "transaction %d of partition %d is not committed (high-water mark %d)" % (
                txn, self.partition_id, self.high_water_mark)
        elif record.transaction_id != txn:
            error = "storage returned transaction %d for %d" % (record.transaction_id, txn)
        elif not record.is_valid():
            error = "transaction %d of partition %d failed its checksum in storage" % (txn, self.partition_id)
        else:
            self.data_cache.put(self.partition_id, txn, record.data, record.checksum)
            self.metrics.data_served.inc(1, self.partition_id)
            connection.sendMessage(TransactionDataResponse(request.req_id, txn, True, record.data, record.checksum))
            return
        self.log.warn("{error}", error=error)
        connection.sendMessage(TransactionDataResponse.failure(request.req_id, txn, error))

    def _record_read_failed(self, failure, connection, request):
        # The store could not read now (no replica reachable, a storage connection lost): the client may
        # ask again.
        error = "reading transaction %d of partition %d failed (%s): %s" % (
            request.transaction_id, self.partition_id, RETRY_LATER_MARK, failure.getErrorMessage())
        self.log.warn("{error}", error=error)
        connection.sendMessage(TransactionDataResponse.failure(request.req_id, request.transaction_id, error))

    def _transaction_data_batch(self, connection, request):
        """Version 5: the records of a prefix of ``request.transaction_ids``, read from the store in
        runs of consecutive ids (the data cache holds no headers, so it is not used), every record
        checked; any missing or damaged record fails the whole request, naming the transaction."""
        ids = request.transaction_ids
        if self.state is not PartitionState.SERVING:
            # Starting (its high-water mark not known yet) or closed: the client looks it up again.
            error = not_served_error(self.partition_id)
        else:
            error = batch_request_problem(ids, self.partition_id, self.high_water_mark)
        if error is not None:
            connection.sendMessage(TransactionDataBatchResponse.failure(request.req_id, error))
            return None
        return connection.run_data_read(lambda: self._read_batch(connection, request))

    def _read_batch(self, connection, request):
        d = read_record_batch(self.store, request.transaction_ids, self.partition_id, MAX_BATCH_RESPONSE_BYTES)
        d.addCallback(self._batch_read, connection, request)
        d.addErrback(self._batch_failed, connection, request)
        return d

    def _batch_read(self, records, connection, request):
        self.metrics.data_served.inc(len(records), self.partition_id)
        connection.sendMessage(TransactionDataBatchResponse.success(request.req_id, records))

    def _batch_failed(self, failure, connection, request):
        error = failure.getErrorMessage()
        if not failure.check(BatchReadError):
            # The store could not read now (no replica reachable, a timeout): the client may ask again.
            error = "reading transactions of partition %d failed (%s): %s" % (self.partition_id, RETRY_LATER_MARK,
                                                                               error)
        self.log.warn("{error}", error=error)
        connection.sendMessage(TransactionDataBatchResponse.failure(request.req_id, error))

    # -- appends --------------------------------------------------------------------------------

    def _append(self, connection, request):
        self.metrics.appends.inc(1, self.partition_id)
        if request.client_hwm > self.high_water_mark and self.state is PartitionState.SERVING:
            # It claims to have applied transactions that do not exist: its locks would never be checked
            # (no estimate exceeds it). A legitimate client mounted here is never ahead (CLIENT_AHEAD).
            raise ProtocolError("append %s claims client high-water mark %d, above partition %d's %d"
                                % (request.req_id, request.client_hwm, self.partition_id, self.high_water_mark))
        drop = self._append_drop_reason(connection, request)
        if drop is not None:
            self.metrics.dropped_appends.inc(1, self.partition_id, drop.value)
            self.log.info("partition {pid}: append {req_id} dropped ({reason})", pid=self.partition_id,
                          req_id=request.req_id, reason=drop.value)
            return None
        item = _QueuedAppend(connection, request, self.reactor.seconds())
        self._queue.append(item)
        self._run_append_task()
        if item.dequeued:
            return None
        item.released = defer.Deferred()
        return item.released

    def _append_drop_reason(self, connection, request):
        if self.state is not PartitionState.SERVING:
            return AppendDrop.NOT_SERVING
        if request.req_id.generation != self.generation:
            return AppendDrop.GENERATION
        if not self.is_mounted(connection, request.req_id.client_id):
            return AppendDrop.NOT_MOUNTED
        return None

    def _enqueue_barrier(self, key=None):
        """A Deferred firing with the high-water mark once every append queued so far has settled (failing
        with PartitionClosed if it closes first); None when ``key`` (``(connection, ...)``) already waits at
        that point. A :class:`ProtocolError` (closing the connection) past MAX_WAITS_PER_CONNECTION keys of one
        connection there."""
        last = self._queue[-1] if self._queue else None
        if isinstance(last, _Barrier):
            if key is not None and key in last.keys:
                return None
        else:
            last = _Barrier()
            self._queue.append(last)
        if key is not None:
            connection = key[0]
            if last.per_connection[connection] >= MAX_WAITS_PER_CONNECTION:
                raise ProtocolError("more than %d flush or mount requests waiting on partition %d"
                                    % (MAX_WAITS_PER_CONNECTION, self.partition_id))
            last.keys.add(key)
            last.per_connection[connection] += 1
        d = last.wait()
        self._run_append_task()
        return d

    def _run_append_task(self):
        """Take queue items in order until the head must wait (re-entrant calls are no-ops)."""
        if self._task_running:
            return
        self._task_running = True
        try:
            while self.state is PartitionState.SERVING and self._queue:
                item = self._queue[0]
                wait = self._process_barrier(item) if isinstance(item, _Barrier) else self._process_append(item)
                if wait is not None:
                    self.append_state = wait
                    return
            self.append_state = (AppendTaskState.IDLE if self.state is PartitionState.SERVING
                                 else AppendTaskState.WAITING_FOR_START)
        finally:
            self._task_running = False

    def _process_barrier(self, barrier):
        if self._in_flight:
            return AppendTaskState.WAITING_FOR_DRAIN
        self._queue.popleft()
        barrier.release(self.high_water_mark)
        return None

    def _process_append(self, item):
        if self._in_flight >= self.settings.max_pending_appends:
            return AppendTaskState.WAITING_FOR_CAPACITY
        check = self.locks.check(item.request, item.request.client_hwm)
        if check.outcome is LockOutcome.IN_FLIGHT:
            return AppendTaskState.WAITING_FOR_LOCKS
        self._queue.popleft()
        self._release(item)
        if check.outcome is LockOutcome.FAILED:
            self._lock_failed(item, check.estimate)
        else:
            self._send_to_store(item)
        return None

    def _release(self, item):
        item.dequeued = True
        if item.released is not None:
            item.released.callback(None)

    def _abandon(self, item):
        if isinstance(item, _Barrier):
            item.abandon(PartitionClosed("partition %d closed" % self.partition_id))
        else:
            self._release(item)

    def _lock_failed(self, item, estimate):
        self.metrics.lock_failures.inc(1, self.partition_id)
        item.connection.sendMessage(LockFailure(item.request.req_id, estimate))

    def _send_to_store(self, item):
        request = item.request
        held = self.locks.begin(request)
        self._in_flight += 1
        try:
            d = self.store.append(request.req_id, request.header, request.data, request.checksum)
        except Exception:
            d = defer.fail()
        d.addCallbacks(self._committed, self._store_failed, callbackArgs=(item, held), errbackArgs=(item, held))
        d.addErrback(self._unexpected)

    def _committed(self, transaction_id, item, held):
        self.locks.commit(held, transaction_id)
        self._in_flight -= 1
        if self.state is PartitionState.CLOSED:
            return
        if transaction_id <= self.high_water_mark:
            # The store reported an id already committed: cached and fed, it would carry two transactions
            # under one id. A store bug; stop serving the partition rather than serve that.
            self.log.critical("partition {pid}: the store reported append {req_id} committed as transaction "
                              "{txn}, at or below the high-water mark {hwm}; closing the partition (it stays "
                              "closed on this server until it is reassigned or the server restarts)",
                              pid=self.partition_id, req_id=item.request.req_id, txn=transaction_id,
                              hwm=self.high_water_mark)
            self.close().addErrback(lambda f: self.log.failure("closing partition {pid} failed", f,
                                                                 pid=self.partition_id))
            return
        request = item.request
        self.feed_cache.add_committed(self.partition_id, transaction_id, request.req_id, request.header)
        self.data_cache.put(self.partition_id, transaction_id, request.data, request.checksum)
        self.metrics.committed.inc(1, self.partition_id)
        self.metrics.append_seconds.observe(self.reactor.seconds() - item.received_at, self.partition_id)
        self._advance(transaction_id)
        self._run_append_task()

    #: Store failures and how loudly they are logged; the client learns the outcome from the feed.
    _STORE_FAILURES = {AppendFailed: "info", AppendFateUnknown: "info", PartitionNotOwned: "warn"}

    def _store_failed(self, failure, item, held):
        self.locks.release(held)
        self._in_flight -= 1
        self.metrics.store_failures.inc(1, self.partition_id)
        if failure.check(AppendFateUnknown, PartitionNotOwned) and self.state is not PartitionState.CLOSED:
            # The store partition is lost: the next owner decides whether this append committed. No
            # barrier may fire with this server's high-water mark, which does not count it: a FLUSH
            # answered or a mount READY now would let the client fail, and retry, an append that
            # may yet commit (a duplicate). The partition stops serving at once.
            self.log.warn("partition {pid}: store partition lost ({reason}); closing",
                          pid=self.partition_id, reason=failure.getErrorMessage())
            self.close().addErrback(lambda f: self.log.failure("closing partition {pid} failed", f,
                                                                 pid=self.partition_id))
        level = self._STORE_FAILURES.get(failure.type)
        if level is None:
            self.log.failure("partition {pid}: append {req_id} failed", failure, pid=self.partition_id,
                             req_id=item.request.req_id)
        else:
            getattr(self.log, level)("partition {pid}: append {req_id} not committed: {reason}",
                                     pid=self.partition_id, req_id=item.request.req_id,
                                     reason=failure.getErrorMessage())
        self._run_append_task()

    def _unexpected(self, failure):
        self.log.failure("partition {pid}: error in the append task", failure, pid=self.partition_id)
