"""The smoke test with faults: the original's SmokeTest, on local processes.

A cluster of its own in a temporary directory (ZooKeeper, 3 storages in
separate groups, 2 servers, 3 partitions) and 2 client applications that
both produce and consume. Each transaction is a random UUID with a write lock
on ("test", random of 1000). While they run, storages, servers and ZooKeeper
are killed with SIGKILL and restarted on a fixed schedule. Checks:

* every client applies consecutive transaction ids on every partition;
* no UUID is applied twice;
* the sum of the checksums of the UUIDs produced equals the sum consumed;
* after a full restart of every process, a second pass from the start of the
  log finds the same (consecutive ids, each UUID once, same checksum sum);
* every storage holds identical record bytes for each partition.

Every problem found is an *anomaly*; :func:`run_smoke` returns them with the
throughput, the latencies and the faults injected.
"""

import glob
import hashlib
import os
import random
import time
import uuid

import attr
from twisted.internet import defer, task, threads
from twisted.logger import Logger
from twisted.python.failure import Failure

from waltz.client import TransactionContext, WaltzClient, WaltzClientCallbacks
from waltz.config import expiration_ms
from waltz.local.cluster import LocalCluster
from waltz.local.daemons import local_server
from waltz.protocols.values import checksum
from waltz.storage.index import FILE_HEADER_SIZE

log = Logger()


@attr.s(frozen=True, slots=True, auto_attribs=True)
class SmokeSettings:
    transactions: int = 20_000
    partitions: int = 3
    storages: int = 3
    servers: int = 2
    clients: int = 2
    lock_range: int = 1000
    inflight: int = 20              #: outstanding transactions per client
    fault_interval: float = 4.0     #: seconds between two faults
    down_time: float = 1.5          #: seconds a killed process stays down
    faults: bool = True
    #: The producers go on past ``transactions`` until this many faults were injected: how many transactions
    #: a machine commits between two faults depends on its speed, and a short run on a fast one ended before
    #: every kind of process had been killed.
    min_faults: int = 0
    seed: int = 1
    timeout: float = 600.0          #: the whole run, seconds


@attr.s(slots=True)
class SmokeReport:
    committed: int = attr.ib(default=0)
    seconds: float = attr.ib(default=0.0)
    latencies: list = attr.ib(factory=list)
    faults: list = attr.ib(factory=list)
    anomalies: list = attr.ib(factory=list)
    unfinished: int = attr.ib(default=0)    #: contexts that ended without committing (replaced)

    @property
    def throughput(self):
        return self.committed / self.seconds if self.seconds else 0.0


class SmokeApplication(WaltzClientCallbacks):
    """A client application that checks everything it applies: ids consecutive, each UUID once."""

    def __init__(self, name, partitions, anomalies):
        self.name = name
        self.high_water_marks = {p: -1 for p in range(partitions)}
        self.seen = set()
        self.checksum_sum = 0
        self.anomalies = anomalies

    def get_client_high_water_mark(self, partition_id):
        return self.high_water_marks[partition_id]

    def apply_transaction(self, transaction):
        expected = self.high_water_marks[transaction.partition_id] + 1
        if transaction.transaction_id != expected:
            self.anomalies.append("%s: partition %d applied transaction %d, expected %d" % (
                self.name, transaction.partition_id, transaction.transaction_id, expected))
        d = transaction.get_data()
        d.addCallback(self._applied, transaction)
        return d

    def _applied(self, data, transaction):
        if data in self.seen:
            self.anomalies.append("%s: UUID %s applied twice (partition %d, transaction %d)" % (
                self.name, _uuid_text(data), transaction.partition_id, transaction.transaction_id))
        self.seen.add(data)
        self.checksum_sum += checksum(data)
        self.high_water_marks[transaction.partition_id] = transaction.transaction_id

    def uncaught_exception(self, partition_id, transaction_id, exception):
        self.anomalies.append("%s: uncaught exception at %d/%d: %s" % (self.name, partition_id, transaction_id,
                                                                      exception))


