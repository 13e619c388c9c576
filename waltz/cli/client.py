"""``waltz client``: tools that talk to the cluster as a Waltz client does.

``high-water-mark`` asks the servers for the high-water mark of every partition (or of those given).
``validate`` runs producers that write their high-water mark + 1 under a write lock on their partition,
and consumers that check every transaction's data equals its id and that ids are consecutive.

The helpers :func:`client_config`, :func:`joined`, :func:`all_of` and :func:`ask_high_water_marks` are
shared with ``waltz perf``.
"""

import time

from twisted.internet import defer, task

from waltz.cli.cluster import (TLS_PREFIX, add_connection_options, connection_config, quiet_kazoo, run_reactor,
                               within)
from waltz.cli.common import CliError, existing_partitions, partition_list, positive_int, positive_seconds
from waltz.client import TransactionContext, WaltzClient, WaltzClientCallbacks
from waltz.client.config import TLS_PREFIX as CLIENT_TLS_PREFIX
from waltz.config import expiration_ms
from waltz.tls import SUFFIXES as TLS_SUFFIXES
from waltz.tls import VERIFY_HOSTNAME

#: The keys of the ``-c`` file and flags (:func:`~waltz.cli.cluster.connection_config`) a Waltz client takes.
_CLIENT_ZOOKEEPER_KEYS = ("zookeeper.connectString", "zookeeper.connectTimeout", "zookeeper.sessionTimeout",
                          "cluster.root")


class _Nothing(WaltzClientCallbacks):
    """A client that applies nothing (it only asks questions)."""

    def get_client_high_water_mark(self, partition_id):
        return -1

    def apply_transaction(self, transaction):
        return None

    def uncaught_exception(self, partition_id, transaction_id, exception):
        return None


def client_config(config, **extra):
    """A Waltz client's config for the cluster of ``config`` (a :func:`~waltz.cli.cluster.connection_config`):
    its ZooKeeper connect string and timeouts and the cluster root, its ``ssl.*`` keys as the client's
    ``client.ssl.*``, plus the ``extra`` client keys."""
    values = {key: config[key] for key in _CLIENT_ZOOKEEPER_KEYS}
    values.update({CLIENT_TLS_PREFIX + suffix: config[TLS_PREFIX + suffix]
                   for suffix in TLS_SUFFIXES + (VERIFY_HOSTNAME,) if config.get(TLS_PREFIX + suffix) is not None})
    values.update(extra)
    return values


def joined(client, timeout, reactor):
    """Fires with ``client`` once it joined the cluster; a :class:`CliError` after ``timeout`` seconds."""
    return within(client.when_started(), timeout, reactor, "the Waltz client did not join the cluster")


def _first_failure(reason):
    reason.trap(defer.FirstError)
    return reason.value.subFailure


def all_of(deferreds):
    """Fires with the list of the results of ``deferreds``, or fails with the first one's failure (not
    ``FirstError``)."""
    return defer.gatherResults(deferreds, consumeErrors=True).addErrback(_first_failure)


@defer.inlineCallbacks
def ask_high_water_marks(reactor, config, timeout, partitions=None):
    """Fires with ``(number of partitions, {partition: high-water mark})`` as a temporary client that mounts
    nothing sees them, of the partition ids ``partitions`` (default all). Every wait is bounded by
    ``timeout`` seconds; a partition whose server does not answer in time is named in the error."""
    client = WaltzClient(_Nothing(), client_config(config, **{"client.autoMount": False}), reactor)
    try:
        yield joined(client, timeout, reactor)
        ids = existing_partitions(partitions, client.num_partitions) if partitions is not None else None
        marks = yield client.high_water_marks(ids, timeout=timeout)
    finally:
        yield client.close()
    return client.num_partitions, marks


def high_water_mark(args):
    config = connection_config(args)
    quiet_kazoo()
    _, marks = run_reactor(ask_high_water_marks, config, args.timeout, args.partitions)
    for partition, mark in sorted(marks.items()):
        print("partition %d: high-water mark %d" % (partition, mark))
    return 0


