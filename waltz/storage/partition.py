"""One partition on a storage node: permissions and session fencing, then disk work in order.

A :class:`StoragePartition` checks each request on the reactor thread, in
arrival order, and hands it to its :class:`~waltz.storage.worker.PartitionWorker`,
which runs the disk work in the same order. The partition's log (a
``PartitionLog``) and its control-file record are only ever touched on that
worker thread.

Rules (the original's ``Partition.checkPermissions`` and ``receiveMessage``):

* an unassigned partition refuses every request;
* an unavailable partition accepts only *offline* recovery requests, and only
  from the session it currently has; an available one refuses offline requests;
* seed 003's toggles: an unreadable partition refuses reads, an unwritable one
  refuses appends, truncation and low-water mark changes;
* session fencing: a request from a higher store session makes the partition
  adopt that session; a request from a lower one is refused. The adoption is
  recorded in the control file (the partition's session fence) before the
  request runs, so a restart keeps refusing the sessions fenced off.
"""

import enum

import attr
from twisted.internet import defer

from waltz.protocols import storage_messages as sm
from waltz.protocols.framing import MAX_BATCH_DATA_SIZE
from waltz.storage.errors import StorageError


class PartitionRefused(StorageError):
    """The partition refuses the request (permissions, fencing or a failed partition)."""


class Access(enum.Enum):
    """What a request does to a partition, for the permission check."""

    SESSION = "session"   # session bookkeeping (last session info, max transaction id)
    READ = "read"
    WRITE = "write"


@attr.s(frozen=True, slots=True, auto_attribs=True)
class Operation:
    """How the partition serves one request type: its access kind and the method that does it."""

    access: Access
    method: str
    is_write: bool = False


#: Request type -> operation. The methods run on the partition's worker thread.
OPERATIONS = {
    sm.LastSessionInfoRequest: Operation(Access.SESSION, "_last_session_info"),
    sm.MaxTransactionIdRequest: Operation(Access.SESSION, "_max_transaction_id"),
    sm.SetLowWaterMarkRequest: Operation(Access.WRITE, "_set_low_water_mark"),
    sm.TruncateRequest: Operation(Access.WRITE, "_truncate"),
    sm.AppendRequest: Operation(Access.WRITE, "_append", is_write=True),
    sm.RecordHeaderRequest: Operation(Access.READ, "_record_header"),
    sm.RecordRequest: Operation(Access.READ, "_record"),
    sm.RecordHeaderListRequest: Operation(Access.READ, "_record_header_list"),
    sm.RecordListRequest: Operation(Access.READ, "_record_list"),
}

#: The most records a list request returns, whatever it asks for (bounds a response frame).
MAX_LIST_RECORDS = 1000


def check_permission(info, current_session_id, message, access):
    """Raise :class:`PartitionRefused` when ``message`` may not run on a partition in state ``info``."""
    pid = info.partition_id
    if not info.assigned:
        raise PartitionRefused("partition %d is not assigned to this storage node" % pid)
    offline = getattr(message, "offline", False)
    if offline:
        if info.available:
            raise PartitionRefused("partition %d is available: offline requests are refused" % pid)
        # Also in the session the partition's control record names (what the admin port reports and the tools
        # ask in), for requests that change nothing: after a newer session's fence, the record stays behind it
        # until that session sets its marks, which an offline partition never lets it do.
        recorded = message.session_id == info.session_id and access is not Access.WRITE
        if message.session_id != current_session_id and not recorded:
            raise PartitionRefused("offline request of session %d refused: partition %d is in session %d"
                                   % (message.session_id, pid, current_session_id))
    elif not info.available:
        raise PartitionRefused("partition %d is not available" % pid)
    if access is Access.READ and not info.readable:
        raise PartitionRefused("partition %d is not readable" % pid)
    if access is Access.WRITE and not info.writable:
        raise PartitionRefused("partition %d is not writable" % pid)


