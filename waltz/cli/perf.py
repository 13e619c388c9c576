"""``waltz perf producers|consumers``: load against a running cluster, with a progress display.

``producers`` runs C clients in this process executing N transactions of S bytes (keeping K outstanding per
client), each with a write lock on a random id; it prints transactions/s, MB/s and latency percentiles
(execute → committed). ``consumers`` reads the whole log of every partition (or the listed ones) through the feed
with every transaction's data, and prints transactions/s and MB/s. Both show their progress on stderr when it is a
terminal, and give up after ``--timeout`` seconds.
"""

import argparse
import random
import sys
import time

from twisted.internet import defer, task

from waltz.cli.client import all_of, ask_high_water_marks, client_config, joined
from waltz.cli.cluster import add_connection_options, connection_config, quiet_kazoo, run_reactor, within
from waltz.cli.common import CliError, non_negative_int, partition_list, positive_int, positive_seconds
from waltz.client import TransactionContext, WaltzClient, WaltzClientCallbacks
from waltz.gc_tuning import tune_garbage_collector
from waltz.protocols.framing import MAX_TRANSACTION_DATA_SIZE


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


class _Progress:
    """``<label> <done()>/<total> (<rate>/s)`` on stderr, redrawn every second between :meth:`start` and
    :meth:`stop`, only when stderr is a terminal (the line is ended at the stop, so an error after it is a
    line of its own)."""

    def __init__(self, reactor, label, done, total):
        self.label = label
        self.done = done
        self.total = total
        self.began = None
        self._ticker = task.LoopingCall(self._show)
        self._ticker.clock = reactor
        self._shown = False

    def start(self):
        self.began = time.monotonic()
        if sys.stderr.isatty():
            self._ticker.start(1.0, now=False)

    def _show(self):
        seconds = time.monotonic() - self.began
        done = self.done()
        print("\r%s %d/%d (%.0f/s)" % (self.label, done, self.total, done / seconds if seconds else 0), end="",
              file=sys.stderr, flush=True)
        self._shown = True

    def stop(self):
        if self._ticker.running:
            self._ticker.stop()
        if self._shown:
            print(file=sys.stderr, flush=True)


def transaction_size(text):
    """An argparse type: transaction data bytes, 0 to the 15 MiB every transaction is limited to."""
    size = non_negative_int(text)
    if size > MAX_TRANSACTION_DATA_SIZE:
        raise argparse.ArgumentTypeError("expected at most %d bytes (15 MiB, the limit of a transaction's data), "
                                         "got %r" % (MAX_TRANSACTION_DATA_SIZE, text))
    return size


def producers(args):
    config = connection_config(args)
    quiet_kazoo()
    latencies, outcome = [], {"committed": 0}
    rng = random.Random(args.seed)

    @defer.inlineCallbacks
    def run(reactor):
        settings = client_config(config, **{"client.maxConcurrentTransactions": args.inflight})
        clients = [WaltzClient(_Follower(), settings, reactor) for _ in range(args.clients)]
        progress = _Progress(reactor, "committed", lambda: outcome["committed"], args.transactions)
        try:
            yield all_of([c.when_started() for c in clients])
            tune_garbage_collector()
            payload = b"p" * args.size
            began = time.monotonic()
            progress.start()
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
                    else:
                        outcome.setdefault("first failure", result.error or result.outcome.value)

            yield all_of([worker(c) for c in clients for _ in range(args.inflight)])
            return time.monotonic() - began
        finally:
            progress.stop()
            for client in clients:
                yield client.close()

    def bounded(reactor):
        return within(run(reactor), args.timeout, reactor, "perf producers did not finish",
                      lambda: "%d of %d transactions committed" % (outcome["committed"], args.transactions))

    seconds = run_reactor(bounded)
    committed = outcome["committed"]
    latencies.sort()

    def pct(q):
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000 if latencies else float("nan")

    print("producers: %d committed in %.1f s: %.0f transactions/s, %.2f MB/s; latency p50 %.1f ms, p99 %.1f ms, "
          "max %.1f ms" % (committed, seconds, committed / seconds, committed * args.size / seconds / 1e6,
                           pct(0.5), pct(0.99), pct(1.0)))
    if "first failure" in outcome:
        print("producers: %d of %d transactions did not commit; the first: %s"
              % (args.transactions - committed, args.transactions, outcome["first failure"]), file=sys.stderr)
    return 0 if committed == args.transactions else 1


def consumers(args):
    config = connection_config(args)
    quiet_kazoo()

    @defer.inlineCallbacks
    def run(reactor):
        _, marks = yield ask_high_water_marks(reactor, config, args.timeout, args.partitions)
        total = sum(m + 1 for m in marks.values())
        follower = _Follower(fetch=True)
        client = WaltzClient(follower, client_config(config, **{"client.autoMount": False}), reactor)
        progress = _Progress(reactor, "consumed", lambda: follower.applied, total)
        try:
            yield joined(client, args.timeout, reactor)
            client.set_partitions(sorted(marks))
            progress.start()
            began = progress.began
            deadline = time.monotonic() + args.timeout
            while any(follower.high_water_marks.get(p, -1) < m for p, m in marks.items()) or \
                    follower.applied < total:
                if time.monotonic() > deadline:
                    raise CliError("consumed %d of %d transactions within %.0f s" % (follower.applied, total,
                                                                                     args.timeout))
                yield task.deferLater(reactor, 0.05, lambda: None)
            return follower.applied, follower.bytes, time.monotonic() - began
        finally:
            progress.stop()
            yield client.close()

    applied, size, seconds = run_reactor(run)
    print("consumers: %d transactions (%d bytes) in %.1f s: %.0f transactions/s, %.2f MB/s"
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
    sub.add_argument("--transactions", type=positive_int, default=10_000)
    sub.add_argument("--size", type=transaction_size, default=100,
                     help="bytes per transaction (default 100, at most 15 MiB)")
    sub.add_argument("--clients", type=positive_int, default=2)
    sub.add_argument("--inflight", type=positive_int, default=50,
                     help="outstanding transactions per client (default 50)")
    sub.add_argument("--lock-range", type=positive_int, default=1_000_000,
                     help="write locks on random ids below this")
    sub.add_argument("--seed", type=int, default=1)
    sub.add_argument("--timeout", type=positive_seconds, default=600.0,
                     help="give up after this many seconds (default 600)")
    sub.set_defaults(func=producers)
    sub = commands.add_parser("consumers", help="read the log with its data and measure throughput")
    add_connection_options(sub)
    sub.add_argument("--partitions", type=partition_list, metavar="LIST",
                     help="partition list such as 0-3 (default all)")
    sub.add_argument("--timeout", type=positive_seconds, default=600.0,
                     help="give up on any step after this many seconds (default 600)")
    sub.set_defaults(func=consumers)