def _uuid_text(data):
    try:
        return str(uuid.UUID(bytes=data))
    except ValueError:
        return repr(data)


class SmokeTransaction(TransactionContext):
    """One UUID, chosen once: re-executions after a failed attempt send the same UUID."""

    def __init__(self, rng, partitions, lock_range):
        super().__init__()
        self.data = uuid.UUID(int=rng.getrandbits(128)).bytes
        self.partition = rng.randrange(partitions)
        self.lock = ("test", rng.randrange(lock_range))

    def partition_id(self, num_partitions):
        return self.partition

    def execute(self, builder):
        builder.set_transaction_data(self.data)
        builder.set_write_locks([self.lock])
        return True


class Producer:
    """Keeps ``inflight`` transactions executing on a client until ``quota`` committed, and then while
    ``more_wanted()`` says so."""

    def __init__(self, reactor, client, settings, quota, rng, report, produced, more_wanted=lambda: False):
        self.reactor = reactor
        self.client = client
        self.settings = settings
        self.quota = quota
        self.rng = rng
        self.report = report
        self.produced = produced      # list of committed UUIDs (shared)
        self.more_wanted = more_wanted
        self.started = 0
        self.committed = 0
        self.done = defer.Deferred()

    def start(self):
        for _ in range(min(self.settings.inflight, self.quota)):
            self._next()

    def _done_producing(self, count) -> bool:
        return count >= self.quota and not self.more_wanted()

    def _next(self):
        if self._done_producing(self.started):
            return
        self.started += 1
        context = SmokeTransaction(self.rng, self.settings.partitions, self.settings.lock_range)
        began = time.monotonic()
        self.client.execute(context).addCallback(self._finished, context, began)

    def _finished(self, result, context, began):
        if result.committed:
            self.committed += 1
            self.report.latencies.append(time.monotonic() - began)
            self.produced.append(context.data)
        else:
            # Not committed: produce another in its place. Had it reached the log after all, the
            # checksum sums would show it.
            self.report.unfinished += 1
            self.started -= 1
        if self._done_producing(self.committed):
            if not self.done.called:
                self.done.callback(None)
        else:
            self.reactor.callLater(0, self._next)


class FaultInjector:
    """Kills (SIGKILL) and restarts storages, servers and ZooKeeper in a fixed cycle."""

    def __init__(self, reactor, cluster, servers, settings, report):
        self.reactor = reactor
        storages = [("storage-%d" % i, d) for i, d in enumerate(cluster.storages)]
        servers = [("server-%d" % i, d) for i, d in enumerate(servers)]
        others = servers[:1] + [("zookeeper", cluster.zookeeper)] + servers[1:]
        # Alternate storages with servers and ZooKeeper: storage-0, server-0, storage-1, zookeeper, storage-2,
        # server-1: every kind of process is killed within the first four faults, even in a short run.
        self.cycle = [item for i in range(max(len(storages), len(others)))
                      for item in (storages[i:i + 1] + others[i:i + 1])]
        self.settings = settings
        self.report = report
        self.running = False
        self._next = 0
        self._done = None

    def start(self):
        self.running = True
        self._done = self._loop()
        return self._done

    def stop(self):
        self.running = False
        return self._done

    @defer.inlineCallbacks
    def _loop(self):
        while self.running:
            yield task.deferLater(self.reactor, self.settings.fault_interval, lambda: None)
            if not self.running:
                break
            name, process = self.cycle[self._next % len(self.cycle)]
            self._next += 1
            started = time.monotonic()
            yield threads.deferToThread(process.kill)
            yield task.deferLater(self.reactor, self.settings.down_time, lambda: None)
            yield threads.deferToThread(_restart, process)
            self.report.faults.append("%s killed and restarted (%.1f s)" % (name, time.monotonic() - started))
            log.info("smoke: {fault}", fault=self.report.faults[-1])


def _restart(process):
    process.start()


