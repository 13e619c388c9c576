"""What an application writes and receives: contexts, builders, callbacks, transactions.

* :class:`TransactionContext`: the application's code that builds one transaction
  (a subclass per kind of transaction). The client calls :meth:`~TransactionContext.execute`
  with a :class:`TransactionBuilder`, again on every retry.
* :class:`WaltzClientCallbacks`: how the client reads the application's high-water
  mark and hands it every committed transaction, in commit order per partition.
* :class:`Transaction`: one committed transaction as the feed delivers it; its data
  is fetched lazily with :meth:`Transaction.get_data`.
* :class:`PartitionLocalLock`: a lock name and id; the wire carries its
  :func:`~waltz.protocols.locks.lock_hash`.
* :class:`ExecutionResult`: what ``WaltzClient.execute`` finally reports.
"""

import enum
import json

import attr
from zope.interface import Interface, implementer

from waltz.protocols.client_messages import AppendRequest
from waltz.protocols.framing import MAX_TRANSACTION_DATA_SIZE
from waltz.protocols.locks import MAX_LOCKS_PER_KIND, lock_hash
from waltz.protocols.values import ReqId


# --- locks -------------------------------------------------------------------------------------

@attr.s(frozen=True, slots=True, auto_attribs=True)
class PartitionLocalLock:
    """A lock on ``(name, id)`` within one partition, e.g. ``PartitionLocalLock("account", 42)``.

    The server only sees :attr:`hash`: a signed 32-bit CRC32C of the UTF-8 name and the
    8-byte big-endian id (:func:`waltz.protocols.locks.lock_hash`), the same in every language.
    """

    name: str
    id: int

    @property
    def hash(self) -> int:
        return lock_hash(self.name, self.id)


def lock_hashes(locks) -> tuple:
    """The hashes of ``locks``: :class:`PartitionLocalLock` objects or ``(name, id)`` pairs."""
    hashes = []
    for lock in locks or ():
        if isinstance(lock, PartitionLocalLock):
            hashes.append(lock_hash(lock.name, lock.id))
        else:
            name, lock_id = lock
            hashes.append(lock_hash(name, lock_id))
    return tuple(hashes)


def _lock_list(locks, kind: str) -> tuple:
    """:func:`lock_hashes` of one kind of a transaction's locks; :class:`ValueError` over the limit."""
    hashes = lock_hashes(locks)
    if len(hashes) > MAX_LOCKS_PER_KIND:
        _check_lock_hashes(hashes, kind)
    return hashes


def _check_header(header):
    if type(header) is not int:
        raise TypeError("a transaction header is a signed 32-bit int, got %s %r" % (type(header).__name__, header))
    if not -2 ** 31 <= header < 2 ** 31:
        raise ValueError("a transaction header is a signed 32-bit int, got %d" % header)


def _wire_ready_hashes(hashes) -> bool:
    """Whether ``hashes`` is what :func:`lock_hashes` makes: a tuple of 32-bit ints (checked per append)."""
    if type(hashes) is not tuple:
        return False
    for h in hashes:
        if type(h) is not int or not -2 ** 31 <= h < 2 ** 31:
            return False
    return True


def _check_lock_hashes(hashes, kind):
    """Lock hashes as :func:`lock_hashes` makes them (use the setters): a tuple of 32-bit ints, not too many."""
    if not _wire_ready_hashes(hashes):
        raise TypeError("the %s locks must be set with set_%s_locks, got %r" % (kind, kind, hashes))
    if len(hashes) > MAX_LOCKS_PER_KIND:
        raise ValueError("%d %s locks are over the limit of %d per transaction"
                         % (len(hashes), kind, MAX_LOCKS_PER_KIND))


# --- serializers -------------------------------------------------------------------------------

class BytesSerializer:
    """The default: transaction data are bytes already (bytearray and memoryview are copied)."""

    def serialize(self, value) -> bytes:
        if isinstance(value, (bytes, bytearray, memoryview)):
            return bytes(value)
        raise TypeError("transaction data must be bytes, or give a serializer (got %s)" % type(value).__name__)

    def deserialize(self, data: bytes):
        return data


class JsonSerializer:
    """Transaction data as compact UTF-8 JSON (keys sorted, so equal values give equal bytes)."""

    def serialize(self, value) -> bytes:
        return json.dumps(value, sort_keys=True, separators=(",", ":")).encode("utf-8")

    def deserialize(self, data: bytes):
        return json.loads(data.decode("utf-8"))


BYTES = BytesSerializer()


