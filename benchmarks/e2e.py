#!/usr/bin/env python
"""End-to-end throughput: WaltzClient producers and a consumer against a real cluster.

A self-contained cluster on 127.0.0.1: ZooKeeper, 3 storage daemons (quorum 2),
1 ``twistd waltz-server``, one partition. ``--producers`` WaltzClients (in this
process) execute transactions of ``--record-size`` bytes, each with one write
lock on ("bench", random id), keeping ``--inflight`` contexts outstanding per
producer; one more WaltzClient consumes the feed. Prints committed
transactions/s, append latency p50/p99 (execute → committed) and the feed rate;
in the same run, the limit: ``benchmarks/replication.py`` (the store layer
alone, same storages setup).

Targets (issue 5): >= 5,000 committed transactions/s, p99 < 50 ms, ratio >= 0.4.

``--rounds`` (default 3) repeats (end to end, limit) on fresh clusters and reports
medians, the ratio being the median of the rounds' ratios: on a small shared machine
the speed of both runs drifts by a quarter between runs a minute apart, and the two
runs of one round are the closest in time.

Defaults: 2 producers x 200 transactions in flight, 400 appends outstanding
in all: the same as the limit run (``replication.py --inflight 400``), so that the
ratio compares the layers at the same offered concurrency. (With fewer in flight
the end-to-end run is bound by latency, not by work: at 2 x 50 it commits about
a sixth of the limit, with a p99 under 20 ms; pass ``--inflight 50`` to see it.)
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
    """Keeps ``inflight`` contexts executing on one client until stopped; records latencies."""

    def __init__(self, reactor, client, payload, inflight, rng):
        self.reactor = reactor
        self.client = client
        self.payload = payload
        self.inflight = inflight
        self.rng = rng
        self.running = False
        self.committed = 0
        self.latencies = []
        self.measuring = False

    def start(self):
        self.running = True
        for _ in range(self.inflight):
            self._next()

    def _next(self):
        if not self.running:
            return
        started = now()
        d = self.client.execute(Transfer(self.payload, self.rng.randrange(1_000_000)))
        d.addCallback(self._done, started)

    def _done(self, result, started):
        if result.committed:
            self.committed += 1
            if self.measuring:
                self.latencies.append(now() - started)
        # The next execution starts from the completion callback itself, as an application's
        # request handler would (the client supports executing from its callbacks): a reactor
        # turn per transaction here would measure this harness, not the client.
        self._next()


def client_config(cluster, inflight):
    return {"zookeeper.connectString": cluster.connect_string, "cluster.root": cluster.root,
            "client.maxConcurrentTransactions": inflight}


@defer.inlineCallbacks
def measure_e2e(reactor, args, run_dir):
    cluster = LocalCluster(run_dir, num_partitions=1, num_storages=3, root="/waltz_bench_e2e")
    server = None
    clients = []
    try:
        yield cluster.start(reactor)
        server = local_server(os.path.join(run_dir, "server"), cluster.connect_string, cluster.root)
        yield threads.deferToThread(server.start)
        consumer_state = Follower()
        consumer = WaltzClient(consumer_state, client_config(cluster, 5), reactor)
        clients.append(consumer)
        producers = []
        rng = random.Random(7)
        for _ in range(args.producers):
            client = WaltzClient(Follower(), client_config(cluster, args.inflight), reactor)
            clients.append(client)
            producers.append(Producer(reactor, client, b"p" * args.record_size, args.inflight, rng))
        yield defer.gatherResults([c.when_started() for c in clients])
        tune_garbage_collector()
        for producer in producers:
            producer.start()
        yield task.deferLater(reactor, 2.0, lambda: None)  # warm up
        for producer in producers:
            producer.measuring = True
        pids = run_processes("client process", cluster, ("server", server.pid))
        first_cpu = cpu_snapshot(pids)
        first_committed = sum(p.committed for p in producers)
        first_fed = consumer_state.applied
        started = now()
        yield task.deferLater(reactor, args.seconds, lambda: None)
        elapsed = now() - started
        committed = sum(p.committed for p in producers) - first_committed
        if args.cpu:
            print_cpu("end to end", first_cpu, cpu_snapshot(pids), committed)
        fed = consumer_state.applied - first_fed
        for producer in producers:
            producer.running = False
            producer.measuring = False
        latencies = [x for p in producers for x in p.latencies]
        if args.server_metrics:
            status, text = yield threads.deferToThread(server.http_get, "/metrics")
            print("\n".join(line for line in text.splitlines()
                            if not line.startswith("#") and "_bucket" not in line))
        return committed / elapsed, latencies, fed / elapsed
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
    p.add_argument("--inflight", type=int, default=200,
                   help="outstanding transactions per producer (client.maxConcurrentTransactions); the default "
                        "makes 400 in all, as the limit run")
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
                rate, latencies, feed_rate = yield measure_e2e(reactor, args, os.path.join(run_dir, "e2e%d" % k))
                limit = 0.0
                if not args.no_limit:
                    limit_args = replication.argument_parser().parse_args(
                        ["--seconds", str(args.seconds), "--record-size", str(args.record_size)]
                        + (["--cpu"] if args.cpu else []))
                    limit, _, _, _ = yield replication.measure_replication(reactor, limit_args,
                                                                           os.path.join(run_dir, "r%d" % k))
                rounds.append((rate, latencies, feed_rate, limit))
        rate, limit, ratio = round_summary([(r[0], r[3]) for r in rounds])
        feed_rate = statistics.median(r[2] for r in rounds)
        latencies = [x for r in rounds for x in r[1]]
        p50, p99 = percentile(latencies, 0.5) * 1000, percentile(latencies, 0.99) * 1000
        ok = rate >= TARGET_OPS and p99 < TARGET_P99_MS and ratio >= TARGET_RATIO
        figures = {
            "ops_per_s": round(rate), "p50_ms": round(p50, 3), "p99_ms": round(p99, 3),
            "feed_per_s": round(feed_rate), "limit_ops_per_s": round(limit), "ratio": round(ratio, 3),
            "target_ops_per_s": TARGET_OPS, "target_p99_ms": TARGET_P99_MS, "target_ratio": TARGET_RATIO,
            "producers": args.producers, "inflight": args.inflight,
            "rounds": [{"ops_per_s": round(r[0]), "limit_ops_per_s": round(r[3]),
                        "ratio": round(r[0] / r[3], 3) if r[3] else None} for r in rounds],
        }
        lines = [
            "end to end: 3 storages (quorum 2), 1 server, 1 partition, %d producers x %d in flight, %d-byte "
            "transactions with one write lock, %.0f s x %d rounds (medians; latency over all rounds)"
            % (args.producers, args.inflight, args.record_size, args.seconds, args.rounds),
            "  committed: %10.0f transactions/s, append latency p50 %.2f ms p99 %.2f ms (target >= %d/s, p99 < %.0f ms)"
            % (rate, p50, p99, TARGET_OPS, TARGET_P99_MS),
            "  consumer feed: %10.0f transactions/s" % feed_rate,
            "  limit (replication.py, store layer alone): %10.0f transactions/s" % limit,
            ratio_line(ratio, TARGET_RATIO, ok),
        ]
        report(figures, args.json, lines)

    task.react(run)


if __name__ == "__main__":
    main()
