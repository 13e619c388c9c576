"""The server's store: storage connections, store session creation, and replica assignment changes.

:class:`Store` is what a Waltz server creates once: it reads ``<root>/store``
(cluster key, partition count) to open connections to the storage nodes (one
per node, shared by all partitions), watches ``<root>/store/assignment``, and
hands out :class:`StorePartition` objects. When the replica assignment
changes, every open store session closes and the next one is built with the
new replica set (the original's eager re-open, PR #93).

:class:`StoreSessionManager` creates sessions: a new session id by
compare-and-set on ``<root>/store/partition/<id>`` (refused when the stored
generation is newer than the server's), one :class:`ReplicaSession` per
assigned replica, and a :class:`StoreSession` that recovers before writing.
"""

from twisted.internet import defer
from twisted.logger import Logger
from zope.interface import implementer

from waltz.interfaces import IPartitionMetadataStore
from waltz.protocols import storage_messages as sm
from waltz.recovery.manager import departing_voters
from waltz.server.store.partition import StorePartition
from waltz.server.store.replica import DEFAULT_REQUEST_TIMEOUT, ReplicaSession, StorageConnectionPool
from waltz.server.store.session import StoreSession
from waltz.zk.znodes import ReplicaAssignments, ReplicaId


@implementer(IPartitionMetadataStore)
class ZooKeeperPartitionMetadata:
    """:class:`IPartitionMetadataStore` over :class:`~waltz.zk.metadata.ClusterMetadata`."""

    def __init__(self, cluster):
        self.cluster = cluster

    def read(self, partition_id):
        return self.cluster.partition_metadata(partition_id).addCallback(lambda v: v.value if v else None)

    def update(self, partition_id, change):
        return self.cluster.update_partition_metadata(partition_id, change)


class StoreSessionManager:
    """Creates the store sessions of every partition of this server."""

    log = Logger()

    def __init__(self, cluster, pool, reactor, assignment, metrics=None, recovery_retry_interval=0.5):
        self.cluster = cluster
        self.pool = pool
        self.reactor = reactor
        self.assignment = assignment  # callable: partition id -> tuple of storage connect strings
        self.metadata_store = ZooKeeperPartitionMetadata(cluster)
        self.metrics = metrics
        self.recovery_retry_interval = recovery_retry_interval

    @defer.inlineCallbacks
    def create_session(self, partition_id, generation, on_close):
        storages = self.assignment(partition_id)
        if not storages:
            raise NoReplicas("partition %d has no replica assigned in ZooKeeper" % partition_id)
        metadata = yield self.cluster.new_store_session(partition_id, generation)
        # Read again: an assignment change while ZooKeeper answered closed no session (there was none yet),
        # so the replicas read before would stay, with their quorum, until the next session.
        storages = self.assignment(partition_id)
        if not storages:
            raise NoReplicas("partition %d has no replica assigned in ZooKeeper" % partition_id)
        replicas = self._replica_sessions(partition_id, metadata.session_id, storages)
        departing = self._replica_sessions(partition_id, metadata.session_id, departing_voters(metadata, storages))
        return StoreSession(partition_id, metadata, replicas, self.metadata_store, self.reactor, on_close,
                            self.metrics, recovery_retry_interval=self.recovery_retry_interval, departing=departing)

    def _replica_sessions(self, partition_id, session_id, storages):
        return {storage: ReplicaSession(ReplicaId(partition_id, storage), session_id, self.pool.connection(storage))
                for storage in storages}


class NoReplicas(Exception):
    """The partition has no replica in the ZooKeeper assignment."""


