"""Reading a range of a partition's log without applying it: ``WaltzClient.read_transactions``.

A :class:`FeedRead` mounts the partition at ``start - 1`` on a stream connection of
its own, under a client id of its own (so it never displaces the client's mount of
the same partition), and takes the feed up to ``end``. The feed brings each
transaction's header, so a header filter drops transactions before any of their
data is fetched. The data of the transactions it keeps is fetched on the same
connection with batched requests (``TransactionDataBatchRequest``, protocol
version 5): up to :data:`DATA_BATCH_SIZE` transaction ids per request and up to
``client.maxDataRequestsInFlight`` requests outstanding, sent while the feed is
still arriving. A read of a range its caller knows is committed (``committed=True``:
``end`` at most the high-water mark, as when planned from ``high_water_marks()``)
that keeps every transaction with its data needs nothing from the feed: it skips the
mount and asks for the records of ``start..end`` directly, since a batch response
carries each record's header and request id as well (a transaction beyond the log
then fails the read instead of being waited for). Every record that comes back is checked against the feed (id,
header, request id) and against its CRC32C; a record whose checksum does not
match is fetched again up to ``client.maxDataFetchRetries`` times, then the read
fails with :class:`~waltz.client.errors.DataChecksumError`. A gap in the feed fails
the read with :class:`~waltz.client.errors.ReadError`, a transaction the server
cannot read fails it with :class:`~waltz.client.errors.TransactionDataError`
naming the transaction: nothing is ever skipped.
It is what the Spark data source uses on its executors.

If the connection drops, it reconnects, mounts again after the last transaction it
received and sends the unanswered data requests again; NOT_READY (and a data
request answered "not served here") is retried after ``client.mountRetryInterval``,
following the partition if it moved.

Read states: ``CONNECTING`` → ``MOUNTING`` → ``FEEDING`` → ``FINISHING`` (waiting for data) → ``DONE``
(or ``FAILED``); without the feed ``CONNECTING`` → ``FINISHING`` → ``DONE``.
"""

import collections
import enum
import itertools

import attr
from twisted.internet import defer
from twisted.logger import Logger

from waltz.client.api import TransactionRecord
from waltz.client.errors import DataChecksumError, ReadError, TransactionDataError
from waltz.client.network import Backoff, ManagedConnection
from waltz.protocols import client_messages as m
from waltz.protocols.values import ReqId

log = Logger()

#: Transaction ids named by one batched data request.
DATA_BATCH_SIZE = 1000

@attr.s(slots=True)
class _DataBatch:
    """Indexes (into the read's records) whose data one batched request asks for."""

    indexes = attr.ib()
    bad_checksums = attr.ib(default=0)  # times the first index's record failed its checksum
    refusals = attr.ib(default=0)      # transient failures answered so far (RETRY_LATER_MARK)


class ReadState(enum.Enum):
    CONNECTING = "connecting"
    MOUNTING = "mounting"
    FEEDING = "feeding"
    FINISHING = "finishing"
    DONE = "done"
    FAILED = "failed"


