"""``WaltzClient``: the application's handle on a Waltz cluster.

It joins the cluster through ZooKeeper (:mod:`waltz.client.discovery`: client id,
partition count, partition → server map), keeps a stream and an RPC connection to
each server that holds one of its partitions (:mod:`waltz.client.network`), and
runs one :class:`~waltz.client.partition.ClientPartition` per partition: mounting,
appends with their monitor, the feed into ``apply_transaction``, transaction data and
high-water marks. Everything runs on the reactor; nothing blocks. For scripts,
see :mod:`waltz.client.blocking`.

Client states: ``STARTING`` → ``RUNNING`` → ``CLOSED``, or ``STARTING`` → ``FAILED``
(ZooKeeper or the cluster could not be reached; executions fail with that error).
"""

import enum
import itertools

from twisted.internet import defer, task
from twisted.logger import Logger

from waltz.client.api import ExecutionResult, IWaltzClientCallbacks, Outcome
from waltz.client.config import TLS_PREFIX, ClientSettings, client_config
from waltz.client.discovery import ZooKeeperDiscovery
from waltz.client.errors import (ClientClosedError, ContextInFlightError, HighWaterMarkTimeout, PartitionNotFoundError,
                                 WaltzClientError)
from waltz.client.monitor import Submission
from waltz.client.network import Backoff, ManagedConnection, ServerConnections, tcp_connector
from waltz.client.partition import ClientPartition
from waltz.client.reader import FeedRead
from waltz.tls import CONNECTS, load_tls

log = Logger()


