"""Typed, asynchronous access to a cluster's znodes, with compare-and-set updates.

:class:`ClusterMetadata` sits on a connected
:class:`~waltz.zk.bridge.ZooKeeperClient` and a cluster root. Reads decode the
znode into its value class; updates are read-modify-write loops that write with
the version they read and start over when another writer got there first
(bounded, with a short random back-off; then
:class:`~waltz.zk.errors.ConcurrentUpdateError`). Admin edits of the storage
topology also hold the admin lock and write their znodes in one multi-op.

Who calls what:

* ``waltz cluster`` (the CLI): :meth:`ClusterMetadata.create_cluster`,
  :meth:`~ClusterMetadata.delete_cluster`, :meth:`~ClusterMetadata.edit_topology`,
  :meth:`~ClusterMetadata.describe`;
* the server: :meth:`~ClusterMetadata.allocate_server_id`,
  :meth:`~ClusterMetadata.register_server`,
  :meth:`~ClusterMetadata.write_partition_assignment`,
  :meth:`~ClusterMetadata.new_store_session`,
  :meth:`~ClusterMetadata.update_partition_metadata`;
* clients: :meth:`~ClusterMetadata.allocate_client_id` and the readers.
"""

import random as random_module
import uuid

import attr
from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError, NotEmptyError
from twisted.internet import defer, task
from twisted.logger import Logger

from waltz.zk.errors import (ClusterExistsError, ClusterNotFoundError, ConcurrentUpdateError,
                             GenerationMismatchError, PartialClusterError, ServersRegisteredError,
                             ZnodeDecodeError, swallow)
from waltz.zk.lock import ZnodeMutex
from waltz.zk.topology import StoreTopology
from waltz.zk.znodes import (EMPTY_PARTITION_METADATA, ClusterParams, ClusterPaths, ConnectionMetadata,
                             GroupDescriptor, IdCounter, PartitionAssignment, PartitionMetadata,
                             ReplicaAssignments, ServerDescriptor, StoreParams)

#: Partition metadata znodes created per multi-op by ``create_cluster`` (keeps requests small).
PARTITION_BATCH = 500
#: The most partitions a cluster may have. Every partition is a znode, a slot in each storage's control
#: file and a Deferred when the cluster is described: a mistyped count must not fill ZooKeeper.
MAX_PARTITIONS = 10000


@attr.s(frozen=True, slots=True, auto_attribs=True)
class Versioned:
    """A decoded znode value with the ``ZnodeStat`` it was read at."""

    value: object
    stat: object

    @property
    def version(self):
        return self.stat.version


@attr.s(frozen=True, slots=True, auto_attribs=True)
class RetryPolicy:
    """How a compare-and-set loop retries: attempts, and a random back-off cap in seconds."""

    attempts: int = 100
    first_delay: float = 0.002
    max_delay: float = 0.1

    def delay(self, attempt, rng):
        return rng.uniform(0, min(self.max_delay, self.first_delay * 2 ** attempt))


@attr.s(frozen=True, slots=True, auto_attribs=True)
class ClusterDescription:
    """Everything ``waltz cluster show`` prints, read in one go."""

    root: str
    params: ClusterParams
    store: StoreParams
    topology: StoreTopology
    partitions: tuple          # (partition id, PartitionMetadata or None), by id
    servers: tuple             # (znode name, ServerDescriptor), by name
    assignment: PartitionAssignment


def _describe(exc) -> str:
    """What stopped a command, for a message: an interrupt, or the error's own text."""
    if isinstance(exc, defer.CancelledError):
        return "an interrupt"
    return str(exc) or type(exc).__name__