class _Validator(WaltzClientCallbacks):
    """Applies transactions checking that data == transaction id and ids are consecutive."""

    def __init__(self, name, num_partitions, problems):
        self.name = name
        self.high_water_marks = {p: -1 for p in range(num_partitions)}
        self.problems = problems

    def get_client_high_water_mark(self, partition_id):
        return self.high_water_marks[partition_id]

    def apply_transaction(self, transaction):
        expected = self.high_water_marks[transaction.partition_id] + 1
        if transaction.transaction_id != expected:
            self.problems.append("%s: partition %d: transaction %d after %d" % (
                self.name, transaction.partition_id, transaction.transaction_id, expected - 1))
        return transaction.get_data().addCallback(self._check, transaction)

    def _check(self, data, transaction):
        if data != b"%d" % transaction.transaction_id:
            self.problems.append("%s: partition %d: transaction %d holds %r" % (
                self.name, transaction.partition_id, transaction.transaction_id, data))
        self.high_water_marks[transaction.partition_id] = transaction.transaction_id


class _NextId(TransactionContext):
    """Writes the client's high-water mark + 1 under a write lock on the partition: only correct if current."""

    def __init__(self, partition):
        super().__init__()
        self.partition = partition

    def partition_id(self, num_partitions):
        return self.partition

    def execute(self, builder):
        builder.set_transaction_data(b"%d" % (builder.client_high_water_mark + 1))
        builder.set_write_locks([("validate", self.partition)])
        return True


def validate(args):
    config = connection_config(args)
    quiet_kazoo()
    problems = []

    @defer.inlineCallbacks
    def run(reactor):
        num_partitions, start = yield ask_high_water_marks(reactor, config, args.timeout)
        validators = [_Validator("client %d" % i, num_partitions, problems) for i in range(args.clients)]
        for validator in validators:
            validator.high_water_marks.update(start)
        settings = client_config(config, **{"client.transactionExpiration": expiration_ms(args.timeout)})
        clients = [WaltzClient(v, settings, reactor) for v in validators]
        began = time.monotonic()
        try:
            yield all_of([joined(c, args.timeout, reactor) for c in clients])
            executions = [clients[n % len(clients)].execute(_NextId(n % num_partitions))
                          for n in range(args.transactions)]
            results = yield within(all_of(executions), args.timeout, reactor,
                                   "the %d transactions did not all finish" % args.transactions)
            committed = sum(1 for r in results if r.committed)
            if committed != args.transactions:
                problems.append("%d of %d transactions did not commit" % (args.transactions - committed,
                                                                         args.transactions))
            marks = yield clients[0].high_water_marks(timeout=args.timeout)
            deadline = time.monotonic() + args.timeout
            while any(v.high_water_marks[p] < marks[p] for v in validators for p in marks):
                if time.monotonic() > deadline:
                    raise CliError("the consumers did not catch up within %.0f s" % args.timeout)
                yield task.deferLater(reactor, 0.05, lambda: None)
            return committed, time.monotonic() - began
        finally:
            for client in clients:
                yield client.close()

    committed, seconds = run_reactor(run)
    print("validated %d transactions with %d clients in %.1f s (%.0f/s)" % (
        committed, args.clients, seconds, committed / seconds if seconds else 0))
    for problem in problems:
        print("PROBLEM: " + problem)
    print("%d problem(s)" % len(problems) if problems else "every transaction's data equals its id; ids consecutive")
    return 1 if problems else 0


def register(subparsers):
    """Add ``waltz client`` and its subcommands."""
    parser = subparsers.add_parser("client", help="ask the cluster as a Waltz client does",
                                   description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="client_command", metavar="SUBCOMMAND")
    commands.required = True
    sub = commands.add_parser("high-water-mark", help="high-water marks of partitions")
    add_connection_options(sub)
    sub.add_argument("--partitions", type=partition_list, metavar="LIST",
                     help="partition list such as 0-3,7 (default all)")
    sub.add_argument("--timeout", type=positive_seconds, default=15.0,
                     help="seconds to wait for each answer (default 15)")
    sub.set_defaults(func=high_water_mark)
    sub = commands.add_parser("validate", help="producers write hwm+1 under a lock; consumers check data == id")
    add_connection_options(sub)
    sub.add_argument("--transactions", type=positive_int, default=1000, help="transactions to write (default 1000)")
    sub.add_argument("--clients", type=positive_int, default=2, help="producing and consuming clients (default 2)")
    sub.add_argument("--timeout", type=positive_seconds, default=120.0,
                     help="give up on any step after this many seconds (default 120)")
    sub.set_defaults(func=validate)
