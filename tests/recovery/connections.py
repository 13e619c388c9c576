"""Test doubles for unit tests of recovery over real :class:`~waltz.server.store.replica.ReplicaSession` objects:
a storage connection the test drops and opens again at will, to an in-memory storage (never for
integration tests)."""
from types import SimpleNamespace
from twisted.internet import defer
from waltz.protocols import storage_messages as sm
from waltz.server.store.replica import ReplicaSession
from waltz.protocols.rpc import ConnectionClosed
from waltz.zk.znodes import ReplicaId


class FakeProtocol:
    """A storage protocol answering from a :class:`FakeStorage`; ``hold`` keeps appends pending."""

    def __init__(self, store):
        self.store = store
        self.closed = False
        self.pending = []
        self.hold = False

    def request(self, msg):
        if self.closed:
            return defer.fail(ConnectionClosed("closed"))
        d = defer.Deferred()
        if self.hold and isinstance(msg, sm.AppendRequest):
            self.pending.append((msg, d))
            return d
        d.callback(self.store.answer(msg))
        return d

    def drop(self):
        self.closed = True
        pending, self.pending = self.pending, []
        for _, d in pending:
            d.errback(ConnectionClosed("connection lost"))


class FakeStorage:
    """A storage node's partition: ``log`` (records by transaction id) and its last session info."""

    def __init__(self, log, last_session=(-1, -1, -1)):
        self.log = log
        self.last_session = last_session

    def answer(self, msg):
        name = type(msg).__name__
        if name == "LastSessionInfoRequest":
            s = self.last_session
            return SimpleNamespace(last_session_id=s[0], low_water_mark=s[1], local_low_water_mark=s[2])
        if name == "MaxTransactionIdRequest":
            return SimpleNamespace(transaction_id=len(self.log) - 1)
        if name == "TruncateRequest":
            del self.log[msg.transaction_id + 1:]
            return SimpleNamespace(transaction_id=len(self.log) - 1)
        if name == "SetLowWaterMarkRequest":
            self.last_session = (msg.session_id, msg.low_water_mark, len(self.log) - 1)
            return SimpleNamespace()
        if name == "AppendRequest":
            assert msg.records[0].transaction_id == len(self.log), (msg.records[0].transaction_id, len(self.log))
            self.log.extend(msg.records)
            return SimpleNamespace()
        if name == "RecordListRequest":
            return SimpleNamespace(records=tuple(self.log[msg.transaction_id:msg.transaction_id + msg.max_records]))
        raise AssertionError(name)


class FakeConnection:
    """A :class:`~waltz.server.store.replica.StorageConnection` the test opens and drops."""

    def __init__(self, storage):
        self.storage = storage
        self.protocol = None
        self._waiters = []
        self._listeners = []

    @property
    def connected(self):
        return self.protocol is not None and not self.protocol.closed

    def when_open(self):
        if self.connected:
            return defer.succeed(self.protocol)
        d = defer.Deferred(lambda c: self._waiters.remove(c) if c in self._waiters else None)
        self._waiters.append(d)
        return d

    def add_close_listener(self, listener):
        self._listeners.append(listener)

    def remove_close_listener(self, listener):
        if listener in self._listeners:
            self._listeners.remove(listener)

    def open(self, hold=False):
        self.protocol = FakeProtocol(self.storage)
        self.protocol.hold = hold
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            waiter.callback(self.protocol)
        return self.protocol

    def drop(self):
        protocol, self.protocol = self.protocol, None
        protocol.drop()
        for listener in list(self._listeners):
            listener(protocol)


def replica_session(storage_name, session_id, conn):
    """A real replica session of partition 0 on ``storage_name`` over ``conn``."""
    return ReplicaSession(ReplicaId(0, storage_name), session_id, conn)