class StoragePartition:
    """A partition's request path: checks on the reactor, disk work on its worker.

    ``control`` is the node's thread-safe control file, ``log`` the opened
    partition log (or ``None`` with ``failure`` set when it could not be opened),
    ``worker`` a started :class:`PartitionWorker` whose sync is the log's.
    """

    def __init__(self, partition_id, info, control, worker, log=None, failure=None, metrics=None):
        self.partition_id = partition_id
        self.info = info
        self.session_id = info.session_id
        #: The session recorded as the partition's fence in the control file (see :meth:`_permitted`).
        self.fenced_session_id = -1
        self._control = control
        self.worker = worker
        self.log = log
        self.failure = failure
        self._metrics = metrics

    @property
    def problem(self):
        """Why the partition cannot serve, for /health and the admin status (None when it can)."""
        if self.failure is not None:
            return "failed to open: %s" % self.failure
        if self.worker is not None and self.worker.failure is not None:
            return "failed: its disk worker stopped after %s; restart the storage node" % self.worker.failure
        if self.log is not None and self.log.sync_failure is not None:
            return "failed: %s; restart the storage node" % self.log.sync_failure
        if self.log is not None and self.log.unusable is not None:
            return "failed: its log is unusable: %s; restart the storage node" % self.log.unusable
        return None

    @property
    def serving(self) -> bool:
        """Opened, healthy, available, readable and writable: what a server's store session needs of it."""
        return (self.problem is None and self.info.available and self.info.readable and self.info.writable
                and self._control.sync_failure is None)

    # -- the request path --------------------------------------------------------------

    def handle(self, message) -> defer.Deferred:
        """Check ``message`` and run it; fires with the response message."""
        try:
            operation = OPERATIONS[type(message)]
            self._admit(message, operation.access)
        except StorageError as exc:
            return defer.fail(exc)
        method = getattr(self, operation.method)
        submit = self.worker.submit_write if operation.is_write else self.worker.submit
        d = submit(self._permitted, method, operation.access, message)
        if self._metrics is not None and type(message) is sm.AppendRequest:
            d.addCallback(self._appended, message)
        return d

    def _appended(self, response, message):
        """(reactor thread, where every metric is updated) Count an append once it is durable."""
        self._metrics.appended(self.partition_id, message.records)
        return response

    def _permitted(self, method, access, message):
        """(worker thread) Run ``method`` if the flags still permit it. They were checked on admission,
        but a toggle queued before the request (``set_flag``) changes them only when its turn comes: an
        append admitted just before ``--offline`` or an unwritable toggle would otherwise still be written
        after the admin tool was told the toggle is done."""
        check_permission(self.info, self.session_id, message, access)
        if message.session_id > self.fenced_session_id:
            # Before the first request of a newer session is answered (an offline one included): a storage that
            # restarted would otherwise forget the fence and accept the old session's appends again
            # (docs/replication.md, "Fencing").
            self.fenced_session_id = self._control.raise_session_fence(self.partition_id, message.session_id)
        return method(message)

    def _admit(self, message, access):
        if self.failure is not None:
            raise PartitionRefused("partition %d failed to open: %s" % (self.partition_id, self.failure))
        check_permission(self.info, self.session_id, message, access)
        if getattr(message, "offline", False):
            return
        if message.session_id > self.session_id:
            self.session_id = message.session_id
        elif message.session_id < self.session_id:
            raise PartitionRefused("session %d is fenced: partition %d is in session %d"
                                   % (message.session_id, self.partition_id, self.session_id))

    # -- operations: these run on the worker thread --------------------------------------

    def _reply(self, message, cls, *fields):
        return cls(message.session_id, message.seq_num, message.partition_id, *fields)

    def _last_session_info(self, message):
        info = self.info
        return self._reply(message, sm.LastSessionInfoResponse, info.session_id, info.low_water_mark,
                           info.local_low_water_mark)

    def _max_transaction_id(self, message):
        # Not after a failed sync: the end of the log may never have reached the disk, and recovery
        # takes this answer as a vote about durable data.
        self.log.check_usable()
        return self._reply(message, sm.MaxTransactionIdResponse, self.log.max_transaction_id)

    def _set_low_water_mark(self, message):
        lwm = message.low_water_mark
        self.log.check_usable()     # (an unusable log's end is not known: it must not become the local mark)
        local_max = self.log.max_transaction_id
        if local_max > lwm:
            raise StorageError("cannot set low-water mark %d of partition %d: it still holds transactions up to %d"
                               % (lwm, self.partition_id, local_max))
        if lwm < self.info.low_water_mark:
            raise StorageError("low-water mark of partition %d cannot go back from %d to %d"
                               % (self.partition_id, self.info.low_water_mark, lwm))
        self.log.sync(index=True)
        self.info = self._control.update_partition_info(
            self.partition_id, session_id=message.session_id, low_water_mark=lwm, local_low_water_mark=local_max)
        return self._reply(message, sm.SuccessResponse)

    def _truncate(self, message):
        # Transactions up to the local low-water mark were committed in an earlier session (its recovery set the
        # mark), and recovery trusts the index up to it: no recovery asks to cut below it.
        if message.transaction_id < self.info.local_low_water_mark:
            raise StorageError("cannot truncate partition %d to %d: transactions up to its local low-water mark "
                               "%d are committed" % (self.partition_id, message.transaction_id,
                                                     self.info.local_low_water_mark))
        self.log.truncate(message.transaction_id)
        return self._reply(message, sm.MaxTransactionIdResponse, self.log.max_transaction_id)

    def _append(self, message):
        self.log.append(message.records)
        return self._reply(message, sm.SuccessResponse)

    def _record_header(self, message):
        return self._reply(message, sm.RecordHeaderResponse, self.log.read_header(message.transaction_id))

    def _record(self, message):
        return self._reply(message, sm.RecordResponse, self.log.read_record(message.transaction_id))

    def _record_header_list(self, message):
        count = min(max(message.max_records, 0), MAX_LIST_RECORDS)
        return self._reply(message, sm.RecordHeaderListResponse,
                           tuple(self.log.read_headers(message.transaction_id, count)))

    def _record_list(self, message):
        count = min(max(message.max_records, 0), MAX_LIST_RECORDS)
        return self._reply(message, sm.RecordListResponse,
                           tuple(self.log.read_records(message.transaction_id, count, MAX_BATCH_DATA_SIZE)))

    # -- admin changes (also through the worker, so they are ordered with requests) ----------

    def set_flag(self, flag, enabled) -> defer.Deferred:
        """Durably set or clear a control-file flag of this partition."""
        def change():
            self.info = self._control.set_flag(self.partition_id, flag, enabled)
            return self.info
        return self.worker.submit(change)

    def read_records(self, transaction_id, max_records) -> defer.Deferred:
        """Records for the admin port (no session, no permission checks beyond a failed open)."""
        if self.failure is not None or self.log is None:
            return defer.fail(PartitionRefused("partition %d failed to open: %s" % (self.partition_id, self.failure)))
        count = min(max(max_records, 0), MAX_LIST_RECORDS)
        return self.worker.submit(lambda: tuple(self.log.read_records(transaction_id, count, MAX_BATCH_DATA_SIZE)))

    def close(self) -> defer.Deferred:
        """Finish queued work, close the log and stop the worker."""
        def close_log():
            if self.log is not None:
                self.log.close()
        d = self.worker.submit_cleanup(close_log)
        d.addBoth(lambda _: self.worker.stop())
        return d
