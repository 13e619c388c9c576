"""``twistd waltz-storage``: options and the service that runs a storage node.

Start-up order (in ``startService``, after twistd has forked): connect to
ZooKeeper and read the cluster key and partition count from ``<root>/store``;
open (or format) the storage directory and recover every assigned partition
on worker threads; only then listen on the storage, admin and HTTP ports. A
failure at any step is logged and ends the process with status 1. A bad
config file is reported by ``Options`` naming the key, before anything starts.
"""

from twisted.application import internet
from twisted.internet import defer
from twisted.internet.error import CannotListenError
from twisted.python import usage

from waltz.config import ConfigError, liveness_of
from waltz.daemon import AsyncStartService, load_config_or_exit
from waltz.http import health_site
from waltz.storage.config import TLS_PREFIX, load_storage_config
from waltz.storage.errors import StorageError
from waltz.storage.handlers import AdminServerProtocol, NodeFactory, StorageServerProtocol
from waltz.storage.node import StorageNode
from waltz.tls import SERVES, load_tls, server_factory
from waltz.zk.bridge import ZooKeeperClient
from waltz.zk.errors import ZooKeeperLayerError
from waltz.zk.metadata import ClusterMetadata


class Options(usage.Options):
    """``twistd waltz-storage --config FILE``."""

    synopsis = "--config FILE"
    longdesc = "Run a Waltz Storage node (see docs/operations.md)."
    optParameters = [["config", "c", None, "storage configuration file (YAML)"]]

    def postOptions(self):
        if not self["config"]:
            raise usage.UsageError("--config FILE is required")
        self.config = load_config_or_exit(load_storage_config, self["config"], "waltz-storage")


class StorageService(AsyncStartService):
    """Runs one storage node: ZooKeeper metadata, the storage directory, three ports."""

    name = "waltz-storage"
    expected_failures = (ConfigError, ZooKeeperLayerError, StorageError, CannotListenError)

    def __init__(self, config, reactor):
        super().__init__(reactor)
        self.config = config
        self.tls = load_tls(config, TLS_PREFIX, SERVES)     # None: plain TCP
        self.node = StorageNode(config["storage.directory"], reactor,
                                segment_size_threshold=config["storage.segment.size.threshold"],
                                segment_cache_capacity=config["storage.segment.cache.capacity"])
        self.zookeeper = None
        self.ports = []

    @defer.inlineCallbacks
    def start(self):
        self.zookeeper = ZooKeeperClient.from_config(self.config, self.reactor)
        yield self.zookeeper.connect()
        params = yield ClusterMetadata(self.zookeeper, self.config["cluster.root"], self.reactor).store_params()
        yield self.zookeeper.close()
        self.zookeeper = None
        yield self.node.open(params.key, params.num_partitions)
        self._listen()

    def _listen(self):
        config, bind = self.config, self.config["storage.bindAddress"]
        max_frame, liveness = config["storage.maxFrameSize"], liveness_of(config, "storage.idleTimeout", self.reactor)
        factories = (
            (config["storage.port"],
             server_factory(NodeFactory(StorageServerProtocol, self.node, max_frame, liveness), self.tls)),
            (config["storage.admin.port"],
             server_factory(NodeFactory(AdminServerProtocol, self.node, max_frame, liveness), self.tls)),
            (config["storage.http.port"], health_site(self.node.registry, self.problems)),
        )
        for port, factory in factories:
            server = internet.TCPServer(port, factory, interface=bind)
            server.setServiceParent(self)
            self.ports.append(server)

    def problems(self):
        """Health problems: partitions that failed to open or whose disk failed (the original always reports
        healthy)."""
        problems = ["partition %d %s" % (pid, p.problem)
                    for pid, p in sorted(self.node.partitions.items()) if p.problem]
        control = self.node.control
        if control is not None and control.sync_failure is not None:
            problems.insert(0, "control file %s: fdatasync failed (%s); restart the storage node"
                            % (control.path, control.sync_failure))
        return problems

    @defer.inlineCallbacks
    def stop(self):
        if self.zookeeper is not None:
            yield self.zookeeper.close()
        yield self.node.close()


def makeService(options, reactor=None):
    if reactor is None:
        from twisted.internet import reactor
    return StorageService(options.config, reactor)
