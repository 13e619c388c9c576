"""A Waltz cluster of local processes: ZooKeeper, storage daemons (and later servers) on 127.0.0.1.

:class:`LocalCluster` creates the cluster in ZooKeeper, starts each storage
daemon with ``twistd`` in its own run directory, registers it
(``add-storage`` with its admin port, one group per storage), assigns every
partition to every storage, and pushes that assignment to the storage nodes
through their admin ports. Everything it starts it stops by pid.
"""

import os

from twisted.internet import defer, threads

from waltz.local.daemons import local_storage
from waltz.local.zookeeper import LocalZooKeeper
from waltz.protocols import admin_messages as am
from waltz.protocols.rpc import connect_storage_client
from waltz.zk.bridge import ZooKeeperClient
from waltz.zk.metadata import ClusterMetadata


@defer.inlineCallbacks
def admin_connection(reactor, host, admin_port, params, tls=None):
    """An opened admin-port connection to a storage node (through TLS with ``tls``)."""
    proto = yield connect_storage_client(reactor, host, admin_port, params.key, params.num_partitions, admin=True,
                                         tls=tls)
    yield proto.opened
    return proto


@defer.inlineCallbacks
def push_assignment(reactor, storage, admin_port, partitions, params, tls=None):
    """Assign ``partitions`` on the storage node ``storage`` (``host:port``) through its admin port."""
    proto = yield admin_connection(reactor, storage.rpartition(":")[0], admin_port, params, tls)
    try:
        yield proto.request(am.PartitionAssignmentRequest(0, tuple(partitions), True, False))
    finally:
        proto.close("assignment pushed", expected=True)


def _first_failure(failure):
    """The failure inside gatherResults' FirstError (a daemon that did not start says why)."""
    return failure.value.subFailure if failure.check(defer.FirstError) else failure


class LocalCluster:
    """ZooKeeper plus ``num_storages`` storage daemons, each holding every partition."""

    def __init__(self, run_dir, num_partitions=1, num_storages=3, root="/waltz_cluster", zookeeper=None,
                 storage_overrides=None, pki=None):
        self.run_dir = os.path.abspath(run_dir)
        self.num_partitions = num_partitions
        self.num_storages = num_storages
        self.root = root
        self.zookeeper = zookeeper
        self._own_zookeeper = zookeeper is None
        self.storage_overrides = dict(storage_overrides or {})
        #: With a :class:`~waltz.local.pki.LocalPKI`, every storage port and admin port speaks mutual TLS (each
        #: storage with a certificate of its own), and so do this cluster's admin connections.
        self.pki = pki
        self.tls = pki.tls("local-admin") if pki is not None else None
        self.storages = []
        self.params = None
        self.zk_client = None
        self.metadata = None

    @property
    def connect_string(self):
        return self.zookeeper.connect_string

    @staticmethod
    def storage_name(daemon):
        return "127.0.0.1:%d" % daemon.config["storage.port"]

    @defer.inlineCallbacks
    def start(self, reactor):
        """Start everything; fires when every storage serves its partitions."""
        if self.zookeeper is None:
            self.zookeeper = LocalZooKeeper(os.path.join(self.run_dir, "zookeeper"))
        if not self.zookeeper.is_running():
            yield threads.deferToThread(self.zookeeper.start)
        self.zk_client = ZooKeeperClient(self.connect_string, reactor=reactor)
        yield self.zk_client.connect()
        self.metadata = ClusterMetadata(self.zk_client, self.root, reactor)
        self.params = yield self.metadata.create_cluster("local", self.num_partitions)
        yield self.add_storages(reactor, range(self.num_storages))
        return self

    def add_storage(self, reactor, group):
        """Start one more storage daemon, register it in ``group`` and give it every partition."""
        return self.add_storages(reactor, [group]).addCallback(lambda daemons: daemons[0])

    @defer.inlineCallbacks
    def add_storages(self, reactor, groups):
        """Start one more storage daemon per group of ``groups``, all at once (a daemon's start-up is mostly
        its imports and the wait for ``/ping``), then register each in its group and give it every
        partition; fires with the daemons."""
        daemons = []
        for _ in groups:
            run_dir = os.path.join(self.run_dir, "storage%d" % len(self.storages))
            overrides = dict(self.storage_overrides)
            if self.pki is not None:
                overrides.update(self.pki.keys("storage.ssl.", "storage%d" % len(self.storages)))
            daemons.append(local_storage(run_dir, self.connect_string, self.root, **overrides))
            self.storages.append(daemons[-1])
        yield defer.gatherResults([threads.deferToThread(daemon.start) for daemon in daemons],
                                  consumeErrors=True).addErrback(_first_failure)
        for daemon, group in zip(daemons, groups):
            name = self.storage_name(daemon)
            admin_port = daemon.config["storage.admin.port"]
            partitions = list(range(self.num_partitions))
            yield self.metadata.edit_topology(
                lambda t, p, name=name, admin_port=admin_port, group=group:
                t.add_storage(name, admin_port, group).assign(name, partitions, p.num_partitions))
            yield push_assignment(reactor, name, admin_port, partitions, self.params, self.tls)
        return daemons

    @defer.inlineCallbacks
    def stop(self):
        """Stop every process this cluster started (by pid) and its ZooKeeper session."""
        if self.zk_client is not None:
            yield self.zk_client.close()
            self.zk_client = None
        for daemon in reversed(self.storages):
            yield threads.deferToThread(daemon.stop)
        if self._own_zookeeper and self.zookeeper is not None:
            yield threads.deferToThread(self.zookeeper.stop)
