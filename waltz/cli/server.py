"""``waltz server list``: every live server with its partitions, generations and partition health.

The servers and the assignment come from ZooKeeper; each server is then asked over its client port (protocol
``L``, PARTITIONS_HEALTH) which of its partitions are healthy (their store session is writing).
"""

from twisted.internet import defer
from twisted.internet.protocol import Factory

from waltz.cli.cluster import add_connection_options, run_with_cluster
from waltz.cli.common import positive_seconds
from waltz.protocols import client_messages as m
from waltz.protocols.base import WaltzProtocol
from waltz.protocols.rpc import ConnectionClosed
from waltz.protocols.values import ReqId
from waltz.tls import client_endpoint


class _HealthQuery(WaltzProtocol):
    """Sends one PARTITIONS_HEALTH request after the handshake and fires ``answer`` with the response."""

    codec = m.CLIENT_CODEC
    hello_name = "Waltz CLI"
    receives = m.CLIENT_CODEC.replies

    def __init__(self):
        super().__init__()
        self.answer = defer.Deferred()

    def connectionReady(self):
        self.sendMessage(m.PartitionsHealthRequest(ReqId(-1, -1, -1, 0)))

    def messageReceived(self, message):
        if isinstance(message, m.PartitionsHealthResponse) and not self.answer.called:
            self.answer.callback(dict(message.partition_health))
            self.close("answered", expected=True)

    def connectionClosed(self, reason):
        if not self.answer.called:
            self.answer.errback(ConnectionClosed(self.describe_close(reason)))


def partition_health(reactor, host, port, timeout, tls=None):
    """Fires with ``{partition: healthy}`` as the server at ``host:port`` reports it (through TLS with ``tls``,
    a :class:`~waltz.tls.TLSConfig`)."""
    d = client_endpoint(reactor, host, port, timeout, tls).connect(Factory.forProtocol(_HealthQuery))
    d.addCallback(lambda proto: proto.answer)
    return d.addTimeout(timeout, reactor)


def list_servers(args):
    @defer.inlineCallbacks
    def gather(metadata):
        descriptors = yield metadata.server_descriptors()
        assignment = (yield metadata.partition_assignment()).value
        partitions = {server_id: infos for server_id, infos in assignment.servers}
        lines = ["%d live server(s)" % len(descriptors)]
        for _, descriptor in descriptors:
            try:
                health = yield partition_health(metadata.reactor, descriptor.host, descriptor.port, args.timeout,
                                                args.tls)
                reachable = "reachable"
            except defer.TimeoutError:     # its str() is a tuple: "(2.0, 'Deferred')"
                health, reachable = {}, "UNREACHABLE (did not answer within %g s)" % args.timeout
            except Exception as exc:
                health, reachable = {}, "UNREACHABLE (%s)" % (str(exc).splitlines() or ["?"])[0]
            lines.append("server %d at %s: %s%s" % (
                descriptor.server_id, descriptor.endpoint, reachable,
                ", preferred partitions %s" % list(descriptor.preferred_partitions)
                if descriptor.preferred_partitions else ""))
            for info in sorted(partitions.get(descriptor.server_id, ()), key=lambda i: i.partition_id):
                state = {True: "healthy", False: "UNHEALTHY"}.get(health.get(info.partition_id), "unknown")
                lines.append("  partition %d: generation %d, %s" % (info.partition_id, info.generation, state))
        return "\n".join(lines)

    print(run_with_cluster(args, gather))
    return 0


def register(subparsers):
    """Add ``waltz server`` and its subcommands."""
    parser = subparsers.add_parser("server", help="the live Waltz servers", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="server_command", metavar="SUBCOMMAND")
    commands.required = True
    sub = commands.add_parser("list", help="servers, their partitions, generations and health")
    add_connection_options(sub)
    sub.add_argument("--timeout", type=positive_seconds, default=5.0,
                     help="seconds to wait for each server (default 5)")
    sub.set_defaults(func=list_servers)
