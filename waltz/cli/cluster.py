"""``waltz cluster``: create, inspect and edit a Waltz cluster's metadata in ZooKeeper.

Every subcommand connects with --zookeeper HOST:PORT[,...] and --root /PATH,
or -c FILE holding zookeeper.connectString and cluster.root (flags override
the file). Storage edits (add-storage,
remove-storage, assign, unassign, auto-assign) hold the cluster's admin lock
and write the store znodes in one multi-op; refusals are one line on stderr
with a non-zero exit status.

The helpers :func:`add_connection_options`, :func:`connection_config`,
:func:`run_reactor`, :func:`within` and :func:`run_with_cluster` are shared with
other ``waltz`` subcommands that need the cluster metadata or the reactor.
"""

import argparse
import logging
import sys

from twisted.internet import defer, task
from twisted.logger import globalLogBeginner, textFileLogObserver
from twisted.python.failure import Failure

from waltz.cli.common import (CliError, connect_string, debugging, milliseconds, non_negative_int,
                              existing_partitions, partition_count, partition_list, port, positive_seconds,
                              znode_path)
from waltz.config import ZOOKEEPER_KEYS, ConfigError, build_config, flatten, read_yaml
from waltz.tls import CONNECTS, load_tls, tls_keys
from waltz.zk.bridge import ZooKeeperClient
from waltz.zk.metadata import ClusterMetadata
from waltz.zk.topology import format_ids
from waltz.zk.znodes import UNRESOLVED

#: Keys a ``-c`` file may hold besides the ZooKeeper ones, so a daemon's config file works too.
def _daemon_and_client_key_names():
    """The names of the keys a ``-c`` file may hold besides the ZooKeeper ones: it is often a daemon's or a
    client's config file (any other key, a misspelling such as ``cluster.rooot``, is refused)."""
    from waltz.client.config import CLIENT_KEYS
    from waltz.server.config import SERVER_KEYS
    from waltz.storage.config import STORAGE_KEYS
    return frozenset(key.name for key in SERVER_KEYS + STORAGE_KEYS + CLIENT_KEYS) - {
        key.name for key in ZOOKEEPER_KEYS}

_FLAG_KEYS = (
    ("zookeeper", "zookeeper.connectString"),
    ("root", "cluster.root"),
    ("connect_timeout", "zookeeper.connectTimeout"),
)


# --- connection plumbing (shared) ---------------------------------------------------------------


def add_connection_options(parser):
    """Add ``-c``, ``--zookeeper``, ``--root`` and ``--connect-timeout`` to ``parser``."""
    group = parser.add_argument_group("cluster connection")
    group.add_argument("-c", "--config", metavar="FILE",
                       help="YAML file with zookeeper.connectString and cluster.root")
    group.add_argument("--zookeeper", metavar="HOST:PORT[,...]", type=connect_string, help="ZooKeeper connect string")
    group.add_argument("--root", metavar="/PATH", type=znode_path, help="the cluster's root znode, e.g. /waltz_cluster")
    group.add_argument("--connect-timeout", metavar="MS", type=milliseconds,
                       help="give up connecting to ZooKeeper after MS milliseconds (default 10000)")


#: The prefix of the tools' TLS keys in a ``-c`` file (the original's CLI ``ssl.*``): the certificate the tools
#: present to storage nodes and servers, and the roots they verify them with (see :mod:`waltz.tls`).
TLS_PREFIX = "ssl."

#: The keys a ``-c`` file gives the tools themselves.
CLI_KEYS = ZOOKEEPER_KEYS + tls_keys(TLS_PREFIX)


