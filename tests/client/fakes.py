"""Test doubles for the client's unit tests (never for integration tests).

* :class:`FakeServer`: a tiny in-memory Waltz server speaking real ``L`` frames over
  :class:`~waltz.protocols.base.WaltzProtocol`: mount (READY / NOT_READY /
  CLIENT_AHEAD), feed with optional credit and FEED_SUSPENDED, appends (committed
  at once, or held for the test to commit, lock-fail or lose), flush, high-water
  mark and transaction data (optionally corrupted).
* :class:`FakeNetwork`: a connector that joins client and server protocols with
  ``twisted.test.iosim`` pumps; :meth:`FakeNetwork.flush` moves bytes until quiet.
* :class:`FakeDiscovery`: an :class:`~waltz.client.discovery.IClusterDiscovery` the
  test drives by hand.
* :class:`RecordingCallbacks`, :class:`RecordingContext`: callbacks and contexts
  that record what the client did with them.
"""

import itertools

import attr
from twisted.internet import defer, error
from twisted.internet.protocol import Factory
from twisted.test import iosim
from zope.interface import implementer

from waltz.client.api import TransactionContext, WaltzClientCallbacks
from waltz.client.discovery import ClusterInfo, IClusterDiscovery, PartitionLocation
from waltz.client.network import Endpoint
from waltz.protocols import client_messages as m
from waltz.protocols.base import WaltzProtocol
from waltz.protocols.values import Record

BASE_CONFIG = {"zookeeper.connectString": "127.0.0.1:2181", "cluster.root": "/test"}


# --- server ------------------------------------------------------------------------------------

class FakePartitionLog:
    """The committed records of one partition (shared by every fake server, like the storage)."""

    def __init__(self, partition_id):
        self.partition_id = partition_id
        self.records = []

    @property
    def high_water_mark(self):
        return len(self.records) - 1

    def append(self, req_id, header, data):
        record = Record.create(len(self.records), req_id, header, data)
        self.records.append(record)
        return record


class FakeStore(dict):
    """Partition id -> FakePartitionLog, shared by the fake servers (which it knows, to feed them)."""

    def __init__(self, num_partitions):
        super().__init__((pid, FakePartitionLog(pid)) for pid in range(num_partitions))
        self.servers = []

    def commit(self, pid, req_id, header=0, data=b""):
        record = self[pid].append(req_id, header, data)
        for server in self.servers:
            server.feed_all(pid)
        return record


class FakeServerProtocol(WaltzProtocol):
    codec = m.CLIENT_CODEC
    hello_name = "Fake Waltz Server"

    def __init__(self, server):
        super().__init__()
        self.server = server
        #: partition id -> [mount ReqId, next transaction id to feed or None, remaining credit or None]
        self.feeds = {}
        self.mount_seq_nums = []

    def messageReceived(self, message):
        self.server.received.append((self, message))
        self.server.handle(self, message)

    def connectionClosed(self, reason):
        if self in self.server.connections:
            self.server.connections.remove(self)


@attr.s
class HeldAppend:
    """An append the server has received but neither committed nor rejected yet."""

    protocol = attr.ib()
    request = attr.ib()


