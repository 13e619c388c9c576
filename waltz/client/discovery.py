"""Where each partition is served: the cluster as the client sees it in ZooKeeper.

:class:`ZooKeeperDiscovery` connects to ZooKeeper, reads the cluster's partition
count, allocates the client id, and watches ``<root>/serverDescriptors``: its data
is the partition assignment (server id → partitions with their generations), its
children the live servers' descriptors (server id → host:port). Together they give
:func:`partition_locations`, the partition → (endpoint, generation) map, which it
hands to its subscribers every time it changes. A partition assigned to a server
that has no descriptor (it died; the coordinator has not reassigned yet) has no
location until the next assignment.

The watches are kazoo recipes, which read the znodes again after a reconnect
(kazoo does not re-register watches on a new connection). On top of them the
discovery reads both again itself after every reconnect, and whenever the
client asks (:meth:`ZooKeeperDiscovery.refresh`: a server said it does not
serve a partition the map puts there); a read never replaces a newer assignment.

The client depends on the small interface :class:`IClusterDiscovery` only, so unit
tests give it a fake.
"""

import attr
from twisted.internet import defer
from twisted.logger import Logger
from zope.interface import Interface, implementer

from waltz.client.network import Endpoint
from waltz.zk.bridge import SessionState, ZooKeeperClient
from waltz.zk.errors import ZnodeDecodeError
from waltz.zk.metadata import ClusterMetadata
from waltz.zk.znodes import PartitionAssignment

log = Logger()


@attr.s(frozen=True, slots=True, auto_attribs=True)
class PartitionLocation:
    """The server holding a partition and the partition's generation there."""

    endpoint: Endpoint
    generation: int


@attr.s(frozen=True, slots=True, auto_attribs=True)
class ClusterInfo:
    """What the client learns once at start-up."""

    client_id: int
    num_partitions: int
    cluster_name: str = ""


def partition_locations(assignment, descriptors) -> dict:
    """``{partition id: PartitionLocation}`` from a :class:`PartitionAssignment` and the live
    servers' ``(znode name, ServerDescriptor)`` pairs; partitions of unknown servers are left out."""
    endpoints = {descriptor.server_id: Endpoint(descriptor.host, descriptor.port)
                 for _, descriptor in descriptors}
    locations = {}
    for server_id, infos in assignment.servers:
        endpoint = endpoints.get(server_id)
        if endpoint is None:
            continue
        for info in infos:
            known = locations.get(info.partition_id)
            if known is None or info.generation > known.generation:
                locations[info.partition_id] = PartitionLocation(endpoint, info.generation)
    return locations


class IClusterDiscovery(Interface):
    """What the client needs to know about the cluster."""

    def start():
        """Fires with the :class:`ClusterInfo` (a newly allocated client id) once the first
        partition locations are known."""

    def subscribe(listener):
        """Call ``listener({partition id: PartitionLocation})`` now (if known) and on every change."""

    def allocate_client_id():
        """Fires with another client id (for readers that must not disturb the client's mounts)."""

    def close():
        """Stop watching; fires when done."""

    # Optional: ``refresh()`` reads the partition map again now (fires when done); the client calls
    # it, when present, after a server said it does not serve a partition the map puts there.


