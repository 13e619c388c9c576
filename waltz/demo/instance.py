"""One instance of the bank application, as a process of its own: ``python -m waltz.demo.instance``.

It keeps its accounts in its own SQLite database (:class:`~waltz.demo.bank.Bank`),
runs a :class:`~waltz.client.WaltzClient` that applies every partition of the log to
it, and moves money for ``--duration`` seconds: deposits and withdrawals on random
accounts with ``--concurrency`` transactions in flight, and one deactivation at a
random moment between 30 % and 70 % of the run.

It talks to the demo runner (:mod:`waltz.demo.runner`) in JSON lines: on stdout it
writes ``catching_up`` (twice a second while it catches up with the log: how many
transactions it has applied), ``started`` (its database rebuilt from the log), ``progress`` (twice a
second), ``produced`` (the workload is over), ``finished`` and ``error`` events. On stdin
it waits for the line ``go`` (every instance has started) before its workload, and for
``drain`` (every instance has stopped writing) after it; then it catches up with every partition's
high-water mark, writes its report (every transaction it committed, with where it
is in the log) and exits.
"""

import argparse
import json
import random
import sys
import time

import attr
from twisted.internet import defer, stdio, task, threads
from twisted.protocols.basic import LineReceiver

from waltz.client import Outcome, WaltzClient
from waltz.demo.bank import DEACTIVATE, DEPOSIT, WITHDRAWAL, Bank, Deactivation, Deposit, Withdrawal, open_database
from waltz.gc_tuning import tune_garbage_collector

PROGRESS_INTERVAL = 0.5

_COUNTERS = {DEPOSIT: "deposits", WITHDRAWAL: "withdrawals", DEACTIVATE: "deactivations"}


@attr.s
class InstanceStats:
    """What the instance did so far (sent with every progress event)."""

    committed = attr.ib(default=0)
    deposits = attr.ib(default=0)
    withdrawals = attr.ib(default=0)
    deactivations = attr.ib(default=0)
    refused = attr.ib(default=0)        # execute decided not to append (insufficient funds, deactivated)
    lock_failures = attr.ib(default=0)  # attempts refused by the server's optimistic lock check
    retries = attr.ib(default=0)        # attempts after a context's first one (lock failures, lost servers)
    expired = attr.ib(default=0)
    failed = attr.ib(default=0)
    in_flight = attr.ib(default=0)

    def attempted(self, context):
        if context.attempts > 1:
            self.retries += 1

    def lock_failed(self, context):
        self.lock_failures += 1

    def finished(self, context, result):
        if result.outcome is Outcome.COMMITTED:
            self.committed += 1
            counter = _COUNTERS[context.kind]
            setattr(self, counter, getattr(self, counter) + 1)
        elif result.outcome is Outcome.IGNORED:
            self.refused += 1
        elif result.outcome is Outcome.EXPIRED:
            self.expired += 1
        else:
            self.failed += 1


class Channel(LineReceiver):
    """The instance's JSON-lines conversation with the runner over stdin/stdout."""

    delimiter = b"\n"

    def __init__(self):
        self.go = defer.Deferred()
        self.drain = defer.Deferred()

    def send(self, event, **fields):
        fields["event"] = event
        self.sendLine(json.dumps(fields, sort_keys=True).encode("utf-8"))

    def lineReceived(self, line):
        command = {b"go": self.go, b"drain": self.drain}.get(line.strip())
        if command is not None and not command.called:
            command.callback(None)

    def connectionLost(self, reason):
        for command in (self.go, self.drain):
            if not command.called:
                command.errback(RuntimeError("the demo runner went away"))


