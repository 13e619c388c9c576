"""Partition locations from the assignment and the server descriptors; ZooKeeperDiscovery on a real ZooKeeper."""

import pytest_twisted
from twisted.internet import defer, reactor

from tests.conftest import zk_client_for
from waltz.client.config import CLIENT_KEYS
from waltz.client.discovery import PartitionLocation, ZooKeeperDiscovery, partition_locations
from waltz.client.network import Endpoint
from waltz.config import build_config
from waltz.zk.metadata import ClusterMetadata
from waltz.zk.znodes import PartitionAssignment, ServerDescriptor


def client_config_for(zookeeper, cluster_root):
    return build_config({"zookeeper.connectString": zookeeper.connect_string, "cluster.root": cluster_root},
                        CLIENT_KEYS)


def test_locations_join_the_assignment_with_the_live_servers():
    assignment = PartitionAssignment(3, 4, {1: [(0, 5), (1, 5)], 2: [(2, 7)], 3: [(3, 1)]})
    descriptors = (("s_1", ServerDescriptor(1, "h1", 100)), ("s_2", ServerDescriptor(2, "h2", 200)))
    assert partition_locations(assignment, descriptors) == {
        0: PartitionLocation(Endpoint("h1", 100), 5),
        1: PartitionLocation(Endpoint("h1", 100), 5),
        2: PartitionLocation(Endpoint("h2", 200), 7),
    }   # server 3 has no descriptor: partition 3 has no location


def test_a_partition_listed_twice_goes_to_its_newest_generation():
    assignment = PartitionAssignment(3, 1, {1: [(0, 5)], 2: [(0, 6)]})
    descriptors = (("a", ServerDescriptor(1, "h1", 1)), ("b", ServerDescriptor(2, "h2", 2)))
    assert partition_locations(assignment, descriptors)[0].generation == 6


@pytest_twisted.ensureDeferred
async def test_discovery_follows_assignment_and_servers(zookeeper, cluster_metadata, cluster_root):
    config = client_config_for(zookeeper, cluster_root)
    await cluster_metadata.register_server(ServerDescriptor(1, "127.0.0.1", 6001))
    versioned = await cluster_metadata.partition_assignment()
    await cluster_metadata.write_partition_assignment(
        PartitionAssignment(versioned.stat.cversion, 4, {1: [(0, 1), (1, 1), (2, 1), (3, 1)]}),
        versioned.version)
    discovery = ZooKeeperDiscovery(config, reactor)
    updates = defer.DeferredQueue()
    try:
        info = await discovery.start()
        assert info.num_partitions == 4 and info.client_id >= 1
        assert (await discovery.allocate_client_id()) == info.client_id + 1
        discovery.subscribe(updates.put)
        first = await updates.get()
        assert first == {pid: PartitionLocation(Endpoint("127.0.0.1", 6001), 1) for pid in range(4)}

        # a second server joins and takes partition 3 with a new generation
        await cluster_metadata.register_server(ServerDescriptor(2, "127.0.0.1", 6002))
        versioned = await cluster_metadata.partition_assignment()
        await cluster_metadata.write_partition_assignment(
            PartitionAssignment(versioned.stat.cversion, 4, {1: [(0, 1), (1, 1), (2, 1)], 2: [(3, 2)]}),
            versioned.version)
        latest = await updates.get()
        while latest.get(3) != PartitionLocation(Endpoint("127.0.0.1", 6002), 2):
            latest = await updates.get()
        assert latest[0] == first[0]
    finally:
        await discovery.close()


@pytest_twisted.ensureDeferred
async def test_a_server_whose_session_ends_loses_its_partitions(zookeeper, cluster_metadata, cluster_root):
    config = client_config_for(zookeeper, cluster_root)
    server_zk = zk_client_for(zookeeper)
    await server_zk.connect()
    await ClusterMetadata(server_zk, cluster_root).register_server(ServerDescriptor(5, "127.0.0.1", 6005))
    versioned = await cluster_metadata.partition_assignment()
    await cluster_metadata.write_partition_assignment(
        PartitionAssignment(versioned.stat.cversion, 4, {5: [(0, 3)]}), versioned.version)
    discovery = ZooKeeperDiscovery(config, reactor)
    updates = defer.DeferredQueue()
    try:
        await discovery.start()
        discovery.subscribe(updates.put)
        assert (await updates.get()) == {0: PartitionLocation(Endpoint("127.0.0.1", 6005), 3)}
        await server_zk.close()
        assert (await updates.get()) == {}
    finally:
        await discovery.close()
