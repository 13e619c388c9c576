"""``waltz storage``: inspect and administer storage nodes through their admin port.

Storage nodes are named by their connect string HOST:PORT (the storage port,
as in ZooKeeper); their admin ports come from <root>/store/connection and the
cluster key and partition count from <root>/store, so every subcommand takes
the same connection options as ``waltz cluster`` (--zookeeper/--root or -c
FILE). A node that does not answer within --timeout seconds, a node unknown to
ZooKeeper and a failure response from a node are one line on stderr with a
non-zero exit status.
"""

import attr
from twisted.internet import defer
from twisted.internet.error import ConnectError

from waltz.cli.cluster import add_connection_options, run_with_cluster
from waltz.cli.common import CliError, existing_partitions, partition_id, partition_list, positive_seconds
from waltz.protocols import admin_messages as am
from waltz.protocols import storage_messages as sm
from waltz.protocols.rpc import (AdminClientProtocol, ConnectionClosed, RemoteError, RequestClientFactory,
                                 StorageClientProtocol)
from waltz.tls import client_endpoint
from waltz.zk.topology import format_ids
from waltz.zk.znodes import ReplicaId

#: Seconds to wait for a storage node to accept a connection or answer a request.
DEFAULT_TIMEOUT = 10.0


def split_storage(storage):
    """``(host, port)`` of a ``HOST:PORT`` connect string; :class:`CliError` when malformed."""
    host, sep, port = str(storage).rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise CliError("bad storage node %r: expected HOST:PORT (its storage port)" % (storage,))
    return host.strip("[]"), int(port)


# --- talking to one storage node ------------------------------------------------------------------


class StorageNodeError(CliError):
    """A storage node did not answer, or answered with a failure: ``where`` names the port,
    ``problem`` says what happened, ``answered`` tells a failure response from silence."""

    def __init__(self, storage, where, problem, answered=False):
        super().__init__("storage node %s (%s) %s" % (storage, where, problem))
        self.storage = storage
        self.where = where
        self.problem = problem
        self.answered = answered


class StorageNodeClient:
    """Requests to one storage node's admin port (and its storage port when asked), each bounded
    by ``timeout`` seconds; every failure becomes a one-line :class:`StorageNodeError`."""

    def __init__(self, reactor, storage, admin_port, store, timeout=DEFAULT_TIMEOUT, tls=None):
        self.reactor = reactor
        self.tls = tls              # a waltz.tls.TLSConfig, or None (plain TCP)
        self.storage = storage
        self.host, self.port = split_storage(storage)
        self.admin_port = admin_port
        self.store = store
        self.timeout = timeout
        self._connections = {}

    def admin_request(self, message):
        """Fires with the admin port's response to ``message``."""
        open_request = am.OpenRequest(-1, self.store.key, self.store.num_partitions)
        return self._request("admin port", self.admin_port, AdminClientProtocol, open_request, message)

    def storage_request(self, message):
        """Fires with the storage port's response to ``message`` (as a Waltz server would ask)."""
        open_request = sm.OpenRequest.create(self.store.key, self.store.num_partitions)
        return self._request("storage port", self.port, StorageClientProtocol, open_request, message)

    @defer.inlineCallbacks
    def _request(self, what, port, protocol_class, open_request, message):
        try:
            proto = yield self._connection(port, protocol_class, open_request)
            response = yield self._bounded(proto.request(message))
        except Exception as exc:
            raise self._error(exc, what, port) from None
        return response

    @defer.inlineCallbacks
    def _connection(self, port, protocol_class, open_request):
        proto = self._connections.get(port)
        if proto is None:
            endpoint = client_endpoint(self.reactor, self.host, port, self.timeout, self.tls)
            proto = yield self._bounded(endpoint.connect(RequestClientFactory(protocol_class, open_request)))
            self._connections[port] = proto
            yield self._bounded(proto.opened)
        return proto

    def _bounded(self, d):
        return d.addTimeout(self.timeout, self.reactor)

    def _error(self, exc, what, port):
        """The :class:`StorageNodeError` for an exception of a request to ``port``."""
        where = "%s %s:%d" % (what, self.host, port)
        if isinstance(exc, RemoteError):
            return StorageNodeError(self.storage, where, "failed the request: %s" % exc.info.message, answered=True)
        if isinstance(exc, (defer.TimeoutError, defer.CancelledError)):
            return StorageNodeError(self.storage, where, "did not answer within %g s" % self.timeout)
        if isinstance(exc, (ConnectError, ConnectionClosed, OSError)):
            reason = str(exc).strip() or type(exc).__name__
            return StorageNodeError(self.storage, where, "is unreachable: %s" % reason)
        return StorageNodeError(self.storage, where, "failed: %s: %s" % (type(exc).__name__, exc))

    def close(self):
        """Close the connections this client opened."""
        connections, self._connections = self._connections, {}
        for proto in connections.values():
            proto.close("done", expected=True)

    # -- admin operations --

    @defer.inlineCallbacks
    def assigned_partitions(self):
        """Fires with ``((partition id, online), ...)`` of the partitions assigned on the node."""
        response = yield self.admin_request(am.AssignedPartitionStatusRequest(0))
        return tuple(sorted(response.partition_status))

    def assign(self, partition_ids, assign, delete_files=False):
        """Assign, or unassign (optionally deleting the files), partitions on the node."""
        return self.admin_request(am.PartitionAssignmentRequest(0, tuple(partition_ids), assign, delete_files))

    def set_available(self, partition_ids, available):
        """Mark partitions online (available) or offline on the node."""
        return self.admin_request(am.PartitionAvailableRequest(0, tuple(partition_ids), available))

    @defer.inlineCallbacks
    def max_transaction_id(self, partition_id, offline=False):
        """Fires with the max transaction id of a partition, asked on the storage port in the
        partition's last session (from the admin port's last session info) so that session fencing
        lets it through; as that session is never above the partition's current one, asking
        cannot make the node adopt a new session and fence out the Waltz server writing to it."""
        info = yield self.admin_request(am.LastSessionInfoRequest(0, partition_id))
        session_id = info.last_session_id
        response = yield self.storage_request(sm.MaxTransactionIdRequest(session_id, 0, partition_id, offline))
        return response.transaction_id