class ClusterMetadata:
    """The znodes of the cluster at ``root``, over a connected ``ZooKeeperClient``.

    ``reactor`` (for back-off timers and lock timeouts) and ``rng`` (a
    ``random.Random``) are injectable.
    """

    log = Logger()

    def __init__(self, zk, root, reactor=None, rng=None, retry=RetryPolicy()):
        if reactor is None:
            from twisted.internet import reactor
        self.zk = zk
        self.paths = ClusterPaths(root)
        self._reactor = reactor
        self._rng = rng or random_module.Random()
        self._retry = retry

    @property
    def reactor(self):
        """The reactor this metadata's timers run on."""
        return self._reactor

    # --- reading ---------------------------------------------------------------------------

    def read_versioned(self, path, cls):
        """Fires with the :class:`Versioned` value of ``path`` decoded as ``cls``;
        kazoo's ``NoNodeError`` when it does not exist."""
        return self.zk.get(path).addCallback(lambda result: Versioned(cls.decode(result[0], path), result[1]))

    def _read_required(self, path, cls):
        return self.read_versioned(path, cls).addErrback(self._missing, path)

    def _missing(self, reason, path):
        reason.trap(NoNodeError)
        raise ClusterNotFoundError("no Waltz cluster at %s: znode %s does not exist" % (self.paths.root, path))

    def _value(self, path, cls):
        return self._read_required(path, cls).addCallback(lambda versioned: versioned.value)

    def cluster_params(self):
        """Fires with the :class:`ClusterParams` of ``<root>``."""
        return self._value(self.paths.root, ClusterParams)

    def store_params(self):
        """Fires with the :class:`StoreParams` (cluster key, partition count) of ``<root>/store``."""
        return self._value(self.paths.store, StoreParams)

    def replica_assignments(self):
        return self._value(self.paths.assignment, ReplicaAssignments)

    def group_descriptor(self):
        return self._value(self.paths.group, GroupDescriptor)

    def connection_metadata(self):
        return self._value(self.paths.connection, ConnectionMetadata)

    def partition_assignment(self):
        """Fires with the :class:`Versioned` :class:`PartitionAssignment`; its ``stat.cversion``
        is the current children version of ``serverDescriptors`` to compare with the value's."""
        return self._read_required(self.paths.server_descriptors, PartitionAssignment)

    def partition_metadata(self, partition_id):
        """Fires with the :class:`Versioned` :class:`PartitionMetadata`, or ``None`` if the znode
        does not exist yet."""
        d = self.read_versioned(self.paths.partition(partition_id), PartitionMetadata)
        return d.addErrback(swallow, NoNodeError)

    @defer.inlineCallbacks
    def topology(self):
        """Fires with the :class:`Versioned` triple of store znodes as a :class:`StoreTopology`
        (``stat`` is a tuple of the three stats)."""
        reads = yield defer.gatherResults([
            self._read_required(self.paths.assignment, ReplicaAssignments),
            self._read_required(self.paths.group, GroupDescriptor),
            self._read_required(self.paths.connection, ConnectionMetadata),
        ], consumeErrors=True).addErrback(_unwrap_first_error)
        return Versioned(StoreTopology(*(r.value for r in reads)), tuple(r.stat for r in reads))

    def server_descriptors(self, watch=None):
        """Fires with ``((znode name, ServerDescriptor), ...)`` of the live servers, by name;
        ``watch`` is set on the children of ``serverDescriptors``."""
        d = self.versioned_server_descriptors(watch)
        return d.addCallback(lambda found: tuple((name, versioned.value) for name, versioned in found))

    @defer.inlineCallbacks
    def versioned_server_descriptors(self, watch=None):
        """Fires with ``((znode name, Versioned ServerDescriptor), ...)`` of the live servers, by name
        (the stat's ``ephemeralOwner`` is the session that registered it). A child that does not decode
        (a stray znode, a descriptor of a later release) is skipped with a warning: one bad znode must
        not stop every server from reading the others."""
        names = yield self.zk.get_children(self.paths.server_descriptors, watch=watch).addErrback(
            self._missing, self.paths.server_descriptors)
        found = []
        for name in sorted(names):
            path = self.paths.server_descriptors + "/" + name
            try:
                versioned = yield self.read_versioned(path, ServerDescriptor)
            except NoNodeError:
                continue  # that server's session ended since we listed the children
            except ZnodeDecodeError as exc:
                self.log.warn("ignoring {path}: {error}", path=path, error=exc)
                continue
            found.append((name, versioned))
        return tuple(found)

    @defer.inlineCallbacks
    def describe(self):
        """Fires with a :class:`ClusterDescription` of the whole cluster."""
        params = yield self.cluster_params()
        store = yield self.store_params()
        topology = yield self.topology()
        servers = yield self.server_descriptors()
        assignment = yield self.partition_assignment()
        metadata = yield defer.gatherResults(
            [self.partition_metadata(pid) for pid in range(store.num_partitions)], consumeErrors=True
        ).addErrback(_unwrap_first_error)
        partitions = tuple((pid, m.value if m else None) for pid, m in enumerate(metadata))
        return ClusterDescription(self.paths.root, params, store, topology.value, partitions, servers,
                                  assignment.value)

    # --- compare-and-set -----------------------------------------------------------------------

    @defer.inlineCallbacks
    def _retry_on_conflict(self, attempt, what):
        """Run ``attempt()`` (a Deferred-returning read-modify-write) until it does not hit
        ``BadVersionError``; bounded by the retry policy."""
        for number in range(self._retry.attempts):
            try:
                result = yield attempt()
                return result
            except BadVersionError:
                yield task.deferLater(self._reactor, self._retry.delay(number, self._rng), lambda: None)
        raise ConcurrentUpdateError("gave up updating %s: %d attempts in a row lost to concurrent updates"
                                    % (what, self._retry.attempts))

    def update(self, path, cls, change, create_missing=None):
        """Compare-and-set ``path``: read it as ``cls``, write ``change(value)`` if that differs.

        ``change`` may raise to abort (the exception is the Deferred's failure).
        ``create_missing(path)``, when given, creates a missing znode (a rival may
        create it too) and the read-modify-write starts again; without it a missing
        znode means there is no cluster. Fires with the value now stored.
        """
        @defer.inlineCallbacks
        def attempt():
            if create_missing is None:
                current = yield self._read_required(path, cls)
            else:
                try:
                    current = yield self.read_versioned(path, cls)
                except NoNodeError:
                    yield create_missing(path)
                    raise BadVersionError()  # created (by us or a rival): read it again
            new = change(current.value)
            if new == current.value:
                return current.value
            yield self.zk.set(path, new.encode(), version=current.version)
            return new
        return self._retry_on_conflict(attempt, path)

    def _allocate_id(self, path):
        return self.update(path, IdCounter, lambda counter: IdCounter(counter.value + 1)).addCallback(
            lambda counter: counter.value)

    def allocate_client_id(self):
        """Fires with a new client id, unique in the cluster (the first is 1)."""
        return self._allocate_id(self.paths.client_ids)

    def allocate_server_id(self):
        """Fires with a new server id, unique in the cluster (the first is 1)."""
        return self._allocate_id(self.paths.server_ids)

    def update_partition_metadata(self, partition_id, change):
        """Compare-and-set ``<root>/store/partition/<id>`` with ``change(PartitionMetadata)``,
        creating it empty (generation -1, session -1) first if needed. Fires with the new value."""
        return self.update(self.paths.partition(partition_id), PartitionMetadata, change,
                           create_missing=self._create_empty_partition)

    def _create_empty_partition(self, path):
        d = self.zk.create(path, EMPTY_PARTITION_METADATA.encode())
        d.addErrback(swallow, NodeExistsError)
        return d.addErrback(self._missing, path.rsplit("/", 1)[0])

    def new_store_session(self, partition_id, generation):
        """Start a new store session of ``partition_id`` for a server at ``generation``.

        Compare-and-sets the partition metadata to ``(generation, stored session id + 1)``,
        keeping the replica states, and fires with the new :class:`PartitionMetadata`
        (its ``session_id`` is the new session's). Fails with
        :class:`GenerationMismatchError` when the stored generation is greater than
        ``generation``: a newer owner of the partition exists.
        """
        def next_session(metadata):
            if metadata.generation > generation:
                raise GenerationMismatchError(partition_id, metadata.generation, generation)
            return attr.evolve(metadata, generation=generation, session_id=metadata.session_id + 1)
        return self.update_partition_metadata(partition_id, next_session)

    # --- cluster membership ----------------------------------------------------------------------

    def register_server(self, descriptor):
        """Create this server's ephemeral-sequential descriptor; fires with its znode path.
        It disappears when the session ends (re-register after ``EXPIRED``)."""
        d = self.zk.create(self.paths.server_descriptor_prefix, descriptor.encode(),
                           ephemeral=True, sequence=True)
        return d.addErrback(self._missing, self.paths.server_descriptors)

    def write_partition_assignment(self, assignment, version):
        """Write the server partition assignment if ``serverDescriptors`` is still at ``version``
        (kazoo's ``BadVersionError`` otherwise); fires with the new ``ZnodeStat``."""
        return self.zk.set(self.paths.server_descriptors, assignment.encode(), version=version)

    # --- admin ------------------------------------------------------------------------------------

    def admin_lock(self):
        """The :class:`ZnodeMutex` at ``<root>/store/adminLock``."""
        return ZnodeMutex(self.zk, self.paths.admin_lock, self._reactor)

    @defer.inlineCallbacks
    def create_cluster(self, name, num_partitions, key=None):
        """Create every znode of a new cluster; fires with its :class:`StoreParams`.

        The root, the cluster-manager znodes, ``/store`` (with ``key``, by default a
        random UUID) and empty assignment, group and connection znodes are created
        in one multi-op; then the partition metadata znodes, in batches. Fails with
        :class:`ClusterExistsError` if the root exists.
        """
        if not 1 <= num_partitions <= MAX_PARTITIONS:
            raise ValueError("a cluster has 1 to %d partitions, not %d" % (MAX_PARTITIONS, num_partitions))
        paths = self.paths
        if (yield self.zk.exists(paths.root)) is not None:
            raise ClusterExistsError("cluster root %s already exists" % paths.root)
        parent = paths.root.rsplit("/", 1)[0]
        if parent:
            yield self.zk.ensure_path(parent)
        store = StoreParams(key or uuid.uuid4(), num_partitions)
        txn = self.zk.transaction()
        for path, value in (
                (paths.root, ClusterParams(name, num_partitions)),
                (paths.server_descriptors, PartitionAssignment()),
                (paths.ids, None),
                (paths.client_ids, IdCounter(0)),
                (paths.server_ids, IdCounter(0)),
                (paths.store, store),
                (paths.partitions, None),
                (paths.assignment, ReplicaAssignments()),
                (paths.group, GroupDescriptor()),
                (paths.connection, ConnectionMetadata())):
            txn.create(path, value.encode() if value is not None else b"")
        try:
            yield txn.commit()
        except NodeExistsError:
            raise ClusterExistsError("cluster root %s already exists" % paths.root) from None
        created = 0
        try:
            for first in range(0, num_partitions, PARTITION_BATCH):
                txn = self.zk.transaction()
                last = min(first + PARTITION_BATCH, num_partitions)
                for pid in range(first, last):
                    txn.create(paths.partition(pid), EMPTY_PARTITION_METADATA.encode())
                yield txn.commit()
                created = last
        except Exception as exc:   # CancelledError (an interrupt) included
            raise PartialClusterError(
                "cluster %s was left partly created (%d of %d partition metadata znodes, at least) by: %s; "
                "delete it (waltz cluster delete) and create it again"
                % (paths.root, created, num_partitions, _describe(exc))) from exc
        return store

    @defer.inlineCallbacks
    def delete_cluster(self, force=False):
        """Delete the cluster root and everything under it.

        Refused (:class:`~waltz.zk.errors.ZnodeDecodeError`) when the root does not
        hold cluster parameters (it is not a Waltz cluster: ``force`` does not change
        that), and (:class:`ServersRegisteredError`) while servers are registered,
        unless ``force``.
        """
        if (yield self.zk.exists(self.paths.root)) is None:
            raise ClusterNotFoundError("no Waltz cluster at %s: znode %s does not exist"
                                       % (self.paths.root, self.paths.root))
        try:
            yield self.cluster_params()
        except ZnodeDecodeError as exc:
            raise ZnodeDecodeError("refusing to delete %s: it is not a Waltz cluster root (%s)"
                                   % (self.paths.root, exc)) from None
        if not force:
            servers = yield self.zk.get_children(self.paths.server_descriptors).addErrback(
                swallow, NoNodeError, [])
            if servers:
                raise ServersRegisteredError(
                    "%d Waltz server(s) are registered under %s; stop them first or force the delete"
                    % (len(servers), self.paths.server_descriptors))
        for _ in range(3):  # a server may register while the subtree is being deleted
            try:
                yield self.zk.delete(self.paths.root, recursive=True)
                return
            except NotEmptyError:
                continue
        yield self.zk.delete(self.paths.root, recursive=True)

    def edit_topology(self, edit, lock_timeout=None):
        """Apply ``edit(topology, store_params)`` -> new :class:`StoreTopology` under the admin lock.

        The changed znodes are written in one multi-op that also checks the versions
        read of all three (the unchanged ones too), so the three never disagree. ``edit`` raises
        :class:`~waltz.zk.errors.TopologyError` to refuse. Fires with the new topology.
        """
        paths = self.paths

        @defer.inlineCallbacks
        def attempt():
            store = yield self.store_params()
            current = yield self.topology()
            new = edit(current.value, store)
            txn, changed = self.zk.transaction(), False
            for path, old, value, stat in zip((paths.assignment, paths.group, paths.connection),
                                              attr.astuple(current.value, recurse=False),
                                              attr.astuple(new, recurse=False), current.stat):
                if value != old:
                    txn.set_data(path, value.encode(), stat.version)
                    changed = True
                else:
                    txn.check(path, stat.version)
            if changed:
                yield txn.commit()
            return new

        return self.admin_lock().run(self._retry_on_conflict, attempt, "the store topology",
                                     timeout=lock_timeout)


def _unwrap_first_error(reason):
    """Errback for ``gatherResults``: fail with the first underlying failure."""
    reason.trap(defer.FirstError)
    return reason.value.subFailure