class FakeServer(Factory):
    """A fake Waltz server for some partitions (see the module docstring)."""

    def __init__(self, logs, partitions, generation=1):
        self.logs = logs
        logs.servers.append(self)
        self.partitions = set(partitions)
        self.generation = generation
        self.connections = []
        self.received = []
        self.hold_appends = False
        self.held = []
        self.feed_credit = None
        self.corrupt = {}            # transaction id -> corrupted responses still to send
        self.data_errors = {}        # transaction id -> error string
        self.batch_errors = []       # errors the next batched data requests are answered with
        self.answer_mounts = True

    def buildProtocol(self, addr):
        proto = FakeServerProtocol(self)
        proto.factory = self
        self.connections.append(proto)
        return proto

    def messages(self, cls):
        return [message for _, message in self.received if isinstance(message, cls)]

    def handle(self, proto, message):
        handler = getattr(self, "on_" + type(message).__name__, None)
        if handler is not None:
            handler(proto, message)

    def on_MountRequest(self, proto, message):
        proto.mount_seq_nums.append(message.seq_num)
        if not self.answer_mounts:
            return
        pid = message.req_id.partition_id
        log = self.logs[pid]
        if pid not in self.partitions:
            proto.sendMessage(m.MountResponse(message.req_id, m.MountState.NOT_READY))
        elif message.client_hwm > log.high_water_mark:
            proto.sendMessage(m.MountResponse(message.req_id, m.MountState.CLIENT_AHEAD))
        else:
            for record in log.records[message.client_hwm + 1:]:
                proto.sendMessage(m.FeedData(record.req_id, record.transaction_id, record.header))
            proto.feeds[pid] = [message.req_id, None, None]
            proto.sendMessage(m.MountResponse(message.req_id, m.MountState.READY))

    def on_FeedRequest(self, proto, message):
        pid = message.req_id.partition_id
        proto.feeds[pid] = [message.req_id, message.client_hwm + 1, self.feed_credit]
        self._feed(proto, pid)

    def _feed(self, proto, pid):
        feed = proto.feeds.get(pid)
        log = self.logs[pid]
        while feed is not None and feed[1] is not None and feed[1] <= log.high_water_mark:
            if feed[2] is not None:
                if feed[2] == 0:
                    proto.sendMessage(m.FeedSuspended(feed[0]))
                    feed[1] = None
                    return
                feed[2] -= 1
            record = log.records[feed[1]]
            proto.sendMessage(m.FeedData(record.req_id, record.transaction_id, record.header))
            feed[1] += 1

    def on_AppendRequest(self, proto, message):
        if self.hold_appends:
            self.held.append(HeldAppend(proto, message))
        else:
            self.commit_request(message)

    def commit_request(self, request):
        """Commit an append request and feed it to every feeding connection."""
        return self.commit(request.req_id.partition_id, request.req_id, request.header, request.data)

    def commit(self, pid, req_id, header=0, data=b""):
        return self.logs.commit(pid, req_id, header, data)

    def feed_all(self, pid):
        for proto in list(self.connections):
            self._feed(proto, pid)

    def commit_held(self, index):
        held = self.held.pop(index)
        return self.commit_request(held.request)

    def lock_fail_held(self, index, transaction_id):
        held = self.held.pop(index)
        held.protocol.sendMessage(m.LockFailure(held.request.req_id, transaction_id))

    def on_FlushRequest(self, proto, message):
        self.held = []  # whatever was not committed is lost
        proto.sendMessage(m.FlushResponse(message.req_id, self.logs[message.req_id.partition_id].high_water_mark))

    def on_HighWaterMarkRequest(self, proto, message):
        proto.sendMessage(m.HighWaterMarkResponse(message.req_id,
                                                  self.logs[message.req_id.partition_id].high_water_mark))

    def on_TransactionDataRequest(self, proto, message):
        txn = message.transaction_id
        record = self.logs[message.req_id.partition_id].records[txn]
        if txn in self.data_errors:
            proto.sendMessage(m.TransactionDataResponse.failure(message.req_id, txn, self.data_errors[txn]))
        elif self.corrupt.get(txn):
            self.corrupt[txn] -= 1
            proto.sendMessage(m.TransactionDataResponse(message.req_id, txn, True, record.data,
                                                        record.checksum ^ 1))
        else:
            proto.sendMessage(m.TransactionDataResponse.success(message.req_id, txn, record.data))

    def on_TransactionDataBatchRequest(self, proto, message):
        if self.batch_errors:
            proto.sendMessage(m.TransactionDataBatchResponse.failure(message.req_id, self.batch_errors.pop(0)))
            return
        records = [self.logs[message.req_id.partition_id].records[txn] for txn in message.transaction_ids]
        proto.sendMessage(m.TransactionDataBatchResponse.success(message.req_id, self._corrupt_one(records)))

    def _corrupt_one(self, records):
        """``records`` with the first one ``corrupt`` still names failing its checksum (one per answer)."""
        for position, record in enumerate(records):
            if self.corrupt.get(record.transaction_id):
                self.corrupt[record.transaction_id] -= 1
                return records[:position] + [attr.evolve(record, checksum=record.checksum ^ 1)] + records[position + 1:]
        return records


# --- network -------------------------------------------------------------------------------------

class FakeNetwork:
    """Connects client protocols to fake servers by endpoint, through iosim pumps."""

    def __init__(self, clock):
        self.clock = clock
        self.servers = {}
        self.pumps = []
        self.attempts = []

    def add_server(self, endpoint, server):
        self.servers[endpoint] = server
        return server

    def connect(self, endpoint, factory):
        self.attempts.append(endpoint)
        server = self.servers.get(endpoint)
        if server is None:
            return defer.fail(error.ConnectionRefusedError(str(endpoint)))
        client_proto = factory.buildProtocol(None)
        server_proto = server.buildProtocol(None)
        pump = iosim.connect(server_proto, iosim.FakeTransport(server_proto, True),
                             client_proto, iosim.FakeTransport(client_proto, False),
                             greet=False, clock=self.clock)
        self.pumps.append(pump)
        return defer.succeed(client_proto)

    def flush(self):
        """Move bytes between every connected pair until nothing moves."""
        for _ in range(1000):
            moved = False
            for pump in list(self.pumps):
                moved = pump.flush(advanceClock=False) or moved
            if not moved:
                return
        raise AssertionError("the network never went quiet")

    def disconnect(self, endpoint):
        """Drop every connection to ``endpoint`` (the server side closes)."""
        server = self.servers[endpoint]
        for proto in list(server.connections):
            proto.transport.loseConnection()
        self.flush()

    def take_down(self, endpoint):
        """The server at ``endpoint`` goes away: connections drop and new ones are refused."""
        server = self.servers.pop(endpoint)
        for proto in list(server.connections):
            proto.transport.loseConnection()
        self.flush()
        return server

    def advance(self, seconds):
        """Advance the clock and let the network settle."""
        self.clock.advance(seconds)
        self.flush()


