"""ZooKeeperDiscovery reads the partition map again when asked (a server said it does not serve a
partition the map puts there) and after a reconnect, never going back to an older assignment."""

import pytest_twisted
from twisted.internet import defer, reactor, task, threads

from tests.client.test_discovery import client_config_for
from tests.conftest import zk_client_for
from waltz.client.discovery import PartitionLocation, ZooKeeperDiscovery
from waltz.client.network import Endpoint
from waltz.zk.metadata import ClusterMetadata
from waltz.zk.znodes import PartitionAssignment, ServerDescriptor


async def assign(metadata, servers):
    versioned = await metadata.partition_assignment()
    await metadata.write_partition_assignment(PartitionAssignment(versioned.stat.cversion, 4, servers),
                                              versioned.version)


async def until(condition, what, timeout=60.0):  # generous: a loaded machine reconnects slowly
    deadline = reactor.seconds() + timeout
    while not condition():
        if reactor.seconds() > deadline:
            raise AssertionError("timed out waiting for %s" % what)
        await task.deferLater(reactor, 0.02, lambda: None)


@pytest_twisted.ensureDeferred
async def test_refresh_reads_a_change_the_watches_missed(zookeeper, cluster_metadata, cluster_root):
    await cluster_metadata.register_server(ServerDescriptor(1, "127.0.0.1", 6001))
    await cluster_metadata.register_server(ServerDescriptor(2, "127.0.0.1", 6002))
    await assign(cluster_metadata, {1: [(0, 1), (1, 1), (2, 1), (3, 1)]})
    discovery = ZooKeeperDiscovery(client_config_for(zookeeper, cluster_root), reactor)
    try:
        await discovery.start()
        assert discovery.locations[3] == PartitionLocation(Endpoint("127.0.0.1", 6001), 1)
        for handle in discovery._handles:   # as if the watches had been lost
            handle.cancel()
        await assign(cluster_metadata, {1: [(0, 1), (1, 1), (2, 1)], 2: [(3, 2)]})
        await task.deferLater(reactor, 0.3, lambda: None)
        assert discovery.locations[3].generation == 1, "the cancelled watches saw nothing"
        await discovery.refresh()
        assert discovery.locations[3] == PartitionLocation(Endpoint("127.0.0.1", 6002), 2)
        # an older read arriving late does not go back
        old = PartitionAssignment(0, 4, {1: [(0, 1), (1, 1), (2, 1), (3, 1)]}).encode()
        discovery._take_assignment(old, 0)
        assert discovery.locations[3].generation == 2
    finally:
        await discovery.close()


@pytest_twisted.ensureDeferred
async def test_refresh_takes_the_assignment_of_a_znode_deleted_and_created_again(
        zookeeper, cluster_metadata, cluster_root):
    # The data version of a znode created again starts at 0: every later assignment was taken for an old one.
    await cluster_metadata.register_server(ServerDescriptor(1, "127.0.0.1", 6001))
    for generation in (1, 2, 3):
        await assign(cluster_metadata, {1: [(0, generation), (1, 1), (2, 1), (3, 1)]})
    discovery = ZooKeeperDiscovery(client_config_for(zookeeper, cluster_root), reactor)
    try:
        await discovery.start()
        assert discovery.locations[0].generation == 3
        for handle in discovery._handles:   # the deletion happened while the watches could not see it
            handle.cancel()
        path = cluster_metadata.paths.server_descriptors
        await cluster_metadata.zk.delete(path, recursive=True)
        await cluster_metadata.zk.create(path, PartitionAssignment(0, 4, {}).encode())
        await cluster_metadata.register_server(ServerDescriptor(2, "127.0.0.1", 6002))
        await assign(cluster_metadata, {2: [(0, 4), (1, 4), (2, 4), (3, 4)]})
        await discovery.refresh()
        assert discovery.locations[0] == PartitionLocation(Endpoint("127.0.0.1", 6002), 4)
    finally:
        await discovery.close()


@pytest_twisted.ensureDeferred
async def test_after_a_zookeeper_restart_the_map_follows_changes(private_zookeeper):
    await threads.deferToThread(private_zookeeper.start)
    admin = zk_client_for(private_zookeeper)
    await admin.connect()
    metadata = ClusterMetadata(admin, "/waltz_discovery")
    await metadata.create_cluster("d", 4)
    await metadata.register_server(ServerDescriptor(1, "127.0.0.1", 6001))
    await assign(metadata, {1: [(0, 1), (1, 1), (2, 1), (3, 1)]})
    config = client_config_for(private_zookeeper, "/waltz_discovery")
    discovery = ZooKeeperDiscovery(config, reactor)
    updates = defer.DeferredQueue()
    try:
        await discovery.start()
        discovery.subscribe(updates.put)
        await updates.get()
        await threads.deferToThread(private_zookeeper.kill)
        await task.deferLater(reactor, 1.0, lambda: None)
        await threads.deferToThread(private_zookeeper.start)
        await until(lambda: admin.connected and discovery._zk.connected, "the sessions to reconnect")
        await metadata.register_server(ServerDescriptor(2, "127.0.0.1", 6002))
        await assign(metadata, {1: [(0, 1), (1, 1)], 2: [(2, 2), (3, 2)]})
        await until(lambda: discovery.locations.get(3) == PartitionLocation(Endpoint("127.0.0.1", 6002), 2),
                    "the new assignment after the restart")
        assert discovery.refreshes >= 1, "the reconnect made the discovery read the map again"
    finally:
        await discovery.close()
        await admin.close()