def unless_failed_first(d, watched):
    """``d``'s outcome, unless ``watched`` fails before it: then that failure, at once (``d`` goes on). A fault
    loop whose restart failed would otherwise stop without a word, and the run wait for its producers until its
    timeout. A failure of ``watched`` after ``d`` fired stays on ``watched`` for whoever waits for it."""
    outer = defer.Deferred()

    def settled(result):
        if not outer.called:
            (outer.errback if isinstance(result, Failure) else outer.callback)(result)

    def watched_failed(failure):
        if outer.called:
            return failure
        outer.errback(failure)
        return None

    d.addBoth(settled)
    watched.addErrback(watched_failed)
    return outer


@defer.inlineCallbacks
def run_smoke(reactor, run_dir, settings=SmokeSettings(), progress=None):
    """Run the smoke test in ``run_dir``; fires with a :class:`SmokeReport`."""
    report = SmokeReport()
    cluster = LocalCluster(run_dir, num_partitions=settings.partitions, num_storages=settings.storages,
                           root="/waltz_smoke")
    servers, clients = [], []
    try:
        yield cluster.start(reactor)
        for index in range(settings.servers):
            server = local_server(os.path.join(run_dir, "server%d" % index), cluster.connect_string, cluster.root,
                                  **{"zookeeper.sessionTimeout": 6000})
            servers.append(server)
            yield threads.deferToThread(server.start)
        rng = random.Random(settings.seed)
        produced, apps = [], []
        producers = []
        quota = settings.transactions // settings.clients
        for index in range(settings.clients):
            app = SmokeApplication("client-%d" % index, settings.partitions, report.anomalies)
            client = WaltzClient(app, _client_config(cluster, settings), reactor)
            apps.append(app)
            clients.append(client)
            producers.append(Producer(reactor, client, settings,
                                      quota + (settings.transactions % settings.clients if index == 0 else 0),
                                      rng, report, produced, more_wanted=lambda: _faults_wanted(settings, report)))
        yield defer.gatherResults([c.when_started() for c in clients])
        faults = FaultInjector(reactor, cluster, servers, settings, report)
        began = time.monotonic()
        for producer in producers:
            producer.start()
        producing = defer.gatherResults([p.done for p in producers], consumeErrors=True).addTimeout(
            settings.timeout, reactor, onTimeoutCancel=_producers_late(producers, settings))
        if settings.faults:
            producing = unless_failed_first(producing, faults.start())
        ticker = task.LoopingCall(_progress, progress, producers, settings, began) if progress else None
        if ticker is not None:
            ticker.clock = reactor
            ticker.start(1.0, now=False)
        try:
            yield producing
        finally:
            if ticker is not None and ticker.running:
                ticker.stop()
            if settings.faults:
                yield faults.stop()
        report.seconds = time.monotonic() - began
        report.committed = sum(p.committed for p in producers)
        yield _caught_up(reactor, clients, apps, settings)
        _check_pass("first pass", apps, produced, report)
        for client in clients:
            yield client.close()
        clients = []
        # Full restart of every process, then a second pass from the start of the log.
        yield threads.deferToThread(_restart_everything, cluster, servers)
        reader = SmokeApplication("second pass", settings.partitions, report.anomalies)
        client = WaltzClient(reader, _client_config(cluster, settings), reactor)
        clients.append(client)
        yield client.when_started()
        yield _caught_up(reactor, clients, [reader], settings)
        _check_pass("second pass", [reader], produced, report)
    finally:
        for client in clients:
            yield client.close()
        for server in servers:
            yield threads.deferToThread(server.stop)
        yield cluster.stop()
    yield _check_replicas(cluster, settings, report)
    return report


def _faults_wanted(settings, report) -> bool:
    """True while the run has injected fewer faults than ``settings.min_faults`` (and injects any)."""
    return settings.faults and len(report.faults) < settings.min_faults


def _producers_late(producers, settings):
    """``addTimeout``'s ``onTimeoutCancel`` for the producers: a RuntimeError saying how far they got."""
    def late(result, timeout):
        raise RuntimeError("the producers committed %d of %d transactions within %g s (--timeout)"
                           % (sum(p.committed for p in producers), settings.transactions, timeout))
    return late