def connection_config(args):
    """The validated :class:`~waltz.config.Config` (ZooKeeper keys, and ``ssl.*``) from ``-c`` and the flags.

    Sets ``args.tls``: the :class:`~waltz.tls.TLSConfig` of the ``ssl.*`` keys, or None (plain TCP)."""
    values = flatten(read_yaml(args.config)) if args.config else {}
    others = _daemon_and_client_key_names()
    known = others | {key.name for key in CLI_KEYS}
    for name in sorted(values):
        if name not in known:
            raise ConfigError("config key '%s' in %s is not a known key" % (name, args.config), name)
    values.update({key: getattr(args, flag) for flag, key in _FLAG_KEYS if getattr(args, flag) is not None})
    for flag, key in _FLAG_KEYS[:2]:
        if values.get(key) is None:
            raise CliError("no %s given: use --%s or -c FILE with %s" % (key, flag, key))
    # The daemons' and clients' own keys are checked by name only: they check their values themselves.
    config = build_config({k: v for k, v in values.items() if k not in others}, CLI_KEYS)
    args.tls = load_tls(config, TLS_PREFIX, CONNECTS)
    return config


#: How long an interrupted command's own clean-up (closing clients, stopping what it started) may take
#: before the reactor stops anyway.
INTERRUPT_CLEANUP_SECONDS = 30.0


def run_reactor(function, *args):
    """Run ``function(reactor, *args)`` (returning a Deferred) under ``task.react`` and return
    its result here, or raise its exception here (so :mod:`waltz.cli.main` reports it). Twisted's
    log is discarded meanwhile (written on stderr with ``WALTZ_DEBUG``).

    An interrupt (SIGINT, SIGTERM) cancels the Deferred and lets the command's clean-up (its
    ``finally`` blocks) run on the reactor, for up to :data:`INTERRUPT_CLEANUP_SECONDS`, before
    the reactor stops; then :class:`KeyboardInterrupt` is raised here."""
    _begin_twisted_log()
    outcome, interrupted = [], []

    def body(reactor):
        d = defer.maybeDeferred(function, reactor, *args)
        d.addBoth(outcome.append)

        def on_shutdown():
            if outcome:
                return None
            interrupted.append(True)
            return _cancelled_and_settled(d, reactor, INTERRUPT_CLEANUP_SECONDS)
        reactor.addSystemEventTrigger("before", "shutdown", on_shutdown)
        return d

    try:
        task.react(body)
    except SystemExit:
        pass
    if interrupted:
        # What the command's clean-up said of the interrupt (not the bare cancellation) goes with it.
        said = outcome and isinstance(outcome[0], Failure) and not outcome[0].check(defer.CancelledError)
        raise KeyboardInterrupt(*([str(outcome[0].value)] if said else []))
    if isinstance(outcome[0], Failure):
        outcome[0].raiseException()
    return outcome[0]


def _cancelled_and_settled(d, reactor, seconds):
    """Cancel ``d``; a Deferred that fires once ``d`` has (its clean-up done), or after ``seconds``."""
    settled = defer.Deferred()
    d.addBoth(lambda _: None if settled.called else settled.callback(None))
    d.cancel()
    return settled.addTimeout(seconds, reactor).addErrback(lambda _: None)


def _begin_twisted_log():
    # Until logging begins, Twisted prints critical events (a Waltz client failing to join the cluster,
    # an unhandled error in a Deferred) with their tracebacks on stderr; the command reports failures
    # itself, in one line. With WALTZ_DEBUG the log goes to stderr.
    observer = textFileLogObserver(sys.stderr) if debugging() else (lambda event: None)
    globalLogBeginner.beginLoggingTo([observer], redirectStandardIO=False)


def within(d, seconds, reactor, what, progress=None):
    """``d`` bounded by ``seconds``: when they pass first, ``d`` is cancelled and fails with the
    :class:`CliError` "<what> within <seconds> s", followed by "(<progress()>)" when ``progress`` is
    given, whatever the cancellation made of ``d`` (a cancelled ``gatherResults`` fails with
    ``FirstError``, not ``CancelledError``)."""
    def timed_out(result, timeout):
        details = " (%s)" % progress() if progress is not None else ""
        raise CliError("%s within %g s%s" % (what, timeout, details))
    return d.addTimeout(seconds, reactor, onTimeoutCancel=timed_out)


def quiet_kazoo():
    # Kazoo logs every failed connection attempt through the logging module's last-resort
    # handler (stderr); the command reports failures itself, in one line.
    logger = logging.getLogger("kazoo")
    logger.addHandler(logging.NullHandler())
    logger.propagate = False