def _serialize(value, serializer):
    serializer = serializer or BYTES
    data = serializer.serialize(value) if hasattr(serializer, "serialize") else serializer(value)
    if not isinstance(data, bytes):
        raise TypeError("the serializer returned %s, not bytes" % type(data).__name__)
    return data


def deserialize(data, serializer):
    """``data`` turned into the application's value by ``serializer`` (its ``deserialize`` method, or itself
    called), or the bytes themselves when there is none."""
    if serializer is None:
        return data
    return serializer.deserialize(data) if hasattr(serializer, "deserialize") else serializer(data)


# --- building transactions -----------------------------------------------------------------------

class TransactionBuilder:
    """Collects what :meth:`TransactionContext.execute` sets, then builds the append request.

    ``req_id`` and ``client_high_water_mark`` are fixed by the client before ``execute``
    runs: the high-water mark is the partition's last transaction the application has
    applied, which is what the optimistic lock check compares against.
    """

    def __init__(self, req_id: ReqId, client_high_water_mark: int):
        self.req_id = req_id
        self.client_high_water_mark = client_high_water_mark
        self.header = 0
        self.data = None
        self.write_locks = ()
        self.read_locks = ()
        self.append_locks = ()

    def set_header(self, header: int):
        """Application-defined 32-bit metadata delivered with the feed (no data fetch needed)."""
        _check_header(header)
        self.header = header

    def set_transaction_data(self, value, serializer=None):
        """The transaction's data: ``value`` serialized by ``serializer`` (an object with
        ``serialize``, or a function), or bytes when no serializer is given."""
        self.data = _serialize(value, serializer)

    def set_write_locks(self, locks):
        """Locks this transaction updates: it fails if another transaction wrote them after the
        client's high-water mark; once committed it makes later readers and writers fail."""
        self.write_locks = _lock_list(locks, "write")

    def set_read_locks(self, locks):
        """Locks this transaction depends on: checked like write locks, but never updated."""
        self.read_locks = _lock_list(locks, "read")

    def set_append_locks(self, locks):
        """Locks this transaction updates without being checked (e.g. deposits)."""
        self.append_locks = _lock_list(locks, "append")

    def build_request(self) -> AppendRequest:
        """The append request (data defaults to empty bytes). :class:`TypeError` or :class:`ValueError`
        when a field cannot go on the wire (set directly instead of through the setters, which check
        them), or the data is larger than a transaction may carry (``MAX_TRANSACTION_DATA_SIZE``, 15 MiB)."""
        header = self.header
        if type(header) is not int or not -2 ** 31 <= header < 2 ** 31:
            _check_header(header)
        data = self.data if self.data is not None else b""
        if type(data) is not bytes:
            raise TypeError("transaction data must be bytes (use set_transaction_data), got %s" % type(data).__name__)
        write, read, append = self.write_locks, self.read_locks, self.append_locks
        if not (_wire_ready_hashes(write) and _wire_ready_hashes(read) and _wire_ready_hashes(append)) or \
                max(len(write), len(read), len(append)) > MAX_LOCKS_PER_KIND:
            for kind, hashes in (("write", write), ("read", read), ("append", append)):
                _check_lock_hashes(hashes, kind)
        if len(data) > MAX_TRANSACTION_DATA_SIZE:
            raise ValueError("transaction data of %d bytes is over the limit of %d bytes (%d MiB)"
                             % (len(data), MAX_TRANSACTION_DATA_SIZE, MAX_TRANSACTION_DATA_SIZE // 2 ** 20))
        return AppendRequest.create(self.req_id, self.client_high_water_mark, self.header, data,
                                    write_locks=self.write_locks, read_locks=self.read_locks,
                                    append_locks=self.append_locks)


class TransactionContext:
    """The application code that builds one transaction; subclass it.

    Required: :meth:`partition_id` and :meth:`execute`. Optional hooks:
    :meth:`on_completion`, :meth:`on_application`, :meth:`on_exception`,
    :meth:`on_expiration`, :meth:`on_lock_failure`. All run on the reactor thread and
    must not block. Exceptions raised by the hooks are logged and otherwise ignored.

    :attr:`creation_time` (reactor seconds) is set by the client when the context is
    first executed, unless the application set it; the context expires
    ``client.transactionExpiration`` after it.
    """

    creation_time = None
    #: The execution under way (set by the client from ``execute`` until the context ends): a context
    #: runs one execution at a time.
    _waltz_execution = None

    def partition_id(self, num_partitions: int) -> int:
        """The partition of this transaction, in ``0..num_partitions-1``."""
        raise NotImplementedError

    def execute(self, builder: TransactionBuilder) -> bool:
        """Set the header, data and locks on ``builder``; return True to append the transaction,
        False to drop it (then :meth:`on_completion` gets False). Returning None (a forgotten
        ``return``) is an error: the context ends with :meth:`on_exception` (``TypeError``). Called
        again on every retry, with the client's newer high-water mark: recompute from the
        application's current state.
        Raising ends the context with :meth:`on_exception`.

        It runs on the reactor thread: to read state with blocking calls, return a Deferred
        firing with True or False instead (for example from ``DbApiClientCallbacks.run_in_database``).
        The attempt keeps its place among the ``client.maxConcurrentTransactions`` meanwhile; if
        the partition is remounted before it fires, the context is executed again."""
        raise NotImplementedError

    def on_completion(self, result: bool):
        """The end of the context: True when the transaction is in the log, False when
        :meth:`execute` returned False. No retry follows."""

    def on_application(self):
        """The committed transaction was applied by ``apply_transaction`` of this client."""

    def on_exception(self, exception: BaseException):
        """The context ended with an exception (from :meth:`execute` or the client). No retry follows."""

    def on_expiration(self):
        """The context expired before its transaction could be appended. No retry follows."""

    def on_lock_failure(self):
        """An attempt failed the optimistic lock check; the client retries it once its
        high-water mark reaches the conflicting transaction."""


class Outcome(enum.Enum):
    """How the execution of a context ended."""

    COMMITTED = "committed"   #: the transaction is in the log
    IGNORED = "ignored"       #: ``execute`` returned False
    EXPIRED = "expired"       #: it expired before an attempt succeeded
    FAILED = "failed"         #: an exception ended it (``error``)


@attr.s(frozen=True, slots=True, auto_attribs=True)
class ExecutionResult:
    """The final outcome of ``WaltzClient.execute``: ``error`` is set for FAILED; ``partition_id`` and
    ``transaction_id`` say where a COMMITTED transaction is in the log (see ``WaltzClient.when_applied``)."""

    outcome: Outcome
    error: BaseException = None
    partition_id: int = None
    transaction_id: int = None

    @property
    def committed(self) -> bool:
        return self.outcome is Outcome.COMMITTED


# --- callbacks ---------------------------------------------------------------------------------

class IWaltzClientCallbacks(Interface):
    """How the client talks to the application (all called on the reactor thread)."""

    def get_client_high_water_mark(partition_id):
        """The id of the last transaction of the partition the application has applied (-1 for
        none), or a Deferred firing with it."""

    def apply_transaction(transaction):
        """Apply one committed :class:`Transaction` and advance the application's high-water mark
        with it; may return a Deferred. Transactions of a partition arrive one at a time in commit
        order: the next waits for this one. Must not wait for other transactions to commit."""

    def uncaught_exception(partition_id, transaction_id, exception):
        """``apply_transaction`` (or the client for that partition) failed with ``exception``."""


@implementer(IWaltzClientCallbacks)
class WaltzClientCallbacks:
    """Base class for applications' callbacks; override the first two methods."""

    def get_client_high_water_mark(self, partition_id):
        raise NotImplementedError

    def apply_transaction(self, transaction):
        raise NotImplementedError

    def uncaught_exception(self, partition_id, transaction_id, exception):
        """Default: nothing (the client logs the failure itself)."""


# --- committed transactions ----------------------------------------------------------------------

@attr.s(frozen=True, slots=True)
class Transaction:
    """One committed transaction from the feed.

    ``reader`` fetches the data: an object with ``fetch_data(transaction_id)`` returning a
    Deferred of bytes (the client's partition); it is not part of equality.
    """

    partition_id = attr.ib()
    transaction_id = attr.ib()
    header = attr.ib()
    req_id = attr.ib()
    reader = attr.ib(default=None, eq=False, repr=False)

    def get_data(self, serializer=None):
        """A Deferred firing with the data (deserialized by ``serializer`` when given), fetched
        from the server over the RPC connection and checked against its CRC32C."""
        if self.reader is None:
            raise RuntimeError("this Transaction has no data reader")
        return self.reader.fetch_data(self.transaction_id).addCallback(deserialize, serializer)


@attr.s(frozen=True, slots=True, auto_attribs=True)
class TransactionRecord:
    """A transaction read by ``read_transactions``: its header fields and (when asked) its data."""

    partition_id: int
    transaction_id: int
    header: int
    req_id: ReqId
    data: bytes = None
