"""The harness of the client's unit tests: a Clock, fake servers on an iosim network, a fake
discovery, and WaltzClients wired to them."""

import pytest
from twisted.internet.task import Clock

from tests.client.fakes import (
    BASE_CONFIG, EP_A, EP_B, FakeDiscovery, FakeNetwork, FakeServer, FakeStore, RecordingCallbacks)
from waltz.client.client import WaltzClient
from waltz.client.discovery import PartitionLocation
from waltz.protocols.values import ReqId


class Harness:
    """Two fake servers (A holds every partition at first, B none) and a fake discovery."""

    def __init__(self, num_partitions=2):
        self.clock = Clock()
        self.network = FakeNetwork(self.clock)
        self.logs = FakeStore(num_partitions)
        self.server_a = self.network.add_server(EP_A, FakeServer(self.logs, range(num_partitions)))
        self.server_b = self.network.add_server(EP_B, FakeServer(self.logs, ()))
        self.discovery = FakeDiscovery(num_partitions)
        for pid in range(num_partitions):
            self.discovery.locations[pid] = self.location(EP_A, 1)
        self.clients = []

    @staticmethod
    def location(endpoint, generation):
        return PartitionLocation(endpoint, generation)

    def client(self, callbacks=None, join=True, discovery=None, **config):
        """A WaltzClient on the fake cluster (joined and settled unless ``join`` is False)."""
        callbacks = callbacks if callbacks is not None else RecordingCallbacks()
        settings = dict(BASE_CONFIG)
        settings.update(config)
        client = WaltzClient(callbacks, settings, self.clock, discovery=discovery or self.discovery,
                             connector=self.network.connect)
        client.callbacks = callbacks
        self.clients.append(client)
        if join:
            self.join()
        return client

    def join(self):
        self.discovery.join()
        self.settle()

    def settle(self, seconds=0):
        self.clock.advance(seconds)
        self.network.flush()

    def commit(self, pid, header=0, data=b"other", client_id=99, seq=None):
        """Another client's transaction committed on partition ``pid``."""
        seq = len(self.logs[pid].records) if seq is None else seq
        record = self.logs.commit(pid, ReqId(client_id, 1, pid, seq), header, data)
        self.network.flush()
        return record


@pytest.fixture
def harness():
    return Harness()