# --- discovery ------------------------------------------------------------------------------------

@implementer(IClusterDiscovery)
class FakeDiscovery:
    def __init__(self, num_partitions, client_id=7, locations=None):
        self.num_partitions = num_partitions
        self.client_id = client_id
        self.locations = dict(locations or {})
        self.listeners = []
        self.joined = False
        self._waiting = []
        self._ids = itertools.count(client_id + 100)
        self.closed = False

    def start(self):
        d = defer.Deferred()
        self._waiting.append(d)
        if self.joined:
            self.join()
        return d

    def join(self):
        """Let every client that started join the cluster."""
        self.joined = True
        waiting, self._waiting = self._waiting, []
        for d in waiting:
            d.callback(ClusterInfo(self.client_id, self.num_partitions, "fake"))

    def subscribe(self, listener):
        self.listeners.append(listener)
        listener(dict(self.locations))

    def move(self, partition_id, endpoint, generation):
        if endpoint is None:
            self.locations.pop(partition_id, None)
        else:
            self.locations[partition_id] = PartitionLocation(endpoint, generation)
        for listener in self.listeners:
            listener(dict(self.locations))

    def allocate_client_id(self):
        return defer.succeed(next(self._ids))

    def close(self):
        self.closed = True
        return defer.succeed(None)


# --- application side ------------------------------------------------------------------------------

class RecordingCallbacks(WaltzClientCallbacks):
    """Applies nothing but records; ``hold`` makes apply_transaction return a pending Deferred."""

    def __init__(self, high_water_marks=None):
        self.high_water_marks = dict(high_water_marks or {})
        self.applied = []
        self.errors = []
        self.hold = False
        self.pending = []
        self.fail_next = 0

    def get_client_high_water_mark(self, partition_id):
        return self.high_water_marks.get(partition_id, -1)

    def apply_transaction(self, transaction):
        if self.fail_next:
            self.fail_next -= 1
            raise RuntimeError("apply failed on purpose")
        if self.hold:
            d = defer.Deferred()
            self.pending.append((transaction, d))
            return d.addCallback(lambda _: self._record(transaction))
        self._record(transaction)
        return None

    def _record(self, transaction):
        self.applied.append(transaction)
        self.high_water_marks[transaction.partition_id] = transaction.transaction_id

    def release(self):
        pending, self.pending = self.pending, []
        for _, d in pending:
            d.callback(None)

    def uncaught_exception(self, partition_id, transaction_id, exception):
        self.errors.append((partition_id, transaction_id, exception))

    def applied_ids(self, partition_id=0):
        return [t.transaction_id for t in self.applied if t.partition_id == partition_id]


class RecordingContext(TransactionContext):
    """A context recording every call; ``execute`` sets what it was given."""

    def __init__(self, partition=0, header=0, data=b"data", write_locks=(), read_locks=(), append_locks=(),
                 proceed=True, raises=None):
        self.partition = partition
        self.header = header
        self.data = data
        self.locks = (write_locks, read_locks, append_locks)
        self.proceed = proceed
        self.raises = raises
        self.events = []
        self.builders = []

    def partition_id(self, num_partitions):
        return self.partition

    def execute(self, builder):
        self.builders.append(builder)
        self.events.append("execute")
        if self.raises is not None:
            raise self.raises
        builder.set_header(self.header)
        builder.set_transaction_data(self.data)
        builder.set_write_locks(self.locks[0])
        builder.set_read_locks(self.locks[1])
        builder.set_append_locks(self.locks[2])
        return self.proceed

    def on_completion(self, result):
        self.events.append(("completion", result))

    def on_application(self):
        self.events.append("application")

    def on_exception(self, exception):
        self.events.append(("exception", type(exception).__name__))

    def on_expiration(self):
        self.events.append("expiration")

    def on_lock_failure(self):
        self.events.append("lock failure")

    @property
    def executions(self):
        return self.events.count("execute")


EP_A = Endpoint("10.0.0.1", 55180)
EP_B = Endpoint("10.0.0.2", 55180)