class Store:
    """The replicated store as a server sees it.

    Create it, :meth:`start` it (reads the store params and the replica
    assignment, with a watch), then :meth:`partition` for each partition the
    server owns.
    """

    log = Logger()

    def __init__(self, cluster, reactor, max_batch_size=100, checkpoint_interval=250_000, initial_retry=0.1,
                 max_retry=20.0, metrics=None, recovery_retry_interval=0.5, max_batches_in_flight=4,
                 request_timeout=DEFAULT_REQUEST_TIMEOUT, tls=None, liveness=None):
        self.cluster = cluster
        self.tls = tls          # a waltz.tls.TLSConfig for the storage connections, or None (plain TCP)
        self.liveness = liveness    # the storage connections' Liveness (None: the default keep-alives)
        self.reactor = reactor
        self.max_batch_size = max_batch_size
        self.max_batches_in_flight = max_batches_in_flight
        self.checkpoint_interval = checkpoint_interval
        self.initial_retry = initial_retry
        self.request_timeout = request_timeout
        self.max_retry = max_retry
        self.metrics = metrics
        self.recovery_retry_interval = recovery_retry_interval
        self.params = None
        self.pool = None
        self.sessions = None
        self.partitions = {}
        self._replicas_by_partition = {}
        self._watch = None

    @defer.inlineCallbacks
    def start(self):
        self.params = yield self.cluster.store_params()
        open_request = sm.OpenRequest.create(self.params.key, self.params.num_partitions)
        self.pool = StorageConnectionPool(open_request, self.reactor, self.initial_retry, self.max_retry,
                                          self.request_timeout, wanted=self.assigned_storages, tls=self.tls,
                                          liveness=self.liveness)
        self.sessions = StoreSessionManager(self.cluster, self.pool, self.reactor, self.replicas_of, self.metrics,
                                            self.recovery_retry_interval)
        self._apply_assignment((yield self.cluster.replica_assignments()))
        self._watch = yield self.cluster.zk.watch_data(self.cluster.paths.assignment, self._assignment_changed)

    def _apply_assignment(self, assignments):
        """Adopt a replica assignment; returns the partitions whose replica set changed."""
        new = {pid: assignments.replicas_of(pid) for pid in range(self.params.num_partitions)}
        changed = {pid for pid in new if new[pid] != self._replicas_by_partition.get(pid, ())}
        self._replicas_by_partition = new
        return changed

    def replicas_of(self, partition_id):
        return self._replicas_by_partition.get(partition_id, ())

    def assigned_storages(self):
        """Every storage node the replica assignment names."""
        return {storage for storages in self._replicas_by_partition.values() for storage in storages}

    def _assignment_changed(self, data, stat):
        if data is None:
            return
        try:
            changed = self._apply_assignment(ReplicaAssignments.decode(data, self.cluster.paths.assignment))
        except Exception:
            self.log.failure("the replica assignment in ZooKeeper cannot be read")
            return
        for pid in sorted(changed):
            partition = self.partitions.get(pid)
            if partition is not None and partition.session is not None:
                self.log.info("replica assignment of partition {pid} changed to {storages}: new store session",
                              pid=pid, storages=self.replicas_of(pid))
                partition.session.close("replica assignment changed")
        self.pool.release_unwanted()

    def partition(self, partition_id, generation) -> StorePartition:
        """Open (or return) the store partition; a new generation replaces the old object."""
        existing = self.partitions.get(partition_id)
        if existing is not None and existing.generation == generation and not existing.closed:
            return existing
        if existing is not None:
            existing.close()
        partition = StorePartition(partition_id, generation, self.sessions.create_session, self.reactor,
                                   self.max_batch_size, self.checkpoint_interval, self.recovery_retry_interval,
                                   self.max_batches_in_flight)
        self.partitions[partition_id] = partition
        partition.open()
        return partition

    def close_partition(self, partition_id):
        partition = self.partitions.pop(partition_id, None)
        if partition is None:
            return defer.succeed(None)
        d = partition.close()
        if self.metrics is not None:
            # (After the close, which ends its session's recovery.) Served elsewhere now: a state left here
            # would mislead readers of /metrics.
            self.metrics.partition_closed(partition_id)
        return d

    @defer.inlineCallbacks
    def stop(self):
        if self._watch is not None:
            self._watch.cancel()
        for pid in list(self.partitions):
            yield self.close_partition(pid)
        if self.pool is not None:
            yield self.pool.stop()
