#!/usr/bin/env python
"""Storage append throughput: one ``twistd waltz-storage`` daemon, pipelined appends, group commit.

A client process appends batches of ``--batch`` records of ``--record-size``
bytes over the storage protocol, keeping ``--inflight`` batches outstanding per
partition, for 1 and for 4 partitions. Each append is acknowledged only after
fdatasync. In the same run, the limit: this one Python process doing the same
record writes + fdatasync with the same batching (no network, no daemon).

Target (issue 3): at least 30,000 records/s on one partition and a ratio of at
least 0.5 to the limit.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from twisted.internet import defer, task  # noqa: E402

from common import (  # noqa: E402
    connect_storage, create_cluster, now, parser, percentile, processes, report, start_storage,
    start_zookeeper, work_dir)
from waltz.protocols import admin_messages as am  # noqa: E402
from waltz.protocols import storage_messages as sm  # noqa: E402
from waltz.protocols.values import Record, ReqId  # noqa: E402

TARGET_RECORDS_PER_S = 30_000
TARGET_RATIO = 0.5


def fdatasync_limit(directory, seconds, batch, record_size):
    """Records/s of one process writing the same records and fdatasyncing once per batch."""
    record = b"r" * (36 + record_size + 4)
    index_entry = b"i" * 8
    data_fd = os.open(os.path.join(directory, "limit.seg"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    index_fd = os.open(os.path.join(directory, "limit.idx"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    written, latencies = 0, []
    deadline = now() + seconds
    try:
        while now() < deadline:
            started = now()
            os.write(data_fd, record * batch)
            os.write(index_fd, index_entry * batch)
            os.fdatasync(data_fd)
            latencies.append(now() - started)
            written += batch
    finally:
        os.close(data_fd)
        os.close(index_fd)
    return written / seconds, latencies


class AppendLoad:
    """Keeps ``inflight`` append batches outstanding on each partition until the deadline."""

    def __init__(self, client, partitions, batch, record_size, inflight, seconds):
        self.client = client
        self.partitions = partitions
        self.batch = batch
        self.payload = b"x" * record_size
        self.inflight = inflight
        self.seconds = seconds
        self.next_id = {p: 0 for p in partitions}
        self.latencies = []
        self.records = 0
        self.outstanding = 0
        self.finished = defer.Deferred()

    def run(self):
        self.deadline = now() + self.seconds
        self.started = now()
        for p in self.partitions:
            for _ in range(self.inflight):
                self._send(p)
        return self.finished

    def _send(self, partition):
        first = self.next_id[partition]
        self.next_id[partition] = first + self.batch
        records = tuple(Record.create(t, ReqId(1, 1, partition, t), 0, self.payload)
                        for t in range(first, first + self.batch))
        self.outstanding += 1
        d = self.client.request(sm.AppendRequest(1, 0, partition, records, False))
        d.addCallbacks(self._done, self._failed, callbackArgs=(partition, now()))

    def _done(self, response, partition, started):
        self.outstanding -= 1
        if not isinstance(response, sm.SuccessResponse):
            return self._failed(RuntimeError("unexpected response %r" % (response,)))
        finished = now()
        if finished <= self.deadline:
            self.latencies.append(finished - started)
            self.records += self.batch
            self._send(partition)
        elif self.outstanding == 0 and not self.finished.called:
            self.elapsed = min(finished, self.deadline) - self.started
            self.finished.callback(self)

    def _failed(self, failure):
        if not self.finished.called:
            self.finished.errback(failure)


@defer.inlineCallbacks
def measure(reactor, args, run_dir):
    with processes() as started:
        zk = start_zookeeper(os.path.join(run_dir, "zk"), started)
        params = yield create_cluster(reactor, zk.connect_string, 4)
        storage = start_storage(os.path.join(run_dir, "storage"), zk.connect_string, started)
        admin = yield connect_storage(reactor, storage, params, admin=True)
        yield admin.request(am.PartitionAssignmentRequest(0, (0, 1, 2, 3), True, False))
        results = {}
        for partitions in ((0,), (0, 1, 2, 3)) if not args.single else ((0,),):
            client = yield connect_storage(reactor, storage, params)
            load = AppendLoad(client, partitions, args.batch, args.record_size, args.inflight, args.seconds)
            yield load.run()
            results[len(partitions)] = load
            client.transport.loseConnection()
            yield admin.request(am.PartitionAssignmentRequest(0, partitions, False, True))
            yield admin.request(am.PartitionAssignmentRequest(0, partitions, True, False))
        admin.transport.loseConnection()
    limit, limit_latencies = fdatasync_limit(run_dir, args.seconds, args.batch, args.record_size)
    return results, limit, limit_latencies


def summarize(args, results, limit, limit_latencies):
    one = results[1]
    ops = one.records / one.elapsed
    figures = {
        "ops_per_s": round(ops),
        "mb_per_s": round(ops * args.record_size / 1e6, 2),
        "p50_ms": round(percentile(one.latencies, 0.5) * 1000, 3),
        "p99_ms": round(percentile(one.latencies, 0.99) * 1000, 3),
        "limit_ops_per_s": round(limit),
        "limit_p50_ms": round(percentile(limit_latencies, 0.5) * 1000, 3),
        "ratio": round(ops / limit, 3),
        "target_ops_per_s": TARGET_RECORDS_PER_S,
        "target_ratio": TARGET_RATIO,
        "batch": args.batch, "record_size": args.record_size, "inflight": args.inflight,
    }
    lines = ["storage append, batches of %d x %d-byte records, %d in flight per partition, %.0f s per run"
             % (args.batch, args.record_size, args.inflight, args.seconds)]
    for n, load in sorted(results.items()):
        rate = load.records / load.elapsed
        lines.append("  %d partition(s): %10.0f records/s %8.2f MB/s  batch latency p50 %.2f ms p99 %.2f ms"
                     % (n, rate, rate * args.record_size / 1e6, percentile(load.latencies, 0.5) * 1000,
                        percentile(load.latencies, 0.99) * 1000))
        if n != 1:
            figures["ops_per_s_%d_partitions" % n] = round(rate)
            figures["p99_ms_%d_partitions" % n] = round(percentile(load.latencies, 0.99) * 1000, 3)
    lines.append("  limit (one process, write + fdatasync per batch of %d): %10.0f records/s" % (args.batch, limit))
    lines.append("  ratio to limit: %.2f (target >= %.1f); 1-partition target >= %d records/s: %s"
                 % (ops / limit, TARGET_RATIO, TARGET_RECORDS_PER_S,
                    "met" if ops >= TARGET_RECORDS_PER_S and ops / limit >= TARGET_RATIO else "NOT met"))
    return figures, lines


def argument_parser():
    p = parser(__doc__.splitlines()[1])
    p.add_argument("--batch", type=int, default=20)
    p.add_argument("--record-size", type=int, default=100)
    p.add_argument("--inflight", type=int, default=50, help="outstanding batches per partition")
    p.add_argument("--single", action="store_true", help="only the 1-partition run")
    return p


def default_args(seconds, record_size):
    """This benchmark's defaults for a 1-partition run (other benchmarks use it as their limit)."""
    return argument_parser().parse_args(["--seconds", str(seconds), "--record-size", str(record_size), "--single"])


def main(argv=None):
    args = argument_parser().parse_args(argv)

    @defer.inlineCallbacks
    def run(reactor):
        with work_dir("waltz-bench-storage-") as run_dir:
            results, limit, limit_latencies = yield measure(reactor, args, run_dir)
        figures, lines = summarize(args, results, limit, limit_latencies)
        report(figures, args.json, lines)

    task.react(run)


if __name__ == "__main__":
    main()
