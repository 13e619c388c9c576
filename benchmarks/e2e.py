#!/usr/bin/env python
"""End-to-end throughput and latency: WaltzClient producers and a consumer against a real cluster.

A self-contained cluster on 127.0.0.1: ZooKeeper, 3 storage daemons (quorum 2),
1 ``twistd waltz-server``, one partition. ``--producers`` WaltzClients (in this
process) execute transactions of ``--record-size`` bytes, each with one write
lock on ("bench", random id); one more WaltzClient consumes the feed. Each round
measures two phases on one cluster, then the limit:

- **paced**: ``--rate`` transactions/s offered open loop (due at fixed times,
  whatever the completions do), latency measured from each transaction's due time,
  so a late harness or a stalled process counts against it. This is where the
  latency target is checked: at least 5,000 committed/s with p99 under 50 ms.
  The default offers 6,000/s, 1.2 x the target.
- **saturated**: ``--inflight`` contexts outstanding per producer, the next one
  executed from each completion (closed loop): the most the cluster commits. Its
  latency is queueing (in flight / rate, by Little's law) and is printed for
  information. The ratio target compares this rate with the limit.
- **limit**: ``benchmarks/replication.py`` (the store layer alone, same storages
  setup, 400 in flight).

Targets (issue 5): >= 5,000 committed transactions/s with p99 < 50 ms, ratio >= 0.4.

``--rounds`` (default 3) repeats (end to end, limit) on fresh clusters and reports
medians, the ratio being the median of the rounds' ratios: on a small shared machine
the speed of both runs drifts by a quarter between runs a minute apart, and the two
runs of one round are the closest in time.

Defaults for the saturated phase: 2 producers x 200 transactions in flight, 400
appends outstanding in all: the same as the limit run (``replication.py --inflight
400``), so that the ratio compares the layers at the same offered concurrency.
Two application instances is the smallest deployment that survives losing one.
More producers would mostly measure this benchmark's own process: every client
applies the whole feed (that is how Waltz works), and here all of them share
one Python process on the machine that also runs the cluster, where a real
deployment gives each instance its own.
"""

import os
import random
import statistics
import sys

import attr

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from twisted.internet import defer, task, threads  # noqa: E402

import replication  # noqa: E402
from common import (  # noqa: E402
    add_rounds_argument, cpu_snapshot, now, parser, percentile, print_cpu, ratio_line, report, round_summary,
    run_processes, work_dir)
from waltz.client import TransactionContext, WaltzClient, WaltzClientCallbacks  # noqa: E402
from waltz.gc_tuning import tune_garbage_collector  # noqa: E402
from waltz.local.cluster import LocalCluster  # noqa: E402
from waltz.local.daemons import local_server  # noqa: E402

TARGET_OPS = 5000
TARGET_P99_MS = 50.0
TARGET_RATIO = 0.4
DEFAULT_RATE = 6000          # the paced phase offers 1.2 x the throughput target
WARM_UP_SECONDS = 2.0
DRAIN_TIMEOUT_SECONDS = 30.0


class Follower(WaltzClientCallbacks):
    """Applies nothing but the high-water mark, and counts what the feed delivered."""

    def __init__(self):
        self.high_water_mark = -1
        self.applied = 0

    def get_client_high_water_mark(self, partition_id):
        return self.high_water_mark

    def apply_transaction(self, transaction):
        self.high_water_mark = transaction.transaction_id
        self.applied += 1

    def uncaught_exception(self, partition_id, transaction_id, exception):
        print("uncaught exception on %d/%d: %s" % (partition_id, transaction_id, exception), file=sys.stderr)


class Transfer(TransactionContext):
    """One transaction with a write lock on a random id; re-executed as the client decides."""

    def __init__(self, payload, lock_id):
        super().__init__()
        self.payload = payload
        self.lock_id = lock_id

    def partition_id(self, num_partitions):
        return 0

    def execute(self, builder):
        builder.set_transaction_data(self.payload)
        builder.set_write_locks([("bench", self.lock_id)])
        return True


class Producer:
    """Executes transactions on one client and records each one's latency.

    The latency of a transaction is measured from the time it was due (``due``), not from the
    call: in the paced phase a transaction the harness issued late still counts its delay.
    With ``closed_loop`` set, each completion starts the next execution from the completion
    callback itself, as an application's request handler would (the client supports executing
    from its callbacks): a reactor turn per transaction there would measure this harness.
    """

    def __init__(self, client, payload, rng):
        self.client = client
        self.payload = payload
        self.rng = rng
        self.closed_loop = False
        self.committed = 0
        self.outstanding = 0
        self.latencies = []
        self.measuring = False

    def submit(self, due):
        self.outstanding += 1
        d = self.client.execute(Transfer(self.payload, self.rng.randrange(1_000_000)))
        d.addCallback(self._done, due)

    def _done(self, result, due):
        self.outstanding -= 1
        if result.committed:
            self.committed += 1
            if self.measuring:
                self.latencies.append(now() - due)
        if self.closed_loop:
            self.submit(now())


