"""A storage node: its control file, its partitions, and the operations of both ports.

:class:`StorageNode` is what the storage (``S``) and admin (``A``) protocol
handlers call. It owns the control file (shared by every partition's worker
thread, hence :class:`SharedControlFile`) and one :class:`StoragePartition` per
assigned partition. Opening, assigning and removing partitions run their file
work off the reactor thread.
"""

import threading

from twisted.internet import defer, threads
from twisted.logger import Logger

from waltz.storage.controlfile import ControlFile, PartitionFlags, PartitionInfo
from waltz.storage.errors import ControlFileMismatch, StorageError, UnknownPartition
from waltz.storage.partition import PartitionRefused, StoragePartition
from waltz.storage.partition_log import PartitionLog, delete_partition_directory, remove_deleted_directories
from waltz.storage.worker import PartitionWorker
from waltz.config import ConfigError
from waltz.metrics import SIZE_BUCKETS, Registry


class SharedControlFile:
    """The node's control file, made safe for the partitions' worker threads by one lock."""

    def __init__(self, control):
        self._control = control
        self._lock = threading.Lock()

    def __getattr__(self, name):
        attribute = getattr(self._control, name)
        if not callable(attribute):
            return attribute

        def locked(*args, **kwargs):
            with self._lock:
                return attribute(*args, **kwargs)
        return locked


class StorageMetrics:
    """The storage's metrics: appends, bytes, fsyncs, batch sizes, latencies per partition."""

    def __init__(self, registry):
        self.registry = registry
        self.requests = registry.counter("waltz_storage_requests_total", "requests received", ("type",))
        self.failures = registry.counter("waltz_storage_request_failures_total", "failure responses sent",
                                         ("type",))
        self.records = registry.counter("waltz_storage_appended_records_total", "records appended",
                                        ("partition",))
        self.bytes = registry.counter("waltz_storage_appended_bytes_total", "record data bytes appended",
                                      ("partition",))
        self.append_batch = registry.histogram("waltz_storage_append_batch_records", "records per append request",
                                               ("partition",), SIZE_BUCKETS)
        self.fsyncs = registry.counter("waltz_storage_fsyncs_total", "group commits (fdatasync)", ("partition",))
        self.commit_batch = registry.histogram("waltz_storage_group_commit_appends",
                                               "append requests made durable by one fdatasync", ("partition",),
                                               SIZE_BUCKETS)
        self.fsync_seconds = registry.histogram("waltz_storage_fsync_seconds", "fdatasync latency",
                                                ("partition",))
        self.append_seconds = registry.histogram("waltz_storage_append_seconds",
                                                 "append request latency, arrival to durable reply",
                                                 ("partition",))

    def appended(self, partition_id, records):
        self.records.inc(len(records), partition_id)
        self.bytes.inc(sum(len(r.data) for r in records), partition_id)
        self.append_batch.observe(len(records), partition_id)

    def committed(self, partition_id, appends, seconds):
        self.fsyncs.inc(1, partition_id)
        self.commit_batch.observe(appends, partition_id)
        self.fsync_seconds.observe(seconds, partition_id)