# --- the cluster as the subcommands see it --------------------------------------------------------


@attr.s(frozen=True, slots=True, auto_attribs=True)
class StoreView:
    """What the subcommands read from ZooKeeper: the root, the store params (cluster key, partition
    count) and the storage topology; it makes :class:`StorageNodeClient` objects for known nodes."""

    reactor: object
    root: str
    store: object
    topology: object
    timeout: float
    metadata: object       # the ClusterMetadata it was read from, for reads some subcommands make
    tls: object = None     # the waltz.tls.TLSConfig of the connections to storage nodes, or None

    @classmethod
    @defer.inlineCallbacks
    def read(cls, metadata, timeout, tls=None):
        """Fires with the view of the cluster ``metadata`` points at."""
        from twisted.internet import reactor
        store = yield metadata.store_params()
        topology = yield metadata.topology()
        return cls(reactor, metadata.paths.root, store, topology.value, timeout, metadata, tls)

    def storages(self):
        """Storage nodes listed in <root>/store/connection, sorted."""
        return tuple(sorted(self.topology.connections.keys()))

    def client(self, storage):
        """A :class:`StorageNodeClient` for ``storage``; :class:`CliError` when ZooKeeper does not know it."""
        split_storage(storage)
        admin_port = self.topology.connections.get(storage)
        if admin_port is None:
            raise CliError("storage node %s is not in %s/store/connection (known: %s); add it with "
                           "'waltz cluster add-storage'" % (storage, self.root, ", ".join(self.storages()) or "none"))
        return StorageNodeClient(self.reactor, storage, admin_port, self.store, self.timeout, self.tls)

    def existing(self, ids):
        """``ids`` (one partition id or a tuple of them), checked against the cluster's partition count."""
        return existing_partitions(ids, self.store.num_partitions)

    def assigned_in_zookeeper(self, storage):
        """The partitions <root>/store/assignment gives ``storage``, sorted."""
        return tuple(sorted(self.topology.partitions_of(storage)))

    @defer.inlineCallbacks
    def last_session_member_of(self, storage, ids):
        """Fires with those of ``ids`` whose metadata (<root>/store/partition/<id>) records ``storage``'s replica
        as an unresolved member of the last store session: recovery may still need its vote and data."""
        members = []
        for pid in ids:
            versioned = yield self.metadata.partition_metadata(pid)
            state = versioned.value.replica_state(ReplicaId(pid, storage)) if versioned is not None else None
            if state is not None and not state.is_resolved:
                members.append(pid)
        return members


@defer.inlineCallbacks
def using(client, action):
    """Fires with ``action(client)``'s result, closing the client's connections afterwards."""
    try:
        result = yield action(client)
    finally:
        client.close()
    return result