def _client_config(cluster, settings):
    return {"zookeeper.connectString": cluster.connect_string, "cluster.root": cluster.root,
            "zookeeper.sessionTimeout": 10000,
            "client.maxConcurrentTransactions": settings.inflight,
            "client.transactionExpiration": expiration_ms(settings.timeout)}


def _progress(progress, producers, settings, began):
    done = sum(p.committed for p in producers)
    progress(done, settings.transactions, time.monotonic() - began)


@defer.inlineCallbacks
def _caught_up(reactor, clients, apps, settings, stall_timeout=120.0, poll_interval=0.1):
    """Wait until every application applied up to every partition's high-water mark.

    Fails only when none of them moved for ``stall_timeout`` seconds: the second pass over a
    million transactions takes minutes, and a fixed deadline would fail a run that is progressing.
    """
    marks = yield clients[0].high_water_marks()

    def applied():
        return sum(app.high_water_marks[p] for app in apps for p in marks)
    last, last_change = applied(), reactor.seconds()
    while any(app.high_water_marks[p] < marks[p] for app in apps for p in marks):
        now = applied()
        if now != last:
            last, last_change = now, reactor.seconds()
        elif reactor.seconds() - last_change > stall_timeout:
            behind = {app.name: {p: (app.high_water_marks[p], marks[p]) for p in marks} for app in apps}
            raise RuntimeError("clients stopped catching up with the log (no progress for %.0f s): %s"
                               % (stall_timeout, behind))
        yield task.deferLater(reactor, poll_interval, lambda: None)


def _check_pass(name, apps, produced, report):
    expected_sum = sum(checksum(data) for data in produced)
    expected = set(produced)
    for app in apps:
        if app.checksum_sum != expected_sum:
            report.anomalies.append("%s, %s: sum of checksums consumed %d != produced %d"
                                    % (name, app.name, app.checksum_sum, expected_sum))
        if app.seen != expected:
            report.anomalies.append("%s, %s: %d produced transactions missing, %d unexpected" % (
                name, app.name, len(expected - app.seen), len(app.seen - expected)))


def _restart_everything(cluster, servers):
    for server in servers:
        server.stop()
    for storage in cluster.storages:
        storage.stop()
    cluster.zookeeper.stop()
    cluster.zookeeper.start()
    for storage in cluster.storages:
        storage.start()
    for server in servers:
        server.start()


def _check_replicas(cluster, settings, report):
    """Every storage holds identical record bytes for each partition (segment headers hold creation times):
    the segment files are read in a thread; fires once an anomaly is added for each partition whose replicas
    differ."""
    d = threads.deferToThread(_replica_anomalies, cluster, settings)
    return d.addCallback(report.anomalies.extend)


def _replica_anomalies(cluster, settings):
    """The partitions whose storages do not hold identical record bytes, as anomalies (blocking)."""
    anomalies = []
    for pid in range(settings.partitions):
        replicas = {cluster.storage_name(storage): _record_bytes(storage.config["storage.directory"], pid)
                    for storage in cluster.storages}
        if len({digest for _, digest in replicas.values()}) != 1:
            sizes = {name: size for name, (size, _) in replicas.items()}
            anomalies.append("partition %d: replicas differ (record bytes %s)" % (pid, sizes))
    return anomalies


def _record_bytes(directory, partition_id, chunk_size=1 << 20):
    """``(size, SHA-256 hex digest)`` of a partition's record bytes in a storage directory: its segment files
    in order, each without its header (blocking)."""
    digest, size = hashlib.sha256(), 0
    for path in sorted(glob.glob(os.path.join(directory, str(partition_id), "*.seg"))):
        with open(path, "rb") as stream:
            stream.seek(FILE_HEADER_SIZE)
            for chunk in iter(lambda: stream.read(chunk_size), b""):
                digest.update(chunk)
                size += len(chunk)
    return size, digest.hexdigest()
