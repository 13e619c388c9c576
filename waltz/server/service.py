"""The Waltz server daemon: ZooKeeper, the store, membership, the partitions it serves, two ports.

:class:`WaltzServerService` starts, in ``startService`` (after twistd forked):

1. a ZooKeeper session; the cluster must exist and ``<root>`` and ``<root>/store``
   must agree on the partition count;
2. the :class:`~waltz.server.store.store.Store` (storage connections, replica
   assignment watch);
3. the client port (``server.port``, protocol ``L``, :class:`ServerFactory`) and
   the HTTP port (``server.http.port``: ``/ping``, ``/health``, ``/metrics``);
4. only then its :class:`~waltz.server.membership.ServerMembership`: it
   registers the server, so clients find it only once it listens.

From then on :class:`ServerPartitions` opens a
:class:`~waltz.server.partition.ServerPartition` (on ``store.partition(pid,
generation)``) for each partition the assignment gives this server, and closes
(with its store partition) each one that moves away or changes generation.
It also closes a partition whose store partition is *lost* (a store session of
a newer generation exists: another server took the partition over, and this
server's view of the assignment is behind), so the server never answers as the
owner of a partition it lost; the membership then reads the assignment again.
It is the ``registry`` the client protocol asks for partitions;
:class:`ServerInfo` answers the admin-ish client requests.

A failure during start-up is logged and ends the process with status 1.
"""

import time

from twisted.application import internet
from twisted.internet import defer
from twisted.internet.error import CannotListenError
from twisted.logger import Logger

from waltz.config import ConfigError, liveness_of
from waltz.daemon import AsyncStartService
from waltz.http import health_site
from waltz.metrics import Registry
from waltz.server.caches import FeedCache, TransactionDataCache
from waltz.server.config import CLIENT_PORT_TLS_PREFIX, STORAGE_TLS_PREFIX, TLS_ROLES, partition_settings
from waltz.server.membership import InvalidPartitions, MembershipState, ServerMembership, check_partitions
from waltz.server.partition import PartitionMetrics, ServerPartition
from waltz.server.protocol import ServerFactory
from waltz.server.store.metrics import StoreMetrics
from waltz.server.store.store import Store
from waltz.tls import load_tls, server_factory
from waltz.zk.bridge import SessionState, ZooKeeperClient
from waltz.zk.errors import ZooKeeperLayerError
from waltz.zk.metadata import ClusterMetadata


class ClusterMismatch(Exception):
    """The cluster's znodes disagree with each other (e.g. on the partition count)."""


def server_partition_factory(config, reactor, registry):
    """``factory(partition_id, generation, store_partition)`` -> a new :class:`ServerPartition`.

    All partitions of the server share one feed cache, one transaction data cache (sized by
    the config, as in the original) and one set of partition metrics in ``registry``.
    """
    settings = partition_settings(config)
    metrics = PartitionMetrics(registry)
    feed_cache = FeedCache(settings.feed_cache_size)
    data_cache = TransactionDataCache(settings.transaction_data_cache_size)

    def make(partition_id, generation, store_partition):
        return ServerPartition(partition_id, generation, store_partition, settings, reactor, metrics=metrics,
                               feed_cache=feed_cache, data_cache=data_cache)
    return make


class PartitionOpenError(RuntimeError):
    """Some partitions of an assignment could not be opened (the others were); names them and why."""


class ServerMetrics:
    """The server's own metrics (the store's are :class:`StoreMetrics` in the same registry)."""

    def __init__(self, registry, service):
        registry.gauge("waltz_server_id", "this server's id (-1 before it has one)",
                       function=lambda: service.server_id if service.server_id is not None else -1)
        registry.gauge("waltz_server_zookeeper_connected", "1 while the ZooKeeper session is connected",
                       function=lambda: int(service.zookeeper_state == SessionState.CONNECTED))
        registry.gauge("waltz_server_coordinator", "1 while this server coordinates the partition assignment",
                       function=lambda: int(service.membership is not None and service.membership.is_coordinator))
        registry.gauge("waltz_server_partitions", "partitions assigned to this server",
                       function=lambda: len(service.partitions.opened) if service.partitions else 0)
        registry.gauge("waltz_server_ready_partitions", "assigned partitions ready to serve clients",
                       function=lambda: len(service.partitions.ready) if service.partitions else 0)
        self.generation = registry.gauge("waltz_server_partition_generation",
                                         "generation of each partition this server holds", ("partition",))
        self.assignment_changes = registry.counter("waltz_server_assignment_changes_total",
                                                   "changes of this server's partition assignment")
        self.partition_opens = registry.counter("waltz_server_partition_opens_total",
                                                "partitions opened (assigned or at a new generation)")
        self.partition_closes = registry.counter("waltz_server_partition_closes_total",
                                                 "partitions closed (moved away or at a new generation)")