@defer.inlineCallbacks
def sync_node(client, expected, still_needed=None):
    """Make the node's assigned partitions ``expected``: assign what is missing, unassign (keeping the
    files) what is extra, except those ``still_needed(extra)`` fires with (partitions whose last store session
    still counts the node's replica: the next session's recovery asks it for its vote, which a node that no
    longer serves the partition cannot give); fires with a line saying what changed."""
    status = yield client.assigned_partitions()
    present = {pid for pid, _ in status}
    missing = sorted(set(expected) - present)
    extra = sorted(present - set(expected))
    kept = sorted((yield still_needed(extra))) if extra and still_needed is not None else []
    extra = [pid for pid in extra if pid not in kept]
    if missing:
        yield client.assign(missing, True)
    if extra:
        yield client.assign(extra, False)
    changes = ["assigned %s" % format_ids(missing)] if missing else []
    changes += ["unassigned %s (files kept)" % format_ids(extra)] if extra else []
    changes += ["kept %s: their last store session still counts this replica, and the next one needs its vote; "
                "run sync-partitions again once a server has opened a new session of each" % format_ids(kept)
                ] if kept else []
    return "%s: %s" % (client.storage, "; ".join(changes) or "in sync (partitions %s)" % format_ids(expected))


# --- subcommands -------------------------------------------------------------------------------------


def _status_text(partition_status):
    return ", ".join("%d %s" % (pid, "online" if online else "offline")
                     for pid, online in partition_status) or "none"


@defer.inlineCallbacks
def _describe_node(view, storage):
    """One line of ``list``: reachability, the partitions on the node, ZooKeeper's assignment."""
    expected = view.assigned_in_zookeeper(storage)
    head = "  %s (admin port %d):" % (storage, view.topology.connections.get(storage))
    try:
        status = yield using(view.client(storage), lambda client: client.assigned_partitions())
    except StorageNodeError as exc:
        return "%s %s: %s %s; ZooKeeper assigns %s" % (
            head, "ERROR" if exc.answered else "UNREACHABLE", exc.where, exc.problem, format_ids(expected))
    in_sync = "" if tuple(pid for pid, _ in status) == expected else " (out of sync: run sync-partitions)"
    return "%s reachable; assigned partitions: %s; ZooKeeper assigns %s%s" % (
        head, _status_text(status), format_ids(expected), in_sync)


@defer.inlineCallbacks
def _list(view, args):
    print("storage nodes of %s (cluster key %s, %d partitions):"
          % (view.root, view.store.key, view.store.num_partitions))
    if not view.storages():
        print("  none (add one with 'waltz cluster add-storage')")
    lines = yield defer.gatherResults([_describe_node(view, storage) for storage in view.storages()])
    for line in lines:
        print(line)


@defer.inlineCallbacks
def _add_partition(view, args):
    ids = view.existing(args.partitions)
    yield using(view.client(args.storage), lambda client: client.assign(ids, True))
    print("assigned partitions %s on storage node %s" % (format_ids(ids), args.storage))


@defer.inlineCallbacks
def _remove_partition(view, args):
    ids = view.existing(args.partitions)
    if args.delete_files and not args.force:
        yield _refuse_deleting_needed(view, args.storage, ids)
    yield using(view.client(args.storage), lambda client: client.assign(ids, False, args.delete_files))
    print("unassigned partitions %s on storage node %s%s" % (
        format_ids(ids), args.storage, " and deleted their files" if args.delete_files else ""))


@defer.inlineCallbacks
def _refuse_deleting_needed(view, storage, ids):
    """:class:`CliError` when deleting the files of one of ``ids`` on ``storage`` would destroy a replica the
    cluster counts on: ZooKeeper's store assignment still gives it to the node, or the partition's last store
    session still counts the node's replica among its members (recovery may need its vote and data, until a
    server has recovered the partition without it)."""
    assigned = sorted(set(ids) & set(view.assigned_in_zookeeper(storage)))
    if assigned:
        raise CliError("refusing to delete the files of partitions %s on storage node %s: %s/store/assignment "
                       "still assigns them to it; run 'waltz cluster unassign' first (or use --force)"
                       % (format_ids(assigned), storage, view.root))
    members = yield view.last_session_member_of(storage, ids)
    if members:
        raise CliError("refusing to delete the files of partitions %s on storage node %s: their last store session "
                       "(%s/store/partition/<id>) still counts its replica as a member, and recovery may need its "
                       "vote and data; wait until a server has opened a new session of each without it "
                       "(or use --force)" % (format_ids(members), storage, view.root))


