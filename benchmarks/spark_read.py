#!/usr/bin/env python
"""Spark read throughput: ``spark.read.format("waltz")`` on ``local[2]`` against a real cluster.

A self-contained cluster on 127.0.0.1: ZooKeeper, ``--storages`` storage daemons
(default 1: a read touches one replica, and loading is faster), one ``twistd
waltz-server``, ``--partitions`` partitions. ``--producers`` WaltzClients (in this
process, no locks, ``--inflight`` each) load ``--transactions`` transactions of
``--record-size`` bytes (default 1,000,000 x 100 B; use ``--transactions 100000``
for a quick run). Then, in the same run:

* the limit: one client process (a subprocess of this script) reads every
  transaction with the blocking facade (``BlockingWaltzClient.read_transactions``,
  the chunks the executors use), partition after partition;
* Spark: a ``local[2]`` session reads the whole log
  (``maxTransactionsPerSplit`` splits) and aggregates the row count and data bytes,
  which must match what was written.

Prints rows/s for both and the ratio. Targets (issue 7): Spark >= 50,000 rows/s and
at least as fast as the single client (ratio >= 1). ``--json`` prints one JSON
object as the last line. ``--rounds`` (default 3) repeats both reads on the same
log and reports medians, the ratio being the median of the rounds' ratios.
"""

import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from twisted.internet import defer, task, threads  # noqa: E402

from common import (  # noqa: E402
    add_rounds_argument, cpu_snapshot, now, parser, print_cpu, ratio_line, report, round_summary, run_processes,
    work_dir)
from waltz.client import TransactionContext, WaltzClient, WaltzClientCallbacks  # noqa: E402
from waltz.local.cluster import LocalCluster  # noqa: E402
from waltz.local.daemons import local_server  # noqa: E402

TARGET_ROWS = 50_000
TARGET_RATIO = 1.0


class _Idle(WaltzClientCallbacks):
    def get_client_high_water_mark(self, partition_id):
        return -1

    def apply_transaction(self, transaction):
        return None


class _Load(TransactionContext):
    def __init__(self, partition, payload):
        super().__init__()
        self.partition, self.payload = partition, payload

    def partition_id(self, num_partitions):
        return self.partition

    def execute(self, builder):
        builder.set_transaction_data(self.payload)
        return True


@defer.inlineCallbacks
def load(reactor, cluster, args):
    """Write the transactions with pipelined producers; fires with the seconds it took."""
    config = {"zookeeper.connectString": cluster.connect_string, "cluster.root": cluster.root,
              "client.autoMount": True, "client.maxConcurrentTransactions": args.inflight}
    clients = [WaltzClient(_Idle(), config, reactor) for _ in range(args.producers)]
    payload = b"r" * args.record_size
    remaining = {"n": args.transactions}
    began = now()
    try:
        yield defer.gatherResults([c.when_started() for c in clients])

        @defer.inlineCallbacks
        def worker(client, lane):
            while remaining["n"] > 0:
                remaining["n"] -= 1
                result = yield client.execute(_Load(remaining["n"] % args.partitions, payload))
                if not result.committed:
                    raise RuntimeError("a load transaction did not commit: %r" % (result,))

        yield defer.gatherResults([worker(c, i) for c in clients for i in range(args.inflight)], consumeErrors=True)
    finally:
        for client in clients:
            yield client.close()
    return now() - began


