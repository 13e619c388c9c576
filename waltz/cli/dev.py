"""``waltz dev``: a local cluster for development and the demo.

``up`` starts (idempotently) a ZooKeeper, creates the cluster, and starts three storage daemons (each in its own
group, holding every partition) and two servers, each with its own config, log and data under the run directory
(default ``./.waltz-dev``). ``down`` stops only the processes recorded there, by pid. ``status`` shows every process
with its pid and health, every partition with its server, generation and high-water mark, and every replica's max
transaction id.
"""

from twisted.internet import defer, threads

from waltz.cli.common import CliError, partition_count, port, znode_path
from waltz.cli.cluster import quiet_kazoo, run_reactor
from waltz.cli.storage import StorageNodeClient
from waltz.local.daemons import DaemonError
from waltz.local.devcluster import DEFAULT_ROOT, DEFAULT_RUN_DIR, DEFAULT_ZOOKEEPER_PORT, DevCluster, DevClusterError
from waltz.local.zookeeper import ZooKeeperLaunchError
from waltz.zk.bridge import ZooKeeperClient
from waltz.zk.metadata import ClusterMetadata

def _cluster(args):
    quiet_kazoo()
    return DevCluster(args.run_dir, args.zookeeper_port, args.root, num_partitions=args.partitions,
                      tls=getattr(args, "tls", False))


def up(args):
    cluster = _cluster(args)
    try:
        run_reactor(lambda reactor: cluster.up(reactor))
    except DevClusterError as exc:
        raise CliError(str(exc)) from None
    except (DaemonError, ZooKeeperLaunchError) as exc:
        raise CliError("the local cluster did not start: %s (run 'waltz dev down --run-dir %s' to clean up)"
                       % (str(exc).splitlines()[0], args.run_dir)) from None
    print("cluster is up: ZooKeeper %s, root %s%s" % (cluster.connect_string, cluster.root,
                                                      ", mutual TLS" if cluster.tls is not None else ""))
    print("commands: waltz ... -c %s; applications: client config %s"
          % (cluster.tools_config_path, cluster.client_config_path))
    return 0


def down(args):
    _cluster(args).down()
    return 0


def status(args):
    cluster = _cluster(args)
    print(format_processes(cluster))
    if not cluster.zookeeper.is_running():
        print("ZooKeeper is not running: no cluster to show")
        return 3
    try:
        cluster.load_tls()      # (before the reactor runs: a few small files)
    except DevClusterError as exc:
        raise CliError(str(exc)) from None
    print(run_reactor(lambda reactor: cluster_status(reactor, cluster)))
    return 0


def format_processes(cluster):
    lines = ["processes (run dir %s):" % cluster.run_dir,
             "  %-11s %-8s %s" % ("zookeeper", cluster.zookeeper.pid or "-",
                                  "running on %s" % cluster.connect_string if cluster.zookeeper.is_running()
                                  else "not running")]
    for name, daemon in cluster.daemons():
        lines.append("  %-11s %-8s %s" % (name, daemon.pid or "-", daemon_health(daemon)))
    return "\n".join(lines)


def daemon_health(daemon):
    if not daemon.is_running():
        return "not running"
    try:
        code, body = daemon.http_get("/health")
    except OSError as exc:
        return "running, /health unreachable (%s)" % exc
    return "%s (http %d)" % (" ".join(body.split()), daemon.http_port) if code in (200, 503) else \
        "running, /health answered %d" % code


@defer.inlineCallbacks
def cluster_status(reactor, cluster):
    """Partitions (server, generation, high-water mark) and replicas (max transaction id), as text."""
    zk = ZooKeeperClient(cluster.connect_string, reactor=reactor, connect_timeout_ms=5000)
    try:
        yield zk.connect()
        metadata = ClusterMetadata(zk, cluster.root, reactor)
        params = yield metadata.store_params()
        assignment = (yield metadata.partition_assignment()).value
        descriptors = dict((d.server_id, d) for _, d in (yield metadata.server_descriptors()))
        topology = (yield metadata.topology()).value
    finally:
        yield zk.close()
    high_water_marks = yield threads.deferToThread(_server_high_water_marks, cluster)
    owners = {info.partition_id: (server_id, info.generation)
              for server_id, infos in assignment.servers for info in infos}
    lines = ["partitions:"]
    for pid in range(params.num_partitions):
        server_id, generation = owners.get(pid, (None, None))
        where = descriptors[server_id].endpoint if server_id in descriptors else "unassigned"
        lines.append("  %d: server %s (id %s), generation %s, high-water mark %s"
                     % (pid, where, server_id if server_id is not None else "-",
                        generation if generation is not None else "-",
                        high_water_marks.get(where, {}).get(pid, "?")))
    lines.append("replicas (max transaction id):")
    for storage, admin_port in sorted(topology.connections.entries):
        client = StorageNodeClient(reactor, storage, admin_port, params, timeout=3, tls=cluster.tls)
        ids, silent = [], None
        for pid in topology.assignments.get(storage, ()):
            if silent is not None:
                ids.append("%d: ?" % pid)       # a node that did not answer is not asked again, per partition
                continue
            try:
                ids.append("%d: %d" % (pid, (yield client.max_transaction_id(pid))))
            except CliError as exc:
                ids.append("%d: ? (%s)" % (pid, exc.problem if hasattr(exc, "problem") else exc))
                if not getattr(exc, "answered", False):
                    silent = exc
        client.close()
        lines.append("  %s  %s" % (storage, ", ".join(ids) or "no partitions"))
    return "\n".join(lines)


def _server_high_water_marks(cluster):
    """``{endpoint: {partition: high-water mark}}`` as the run directory's running servers report in their
    metrics. Keyed by the endpoint they serve clients on, so that a partition takes the mark of the server
    the assignment gives it to: the run directory's servers may serve another cluster root than the one
    asked about (``--root``), whose partitions have the same numbers."""
    daemons = dict(cluster.daemons())
    return {"%s:%s" % (daemons[name].config.get("server.host"), daemons[name].config.get("server.port")): marks
            for name, marks in cluster.served_partitions().items()}


def register(subparsers):
    """Add ``waltz dev`` and its subcommands."""
    parser = subparsers.add_parser("dev", help="a local cluster for development and the demo",
                                   description=__doc__.split("\n\n")[1])
    commands = parser.add_subparsers(dest="dev_command", metavar="SUBCOMMAND")
    commands.required = True
    for func, name, text in ((up, "up", "start the local cluster (no-op for what runs)"),
                             (down, "down", "stop the processes the run directory records, by pid"),
                             (status, "status", "processes, partitions and replicas")):
        sub = commands.add_parser(name, help=text, description=text)
        sub.add_argument("--run-dir", default=DEFAULT_RUN_DIR, help="run directory (default %(default)s)")
        sub.add_argument("--zookeeper-port", type=port, default=None,
                         help="ZooKeeper client port on 127.0.0.1 (default: the run directory's last one, "
                              "else %d)" % DEFAULT_ZOOKEEPER_PORT)
        sub.add_argument("--root", default=DEFAULT_ROOT, type=znode_path,
                         help="cluster root znode (default %(default)s)")
        sub.add_argument("--partitions", type=partition_count, default=4,
                         help="partitions of a new cluster (default 4)")
        if func is up:
            sub.add_argument("--tls", action="store_true",
                             help="a new cluster speaks mutual TLS on every storage, admin and client port, with "
                                  "certificates of the run directory's own CA (a run directory made with TLS "
                                  "keeps it)")
        sub.set_defaults(func=func)