@implementer(IClusterDiscovery)
class ZooKeeperDiscovery:
    """:class:`IClusterDiscovery` over ZooKeeper (``zk``: a connected
    :class:`~waltz.zk.bridge.ZooKeeperClient` to share, or None to open one from ``config``)."""

    def __init__(self, config, reactor, zk=None):
        self._config = config
        self._reactor = reactor
        self._zk = zk
        self._own_zk = zk is None
        self._metadata = None
        self._listeners = []
        self._handles = []
        self._assignment = PartitionAssignment()
        #: The zxid of the change that wrote _assignment (None: not read yet). Not the data version: that
        #: starts again at 0 when the znode is deleted and created again.
        self._assignment_mzxid = None
        self._descriptors = ()
        self._servers_read = 0
        self._listening = False
        self.refreshes = 0
        self.locations = None
        self.closed = False

    @defer.inlineCallbacks
    def start(self):
        if self._zk is None:
            self._zk = ZooKeeperClient.from_config(self._config, reactor=self._reactor)
            yield self._zk.connect()
        self._metadata = ClusterMetadata(self._zk, self._config["cluster.root"], self._reactor)
        params = yield self._metadata.cluster_params()
        client_id = yield self._metadata.allocate_client_id()
        path = self._metadata.paths.server_descriptors
        self._zk.add_state_listener(self._session_changed)
        self._listening = True
        self._handles.append((yield self._zk.watch_data(path, self._assignment_changed)))
        self._handles.append((yield self._zk.watch_children(path, self._servers_changed)))
        yield self._read_servers()
        log.info("Waltz client {client_id} joined cluster {name} ({n} partitions)",
                 client_id=client_id, name=params.name, n=params.num_partitions)
        return ClusterInfo(client_id, params.num_partitions, params.name)

    def subscribe(self, listener):
        self._listeners.append(listener)
        if self.locations is not None:
            listener(dict(self.locations))

    def allocate_client_id(self):
        return self._metadata.allocate_client_id()

    def _assignment_changed(self, data, stat):
        if data is None:
            self._assignment, self._assignment_mzxid = PartitionAssignment(), None
            self._publish()
            return
        self._take_assignment(data, stat.mzxid)

    def _take_assignment(self, data, mzxid):
        if self._assignment_mzxid is not None and mzxid < self._assignment_mzxid:
            return  # an older read arriving late
        try:
            assignment = PartitionAssignment.decode(data, self._metadata.paths.server_descriptors)
        except ZnodeDecodeError:
            log.failure("ignoring an undecodable partition assignment")
            return
        self._assignment, self._assignment_mzxid = assignment, mzxid
        self._publish()

    def _session_changed(self, state):
        if state == SessionState.CONNECTED and not self.closed:
            # Changes made while disconnected reach the watches only if kazoo's recipes notice them.
            self.refresh().addErrback(
                lambda f: log.warn("reading the partition map after a reconnect failed: {error}",
                                   error=f.getErrorMessage()) if not self.closed else None)

    def refresh(self):
        """Read the assignment and the live servers again now; fires once both are read (and published
        if the map changed)."""
        if self.closed or self._metadata is None:
            return defer.succeed(None)
        self.refreshes += 1
        path = self._metadata.paths.server_descriptors
        reading = self._zk.get(path).addCallback(lambda result: self._take_assignment(result[0], result[1].mzxid))
        return defer.gatherResults([reading, self._read_servers()], consumeErrors=True).addCallbacks(
            lambda _: None, lambda f: f.value.subFailure)

    def _servers_changed(self, children):
        self._read_servers().addErrback(
            lambda f: log.failure("cannot read the server descriptors", f) if not self.closed else None)

    def _read_servers(self):
        self._servers_read += 1
        token = self._servers_read

        def read(descriptors):
            if token == self._servers_read:  # a later read supersedes this one
                self._descriptors = descriptors
                self._publish()
        return self._metadata.server_descriptors().addCallback(read)

    def _publish(self):
        if self.closed:
            return
        locations = partition_locations(self._assignment, self._descriptors)
        if locations == self.locations:
            return
        self.locations = locations
        for listener in list(self._listeners):
            try:
                listener(dict(locations))
            except Exception:
                log.failure("partition location listener {listener!r} failed", listener=listener)

    @defer.inlineCallbacks
    def close(self):
        if self.closed:
            return
        self.closed = True
        if self._listening:
            self._listening = False
            self._zk.remove_state_listener(self._session_changed)
        for handle in self._handles:
            handle.cancel()
        if self._own_zk and self._zk is not None:
            yield self._zk.close()