@defer.inlineCallbacks
def _availability(view, args):
    ids = view.existing(args.partitions)
    yield using(view.client(args.storage), lambda client: client.set_available(ids, args.online))
    print("partitions %s on storage node %s are now %s" % (
        format_ids(ids), args.storage, "online" if args.online else "offline"))


@defer.inlineCallbacks
def _max_transaction_id(view, args):
    pid = view.existing(args.partition)
    txn_id = yield using(view.client(args.storage), lambda client: client.max_transaction_id(pid, args.offline))
    print(txn_id)


@defer.inlineCallbacks
def _sync_partitions(view, args):
    clients = [view.client(storage) for storage in ([args.storage] if args.storage else view.storages())]
    failed = []
    for client in clients:  # one at a time, so the output follows the order of the nodes
        try:
            line = yield using(client, lambda c: sync_node(
                c, view.assigned_in_zookeeper(c.storage), lambda ids: view.last_session_member_of(c.storage, ids)))
        except StorageNodeError as exc:
            line = "%s: NOT SYNCED: %s %s" % (client.storage, exc.where, exc.problem)
            failed.append(client.storage)
        print(line)
    if failed:
        raise CliError("could not sync %d of %d storage nodes: %s"
                       % (len(failed), len(clients), ", ".join(failed)))


# --- parser ---------------------------------------------------------------------------------------------


def _storage_option(parser, required=True):
    parser.add_argument("--storage", "-s", metavar="HOST:PORT", required=required,
                        help="the storage node's connect string (its storage port, as in ZooKeeper)")


def _partitions_options(parser):
    _storage_option(parser)
    parser.add_argument("--partitions", "-p", type=partition_list, metavar="LIST", required=True,
                        help="partition ids, e.g. 0-3,7")


def _remove_partition_options(parser):
    _partitions_options(parser)
    parser.add_argument("--delete-files", "-d", action="store_true",
                        help="also delete the partitions' files and reset their control-file records "
                             "(refused while ZooKeeper's store assignment gives the node one of them, or a "
                             "partition's last store session still counts the node's replica as a member)")
    parser.add_argument("--force", "-f", action="store_true",
                        help="with --delete-files: delete even partitions ZooKeeper still assigns to the node "
                             "or counts on")


def _availability_options(parser):
    _partitions_options(parser)
    state = parser.add_mutually_exclusive_group(required=True)
    state.add_argument("--online", dest="online", action="store_true", help="mark the partitions available")
    state.add_argument("--offline", "-o", dest="online", action="store_false",
                       help="mark the partitions unavailable (they then serve only offline recovery requests)")


def _max_transaction_id_options(parser):
    _storage_option(parser)
    parser.add_argument("--partition", "-p", type=partition_id, metavar="P", required=True, help="the partition id")
    parser.add_argument("--offline", "-o", action="store_true",
                        help="ask with an offline recovery request (for a partition marked offline)")


SUBCOMMANDS = (
    ("list", "list the storage nodes with their assigned partitions and status", _list, lambda parser: None),
    ("add-partition", "assign partitions on a storage node", _add_partition, _partitions_options),
    ("remove-partition", "unassign partitions on a storage node", _remove_partition, _remove_partition_options),
    ("availability", "mark partitions on a storage node online or offline", _availability,
     _availability_options),
    ("max-transaction-id", "print a partition's max transaction id on a storage node", _max_transaction_id,
     _max_transaction_id_options),
    ("sync-partitions", "make storage nodes' assigned partitions match ZooKeeper's store/assignment",
     _sync_partitions, lambda parser: _storage_option(parser, required=False)),
)


def _run(args, action):
    """Read the store znodes, then run ``action(view, args)`` under the reactor."""
    return run_with_cluster(
        args, lambda metadata: StoreView.read(metadata, args.timeout, args.tls).addCallback(action, args)) or 0


def register(subparsers):
    """Add ``waltz storage`` and its subcommands."""
    parser = subparsers.add_parser("storage", help="administer storage nodes through their admin port",
                                   description=__doc__.split("\n\n")[1])
    commands = parser.add_subparsers(dest="storage_command", metavar="SUBCOMMAND")
    commands.required = True
    for name, text, action, add_arguments in SUBCOMMANDS:
        sub = commands.add_parser(name, help=text, description=text)
        add_arguments(sub)
        sub.add_argument("--timeout", type=positive_seconds, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                         help="give up on a storage node after SECONDS (default %g)" % DEFAULT_TIMEOUT)
        add_connection_options(sub)
        sub.set_defaults(func=lambda args, action=action: _run(args, action))