class ServerPartitions:
    """The partitions this server serves, opened and closed as its assignment changes.

    The ``registry`` of the client protocol: :meth:`partition` gives a partition
    only once it is ready (its store partition is writing); :meth:`server_info`
    the :class:`ServerInfo`.

    A partition whose store partition is *lost* (another server's generation took
    it over) is given out no more from the moment the store partition tells its
    lost listeners, and closed in the next turn of ``reactor`` (at once without
    one; :meth:`check_lost` does it on demand). It stays closed until the
    assignment gives it at another generation; ``on_lost(partition_id,
    generation, reason)`` is then called (the service makes the membership read
    the assignment again).
    """

    log = Logger()

    def __init__(self, store, factory, metrics=None, reactor=None, on_lost=None):
        self.store = store
        self.factory = factory      # (partition id, generation, store partition) -> ServerPartition
        self.metrics = metrics
        self.reactor = reactor
        self.on_lost = on_lost
        self.opened = {}            # partition id -> ServerPartition
        self.ready = set()          # partition ids whose start() fired
        self.failures = {}          # partition id -> why it could not be opened, or its start failed
        self.lost = {}              # partition id -> (generation, why) of a partition another server took over
        self.assigned = {}          # the last assignment: partition id -> generation
        self.info = None
        self._store_partitions = {}  # partition id -> the store partition of the opened ServerPartition
        self._lost_call = None      # the DelayedCall of check_lost after a store partition was lost
        self.stopping = False       # close_all() ran: nothing opens again

    # --- the registry contract ------------------------------------------------------------------

    def partition(self, partition_id):
        """The partition if it is assigned here and ready, else ``None`` (mount: NOT_READY)."""
        return self.opened.get(partition_id) if partition_id in self.ready else None

    def server_info(self):
        return self.info

    # --- following the assignment ----------------------------------------------------------------

    def assign(self, assigned):
        """Serve exactly ``assigned`` (``{partition id: generation}``), except partitions lost at the
        generation assigned. Once :meth:`close_all` ran, nothing is opened (the server is stopping)."""
        self.assigned = dict(assigned)
        if self.stopping:
            return
        for partition_id in sorted(self.opened):
            generation = assigned.get(partition_id)
            if generation != self.opened[partition_id].generation:
                self._close(partition_id, "moved away" if generation is None else "new generation %d" % generation)
        for partition_id in [pid for pid, (generation, _) in self.lost.items() if assigned.get(pid) != generation]:
            del self.lost[partition_id]
        for partition_id in [pid for pid in self.failures if pid not in self.opened]:
            del self.failures[partition_id]     # could not be opened: tried again below, if still assigned
        unopened = [partition_id for partition_id, generation in sorted(assigned.items())
                    if partition_id not in self.opened and partition_id not in self.lost
                    and not self._open(partition_id, generation)]
        if unopened:
            # The others are open. Raised, the membership tries the same assignment again shortly (its
            # reconcile retry), and only these are opened again.
            raise PartitionOpenError("partitions %s could not be opened: %s" % (
                unopened, "; ".join(self.failures[pid] for pid in unopened)))

    def _open(self, partition_id, generation):
        """Open the partition; False (logged, and reported by problems()) if that raised."""
        self.log.info("opening partition {pid} at generation {generation}", pid=partition_id, generation=generation)
        try:
            store_partition = self.store.partition(partition_id, generation)
            partition = self.factory(partition_id, generation, store_partition)
        except Exception as exc:
            # Not opened (and reported by problems()): assign() opens the others, then raises, so that the
            # membership tries this one again.
            self.failures[partition_id] = str(exc) or repr(exc)
            self.log.failure("partition {pid} (generation {generation}) could not be opened", pid=partition_id,
                             generation=generation)
            self._close_store_partition(partition_id)
            return False
        self.opened[partition_id] = partition
        self._store_partitions[partition_id] = store_partition
        store_partition.add_lost_listener(lambda reason, partition=partition: self._store_partition_lost(partition))
        if self.metrics is not None:
            self.metrics.partition_opens.inc()
            self.metrics.generation.set(generation, partition_id)
        d = defer.maybeDeferred(partition.start)
        d.addCallbacks(self._started, self._start_failed, callbackArgs=(partition,), errbackArgs=(partition,))
        return True

    def _current(self, partition):
        return self.opened.get(partition.partition_id) is partition

    def _started(self, _, partition):
        if self._current(partition):
            self.ready.add(partition.partition_id)
            self.log.info("partition {pid} (generation {generation}) is ready", pid=partition.partition_id,
                          generation=partition.generation)

    def _start_failed(self, failure, partition):
        if self._current(partition):
            self.failures[partition.partition_id] = failure.getErrorMessage()
            self.log.error("partition {pid} (generation {generation}) failed to start: {error}",
                           pid=partition.partition_id, generation=partition.generation,
                           error=failure.getErrorMessage())

    def _close(self, partition_id, why):
        partition = self.opened.pop(partition_id)
        self._store_partitions.pop(partition_id, None)
        self.ready.discard(partition_id)
        self.failures.pop(partition_id, None)
        self.log.info("closing partition {pid} (generation {generation}): {why}", pid=partition_id,
                      generation=partition.generation, why=why)
        if self.metrics is not None:
            self.metrics.partition_closes.inc()
            self.metrics.generation.remove(partition_id)
        d = defer.maybeDeferred(partition.close)
        d.addErrback(lambda f: self.log.failure("closing partition {pid} failed", f, pid=partition_id))
        # Synchronously forgets the store partition, so a new generation opens a new one.
        return defer.gatherResults([d, self._close_store_partition(partition_id)])

    def _close_store_partition(self, partition_id):
        """Close the store partition; a failure is logged (callers such as assign() do not wait)."""
        return defer.maybeDeferred(self.store.close_partition, partition_id).addErrback(
            lambda f: self.log.failure("closing store partition {pid} failed", f, pid=partition_id))

    def close_all(self):
        """Close every partition for good: the server is stopping (an assignment arriving meanwhile opens
        nothing)."""
        self.stopping = True
        self._stop_checking()
        return defer.gatherResults([self._close(pid, "server stopping") for pid in sorted(self.opened)])

    # --- partitions another server took over -------------------------------------------------------

    def check_lost(self):
        """Close every opened partition whose store partition is lost; returns their ids."""
        found = []
        for partition_id in sorted(self.opened):
            store_partition = self._store_partitions.get(partition_id)
            reason = store_partition.lost if store_partition is not None else None
            if not reason:
                continue
            generation = self.opened[partition_id].generation
            self.lost[partition_id] = (generation, reason)
            self.log.warn("partition {pid} (generation {generation}) was taken over by another server: {reason}",
                          pid=partition_id, generation=generation, reason=reason)
            self._close(partition_id, "lost: %s" % reason)
            found.append(partition_id)
            if self.on_lost is not None:
                try:
                    self.on_lost(partition_id, generation, reason)
                except Exception:
                    self.log.failure("on_lost({pid}) failed", pid=partition_id)
        return found

    def _store_partition_lost(self, partition):
        """``partition``'s store partition was lost: it stops being given out now, and is closed in the next
        reactor turn (the store partition is still failing its appends, the turn this is called in)."""
        if not self._current(partition):
            return
        self.ready.discard(partition.partition_id)
        if self.reactor is None:
            self.check_lost()
        elif self._lost_call is None:
            self._lost_call = self.reactor.callLater(0, self._check_lost_now)

    def _check_lost_now(self):
        self._lost_call = None
        self.check_lost()

    def _stop_checking(self):
        call, self._lost_call = self._lost_call, None
        if call is not None and call.active():
            call.cancel()

    def problems(self):
        """Partitions that failed to start, or whose store is not writing."""
        found = ["partition %d (generation %d) is assigned here but another server took it over (%s); "
                 "waiting for the assignment to catch up" % (pid, generation, why)
                 for pid, (generation, why) in sorted(self.lost.items())]
        found.extend("partition %d (generation %s) could not be opened: %s" % (pid, self.assigned.get(pid), why)
                     for pid, why in sorted(self.failures.items()) if pid not in self.opened)
        for partition_id, partition in sorted(self.opened.items()):
            if partition_id in self.failures:
                found.append("partition %d (generation %d) failed to start: %s"
                             % (partition_id, partition.generation, self.failures[partition_id]))
            elif not partition.healthy:
                found.append("partition %d (generation %d): the store is not writing"
                             % (partition_id, partition.generation))
        return found