class Pacer:
    """Offers transactions to the producers at a fixed rate, whatever their completions do (open loop).

    Transaction ``k`` is due at ``start + k / rate``; every ``tick`` seconds the pacer submits
    all that are due, round robin over the producers, each with its due time.
    """

    def __init__(self, reactor, producers, rate, tick=0.002):
        self.producers = producers
        self.rate = rate
        self._loop = task.LoopingCall(self._tick)
        self._loop.clock = reactor
        self._tick_interval = tick
        self._start = None
        self._issued = 0

    def start(self):
        self._start = now()
        self._loop.start(self._tick_interval)

    def stop(self):
        self._loop.stop()

    def _tick(self):
        due = int((now() - self._start) * self.rate)
        while self._issued < due:
            self.producers[self._issued % len(self.producers)].submit(self._start + self._issued / self.rate)
            self._issued += 1


def client_config(cluster, inflight):
    return {"zookeeper.connectString": cluster.connect_string, "cluster.root": cluster.root,
            "client.maxConcurrentTransactions": inflight}


@attr.s(frozen=True)
class Phase:
    """What one measured window of the end-to-end run gave."""
    rate = attr.ib()        # committed transactions/s
    latencies = attr.ib()   # seconds, due time to commit, of the transactions committed in the window
    feed_rate = attr.ib()   # transactions/s the consumer applied


@defer.inlineCallbacks
def measure_window(reactor, args, title, producers, follower, pids):
    """Measure ``args.seconds`` of whatever load the producers are under (after a warm-up)."""
    yield task.deferLater(reactor, WARM_UP_SECONDS, lambda: None)
    for producer in producers:
        producer.latencies = []
        producer.measuring = True
    first_cpu = cpu_snapshot(pids)
    first_committed = sum(p.committed for p in producers)
    first_fed = follower.applied
    started = now()
    yield task.deferLater(reactor, args.seconds, lambda: None)
    elapsed = now() - started
    committed = sum(p.committed for p in producers) - first_committed
    fed = follower.applied - first_fed
    for producer in producers:
        producer.measuring = False
    if args.cpu:
        print_cpu(title, first_cpu, cpu_snapshot(pids), committed)
    return Phase(committed / elapsed, [x for p in producers for x in p.latencies], fed / elapsed)


@defer.inlineCallbacks
def drain(reactor, producers, timeout=DRAIN_TIMEOUT_SECONDS):
    """Wait until every submitted transaction has completed; a cluster that cannot is a failed run."""
    deadline = now() + timeout
    while any(p.outstanding for p in producers):
        if now() > deadline:
            raise RuntimeError("%d transactions still outstanding %.0f s after the paced phase"
                               % (sum(p.outstanding for p in producers), timeout))
        yield task.deferLater(reactor, 0.05, lambda: None)


@defer.inlineCallbacks
def measure_e2e(reactor, args, run_dir):
    """One round on a fresh cluster: the paced phase (latency at ``--rate``), then the saturated phase."""
    cluster = LocalCluster(run_dir, num_partitions=1, num_storages=3, root="/waltz_bench_e2e")
    server = None
    clients = []
    try:
        yield cluster.start(reactor)
        server = local_server(os.path.join(run_dir, "server"), cluster.connect_string, cluster.root)
        yield threads.deferToThread(server.start)
        follower = Follower()
        clients.append(WaltzClient(follower, client_config(cluster, 5), reactor))
        producers = []
        rng = random.Random(7)
        for _ in range(args.producers):
            client = WaltzClient(Follower(), client_config(cluster, args.inflight), reactor)
            clients.append(client)
            producers.append(Producer(client, b"p" * args.record_size, rng))
        yield defer.gatherResults([c.when_started() for c in clients])
        tune_garbage_collector()
        pids = run_processes("client process", cluster, ("server", server.pid))
        paced = None
        if args.rate:
            pacer = Pacer(reactor, producers, args.rate)
            pacer.start()
            paced = yield measure_window(reactor, args, "paced at %d/s" % args.rate, producers, follower, pids)
            pacer.stop()
            yield drain(reactor, producers)
        for producer in producers:
            producer.closed_loop = True
            for _ in range(args.inflight):
                producer.submit(now())
        saturated = yield measure_window(reactor, args, "saturated", producers, follower, pids)
        for producer in producers:
            producer.closed_loop = False
        if args.server_metrics:
            status, text = yield threads.deferToThread(server.http_get, "/metrics")
            print("\n".join(line for line in text.splitlines()
                            if not line.startswith("#") and "_bucket" not in line))
        return paced, saturated
    finally:
        for client in clients:
            yield client.close()
        if server is not None:
            server.stop()
        yield cluster.stop()


