"""Fixtures for tests that run real daemons (``twistd waltz-storage``) on 127.0.0.1.

* ``daemons``: every daemon a test starts is registered here and stopped by its
  pid when the test ends, whatever happened.
* ``start_storage``: makes (and by default starts) a storage daemon for the
  test's cluster root on the session's ZooKeeper, with its run directory
  under the test's ``tmp_path``.
* ``store_params``: creates the test's cluster (``cluster_metadata`` from
  tests/conftest.py) and returns its :class:`~waltz.zk.znodes.StoreParams`;
  request it before starting a storage daemon, which reads them at start-up.
* ``storage_clients``: connections to a daemon's storage or admin port, closed
  when the test ends.

Tests outside this directory (tests/cli) import the fixtures they need from here.
"""

import pytest
import pytest_twisted
from twisted.internet import reactor

from waltz.local.cluster import LocalCluster
from waltz.local.daemons import local_storage
from waltz.protocols.rpc import connect_storage_client


@pytest.fixture
def daemons():
    """A list to append started :class:`~waltz.local.daemons.LocalDaemon` objects to; each one is
    stopped (SIGTERM, then SIGKILL) by its pid when the test ends."""
    started = []
    yield started
    errors = []
    for daemon in reversed(started):
        try:
            daemon.stop(timeout=10)
        except Exception as exc:  # keep stopping the others
            errors.append(exc)
    if errors:
        raise errors[0]


@pytest.fixture
def start_storage(zookeeper, cluster_root, tmp_path, daemons):
    """``start_storage(name="storage", start=True, **config_overrides)`` -> a storage
    :class:`LocalDaemon` of this test's cluster, run in ``tmp_path/name``, stopped after the test."""
    def make(name="storage", start=True, **overrides):
        daemon = local_storage(str(tmp_path / name), zookeeper.connect_string, cluster_root, **overrides)
        daemons.append(daemon)
        if start:
            daemon.start()
        return daemon
    return make


@pytest_twisted.async_fixture
async def store_params(cluster_metadata):
    """The test cluster's :class:`~waltz.zk.znodes.StoreParams` (cluster key, partition count)."""
    return await cluster_metadata.store_params()


class StorageClients:
    """Opens connections to storage daemons' ports as a Waltz server (``S``) or an admin tool
    (``A``) would, and closes all of them in :meth:`close`."""

    def __init__(self, params):
        self.params = params
        self.connections = []

    async def connect(self, daemon, admin=False, key=None, num_partitions=None):
        """A connection to ``daemon``'s storage (or admin) port; it sends the open request with
        ``key`` and ``num_partitions`` (default: the cluster's) and queues requests until accepted
        (``await proto.opened`` to see the refusal)."""
        key = self.params.key if key is None else key
        count = self.params.num_partitions if num_partitions is None else num_partitions
        port = daemon.config["storage.admin.port" if admin else "storage.port"]
        proto = await connect_storage_client(reactor, "127.0.0.1", port, key, count, admin)
        self.connections.append(proto)
        return proto

    async def admin(self, daemon):
        """An opened admin connection to ``daemon``."""
        proto = await self.connect(daemon, admin=True)
        await proto.opened
        return proto

    async def storage(self, daemon):
        """An opened storage connection to ``daemon``."""
        proto = await self.connect(daemon)
        await proto.opened
        return proto

    def close(self):
        for proto in self.connections:
            if proto.transport is not None:
                proto.transport.abortConnection()
        self.connections = []


@pytest.fixture
def storage_clients(store_params):
    """A :class:`StorageClients` for the test's cluster; its connections close after the test."""
    clients = StorageClients(store_params)
    yield clients
    clients.close()



@pytest_twisted.async_yield_fixture
async def local_clusters(zookeeper, cluster_root, tmp_path):
    """``await local_clusters(num_partitions, num_storages)``: a started :class:`LocalCluster` (on the session's
    ZooKeeper, under this test's cluster root); every one made is stopped after the test."""
    made = []

    async def make(num_partitions, num_storages):
        local = LocalCluster(str(tmp_path / ("cluster%d" % len(made))), num_partitions=num_partitions,
                             num_storages=num_storages, root=cluster_root, zookeeper=zookeeper)
        made.append(local)
        await local.start(reactor)
        return local

    yield make
    for local in made:
        await local.stop()


@pytest_twisted.async_yield_fixture
async def clients():
    """A list to add WaltzClients to; they are closed when the test ends."""
    started = []
    yield started
    for client in started:
        await client.close()