class ServerInfo:
    """Answers the admin-ish client requests: storage connectivity, assignment, preferences, health."""

    log = Logger()

    def __init__(self, membership, store, partitions, reactor, connect_timeout=5.0):
        self.membership = membership
        self.store = store
        self.partitions = partitions
        self.reactor = reactor
        self.connect_timeout = connect_timeout

    def storages(self):
        """Every storage node the store's replica assignment names."""
        return sorted(self.store.assigned_storages())

    def check_storage_connectivity(self):
        """Fires with ``[(storage "host:port", connected)]``, waiting up to ``connect_timeout`` each."""
        def probe(storage):
            d = self.store.pool.connection(storage).when_open()
            d.addTimeout(self.connect_timeout, self.reactor)
            return d.addCallbacks(lambda _: (storage, True), lambda _: (storage, False))
        return defer.gatherResults([probe(s) for s in self.storages()])

    def assigned_partitions(self):
        return sorted(self.membership.partitions)

    def add_preferred_partitions(self, partition_ids):
        return self._preference(self.membership.add_preferred_partitions, partition_ids)

    def remove_preferred_partitions(self, partition_ids):
        return self._preference(self.membership.remove_preferred_partitions, partition_ids)

    def _preference(self, change, partition_ids):
        def refused(failure):
            failure.trap(InvalidPartitions)
            self.log.warn("preferred partitions refused: {error}", error=failure.getErrorMessage())
            return False
        return defer.maybeDeferred(change, partition_ids).addErrback(refused)

    def partitions_health(self):
        return [(pid, bool(partition.healthy)) for pid, partition in sorted(self.partitions.opened.items())]