class Workload:
    """Deposits, withdrawals and one deactivation against ``client`` for ``duration`` seconds."""

    def __init__(self, reactor, client, bank, args, stats):
        self.reactor = reactor
        self.client = client
        self.bank = bank
        self.args = args
        self.stats = stats
        self.rng = random.Random(args.seed)
        self.committed = []
        self._deadline = None
        self._deactivate_at = None
        self._done = defer.Deferred()

    def run(self):
        """Fires when the duration is over and every transaction in flight has ended."""
        now = self.reactor.seconds()
        self._deadline = now + self.args.duration
        self._deactivate_at = now + self.args.duration * self.rng.uniform(0.3, 0.7)
        for _ in range(self.args.concurrency):
            self._next()
        return self._done

    def _account(self):
        return self.args.first_account + self.rng.randrange(self.args.accounts)

    def _context(self):
        account = self._account()
        if self._deactivate_at is not None and self.reactor.seconds() >= self._deactivate_at:
            self._deactivate_at = None
            return Deactivation(self.bank, account, listener=self.stats)
        if self.rng.random() < 0.45:
            return Deposit(self.bank, account, self.rng.randint(10, 100), listener=self.stats)
        return Withdrawal(self.bank, account, self.rng.randint(10, 120), listener=self.stats)

    def _next(self):
        if self.reactor.seconds() >= self._deadline:
            if self.stats.in_flight == 0 and not self._done.called:
                self._done.callback(None)
            return
        context = self._context()
        self.stats.in_flight += 1
        d = self.client.execute(context)
        d.addCallback(self._finished, context)
        d.addErrback(self._crashed)

    def _finished(self, result, context):
        self.stats.in_flight -= 1
        self.stats.finished(context, result)
        if result.outcome is Outcome.COMMITTED:
            self.committed.append([result.partition_id, result.transaction_id, context.kind, context.account,
                                   context.amount or 0])
        self._next()

    def _crashed(self, failure):
        if not self._done.called:
            self._done.errback(failure)


def applied_count(client):
    """How many transactions ``client`` has applied, over every partition it follows."""
    return sum(client.client_high_water_mark(p) + 1 for p in client.partitions)


@defer.inlineCallbacks
def catch_up(client, channel, clock):
    """Wait until this instance has applied every partition up to its high-water mark, telling ``channel``
    how far it got every PROGRESS_INTERVAL (the runner's deadline counts from the last progress); fires with
    the marks."""
    reporter = task.LoopingCall(lambda: channel.send("catching_up", applied=applied_count(client)))
    reporter.clock = clock
    reporter.start(PROGRESS_INTERVAL)
    try:
        marks = yield client.high_water_marks()
        for partition_id, mark in sorted(marks.items()):
            if mark >= 0:
                yield client.when_applied(partition_id, mark)
    finally:
        reporter.stop()
    return marks


def _write_json(path, value):
    with open(path, "w", encoding="utf-8") as stream:
        json.dump(value, stream)


@defer.inlineCallbacks
def run_instance(reactor, args, channel):
    bank = Bank(lambda: open_database(args.db), reactor=reactor)
    yield bank.create_tables()
    client = WaltzClient(bank, args.config, reactor)
    stats = InstanceStats()
    progress = task.LoopingCall(lambda: channel.send("progress", **attr.asdict(stats)))
    try:
        yield client.when_started()
        # Rebuild the database from the log before making decisions on it.
        marks = yield catch_up(client, channel, reactor)
        tune_garbage_collector()
        channel.send("started", partitions=client.num_partitions, rebuilt=sum(m + 1 for m in marks.values()))
        yield channel.go                # every instance starts its workload at the same moment
        progress.start(PROGRESS_INTERVAL, now=False)
        workload = Workload(reactor, client, bank, args, stats)
        yield workload.run()
        progress.stop()
        channel.send("produced", **attr.asdict(stats))
        yield channel.drain
        began = time.monotonic()
        marks = yield catch_up(client, channel, reactor)
        report = {"name": args.name, "committed": workload.committed, "stats": attr.asdict(stats),
                  "accounts": [args.first_account, args.first_account + args.accounts - 1],
                  "high_water_marks": {str(p): m for p, m in marks.items()},
                  "catch_up_seconds": round(time.monotonic() - began, 3)}
        yield threads.deferToThread(_write_json, args.report, report)
        channel.send("finished", **attr.asdict(stats))
    finally:
        if progress.running:
            progress.stop()
        yield client.close()
        yield bank.close()


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m waltz.demo.instance", description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", required=True)
    parser.add_argument("--config", required=True, help="client config file")
    parser.add_argument("--db", required=True, help="this instance's SQLite database")
    parser.add_argument("--report", required=True, help="where to write the final report (JSON)")
    parser.add_argument("--first-account", type=int, default=1)
    parser.add_argument("--accounts", type=int, default=20)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)

    def body(reactor):
        channel = Channel()
        stdio.StandardIO(channel, reactor=reactor)
        d = run_instance(reactor, args, channel)

        def report_error(failure):
            channel.send("error", message="%s: %s" % (failure.type.__name__, failure.getErrorMessage()))
            return failure
        return d.addErrback(report_error)
    task.react(body)


if __name__ == "__main__":
    main()