class ClientState(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    FAILED = "failed"
    CLOSED = "closed"


class WaltzClient:
    """A Waltz client (see the module docstring).

    ``callbacks`` provides :class:`~waltz.client.api.IWaltzClientCallbacks`; ``config``
    is a mapping of config keys, a YAML path or a :class:`~waltz.config.Config`
    (:data:`~waltz.client.config.CLIENT_KEYS`). ``reactor`` defaults to the global one.
    ``discovery`` (an :class:`~waltz.client.discovery.IClusterDiscovery`) and
    ``connector`` (``connector(endpoint, factory) -> Deferred[protocol]``) replace
    ZooKeeper and TCP in tests.

    The client starts joining the cluster at once; :meth:`when_started` fires once it has.
    """

    def __init__(self, callbacks, config, reactor=None, *, discovery=None, connector=None):
        if reactor is None:
            from twisted.internet import reactor
        if not IWaltzClientCallbacks.providedBy(callbacks):
            missing = [name for name in IWaltzClientCallbacks.names() if not hasattr(callbacks, name)]
            if missing:
                raise TypeError("callbacks lack %s" % ", ".join(missing))
        self._reactor = reactor
        self.config = client_config(config)
        self.settings = ClientSettings.from_config(self.config)
        self._callbacks = callbacks
        self._discovery = discovery if discovery is not None else ZooKeeperDiscovery(self.config, reactor)
        self._connector = connector if connector is not None else tcp_connector(
            reactor, self.settings.connect_timeout, load_tls(self.config, TLS_PREFIX, CONNECTS))
        self._seq_numbers = itertools.count(0)
        self._servers = {}
        self._partitions = {}
        self._locations = {}
        self._location_waiters = {}
        self._read_locks = {}
        self._reads = set()
        self._reader_client_id = None
        self._start_waiters = []
        self._error = None
        self._nudger = task.LoopingCall(self._nudge)
        self._nudger.clock = reactor
        self._last_refresh = None
        self.client_id = None
        self.num_partitions = None
        self.cluster_name = None
        self.state = ClientState.STARTING
        self._discovery.start().addCallbacks(self._joined, self._join_failed)

    def __repr__(self):
        return "<WaltzClient %s %s>" % (self.client_id, self.state.value)

    # --- start-up ------------------------------------------------------------------------------

    def _set_state(self, state):
        log.info("Waltz client {client_id}: {old} -> {new}", client_id=self.client_id,
                 old=self.state.value, new=state.value)
        self.state = state

    def _joined(self, info):
        if self.state is not ClientState.STARTING:
            return
        self.client_id = info.client_id
        self.num_partitions = info.num_partitions
        self.cluster_name = info.cluster_name
        self._partitions = {pid: ClientPartition(pid, info.client_id, self._callbacks, self.settings,
                                                 self._reactor)
                            for pid in range(info.num_partitions)}
        for partition in self._partitions.values():
            partition.on_misrouted = self._misrouted
        self._set_state(ClientState.RUNNING)
        self._discovery.subscribe(self._locations_changed)
        if self.settings.auto_mount:
            for partition in self._partitions.values():
                partition.activate()
        self._nudger.start(self.settings.long_wait_threshold / 2, now=False)
        self._release_start_waiters()

    def _join_failed(self, failure):
        if self.state is not ClientState.STARTING:
            return
        log.failure("Waltz client cannot join the cluster", failure)
        self._error = failure.value
        self._set_state(ClientState.FAILED)
        self._release_start_waiters()
        # The discovery's ZooKeeper session (retrying for ever) is of no use to a client that failed.
        defer.maybeDeferred(self._discovery.close).addErrback(
            lambda f: log.failure("closing the discovery of a failed client", f))

    def _release_start_waiters(self):
        waiters, self._start_waiters = self._start_waiters, []
        for d in waiters:
            self._fire_started(d)

    def _fire_started(self, d):
        if self.state is ClientState.RUNNING:
            d.callback(self)
        elif self.state is ClientState.FAILED:
            d.errback(self._error)
        else:
            d.errback(ClientClosedError("the Waltz client is closed"))

    def when_started(self):
        """Fires with the client once it joined the cluster (client id, partitions, servers known)."""
        d = defer.Deferred()
        if self.state is ClientState.STARTING:
            self._start_waiters.append(d)
        else:
            self._fire_started(d)
        return d

    # --- partitions and servers ------------------------------------------------------------------

    def _check_running(self):
        """Raise unless the client runs: closed, failed, or not joined the cluster yet."""
        if self.state is ClientState.CLOSED:
            raise ClientClosedError("the Waltz client is closed")
        if self.state is ClientState.FAILED:
            raise self._error
        if self.state is ClientState.STARTING:
            raise WaltzClientError("the Waltz client has not joined the cluster yet (wait for when_started())")

    def _partition(self, partition_id):
        self._check_running()
        partition = self._partitions.get(partition_id)
        if partition is None:
            raise PartitionNotFoundError(partition_id, self.num_partitions)
        return partition

    def _locations_changed(self, locations):
        if self.state is not ClientState.RUNNING:
            return
        self._locations = locations
        for pid, partition in self._partitions.items():
            location = locations.get(pid)
            partition.relocate(location, self._connections(location.endpoint) if location else None)
        for read in list(self._reads):
            read.relocate(locations.get(read.partition_id))
        in_use = {location.endpoint for location in locations.values()}
        for endpoint in [e for e in self._servers if e not in in_use]:
            log.info("closing the connections to {endpoint}: it holds no partition any more", endpoint=endpoint)
            self._servers.pop(endpoint).close()
        for pid in [p for p in self._location_waiters if p in locations]:
            for d in self._location_waiters.pop(pid):
                d.callback(locations[pid])

    def _misrouted(self, partition_id):
        """A server said it does not serve ``partition_id``: read the partition map again (at most once
        per ``client.mountRetryInterval``), in case a change was missed. A map that really is behind (a
        dead server's descriptor is still there) catches up by itself; requests are retried meanwhile."""
        refresh = getattr(self._discovery, "refresh", None)
        if refresh is None or self.state is not ClientState.RUNNING:
            return
        now = self._reactor.seconds()
        if self._last_refresh is not None and now - self._last_refresh < self.settings.mount_retry_interval:
            return
        self._last_refresh = now
        log.debug("partition {pid} is not served where the map says; reading the map again", pid=partition_id)
        defer.maybeDeferred(refresh).addErrback(
            lambda f: log.warn("reading the partition map again failed: {error}", error=f.getErrorMessage())
            if self.state is ClientState.RUNNING else None)

    def _connections(self, endpoint):
        connections = self._servers.get(endpoint)
        if connections is None:
            connections = self._servers[endpoint] = ServerConnections(
                endpoint, self._new_connection(endpoint, "stream"), self._new_connection(endpoint, "rpc"))
            connections.start()
        return connections

    def _new_connection(self, endpoint, role):
        backoff = Backoff(self.settings.reconnect_initial_interval, self.settings.reconnect_max_interval)
        return ManagedConnection(endpoint, role, self, self._connector, self._reactor, backoff, self._seq_numbers,
                                 self.settings.connect_timeout, self.settings.idle_timeout)

    def _locate(self, partition_id):
        """Fires with the partition's location once one is known."""
        location = self._locations.get(partition_id)
        if location is not None:
            return defer.succeed(location)
        d = defer.Deferred()
        self._location_waiters.setdefault(partition_id, []).append(d)
        return d

    # --- ManagedConnection listener --------------------------------------------------------------

    def connection_ready(self, conn):
        for partition in list(self._partitions.values()):
            if conn.role == "stream":
                partition.stream_ready(conn)
            else:
                partition.rpc_ready(conn)

    def connection_lost(self, conn):
        if conn.role == "stream":
            for partition in list(self._partitions.values()):
                partition.stream_lost(conn)

    def connection_message(self, conn, message):
        partition = self._partitions.get(message.req_id.partition_id)
        if partition is None:
            log.warn("{conn}: {message!r} names an unknown partition", conn=conn, message=message)
            return None
        if conn.role == "stream":
            return partition.stream_message(conn, message)
        partition.rpc_message(conn, message)
        return None

    # --- the API -------------------------------------------------------------------------------

    def execute(self, context):
        """Execute a :class:`~waltz.client.api.TransactionContext`: build its transaction and append it,
        retrying failed attempts, until it commits, is ignored, expires or fails.

        Returns a Deferred firing with the :class:`~waltz.client.api.ExecutionResult` (it fails only
        when cancelled, see ``docs/client.md``); the context's hooks are called as well.
        """
        if getattr(context, "_waltz_execution", None) is not None:
            error = ContextInFlightError(context)
            log.error("{error}", error=error)
            return defer.succeed(ExecutionResult(Outcome.FAILED, error))
        if context.creation_time is None:
            context.creation_time = self._reactor.seconds()
        submission = Submission(context, None)
        context._waltz_execution = submission
        if self.state is ClientState.STARTING:
            self.when_started().addBoth(lambda _: self._submit(submission))
        else:
            self._submit(submission)
        return submission.result

    def _submit(self, submission):
        if submission.done:
            return          # cancelled by its caller while the client was starting
        try:
            if self.state is ClientState.RUNNING:
                submission.partition_id = submission.context.partition_id(self.num_partitions)
            partition = self._partition(submission.partition_id)
        except Exception as exc:
            submission.failed(exc)
        else:
            partition.submit(submission)

    def flush(self, partition_id=None):
        """Fires once every append pending now (on ``partition_id``, or on all partitions) is settled, and
        every execution submitted before the call but not sent yet has been sent and settled, or ended
        unsent. Called while the client is starting, it first waits for the start (executions submitted
        meanwhile are sent then)."""
        if self.state is ClientState.STARTING:
            return self.when_started().addCallback(lambda _: self.flush(partition_id))
        try:
            if partition_id is not None:
                partitions = [self._partition(partition_id)]
            else:
                self._check_running()
                partitions = list(self._partitions.values())
        except Exception:
            return defer.fail()
        return defer.gatherResults([p.flush() for p in partitions]).addCallback(lambda _: None)

    def has_pending_transactions(self) -> bool:
        """Whether an execution has not ended yet: an append waiting for its outcome, or an execution not
        sent yet (queued, building, or waiting to retry)."""
        return any(p.has_pending() for p in self._partitions.values())

    def high_water_mark(self, partition_id):
        """Fires with the partition's current high-water mark (asked of its server over RPC)."""
        try:
            return self._partition(partition_id).high_water_mark()
        except Exception:
            return defer.fail()

    def high_water_marks(self, partition_ids=None, timeout=None):
        """Fires with ``{partition id: high-water mark}`` of ``partition_ids`` (default: every partition).

        With ``timeout`` (seconds), fails with :class:`HighWaterMarkTimeout` naming the partitions that
        did not answer in time (a partition not served anywhere answers nothing).
        """
        try:
            self._check_running()       # before the client joined, "every partition" is none yet
        except Exception:
            return defer.fail()
        pids = sorted(self._partitions if partition_ids is None else set(partition_ids))
        asks = [self.high_water_mark(pid) for pid in pids]
        if timeout is not None:
            for ask in asks:
                ask.addTimeout(timeout, self._reactor)
        d = defer.DeferredList(asks, consumeErrors=True)
        return d.addCallback(self._marks_answered, pids, timeout)

    @staticmethod
    def _marks_answered(results, pids, timeout):
        late = [pid for pid, (ok, value) in zip(pids, results) if not ok and value.check(defer.TimeoutError)]
        if late:
            raise HighWaterMarkTimeout("no high-water mark within %s s for partition(s) %s: not served, or their "
                                       "server does not answer" % (timeout, ", ".join(map(str, late))))
        for ok, value in results:
            if not ok:
                value.raiseException()
        return {pid: value for pid, (_, value) in zip(pids, results)}

    def client_high_water_mark(self, partition_id) -> int:
        """The last transaction of the partition applied through this client's callbacks."""
        return self._partition(partition_id).applied_hwm

    def when_applied(self, partition_id, transaction_id):
        """Fires (with the client high-water mark) once this client's ``apply_transaction`` has applied
        ``transaction_id`` of the partition: to read your own writes after ``execute``, pass the
        ``partition_id`` and ``transaction_id`` of its ExecutionResult."""
        try:
            return self._partition(partition_id).when_applied(transaction_id)
        except Exception:
            return defer.fail()

    def get_transaction_data(self, partition_id, transaction_id):
        """Fires with the data of one transaction (bytes), checksum verified."""
        try:
            return self._partition(partition_id).fetch_data(transaction_id)
        except Exception:
            return defer.fail()

    def set_partitions(self, partition_ids):
        """With ``client.autoMount`` false: mount exactly these partitions (others drain and unmount)."""
        if self.settings.auto_mount:
            raise ValueError("set_partitions needs client.autoMount: false")
        wanted = set(partition_ids)
        for pid in wanted:
            self._partition(pid)
        for pid, partition in self._partitions.items():
            if pid in wanted:
                partition.activate()
            else:
                partition.deactivate()

    @property
    def partitions(self) -> frozenset:
        """The ids of the partitions this client mounts."""
        return frozenset(pid for pid, p in self._partitions.items() if p.wanted)

    def partition_state(self, partition_id):
        """The :class:`~waltz.client.partition.PartitionState` of a partition."""
        return self._partition(partition_id).state

    def read_transactions(self, partition_id, start, end=None, headers=None, include_data=True, committed=False):
        """Fires with the :class:`~waltz.client.api.TransactionRecord` list of transactions
        ``start..end`` of a partition (``end`` None: up to its high-water mark when the read mounts),
        only those whose header is in ``headers`` when given, with their data when ``include_data``
        (fetched in batches, every checksum verified: see :mod:`waltz.client.reader`; the server must
        speak protocol version 5). ``committed=True`` says ``start..end`` is known to be committed (planned
        from ``high_water_marks()``): an unfiltered read with data then skips the feed, and a transaction
        beyond the log fails the read instead of being waited for. Reads of one partition run one at a
        time."""
        try:
            self._partition(partition_id)
        except Exception:
            return defer.fail()
        lock = self._read_locks.setdefault(partition_id, defer.DeferredLock())
        return lock.run(self._read, partition_id, start, end, headers, include_data, committed)

    @defer.inlineCallbacks
    def _read(self, partition_id, start, end, headers, include_data, committed):
        client_id = yield self._reader_id()
        self._partition(partition_id)
        read = FeedRead(partition_id, client_id, start, end, headers, include_data,
                        locate=lambda: self._locate(partition_id),
                        connector=self._connector, reactor=self._reactor, settings=self.settings,
                        seq_numbers=self._seq_numbers, committed=committed,
                        on_misrouted=lambda: self._misrouted(partition_id))
        self._reads.add(read)
        try:
            records = yield read.run()
        finally:
            self._reads.discard(read)
        return records

    @defer.inlineCallbacks
    def _reader_id(self):
        """The client id reads mount under (allocated on the first read), so that a read never
        displaces this client's own mount of the partition on the server."""
        if self._reader_client_id is None:
            self._reader_client_id = yield self._discovery.allocate_client_id()
        return self._reader_client_id

    # --- housekeeping and closing -----------------------------------------------------------------

    def _nudge(self):
        now = self._reactor.seconds()
        for partition in self._partitions.values():
            partition.nudge(now)

    def close(self):
        """Close everything: pending executions end with ClientClosedError. Fires when done."""
        if self.state is ClientState.CLOSED:
            return defer.succeed(None)
        self._set_state(ClientState.CLOSED)
        self._release_start_waiters()
        if self._nudger.running:
            self._nudger.stop()
        error = ClientClosedError("the Waltz client is closed")
        for read in list(self._reads):
            read.abort(error)
        for partition in self._partitions.values():
            partition.close()
        for connections in self._servers.values():
            connections.close()
        self._servers = {}
        waiters, self._location_waiters = self._location_waiters, {}
        for ds in waiters.values():
            for d in ds:
                d.errback(error)
        return defer.maybeDeferred(self._discovery.close)