def run_with_cluster(args, action):
    """Connect as ``args`` say, call ``action(metadata)`` (may return a Deferred) with a
    :class:`ClusterMetadata`, close, and return the action's result; ZooKeeper-layer and
    kazoo errors are raised here, for :mod:`waltz.cli.main` to report in one line."""
    config = connection_config(args)
    quiet_kazoo()

    @defer.inlineCallbacks
    def session(reactor):
        zk = ZooKeeperClient.from_config(config, reactor=reactor)
        try:
            yield zk.connect()      # (inside: an interrupt cancelling the connect still closes)
            result = yield action(ClusterMetadata(zk, config["cluster.root"], reactor=reactor))
        finally:
            yield zk.close()
        return result

    return run_reactor(session)


# --- subcommands -----------------------------------------------------------------------------------


@defer.inlineCallbacks
def _create(metadata, args):
    store = yield metadata.create_cluster(args.name, args.partitions)
    print("created cluster %r at %s with %d partitions (cluster key %s)"
          % (args.name, metadata.paths.root, store.num_partitions, store.key))


@defer.inlineCallbacks
def _show(metadata, args):
    description = yield metadata.describe()
    print("\n".join(format_description(description)))


@defer.inlineCallbacks
def _delete(metadata, args):
    yield metadata.delete_cluster(force=args.force)
    print("deleted cluster %s" % metadata.paths.root)


def _topology_edit(describe_change, edit):
    """A subcommand that applies ``edit(topology, store_params, args)`` under the admin lock."""
    @defer.inlineCallbacks
    def run(metadata, args):
        yield metadata.edit_topology(lambda topology, store: edit(topology, store, args),
                                     lock_timeout=args.lock_timeout)
        print(describe_change(args))
    return run


def _partitions(args, store):
    return existing_partitions(args.partitions, store.num_partitions)


_add_storage = _topology_edit(
    lambda a: "added storage node %s (admin port %d) to group %d" % (a.storage, a.admin_port, a.group),
    lambda t, s, a: t.add_storage(a.storage, a.admin_port, a.group))
_remove_storage = _topology_edit(
    lambda a: "removed storage node %s" % a.storage,
    lambda t, s, a: t.remove_storage(a.storage))
_assign = _topology_edit(
    lambda a: "assigned partitions %s to %s" % (format_ids(a.partitions), a.storage),
    lambda t, s, a: t.assign(a.storage, _partitions(a, s), s.num_partitions))
_unassign = _topology_edit(
    lambda a: "unassigned partitions %s from %s" % (format_ids(a.partitions), a.storage),
    lambda t, s, a: t.unassign(a.storage, _partitions(a, s)))
_auto_assign = _topology_edit(
    lambda a: "assigned every partition to group %d, round-robin" % a.group,
    lambda t, s, a: t.auto_assign(a.group, s.num_partitions))


# --- output -----------------------------------------------------------------------------------------


def _hwm(value):
    return "UNRESOLVED" if value == UNRESOLVED else str(value)


def format_description(d):
    """The lines ``waltz cluster show`` prints for a :class:`~waltz.zk.metadata.ClusterDescription`."""
    topology = d.topology
    lines = [
        "cluster %s" % d.root,
        "  name: %s" % d.params.name,
        "  partitions: %d" % d.params.num_partitions,
        "  cluster key: %s" % d.store.key,
        "storage nodes (%d):" % len(topology.storages()),
    ]
    for storage in topology.storages():
        lines.append("  %s  group %s  admin port %s  partitions %s" % (
            storage, topology.groups.get(storage, "?"), topology.connections.get(storage, "?"),
            format_ids(topology.partitions_of(storage))))
    lines.append("partitions without a replica: %s" % format_ids(topology.unreplicated(d.store.num_partitions)))
    lines.append("servers (%d live):" % len(d.servers))
    lines.extend("  %s  server %d at %s  preferred partitions %s"
                 % (name, s.server_id, s.endpoint, format_ids(s.preferred_partitions)) for name, s in d.servers)
    lines.append("server partition assignment (cversion %d):" % d.assignment.cversion)
    lines.extend("  server %d: %s" % (server_id, ", ".join(
        "%d (generation %d)" % (p.partition_id, p.generation) for p in partitions) or "-")
        for server_id, partitions in d.assignment.servers)
    lines.append("partition metadata:")
    for pid, meta in d.partitions:
        if meta is None:
            lines.append("  %d: (no znode yet)" % pid)
            continue
        lines.append("  %d: generation %d, store session %d" % (pid, meta.generation, meta.session_id))
        lines.extend("      replica %s  session %d  closing high-water mark %s"
                     % (s.replica_id.storage, s.session_id, _hwm(s.closing_high_water_mark))
                     for s in meta.replica_states)
    return lines