def spark_read(cluster, args):
    """Rows/s of a local[2] Spark read of the whole log (a warm-up read first); checks the rows."""
    from pyspark.sql import functions as F
    from waltz.spark.session import build_session
    spark = build_session(args.master, "waltz-bench", {"spark.sql.shuffle.partitions": "2"})
    try:
        def frame(**options):
            reader = spark.read.format("waltz").option("zookeeper", cluster.connect_string) \
                .option("cluster.root", cluster.root).option("maxTransactionsPerSplit", str(args.max_per_split))
            for key, value in options.items():
                reader = reader.option(key, value)
            return reader.load()
        frame(endingTransactionIds=json.dumps({str(p): min(999, args.transactions // args.partitions - 1)
                                               for p in range(args.partitions)})).count()  # start the workers
        began = now()
        row = frame().agg(F.count(F.lit(1)).alias("rows"), F.sum(F.length("data")).alias("bytes")).collect()[0]
        seconds = now() - began
    finally:
        spark.stop()
    if row["rows"] != args.transactions or row["bytes"] != args.transactions * args.record_size:
        raise RuntimeError("Spark read %s rows / %s bytes, expected %d / %d" % (
            row["rows"], row["bytes"], args.transactions, args.transactions * args.record_size))
    return args.transactions / seconds


def client_read(cluster):
    """Rows/s of one client process (this script with --limit-reader) reading every transaction."""
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--limit-reader", cluster.connect_string,
                          cluster.root], capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError("the single-client read failed: %s" % out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def limit_reader(connect_string, root):
    """The limit run, in its own process: the blocking facade reads every partition, chunk by chunk."""
    from waltz.client.blocking import BlockingWaltzClient
    from waltz.spark.reading import read_in_chunks
    client = BlockingWaltzClient.for_reading({"zookeeper.connectString": connect_string, "cluster.root": root},
                                             timeout=600)
    try:
        marks = client.high_water_marks()
        rows = size = 0
        began = time.perf_counter()
        for pid, mark in sorted(marks.items()):
            chunks = read_in_chunks(lambda first, last: client.read_transactions(pid, first, last, committed=True),
                                    0, mark)
            for _, _, records in chunks:
                rows += len(records)
                size += sum(len(r.data) for r in records)
        seconds = time.perf_counter() - began
    finally:
        client.close()
    print(json.dumps({"rows": rows, "bytes": size, "rows_per_s": rows / seconds}))


@defer.inlineCallbacks
def measure(reactor, args, run_dir):
    cluster = LocalCluster(run_dir, num_partitions=args.partitions, num_storages=args.storages,
                           root="/waltz_bench_spark")
    server = None
    try:
        yield cluster.start(reactor)
        server = local_server(os.path.join(run_dir, "server"), cluster.connect_string, cluster.root)
        yield threads.deferToThread(server.start)
        load_seconds = yield load(reactor, cluster, args)
        print("loaded %d transactions in %.0f s" % (args.transactions, load_seconds), file=sys.stderr)
        pairs = []
        # The processes whose CPU per row --cpu prints: this one (Spark's driver), the cluster's, and the whole
        # machine, which counts the readers too (the limit's process, or Spark's JVM and Python workers).
        pids = run_processes("bench process", cluster, ("server", server.pid), ("whole machine", None))
        for _ in range(args.rounds):      # both reads again on the same log: the machine's speed drifts
            before = cpu_snapshot(pids)
            limit = yield threads.deferToThread(client_read, cluster)
            if limit["rows"] != args.transactions:
                raise RuntimeError("the single client read %d rows, expected %d"
                                   % (limit["rows"], args.transactions))
            between = cpu_snapshot(pids)
            rate = yield threads.deferToThread(spark_read, cluster, args)
            if args.cpu:
                print_cpu("the single client's read", before, between, args.transactions, "row")
                # (Spark's warm-up read of 1,000 rows per partition is counted too: a rounding error.)
                print_cpu("Spark's read", between, cpu_snapshot(pids), args.transactions, "row")
            pairs.append((rate, limit["rows_per_s"]))
        return pairs, load_seconds
    finally:
        if server is not None:
            yield threads.deferToThread(server.stop)
        yield cluster.stop()


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--limit-reader"]:
        limit_reader(*argv[1:3])
        return
    p = parser(__doc__.splitlines()[1])
    p.add_argument("--transactions", type=int, default=1_000_000)
    p.add_argument("--record-size", type=int, default=100)
    p.add_argument("--partitions", type=int, default=2)
    p.add_argument("--storages", type=int, default=1)
    p.add_argument("--producers", type=int, default=4)
    p.add_argument("--inflight", type=int, default=100, help="outstanding transactions per producer")
    p.add_argument("--master", default="local[2]")
    p.add_argument("--max-per-split", type=int, default=100_000, help="maxTransactionsPerSplit")
    p.add_argument("--cpu", action="store_true",
                   help="print the CPU per row read of this process, the server, each storage and the whole machine, "
                        "for each read")
    add_rounds_argument(p)
    args = p.parse_args(argv)

    @defer.inlineCallbacks
    def run(reactor):
        with work_dir("waltz-bench-spark-") as run_dir:
            pairs, load_seconds = yield measure(reactor, args, run_dir)
        rate, limit, ratio = round_summary(pairs)
        ok = rate >= TARGET_ROWS and ratio >= TARGET_RATIO
        figures = {"ops_per_s": round(rate), "rows_per_s": round(rate), "limit_ops_per_s": round(limit),
                   "ratio": round(ratio, 3), "p50_ms": None, "p99_ms": None, "transactions": args.transactions,
                   "record_size": args.record_size, "partitions": args.partitions, "master": args.master,
                   "load_seconds": round(load_seconds, 1), "target_rows_per_s": TARGET_ROWS,
                   "target_ratio": TARGET_RATIO,
                   "rounds": [{"rows_per_s": round(r), "limit_rows_per_s": round(lim), "ratio": round(r / lim, 3)}
                              for r, lim in pairs]}
        lines = [
            "spark read: %d transactions of %d bytes in %d partitions, %s, maxTransactionsPerSplit %d, %d rounds "
            "(medians)" % (args.transactions, args.record_size, args.partitions, args.master, args.max_per_split,
                           args.rounds),
            "  spark:         %10.0f rows/s (target >= %d)" % (rate, TARGET_ROWS),
            "  limit (one client process, blocking facade): %10.0f rows/s" % limit,
            ratio_line(ratio, TARGET_RATIO, ok),
        ]
        report(figures, args.json, lines)

    task.react(run)


if __name__ == "__main__":
    main()
