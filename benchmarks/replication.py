#!/usr/bin/env python
"""Replication throughput: appends through IStorePartition to 3 storage daemons with quorum 2.

The real store layer (store partition, store session, replica sessions) runs
in this process and appends ``--record-size``-byte transactions with
``--inflight`` outstanding, against three ``twistd waltz-storage`` daemons.
It prints transactions/s and p50/p99 commit latency; then, under the same
load, kills one storage with SIGKILL and measures the time until an append
queued after the kill is committed (failover). In the same run, the limit:
the single-storage figure of ``benchmarks/storage_append.py`` (1 partition).

Targets (issue 4): ratio to the limit >= 0.5; failover < 2 s.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from twisted.internet import defer, task  # noqa: E402

import storage_append  # noqa: E402
from common import (  # noqa: E402
    add_rounds_argument, cpu_snapshot, now, parser, percentile, print_cpu, ratio_line, report, round_summary,
    run_processes, work_dir)
from waltz.gc_tuning import tune_garbage_collector  # noqa: E402
from waltz.local.cluster import LocalCluster  # noqa: E402
from waltz.protocols.values import ReqId, checksum  # noqa: E402
from waltz.server.store.partition import AppendFailed, AppendFateUnknown  # noqa: E402
from waltz.server.store.store import Store  # noqa: E402

TARGET_RATIO = 0.5
TARGET_FAILOVER_S = 2.0


class Load:
    """Keeps ``inflight`` appends outstanding; records commit latencies and commit times."""

    def __init__(self, reactor, partition, record_size, inflight):
        self.reactor = reactor
        self.partition = partition
        self.payload = b"x" * record_size
        self.crc = checksum(self.payload)
        self.inflight = inflight
        self.sent = 0
        self.committed = 0
        self.failed = 0
        self.latencies = []
        self.running = False
        self.window = None
        self.watch = None  # (first append number, Deferred) fired when an append >= number commits

    def start(self):
        self.running = True
        for _ in range(self.inflight):
            self._send()

    def _send(self):
        number = self.sent
        self.sent += 1
        started = now()
        d = self.partition.append(ReqId(1, 1, 0, number), 0, self.payload, self.crc)
        d.addCallbacks(self._committed, self._failed, callbackArgs=(number, started))

    def _committed(self, transaction_id, number, started):
        self.committed += 1
        if self.window is not None:
            self.latencies.append(now() - started)
        if self.watch is not None and number >= self.watch[0] and not self.watch[1].called:
            self.watch[1].callback(now())
        # The next append starts from this one's commit, as the server's append task does: a
        # reactor turn per append here would measure this harness, not the store layer.
        if self.running:
            self._send()

    def _failed(self, failure):
        failure.trap(AppendFailed, AppendFateUnknown)
        self.failed += 1
        if self.running:    # paced by the reactor: a failing partition may fail appends at once
            self.reactor.callLater(0, self._send)

    @defer.inlineCallbacks
    def measure(self, seconds):
        """Commits per second over ``seconds`` (latencies of that window kept)."""
        self.latencies, self.window = [], True
        first, started = self.committed, now()
        yield task.deferLater(self.reactor, seconds, lambda: None)
        self.window = None
        return (self.committed - first) / (now() - started)

    def committed_after(self, number):
        """Fires with the time an append numbered ``number`` or later commits."""
        self.watch = (number, defer.Deferred())
        return self.watch[1]


@defer.inlineCallbacks
def measure_replication(reactor, args, run_dir):
    cluster = LocalCluster(run_dir, num_partitions=1, num_storages=3, root="/waltz_bench_replication")
    store = None
    try:
        yield cluster.start(reactor)
        store = Store(cluster.metadata, reactor, max_batch_size=args.max_batch, initial_retry=0.05,
                      max_retry=0.5, recovery_retry_interval=0.05, max_batches_in_flight=args.batches_in_flight)
        yield store.start()
        tune_garbage_collector()  # as the server daemon does: this process stands in for its store layer
        partition = store.partition(0, 1)
        load = Load(reactor, partition, args.record_size, args.inflight)
        load.start()
        yield task.deferLater(reactor, 1.0, lambda: None)  # warm up
        pids = run_processes("bench process", cluster)
        first_cpu, first_committed = cpu_snapshot(pids), load.committed
        rate = yield load.measure(args.seconds)
        if args.cpu:
            print_cpu("replication (the store layer alone)", first_cpu, cpu_snapshot(pids),
                      load.committed - first_committed)
        latencies = list(load.latencies)
        killed_at = now()
        marker = load.sent
        cluster.storages[2].kill()
        committed_at = yield load.committed_after(marker)
        failover = committed_at - killed_at
        load.running = False
        yield partition.flush()
        return rate, latencies, failover, load
    finally:
        if store is not None:
            yield store.stop()
        yield cluster.stop()


def argument_parser():
    p = parser(__doc__.splitlines()[1])
    p.add_argument("--record-size", type=int, default=100)
    p.add_argument("--inflight", type=int, default=400, help="outstanding appends")
    p.add_argument("--max-batch", type=int, default=100, help="storage.maxBatchSize")
    p.add_argument("--batches-in-flight", type=int, default=4, help="storage.maxBatchesInFlight")
    p.add_argument("--cpu", action="store_true", help="print CPU milliseconds per transaction of each process")
    add_rounds_argument(p)
    return p


def main(argv=None):
    args = argument_parser().parse_args(argv)

    @defer.inlineCallbacks
    def run(reactor):
        pairs, latencies, failovers, failed = [], [], [], 0
        with work_dir("waltz-bench-replication-") as run_dir:
            for k in range(args.rounds):
                rate, round_latencies, failover, load = yield measure_replication(
                    reactor, args, os.path.join(run_dir, "r%d" % k))
                limit_args = storage_append.default_args(args.seconds, args.record_size)
                results, _, _ = yield storage_append.measure(reactor, limit_args,
                                                             os.path.join(run_dir, "limit%d" % k))
                one = results[1]
                pairs.append((rate, one.records / one.elapsed))
                latencies += round_latencies
                failovers.append(failover)
                failed += load.failed
        rate, limit, ratio = round_summary(pairs)
        failover = max(failovers)
        figures = {
            "ops_per_s": round(rate),
            "p50_ms": round(percentile(latencies, 0.5) * 1000, 3),
            "p99_ms": round(percentile(latencies, 0.99) * 1000, 3),
            "limit_ops_per_s": round(limit),
            "ratio": round(ratio, 3),
            "failover_s": round(failover, 3),
            "target_ratio": TARGET_RATIO,
            "target_failover_s": TARGET_FAILOVER_S,
            "failed_appends": failed,
            "inflight": args.inflight,
            "rounds": [{"ops_per_s": round(r), "limit_ops_per_s": round(lim), "ratio": round(r / lim, 3)}
                       for r, lim in pairs],
        }
        ok = ratio >= TARGET_RATIO and failover < TARGET_FAILOVER_S
        lines = [
            "replication: 3 storages, quorum 2, %d-byte transactions, %d in flight, %.0f s x %d rounds (medians; "
            "latency over all rounds, failover the slowest)" % (args.record_size, args.inflight, args.seconds,
                                                               args.rounds),
            "  committed: %10.0f transactions/s, commit latency p50 %.2f ms p99 %.2f ms"
            % (rate, figures["p50_ms"], figures["p99_ms"]),
            "  failover after kill -9 of one storage under load: %.3f s (target < %.1f s)"
            % (failover, TARGET_FAILOVER_S),
            "  limit (storage_append.py, one storage, 1 partition): %10.0f records/s" % limit,
            ratio_line(ratio, TARGET_RATIO, ok),
        ]
        report(figures, args.json, lines)

    task.react(run)


if __name__ == "__main__":
    main()