def main(argv=None):
    p = parser(__doc__.splitlines()[1])
    p.add_argument("--record-size", type=int, default=100)
    p.add_argument("--producers", type=int, default=2, help="producer clients (see the module doc)")
    p.add_argument("--rate", type=int, default=DEFAULT_RATE,
                   help="transactions/s offered in the paced phase, where the latency target is checked "
                        "(0 skips the phase)")
    p.add_argument("--inflight", type=int, default=200,
                   help="outstanding transactions per producer in the saturated phase "
                        "(client.maxConcurrentTransactions); the default makes 400 in all, as the limit run")
    add_rounds_argument(p)
    p.add_argument("--no-limit", action="store_true", help="skip the limit runs (for profiling)")
    p.add_argument("--cpu", action="store_true",
                   help="print CPU milliseconds per transaction of each process (of the limit run's too)")
    p.add_argument("--server-metrics", action="store_true", help="print the server's metrics after the run")
    args = p.parse_args(argv)

    @defer.inlineCallbacks
    def run(reactor):
        rounds = []
        with work_dir("waltz-bench-e2e-") as run_dir:
            for k in range(args.rounds):
                paced, saturated = yield measure_e2e(reactor, args, os.path.join(run_dir, "e2e%d" % k))
                limit = 0.0
                if not args.no_limit:
                    limit_args = replication.argument_parser().parse_args(
                        ["--seconds", str(args.seconds), "--record-size", str(args.record_size)]
                        + (["--cpu"] if args.cpu else []))
                    limit, _, _, _ = yield replication.measure_replication(reactor, limit_args,
                                                                           os.path.join(run_dir, "r%d" % k))
                rounds.append((paced, saturated, limit))
        report(*summarize(args, rounds))

    task.react(run)


def latency_figures(phases):
    """Median rate, and p50/p99 in ms over all the phases' samples."""
    latencies = [x for phase in phases for x in phase.latencies]
    return (statistics.median(phase.rate for phase in phases),
            percentile(latencies, 0.5) * 1000, percentile(latencies, 0.99) * 1000)


def summarize(args, rounds):
    """``report``'s arguments: the figures and the lines for the rounds' (paced, saturated, limit)."""
    rate, limit, ratio = round_summary([(saturated.rate, limit) for _, saturated, limit in rounds])
    _, sat_p50, sat_p99 = latency_figures([saturated for _, saturated, _ in rounds])
    feed_rate = statistics.median(saturated.feed_rate for _, saturated, _ in rounds)
    lines = [
        "end to end: 3 storages (quorum 2), 1 server, 1 partition, %d producers, %d-byte transactions with one "
        "write lock, %.0f s x %d rounds (medians; latency over all rounds)"
        % (args.producers, args.record_size, args.seconds, args.rounds)]
    figures = {"producers": args.producers, "inflight": args.inflight, "rate": args.rate,
               "target_ops_per_s": TARGET_OPS, "target_p99_ms": TARGET_P99_MS, "target_ratio": TARGET_RATIO}
    latency_met = False
    if args.rate:
        paced_rate, p50, p99 = latency_figures([paced for paced, _, _ in rounds])
        latency_met = paced_rate >= TARGET_OPS and p99 < TARGET_P99_MS
        figures.update({"paced_ops_per_s": round(paced_rate), "paced_p50_ms": round(p50, 3),
                        "paced_p99_ms": round(p99, 3), "latency_target_met": latency_met})
        lines.append("  paced at %d/s offered: %10.0f committed/s, latency p50 %.2f ms p99 %.2f ms "
                     "(target >= %d/s with p99 < %.0f ms: %s)"
                     % (args.rate, paced_rate, p50, p99, TARGET_OPS, TARGET_P99_MS, "met" if latency_met else "NOT met"))
    figures.update({
        "ops_per_s": round(rate), "p50_ms": round(sat_p50, 3), "p99_ms": round(sat_p99, 3),
        "feed_per_s": round(feed_rate), "limit_ops_per_s": round(limit), "ratio": round(ratio, 3),
        "rounds": [{"paced_ops_per_s": round(paced.rate) if paced else None, "ops_per_s": round(saturated.rate),
                    "limit_ops_per_s": round(limit), "ratio": round(saturated.rate / limit, 3) if limit else None}
                   for paced, saturated, limit in rounds]})
    lines += [
        "  saturated at %d x %d in flight: %10.0f committed/s, latency p50 %.2f ms p99 %.2f ms (queueing: "
        "in flight / rate)" % (args.producers, args.inflight, rate, sat_p50, sat_p99),
        "  consumer feed: %10.0f transactions/s" % feed_rate,
        "  limit (replication.py, store layer alone): %10.0f transactions/s" % limit,
        ratio_line(ratio, TARGET_RATIO, ratio >= TARGET_RATIO),
    ]
    return figures, args.json, lines


if __name__ == "__main__":
    main()