class FeedRead:
    """One ``read_transactions(partition, start, end, headers, include_data)`` call.

    ``locate()`` fires with the partition's current ``PartitionLocation``; ``seq_numbers`` is the
    client's network-client sequence; ``on_misrouted()`` is called when the server the map names says it
    does not serve the partition (NOT_READY, or a batch refused as not served there), so that the client
    reads its map again: a client that only reads mounts nothing else that would notice a missed change.
    """

    def __init__(self, partition_id, client_id, start, end, headers, include_data, *, locate,
                 connector, reactor, settings, seq_numbers, committed=False, on_misrouted=None):
        if start < 0:
            raise ValueError("start must be a transaction id >= 0, got %d" % start)
        if end is not None and end < start - 1:
            raise ValueError("end (%d) must be at least start - 1 (%d)" % (end, start - 1))
        self.partition_id = partition_id
        self.client_id = client_id
        self.start = start
        self.end = end
        self.headers = None if headers is None else frozenset(headers)
        self.include_data = include_data
        #: Records straight from batched requests, without the feed (see the module docstring).
        self.feedless = committed and self.headers is None and include_data and end is not None
        self._planned = False
        self._locate = locate
        self._on_misrouted = on_misrouted
        self._connector = connector
        self._reactor = reactor
        self._settings = settings
        self._seq_numbers = seq_numbers
        self._req_seq = itertools.count(1)
        self.state = ReadState.CONNECTING
        self.last_received = start - 1
        self._records = []
        self._unbatched = []                    # indexes of kept records not yet in a batch
        self._batches = collections.deque()     # batches waiting to be sent
        self._delayed = []                      # (when, batch): answered RETRY_LATER, sent again at ``when``
        self._in_flight = {}                    # req id -> batch sent on the current connection
        self._location = None
        self._conn = None
        self._mount_req_id = None
        self._retry_call = None     # moves the delayed batches due back to the queue
        self._remount_call = None   # looks the partition up again after NOT_READY / not served
        self._result = defer.Deferred(self._cancelled)

    def run(self):
        """Fires with the :class:`TransactionRecord` list, in transaction id order."""
        if self.end is not None and self.end < self.start:
            self._finish()
        else:
            self._connect()
        return self._result

    # --- connection ------------------------------------------------------------------------------

    @property
    def ended(self) -> bool:
        return self.state in (ReadState.DONE, ReadState.FAILED)

    def _connect(self):
        self._remount_call = None
        if self.ended:
            return
        self._set_state(ReadState.CONNECTING)
        self._locate().addCallbacks(self._located, self._fail)

    def _located(self, location):
        if self.state is not ReadState.CONNECTING or self._conn is not None:
            return      # ended, or relocate() opened a connection while the lookup waited
        self._open(location)

    def relocate(self, location):
        """The partition map changed: if the partition moved, leave the old server (which may be dead
        and would never answer) and go on at the new one, from the last transaction received."""
        if self.state in (ReadState.DONE, ReadState.FAILED) or location is None or self._location is None:
            return
        if (location.endpoint, location.generation) == (self._location.endpoint, self._location.generation):
            return
        log.info("partition {pid} moved to {endpoint}; the read continues there", pid=self.partition_id,
                 endpoint=location.endpoint)
        self.cancel_timers()
        self._close_connection()
        if self.state is not ReadState.FINISHING:
            self._set_state(ReadState.CONNECTING)
        self._open(location)

    def _open(self, location):
        self._close_connection()        # one connection per read, ever
        self._location = location
        backoff = Backoff(self._settings.reconnect_initial_interval, self._settings.reconnect_max_interval)
        self._conn = ManagedConnection(location.endpoint, "reader", self, self._connector, self._reactor,
                                       backoff, self._seq_numbers, self._settings.connect_timeout,
                                       self._settings.idle_timeout)
        self._conn.start()

    def connection_ready(self, conn):
        if conn is not self._conn:
            return
        if self.feedless:
            self._plan_range()
        elif self.state in (ReadState.CONNECTING, ReadState.MOUNTING, ReadState.FEEDING):
            self._mount()
        self._send_batches()

    def _plan_range(self):
        """Without the feed: every transaction of ``start..end`` is to be fetched."""
        if not self._planned:
            self._planned = True
            self._records = [None] * (self.end - self.start + 1)
            self._unbatched = list(range(len(self._records)))
            self._batch_unbatched()
        self._set_state(ReadState.FINISHING)

    def connection_lost(self, conn):
        if conn is not self._conn:
            return
        self._requeue_in_flight()
        if self.state in (ReadState.MOUNTING, ReadState.FEEDING):
            self._set_state(ReadState.CONNECTING)  # the connection reconnects by itself

    def _mount(self):
        self._mount_req_id = ReqId(self.client_id, self._location.generation, self.partition_id,
                                   next(self._req_seq))
        self._set_state(ReadState.MOUNTING)
        self._conn.send(m.MountRequest(self._mount_req_id, self.last_received, self._conn.seq_num))

    def _remount_later(self):
        """NOT_READY (or not served there): have the client read its map again, look the partition up again and
        mount after ``client.mountRetryInterval``."""
        if self._on_misrouted is not None:
            self._on_misrouted()
        self._close_connection()
        self._set_state(ReadState.CONNECTING)
        self.cancel_timers()            # the remount sends the waiting batches itself
        self._remount_call = self._reactor.callLater(self._settings.mount_retry_interval, self._connect)

    def _close_connection(self):
        self._requeue_in_flight()
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    # --- messages ------------------------------------------------------------------------------

    def connection_message(self, conn, message):
        if conn is not self._conn:
            return None
        if isinstance(message, m.TransactionDataBatchResponse):
            if self.state in (ReadState.MOUNTING, ReadState.FEEDING, ReadState.FINISHING):
                self._batch_response(message)
            return None
        if self.state not in (ReadState.MOUNTING, ReadState.FEEDING):
            return None
        if isinstance(message, m.FeedData):
            self._feed_data(message)
        elif isinstance(message, m.MountResponse) and message.req_id == self._mount_req_id:
            self._mount_response(message.state)
        elif isinstance(message, m.FeedSuspended) and message.req_id == self._mount_req_id:
            self._conn.send(m.FeedRequest(message.req_id, self.last_received))
        return None

    def _feed_data(self, message):
        txn = message.transaction_id
        if txn <= self.last_received or (self.end is not None and txn > self.end):
            return  # a repeat after a remount, or beyond the range
        if txn != self.last_received + 1:
            self._fail(ReadError("partition %d: the feed went from transaction %d to %d; transactions are missing"
                                 % (self.partition_id, self.last_received, txn)))
            return
        self.last_received = txn
        if self.headers is None or message.header in self.headers:
            self._keep(TransactionRecord(self.partition_id, txn, message.header, message.req_id))
        if self.end is not None and txn >= self.end:
            self._finish()

    def _keep(self, record):
        self._records.append(record)
        if self.include_data:
            self._unbatched.append(len(self._records) - 1)
            if len(self._unbatched) >= DATA_BATCH_SIZE:
                self._batch_unbatched()

    # --- batched data requests ---------------------------------------------------------------------

    def _batch_unbatched(self):
        for first in range(0, len(self._unbatched), DATA_BATCH_SIZE):
            self._batches.append(_DataBatch(self._unbatched[first:first + DATA_BATCH_SIZE]))
        self._unbatched = []
        self._send_batches()

    def _send_batches(self):
        conn = self._conn
        while (self._batches and conn is not None and conn.ready
               and len(self._in_flight) < self._settings.max_data_requests_in_flight):
            batch = self._batches.popleft()
            req_id = ReqId(self.client_id, self._location.generation, self.partition_id, next(self._req_seq))
            self._in_flight[req_id] = batch
            ids = [self._txn_at(index) for index in batch.indexes]
            conn.send(m.TransactionDataBatchRequest(req_id, ids))

    def _requeue_in_flight(self):
        """The connection is gone: its unanswered requests go back to the front of the queue."""
        batches = list(self._in_flight.values())
        self._in_flight.clear()
        self._batches.extendleft(reversed(batches))

    def _batch_response(self, message):
        batch = self._in_flight.pop(message.req_id, None)
        if batch is None:
            return
        if not message.ok:
            self._batch_refused(batch, message.error)
            return
        try:
            rest = self._fill(batch, message.records)
        except Exception as exc:
            self._fail(exc)
            return
        if rest is not None:
            self._batches.appendleft(rest)
        self._send_batches()
        self._check_done()

    def _batch_refused(self, batch, error):
        error = error or "no reason given"
        if m.is_not_served(error):
            self._batches.appendleft(batch)
            log.info("partition {pid}: data request answered {error!r}; looking the partition up again",
                     pid=self.partition_id, error=error)
            self._remount_later()
        elif m.is_retry_later(error) and batch.refusals < self._settings.max_data_fetch_retries:
            batch = attr.evolve(batch, refusals=batch.refusals + 1)
            delay = self._settings.retry_later_delay(batch.refusals)
            log.info("partition {pid}: data request answered {error!r}; asking again in {delay} s",
                     pid=self.partition_id, error=error, delay=delay)
            if self._remount_call is not None:
                self._batches.appendleft(batch)     # a remount sends the waiting batches itself
            else:
                # Not back in the queue: every answer to another batch sends what the queue holds.
                self._delayed.append((self._reactor.seconds() + delay, batch))
                self._arm_retry()
        else:
            self._fail(TransactionDataError("partition %d: %s" % (self.partition_id, error)))

    def _arm_retry(self):
        """Time the retry for the earliest delayed batch."""
        if not self._delayed:
            return
        due = min(when for when, _ in self._delayed)
        call = self._retry_call
        if call is not None:
            if call.getTime() <= due:
                return
            call.cancel()
        self._retry_call = self._reactor.callLater(max(0.0, due - self._reactor.seconds()), self._send_later)

    def _send_later(self):
        self._retry_call = None
        if self.ended:
            return
        now = self._reactor.seconds()
        due = [batch for when, batch in self._delayed if when <= now]
        self._delayed = [(when, batch) for when, batch in self._delayed if when > now]
        self._batches.extendleft(reversed(due))
        self._arm_retry()
        self._send_batches()

    def _txn_at(self, index):
        kept = self._records[index]
        return self.start + index if kept is None else kept.transaction_id

    def _fill(self, batch, records):
        """Put ``records`` (for a prefix of the batch) into the read's records, checking each one against
        the feed and its checksum; returns the batch of what is still to fetch (None when nothing is)."""
        if not records:
            raise TransactionDataError("partition %d: the server returned no record for transaction %d"
                                       % (self.partition_id, self._txn_at(batch.indexes[0])))
        for position, record in enumerate(records[:len(batch.indexes)]):
            index = batch.indexes[position]
            self._check_matches(index, record)
            if not record.is_valid():
                # Counted per record: the same one failing again is at the head of the batch again.
                failures = batch.bad_checksums + 1 if position == 0 else 1
                return self._bad_checksum(_DataBatch(batch.indexes[position:], failures))
            self._records[index] = TransactionRecord(self.partition_id, record.transaction_id, record.header,
                                                     record.req_id, record.data)
        rest = batch.indexes[len(records):]
        return _DataBatch(rest) if rest else None

    def _check_matches(self, index, record):
        kept = self._records[index]
        if kept is None:
            matches = record.transaction_id == self.start + index
        else:
            matches = (record.transaction_id == kept.transaction_id and record.header == kept.header
                       and record.req_id == kept.req_id)
        if not matches:
            raise ReadError("partition %d transaction %d: the server returned %r, which does not match the feed"
                            % (self.partition_id, self._txn_at(index), record.record_header))

    def _bad_checksum(self, batch):
        txn = self._txn_at(batch.indexes[0])
        if batch.bad_checksums > self._settings.max_data_fetch_retries:
            raise DataChecksumError("partition %d transaction %d: data failed its checksum %d times"
                                    % (self.partition_id, txn, batch.bad_checksums))
        log.warn("partition {pid}: transaction {txn} data failed its checksum; fetching again ({n})",
                 pid=self.partition_id, txn=txn, n=batch.bad_checksums)
        return batch

    def _mount_response(self, state):
        if state is m.MountState.READY:
            if self.end is None:
                self.end = self.last_received  # the high-water mark at the mount
            if self.last_received >= self.end:
                self._finish()
            else:
                self._set_state(ReadState.FEEDING)
                self._conn.send(m.FeedRequest(self._mount_req_id, self.last_received))
        elif state is m.MountState.NOT_READY:
            self._remount_later()
        else:
            self._fail(ReadError("partition %d: cannot read from transaction %d, the log ends before it"
                                 % (self.partition_id, self.last_received + 1)))

    # --- ending --------------------------------------------------------------------------------

    def _finish(self):
        fed = self.state in (ReadState.MOUNTING, ReadState.FEEDING)
        self._set_state(ReadState.FINISHING)
        if fed and (self._unbatched or self._batches or self._in_flight or self._delayed):
            # The mount's catch-up goes on to the partition's high-water mark, past ``end``, for as long as
            # the connection stays: the data is fetched on a new connection that mounts nothing.
            self._open(self._location)
        self._batch_unbatched()
        self._check_done()

    def _check_done(self):
        if self.state is ReadState.FINISHING and not (self._batches or self._delayed or self._in_flight
                                                      or self._unbatched):
            self._close_connection()
            self._set_state(ReadState.DONE)
            self._result.callback(list(self._records))

    def _fail(self, reason):
        if self.state in (ReadState.DONE, ReadState.FAILED):
            return
        self._set_state(ReadState.FAILED)
        self.cancel_timers()
        self._close_connection()
        self._result.errback(reason)

    def cancel_timers(self):
        """Cancel the retry and remount timers; the delayed batches go back to the queue (whoever cancels
        sends it: a remount, or nobody once the read has ended)."""
        for call in (self._retry_call, self._remount_call):
            if call is not None and call.active():
                call.cancel()
        self._retry_call = self._remount_call = None
        self._batches.extendleft(reversed([batch for _, batch in self._delayed]))
        self._delayed = []

    def abort(self, error):
        """Stop the read (the client is closing)."""
        self._fail(error)

    def _cancelled(self, _):
        # The caller gave up (a timeout): the connection and its mount go, and reads queued behind this
        # one on the partition go on.
        self._fail(defer.CancelledError("read of partition %d from transaction %d cancelled"
                                        % (self.partition_id, self.start)))

    def _set_state(self, state):
        if state is not self.state:
            log.debug("read of partition {pid}: {old} -> {new}", pid=self.partition_id,
                      old=self.state.value, new=state.value)
            self.state = state
