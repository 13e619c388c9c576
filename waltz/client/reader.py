"""Reading a range of a partition's log without applying it: ``WaltzClient.read_transactions``.

A :class:`FeedRead` mounts the partition at ``start - 1`` on a stream connection of
its own, under a client id of its own (so it never displaces the client's mount of
the same partition), takes the feed up to ``end``, and fetches the data of the
transactions it keeps over the client's RPC connection, many requests in flight
(``client.maxDataRequestsInFlight``). It is what the Spark data source uses on its
executors. If the connection drops, it reconnects and mounts again after the last
transaction it received; NOT_READY is retried after ``client.mountRetryInterval``,
following the partition if it moved.

Read states: ``CONNECTING`` → ``MOUNTING`` → ``FEEDING`` → ``FINISHING`` (waiting for data) → ``DONE``
(or ``FAILED``).
"""

import enum
import itertools

from twisted.internet import defer
from twisted.logger import Logger
from twisted.python.failure import Failure

from waltz.client.api import TransactionRecord
from waltz.client.errors import ReadError
from waltz.client.network import Backoff, ManagedConnection
from waltz.protocols import client_messages as m
from waltz.protocols.values import ReqId

log = Logger()


class ReadState(enum.Enum):
    CONNECTING = "connecting"
    MOUNTING = "mounting"
    FEEDING = "feeding"
    FINISHING = "finishing"
    DONE = "done"
    FAILED = "failed"


class FeedRead:
    """One ``read_transactions(partition, start, end, headers, include_data)`` call.

    ``locate()`` fires with the partition's current ``PartitionLocation``; ``fetch_data(txn)``
    fetches data; ``seq_numbers`` is the client's network-client sequence.
    """

    def __init__(self, partition_id, client_id, start, end, headers, include_data, *, locate, fetch_data,
                 connector, reactor, settings, seq_numbers):
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
        self._locate = locate
        self._fetch_data = fetch_data
        self._connector = connector
        self._reactor = reactor
        self._settings = settings
        self._seq_numbers = seq_numbers
        self._req_seq = itertools.count(1)
        self._semaphore = defer.DeferredSemaphore(settings.max_data_requests_in_flight)
        self.state = ReadState.CONNECTING
        self.last_received = start - 1
        self._records = []
        self._fetches = []
        self._location = None
        self._conn = None
        self._mount_req_id = None
        self._retry_call = None
        self._result = defer.Deferred()

    def run(self):
        """Fires with the :class:`TransactionRecord` list, in transaction id order."""
        if self.end is not None and self.end < self.start:
            self._finish()
        else:
            self._connect()
        return self._result

    # --- connection ------------------------------------------------------------------------------

    def _connect(self):
        self._set_state(ReadState.CONNECTING)
        self._locate().addCallbacks(self._located, self._fail)

    def _located(self, location):
        if self.state is not ReadState.CONNECTING:
            return
        self._location = location
        backoff = Backoff(self._settings.reconnect_initial_interval, self._settings.reconnect_max_interval)
        self._conn = ManagedConnection(location.endpoint, "reader", self, self._connector, self._reactor,
                                       backoff, self._seq_numbers)
        self._conn.start()

    def connection_ready(self, conn):
        if conn is self._conn and self.state in (ReadState.CONNECTING, ReadState.MOUNTING, ReadState.FEEDING):
            self._mount()

    def connection_lost(self, conn):
        if conn is self._conn and self.state in (ReadState.MOUNTING, ReadState.FEEDING):
            self._set_state(ReadState.CONNECTING)  # the connection reconnects by itself

    def _mount(self):
        self._mount_req_id = ReqId(self.client_id, self._location.generation, self.partition_id,
                                   next(self._req_seq))
        self._set_state(ReadState.MOUNTING)
        self._conn.send(m.MountRequest(self._mount_req_id, self.last_received, self._conn.seq_num))

    def _remount_later(self):
        """NOT_READY: look the partition up again and mount after ``client.mountRetryInterval``."""
        self._close_connection()
        self._set_state(ReadState.CONNECTING)
        self._retry_call = self._reactor.callLater(self._settings.mount_retry_interval, self._connect)

    def _close_connection(self):
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    # --- messages ------------------------------------------------------------------------------

    def connection_message(self, conn, message):
        if conn is not self._conn or self.state not in (ReadState.MOUNTING, ReadState.FEEDING):
            return None
        if isinstance(message, m.FeedData):
            self._feed_data(message)
        elif isinstance(message, m.MountResponse) and message.req_id == self._mount_req_id:
            self._mount_response(message.state)
        elif isinstance(message, m.FeedSuspended):
            self._conn.send(m.FeedRequest(message.req_id, self.last_received))
        return None

    def _feed_data(self, message):
        txn = message.transaction_id
        if txn != self.last_received + 1 or (self.end is not None and txn > self.end):
            return
        self.last_received = txn
        if self.headers is None or message.header in self.headers:
            self._keep(TransactionRecord(self.partition_id, txn, message.header, message.req_id))
        if self.end is not None and txn >= self.end:
            self._finish()

    def _keep(self, record):
        index = len(self._records)
        self._records.append(record)
        if self.include_data:
            d = self._semaphore.run(self._fetch_data, record.transaction_id)
            d.addCallback(self._data_arrived, index)
            self._fetches.append(d)

    def _data_arrived(self, data, index):
        record = self._records[index]
        self._records[index] = TransactionRecord(record.partition_id, record.transaction_id, record.header,
                                                 record.req_id, data)

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
        self._set_state(ReadState.FINISHING)
        self._close_connection()
        d = defer.gatherResults(self._fetches, consumeErrors=True)
        d.addCallbacks(self._done, self._fail)

    def _done(self, _):
        if self.state is ReadState.FINISHING:
            self._set_state(ReadState.DONE)
            self._result.callback(list(self._records))

    def _fail(self, reason):
        if self.state in (ReadState.DONE, ReadState.FAILED):
            return
        if isinstance(reason, Failure) and reason.check(defer.FirstError):
            reason = reason.value.subFailure
        self._set_state(ReadState.FAILED)
        self.cancel_timers()
        self._close_connection()
        self._result.errback(reason)

    def cancel_timers(self):
        if self._retry_call is not None and self._retry_call.active():
            self._retry_call.cancel()
        self._retry_call = None

    def abort(self, error):
        """Stop the read (the client is closing)."""
        self._fail(error)

    def _set_state(self, state):
        if state is not self.state:
            log.debug("read of partition {pid}: {old} -> {new}", pid=self.partition_id,
                      old=self.state.value, new=state.value)
            self.state = state
