"""``waltz perf producers|consumers``: load against a running cluster, with a progress display.

``producers`` runs C clients in this process executing N transactions of S bytes (keeping K outstanding per
client), each with a write lock on a random id; it prints transactions/s, MB/s and latency percentiles
(execute → committed). ``consumers`` reads the whole log of every partition (or the listed ones) through the feed
with every transaction's data, and prints transactions/s and MB/s.
"""

import random
import sys
import time

from twisted.internet import defer, task

from waltz.cli.cluster import add_connection_options, connection_config, quiet_kazoo, run_reactor
from waltz.cli.common import CliError, parse_partition_list
from waltz.client import TransactionContext, WaltzClient, WaltzClientCallbacks
from waltz.gc_tuning import tune_garbage_collector


class _Follower(WaltzClientCallbacks):
    """Keeps the high-water mark; optionally fetches every transaction's data and counts bytes."""

    def __init__(self, num_partitions=0, fetch=False, start=None):
        self.high_water_marks = dict(start or {})
        self.fetch = fetch
        self.applied = 0
        self.bytes = 0

    def get_client_high_water_mark(self, partition_id):
        return self.high_water_marks.get(partition_id, -1)

    def apply_transaction(self, transaction):
        self.high_water_marks[transaction.partition_id] = transaction.transaction_id
        if not self.fetch:
            self.applied += 1
            return None
        return transaction.get_data().addCallback(self._fetched)

    def _fetched(self, data):
        self.applied += 1
        self.bytes += len(data)

    def uncaught_exception(self, partition_id, transaction_id, exception):
        print("\nuncaught exception at %d/%d: %s" % (partition_id, transaction_id, exception), file=sys.stderr)


class _Payload(TransactionContext):
    def __init__(self, data, lock_id, spread):
        super().__init__()
        self.data = data
        self.lock_id = lock_id
        self.spread = spread

    def partition_id(self, num_partitions):
        return self.spread % num_partitions

    def execute(self, builder):
        builder.set_transaction_data(self.data)
        builder.set_write_locks([("perf", self.lock_id)])
        return True


def _progress(label, done, total, began):
    seconds = time.monotonic() - began
    print("\r%s %d/%d (%.0f/s)" % (label, done, total, done / seconds if seconds else 0), end="", file=sys.stderr,
          flush=True)


def _client_config(config, **extra):
    values = {"zookeeper.connectString": config["zookeeper.connectString"], "cluster.root": config["cluster.root"]}
    values.update(extra)
    return values


def producers(args):
    config = connection_config(args)
    quiet_kazoo()
    latencies, outcome = [], {"committed": 0}
    rng = random.Random(args.seed)

    @defer.inlineCallbacks
    def run(reactor):
        clients = [WaltzClient(_Follower(), _client_config(config, **{"client.maxConcurrentTransactions":
                                                                       args.inflight}), reactor)
                   for _ in range(args.clients)]
        ticker = task.LoopingCall(lambda: _progress("committed", outcome["committed"], args.transactions, began))
        try:
            yield defer.gatherResults([c.when_started() for c in clients])
            tune_garbage_collector()
            payload = b"p" * args.size
            began = time.monotonic()
            ticker.start(1.0, now=False)
            remaining = {"n": args.transactions}

            @defer.inlineCallbacks
            def worker(client):
                while remaining["n"] > 0:
                    remaining["n"] -= 1
                    started = time.monotonic()
                    result = yield client.execute(_Payload(payload, rng.randrange(args.lock_range),
                                                           rng.randrange(1 << 30)))
                    if result.committed:
                        outcome["committed"] += 1
                        latencies.append(time.monotonic() - started)

            yield defer.gatherResults([worker(c) for c in clients for _ in range(args.inflight)])
            return time.monotonic() - began
        finally:
            if ticker.running:
                ticker.stop()
            for client in clients:
                yield client.close()

    seconds = run_reactor(run)
    committed = outcome["committed"]
    latencies.sort()

    def pct(q):
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000 if latencies else float("nan")

    print("\nproducers: %d committed in %.1f s: %.0f transactions/s, %.2f MB/s; latency p50 %.1f ms, p99 %.1f ms, "
          "max %.1f ms" % (committed, seconds, committed / seconds, committed * args.size / seconds / 1e6,
                           pct(0.5), pct(0.99), pct(1.0)))
    return 0 if committed == args.transactions else 1


def consumers(args):
    config = connection_config(args)
    quiet_kazoo()

    @defer.inlineCallbacks
    def run(reactor):
        probe = WaltzClient(_Follower(), _client_config(config, **{"client.autoMount": False}), reactor)
        yield probe.when_started()
        partitions = parse_partition_list(args.partitions, probe.num_partitions) if args.partitions \
            else tuple(range(probe.num_partitions))
        marks = dict(zip(partitions, (yield defer.gatherResults([probe.high_water_mark(p) for p in partitions]))))
        yield probe.close()
        total = sum(m + 1 for m in marks.values())
        follower = _Follower(fetch=True)
        client = WaltzClient(follower, _client_config(config, **{"client.autoMount": False}), reactor)
        began = time.monotonic()
        ticker = task.LoopingCall(lambda: _progress("consumed", follower.applied, total, began))
        try:
            yield client.when_started()
            client.set_partitions(partitions)
            ticker.start(1.0, now=False)
            deadline = time.monotonic() + args.timeout
            while any(follower.high_water_marks.get(p, -1) < m for p, m in marks.items()) or \
                    follower.applied < total:
                if time.monotonic() > deadline:
                    raise CliError("consumed %d of %d transactions within %.0f s" % (follower.applied, total,
                                                                                     args.timeout))
                yield task.deferLater(reactor, 0.05, lambda: None)
            return follower.applied, follower.bytes, time.monotonic() - began
        finally:
            if ticker.running:
                ticker.stop()
            yield client.close()

    applied, size, seconds = run_reactor(run)
    print("\nconsumers: %d transactions (%d bytes) in %.1f s: %.0f transactions/s, %.2f MB/s"
          % (applied, size, seconds, applied / seconds if seconds else 0, size / seconds / 1e6 if seconds else 0))
    return 0


def register(subparsers):
    """Add ``waltz perf`` and its subcommands."""
    parser = subparsers.add_parser("perf", help="load and throughput against a running cluster",
                                   description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="perf_command", metavar="SUBCOMMAND")
    commands.required = True
    sub = commands.add_parser("producers", help="append transactions and measure throughput and latency")
    add_connection_options(sub)
    sub.add_argument("--transactions", type=int, default=10_000)
    sub.add_argument("--size", type=int, default=100, help="bytes per transaction (default 100)")
    sub.add_argument("--clients", type=int, default=2)
    sub.add_argument("--inflight", type=int, default=50, help="outstanding transactions per client (default 50)")
    sub.add_argument("--lock-range", type=int, default=1_000_000, help="write locks on random ids below this")
    sub.add_argument("--seed", type=int, default=1)
    sub.set_defaults(func=producers)
    sub = commands.add_parser("consumers", help="read the log with its data and measure throughput")
    add_connection_options(sub)
    sub.add_argument("--partitions", help="partition list such as 0-3 (default all)")
    sub.add_argument("--timeout", type=float, default=600.0)
    sub.set_defaults(func=consumers)
