"""``waltz client``: tools that talk to the cluster as a Waltz client does.

``high-water-mark`` asks the servers for the high-water mark of every partition (or of those given).
"""

from twisted.internet import defer

from waltz.cli.cluster import add_connection_options, connection_config, quiet_kazoo, run_reactor
from waltz.cli.common import CliError, parse_partition_list
from waltz.client import WaltzClient, WaltzClientCallbacks


class _Nothing(WaltzClientCallbacks):
    """A client that applies nothing (it only asks questions)."""

    def get_client_high_water_mark(self, partition_id):
        return -1

    def apply_transaction(self, transaction):
        return None

    def uncaught_exception(self, partition_id, transaction_id, exception):
        return None


def high_water_mark(args):
    config = connection_config(args)
    quiet_kazoo()
    client_config = {"zookeeper.connectString": config["zookeeper.connectString"],
                     "cluster.root": config["cluster.root"], "client.autoMount": False}

    @defer.inlineCallbacks
    def ask(reactor):
        client = WaltzClient(_Nothing(), client_config, reactor)
        try:
            yield client.when_started().addTimeout(args.timeout, reactor)
            partitions = parse_partition_list(args.partitions, client.num_partitions) if args.partitions \
                else tuple(range(client.num_partitions))
            marks = yield defer.gatherResults([client.high_water_mark(p) for p in partitions],
                                              consumeErrors=True).addTimeout(args.timeout, reactor)
            return list(zip(partitions, marks))
        finally:
            yield client.close()

    try:
        marks = run_reactor(ask)
    except defer.TimeoutError:
        raise CliError("no answer from the cluster within %.0f s" % args.timeout) from None
    except defer.FirstError as exc:
        raise CliError("a server did not answer: %s" % exc.subFailure.getErrorMessage()) from None
    for partition, mark in marks:
        print("partition %d: high-water mark %d" % (partition, mark))
    return 0


def register(subparsers):
    """Add ``waltz client`` and its subcommands."""
    parser = subparsers.add_parser("client", help="ask the cluster as a Waltz client does",
                                   description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="client_command", metavar="SUBCOMMAND")
    commands.required = True
    sub = commands.add_parser("high-water-mark", help="high-water marks of partitions")
    add_connection_options(sub)
    sub.add_argument("--partitions", help="partition list such as 0-3,7 (default all)")
    sub.add_argument("--timeout", type=float, default=15.0, help="seconds to wait for answers (default 15)")
    sub.set_defaults(func=high_water_mark)