class StorageNode:
    """The partitions of one storage directory and the operations on them."""

    log = Logger()

    def __init__(self, directory, reactor, segment_size_threshold=1_000_000_000, segment_cache_capacity=5,
                 registry=None):
        self.directory = directory
        self.reactor = reactor
        self.segment_size_threshold = segment_size_threshold
        self.segment_cache_capacity = segment_cache_capacity
        self.registry = registry if registry is not None else Registry()
        self.metrics = StorageMetrics(self.registry)
        self.control = None
        self.partitions = {}
        self._admin_locks = {}      # partition id -> DeferredLock of its admin operations

    # -- life cycle ----------------------------------------------------------------

    @defer.inlineCallbacks
    def open(self, cluster_key, num_partitions):
        """Open (or format) the directory for this cluster and open every assigned partition."""
        try:
            control = yield threads.deferToThread(ControlFile.open_or_create, self.directory, cluster_key,
                                                  num_partitions)
        except OSError as exc:
            raise ConfigError("config key 'storage.directory': cannot use %s: %s"
                              % (self.directory, exc.strerror or exc), "storage.directory") from None
        self.control = SharedControlFile(control)
        removed = yield threads.deferToThread(remove_deleted_directories, self.directory)
        if removed:
            self.log.info("removed partition directories whose deletion a crash interrupted: {names}",
                          names=", ".join(sorted(removed)))
        for pid in range(num_partitions):
            info = yield threads.deferToThread(self._read_info, pid)
            if info is None or info.assigned:
                yield self._open_partition(pid)
        self.log.info("storage directory {dir} open: cluster key {key}, {n} partitions, assigned {assigned}",
                      dir=self.directory, key=cluster_key, n=num_partitions, assigned=sorted(self.partitions))

    def _read_info(self, pid):
        try:
            return self.control.partition_info(pid)
        except StorageError:
            return None  # corrupted: opened as a failed partition, so requests say why

    @defer.inlineCallbacks
    def close(self):
        """Finish queued work on every partition and close the files."""
        partitions, self.partitions = self.partitions, {}
        yield defer.DeferredList([p.close() for p in partitions.values()])
        if self.control is not None:
            yield threads.deferToThread(self.control.close)
            self.control = None

    @property
    def cluster_key(self):
        return self.control.key

    @property
    def num_partitions(self):
        return self.control.num_partitions

    def check_open(self, cluster_key, num_partitions):
        """Raise :class:`ControlFileMismatch` naming both values when a peer belongs to another cluster."""
        if cluster_key != self.control.key:
            raise ControlFileMismatch("cluster key mismatch: this storage belongs to cluster %s, the request "
                                      "names %s" % (self.control.key, cluster_key))
        if num_partitions != self.control.num_partitions:
            raise ControlFileMismatch("partition count mismatch: this storage has %d partitions, the request "
                                      "names %d" % (self.control.num_partitions, num_partitions))

    # -- partitions ------------------------------------------------------------------

    def partition(self, pid) -> StoragePartition:
        """The open partition ``pid``; :class:`PartitionRefused` when it is not assigned here."""
        self._check_id(pid)
        partition = self.partitions.get(pid)
        if partition is None:
            raise PartitionRefused("partition %d is not assigned to this storage node" % pid)
        return partition

    def _check_id(self, pid):
        if self.control is None:
            raise StorageError("storage is not open")
        if not 0 <= pid < self.control.num_partitions:
            raise UnknownPartition("partition %d does not exist (the cluster has %d partitions)"
                                   % (pid, self.control.num_partitions))

    @defer.inlineCallbacks
    def _open_partition(self, pid):
        partition = StoragePartition(pid, PartitionInfo(pid), self.control, None, metrics=self.metrics)
        worker = PartitionWorker("partition-%d" % pid, self.reactor, self._sync_of(partition),
                                 lambda appends, seconds: self.metrics.committed(pid, appends, seconds))
        partition.worker = worker
        worker.start()
        try:
            # The control record first: a partition whose log fails to open still reports its real session and
            # marks (the admin port answered -1 for them, and tools then sent session -1).
            info = yield worker.submit(self.control.partition_info, pid)
            fence = yield worker.submit(self.control.session_fence, pid)
            partition.info, partition.session_id, partition.fenced_session_id = (
                info, max(info.session_id, fence), fence)
            partition.log = yield worker.submit(self._open_log, pid, info)
        except Exception as exc:
            partition.failure = str(exc)
            self.log.error("partition {pid} failed to open: {reason}", pid=pid, reason=exc)
        else:
            self._report_recovery(pid, partition.log.recovery)
        self.partitions[pid] = partition
        return partition

    def _report_recovery(self, pid, recovery):
        """Log what opening the partition cut: the torn end of a write that was never acknowledged."""
        if recovery is not None and recovery.truncated_bytes:
            self.log.warn("partition {pid}: recovery cut {size} bytes after record {max} in the segment of {first} "
                          "({why}): the torn end of an unacknowledged write", pid=pid, size=recovery.truncated_bytes,
                          max=recovery.max_transaction_id, first=recovery.first_transaction_id,
                          why=recovery.problem)

    @staticmethod
    def _sync_of(partition):
        def sync():
            partition.log.sync()
        return sync

    def _open_log(self, pid, info):
        """(worker thread) Open (recover) the log of partition ``pid``, whose control record is ``info``."""
        return PartitionLog.open(self.directory, self.control.key, pid,
                                 local_low_water_mark=info.local_low_water_mark,
                                 segment_size_threshold=self.segment_size_threshold,
                                 segment_cache_capacity=self.segment_cache_capacity)

    def _administered(self, pid, function, *args):
        """Run ``function(*args)`` (which may return a Deferred) after the admin operations on partition
        ``pid`` requested before it have ended. They change the control record, open and close the log:
        an assign overlapping an unassign still draining its disk thread opened a second log on the same
        files, which then missed (and later overwrote) the appends the first one acknowledged."""
        lock = self._admin_locks.setdefault(pid, defer.DeferredLock())
        return lock.run(function, *args)

    @defer.inlineCallbacks
    def assign(self, partition_ids, assign, delete_files=False):
        """Assign (create and open) or unassign (close, optionally delete) partitions, one admin operation
        at a time per partition."""
        for pid in partition_ids:
            self._check_id(pid)
        for pid in partition_ids:
            if assign:
                yield self._administered(pid, self._assign_one, pid)
            else:
                yield self._administered(pid, self._unassign_one, pid, delete_files)

    @defer.inlineCallbacks
    def _assign_one(self, pid):
        yield threads.deferToThread(self.control.set_flag, pid, PartitionFlags.ASSIGNED, True)
        old = self.partitions.pop(pid, None)
        if old is not None and old.failure is None:
            self.partitions[pid] = old
            return
        if old is not None:
            yield old.close()
        yield self._open_partition(pid)

    @defer.inlineCallbacks
    def _unassign_one(self, pid, delete_files):
        partition = self.partitions.pop(pid, None)
        if partition is not None:
            yield partition.close()
        if delete_files:
            # The reset clears ASSIGNED too, and works on a corrupted record, which set_flag cannot.
            yield threads.deferToThread(self._delete_files, pid)
        else:
            yield threads.deferToThread(self.control.set_flag, pid, PartitionFlags.ASSIGNED, False)
        self._forget_metrics(pid)

    def _delete_files(self, pid):
        """Reset the partition's control record, then remove its directory, both durably.

        In this order: a crash in between leaves old segments beside a reset record, which a recovering
        server truncates (the storage reports no session). The other way round, a record still claiming
        the last session beside missing segments would let the replica vote with an empty log. The
        directory goes in one step (:func:`delete_partition_directory`), never leaving part of a log.
        """
        self.control.reset_partition_info(pid)
        delete_partition_directory(self.directory, pid)

    def _forget_metrics(self, pid):
        for metric in (self.metrics.records, self.metrics.bytes, self.metrics.fsyncs, self.metrics.append_batch,
                       self.metrics.commit_batch, self.metrics.fsync_seconds, self.metrics.append_seconds):
            metric.remove(pid)

    @defer.inlineCallbacks
    def set_flag(self, partition_ids, flag, enabled):
        """Set or clear ``flag`` on assigned partitions (availability, read/write toggles)."""
        for pid in partition_ids:
            self.partition(pid)
        for pid in partition_ids:
            yield self._administered(pid, lambda pid=pid: self.partition(pid).set_flag(flag, enabled))

    def assigned_status(self):
        """(partition id, serving) for every assigned partition (see :attr:`StoragePartition.serving`)."""
        return tuple((pid, p.serving) for pid, p in sorted(self.partitions.items()))