class WaltzServerService(AsyncStartService):
    """One Waltz server (see the module docstring for the start-up order)."""

    name = "waltz-server"
    expected_failures = (ConfigError, ZooKeeperLayerError, InvalidPartitions, CannotListenError)
    log = Logger()

    def __init__(self, config, reactor, partition_factory=None, rng=None, clock=time.monotonic):
        super().__init__(reactor)
        self.config = config
        self.rng = rng
        self.clock = clock
        self.metrics_registry = Registry()
        self.metrics = ServerMetrics(self.metrics_registry, self)
        self.partition_factory = partition_factory or server_partition_factory(config, reactor,
                                                                               self.metrics_registry)
        self.zookeeper = None
        self.zookeeper_state = None
        self.zookeeper_state_since = clock()
        self.cluster = None
        self.store = None
        self.membership = None
        self.partitions = None
        self.client_factory = None
        self.ports = []
        # TLS of the client port and of the connections to storage nodes (None: plain TCP); a bad file
        # fails here, before anything starts.
        self.client_port_tls = load_tls(config, CLIENT_PORT_TLS_PREFIX, TLS_ROLES[CLIENT_PORT_TLS_PREFIX])
        self.storage_tls = load_tls(config, STORAGE_TLS_PREFIX, TLS_ROLES[STORAGE_TLS_PREFIX])
        self.liveness = liveness_of(config, "server.idleTimeout", reactor)     # of every connection

    @property
    def server_id(self):
        return self.membership.server_id if self.membership is not None else None

    # --- start ----------------------------------------------------------------------------------

    @defer.inlineCallbacks
    def start(self):
        config = self.config
        self.zookeeper = ZooKeeperClient.from_config(config, self.reactor)
        self.zookeeper.add_state_listener(self._zookeeper_state_changed)
        yield self.zookeeper.connect()
        self._zookeeper_state_changed(SessionState.CONNECTED)
        self.cluster = ClusterMetadata(self.zookeeper, config["cluster.root"], self.reactor, rng=self.rng)
        yield self._check_cluster()
        self.store = Store(self.cluster, self.reactor, max_batch_size=config["storage.maxBatchSize"],
                           checkpoint_interval=config["storage.checkpointInterval"],
                           initial_retry=config["storage.initialRetryInterval"] / 1000.0,
                           max_retry=config["storage.maxRetryInterval"] / 1000.0,
                           request_timeout=config["storage.requestTimeout"] / 1000.0,
                           metrics=StoreMetrics(self.metrics_registry), tls=self.storage_tls,
                           liveness=self.liveness)
        yield self.store.start()
        self.partitions = ServerPartitions(self.store, self.partition_factory, self.metrics, reactor=self.reactor,
                                           on_lost=self._partition_lost)
        self.membership = ServerMembership(self.cluster, config["server.host"], config["server.port"],
                                           self._assignment_changed, config["server.preferredPartitions"],
                                           reactor=self.reactor, rng=self.rng, on_give_up=self._gave_up)
        self.partitions.info = ServerInfo(self.membership, self.store, self.partitions, self.reactor)
        self._listen()
        yield self.membership.start()
        self.log.info("Waltz server {id} started: clients on {host}:{port}", id=self.server_id,
                      host=config["server.host"], port=config["server.port"])

    @defer.inlineCallbacks
    def _check_cluster(self):
        params = yield self.cluster.cluster_params()
        store = yield self.cluster.store_params()
        if params.num_partitions != store.num_partitions:
            raise ClusterMismatch("inconsistent number of partitions: %s says %d, %s says %d" % (
                self.cluster.paths.root, params.num_partitions, self.cluster.paths.store, store.num_partitions))
        try:   # before anything is bound: a bad config fails the start naming the key
            check_partitions(self.config["server.preferredPartitions"], params.num_partitions)
        except InvalidPartitions as exc:
            raise ConfigError("config key 'server.preferredPartitions': %s" % exc, "server.preferredPartitions") \
                from None

    def _listen(self):
        config, bind = self.config, self.config["server.bindAddress"]
        self.client_factory = ServerFactory(self.partitions, max_frame_size=config["server.maxFrameSize"],
                                            liveness=self.liveness)
        factories = (
            (config["server.port"], server_factory(self.client_factory, self.client_port_tls)),
            (config["server.http.port"], health_site(self.metrics_registry, self.problems)),
        )
        for port, factory in factories:
            server = internet.TCPServer(port, factory, interface=bind)
            server.setServiceParent(self)
            self.ports.append(server)

    # --- events -----------------------------------------------------------------------------------

    def _zookeeper_state_changed(self, state):
        if state != self.zookeeper_state:
            self.zookeeper_state = state
            self.zookeeper_state_since = self.clock()

    def _assignment_changed(self, assigned):
        self.metrics.assignment_changes.inc()
        self.partitions.assign(assigned)

    def _gave_up(self, why):
        # A client mounted here cannot tell: if ZooKeeper gives this server the same partitions back at the
        # same generations, its map does not change, and its appends would be dropped as not mounted (a
        # closed partition forgets its mounts) with no answer, for good. Closing its connection makes it
        # remount: NOT_READY while nothing is served, READY once the partitions are back here, or it
        # follows them to their new server.
        if self.client_factory is not None:
            self.client_factory.close_connections("partitions given up (%s); mount again" % why)

    def _partition_lost(self, partition_id, generation, reason):
        # Another server holds the partition at a newer generation: our assignment is behind. Read it again.
        if self.membership is not None:
            self.membership.request_reconcile()

    # --- health -------------------------------------------------------------------------------------

    def problems(self):
        """Why the server is unhealthy (an empty list when it is healthy)."""
        if self.membership is None or self.membership.state is MembershipState.NEW:
            return ["starting"]
        found = []
        if self.zookeeper_state != SessionState.CONNECTED:
            found.append("ZooKeeper session %s for %.1f s" % (
                str(self.zookeeper_state).lower(), self.clock() - self.zookeeper_state_since))
        if self.membership.state is not MembershipState.MEMBER:
            found.append("not registered in ZooKeeper (membership %s)" % self.membership.state.value)
        if self.membership.given_up_while_connected is not None:
            found.append(self.membership.given_up_while_connected)
        return found + self.partitions.problems()

    # --- stop -----------------------------------------------------------------------------------------

    @defer.inlineCallbacks
    def stop(self):
        # The ports stopped listening already (child services stop first).
        if self.client_factory is not None:
            self.client_factory.close_connections()
        # The partitions close before the descriptor goes: the server that takes them over must not start while
        # they are open here, and membership.stop() stops every give-up, then waits for ZooKeeper to delete the
        # descriptor, which a ZooKeeper that does not hear this session (a follower cut off from the leader)
        # answers only after the request timeout, past the session's expiry.
        if self.partitions is not None:
            yield self.partitions.close_all()
        if self.membership is not None:
            yield self.membership.stop()
        if self.store is not None:
            yield self.store.stop()
        if self.zookeeper is not None:
            yield self.zookeeper.close()