# --- parser ---------------------------------------------------------------------------------------------


def _verify(metadata, args):
    from waltz.cli.verify import verify  # it uses the server and storage tools, which import this module
    return verify(metadata, args)


def _options(*specs, edit=False):
    """Argument adders: each spec is ``(flags, kwargs)`` of a required option; ``edit`` adds
    ``--lock-timeout`` for the subcommands that take the admin lock."""
    def add(parser):
        for flags, kwargs in specs:
            parser.add_argument(*flags, required=True, **kwargs)
        if edit:
            parser.add_argument("--lock-timeout", type=positive_seconds, default=30.0, metavar="S",
                                help="give up after S seconds if another admin holds the lock "
                                     "(default %(default)s)")
    return add


def cluster_name(text):
    """An argparse type: a cluster name (not empty, not only spaces)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a name, got %r" % text)
    return text.strip()


_STORAGE = (("--storage", "-s"), dict(metavar="HOST:PORT", help="the storage node's connect string"))
_PARTITIONS = (("--partitions", "-p"), dict(type=partition_list, metavar="LIST", help="partition ids, e.g. 0-3,7"))
_GROUP = (("--group", "-g"), dict(type=non_negative_int, metavar="G", help="storage group id"))

SUBCOMMANDS = (
    ("create", "create the cluster's znodes", _create, _options(
        (("--name", "-n"), dict(type=cluster_name, help="the cluster's name")),
        (("--partitions", "-p"), dict(type=partition_count, metavar="P", help="number of partitions")))),
    ("show", "print the cluster's metadata", _show, _options()),
    ("delete", "delete the cluster's znodes (refused while servers are registered, and always for a root "
               "that is not a Waltz cluster)", _delete,
     lambda parser: parser.add_argument("--force", "-f", action="store_true",
                                        help="delete even while servers are registered")),
    ("add-storage", "add a storage node to a group", _add_storage, _options(
        _STORAGE, (("--admin-port", "-a"), dict(type=port, metavar="PORT",
                                                 help="the storage node's admin port")), _GROUP, edit=True)),
    ("remove-storage", "remove a storage node holding no partitions", _remove_storage, _options(_STORAGE, edit=True)),
    ("assign", "assign partitions to a storage node", _assign, _options(_STORAGE, _PARTITIONS, edit=True)),
    ("unassign", "unassign partitions from a storage node", _unassign, _options(_STORAGE, _PARTITIONS, edit=True)),
    ("auto-assign", "spread all partitions round-robin over a group's storage nodes", _auto_assign,
     _options(_GROUP, edit=True)),
    ("verify", "check the assignment against what servers and storage nodes report", _verify,
     lambda parser: parser.add_argument("--timeout", type=positive_seconds, default=5.0, metavar="S",
                                        help="seconds to wait for each server and storage node (default 5)")),
)


def register(subparsers):
    """Add ``waltz cluster`` and its subcommands."""
    parser = subparsers.add_parser("cluster", help="create, inspect and edit cluster metadata in ZooKeeper",
                                   description=__doc__.split("\n\n")[1])
    commands = parser.add_subparsers(dest="cluster_command", metavar="SUBCOMMAND")
    commands.required = True
    for name, text, action, add_arguments in SUBCOMMANDS:
        sub = commands.add_parser(name, help=text, description=text)
        add_arguments(sub)
        add_connection_options(sub)
        sub.set_defaults(func=lambda args, action=action: run_with_cluster(args, lambda m: action(m, args)) or 0)
