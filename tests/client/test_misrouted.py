"""A server that does not serve a partition the client's map puts there (the map lags behind the cluster:
a server restarted on the same endpoint, or gave the partition up): the client's requests wait and are
sent again, the application sees no error, and the client reads the partition map again."""

from twisted.internet import defer

from tests.client.fakes import EP_A, EP_B, FakeDiscovery, RecordingCallbacks
from waltz.protocols.client_messages import is_not_served
from waltz.protocols import client_messages as m


class RefreshingDiscovery(FakeDiscovery):
    """A fake discovery that counts ``refresh()`` calls (the optional re-read of the partition map)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.refreshes = 0

    def refresh(self):
        self.refreshes += 1
        return defer.succeed(None)


def refreshing(harness):
    discovery = RefreshingDiscovery(harness.discovery.num_partitions, locations=harness.discovery.locations)
    harness.discovery = discovery
    return discovery


def data_requests(server, pid=0):
    return [r for r in server.messages(m.TransactionDataRequest) if r.req_id.partition_id == pid]


def test_the_servers_answer_is_recognised():
    assert is_not_served("partition 3 is not served here")
    assert not is_not_served("transaction 4 of partition 3 is not committed (high-water mark 2)")
    assert not is_not_served(None)


def test_not_served_here_keeps_the_fetch_pending_and_asks_again(harness):
    harness.commit(0, data=b"x")
    discovery = refreshing(harness)
    client = harness.client()
    refreshes_before = discovery.refreshes
    harness.server_a.data_errors[0] = "partition 0 is not served here"
    d = client.get_transaction_data(0, 0)
    harness.settle()
    assert not d.called, "a routing miss is not the application's error"
    assert len(data_requests(harness.server_a)) == 1
    assert discovery.refreshes == refreshes_before + 1, "the client reads the partition map again"
    harness.settle(0.5)                      # client.mountRetryInterval
    assert len(data_requests(harness.server_a)) == 2
    assert not d.called
    del harness.server_a.data_errors[0]      # the server serves it now (e.g. the assignment caught up)
    harness.settle(0.5)
    assert d.result == b"x"


def test_not_served_here_is_sent_to_the_new_server_as_soon_as_the_partition_moves(harness):
    harness.commit(0, data=b"y")
    client = harness.client()
    harness.server_a.data_errors[0] = "partition 0 is not served here"
    d = client.get_transaction_data(0, 0)
    harness.settle()
    assert not d.called
    harness.server_b.partitions = {0}
    harness.discovery.move(0, EP_B, 2)
    harness.settle()
    assert d.result == b"y"
    assert len(data_requests(harness.server_b)) == 1


def test_applying_the_feed_survives_a_routing_miss(harness):
    """The smoke test's anomaly: apply_transaction fetches the data, the RPC goes to a server that
    does not serve the partition; the application must not get an uncaught exception."""

    class FetchingCallbacks(RecordingCallbacks):
        def apply_transaction(self, transaction):
            d = transaction.get_data()
            d.addCallback(lambda data: self.applied.append((transaction.transaction_id, data)))
            return d

    callbacks = FetchingCallbacks()
    harness.server_a.data_errors[0] = "partition 0 is not served here"
    client = harness.client(callbacks)
    harness.commit(0, data=b"z")
    harness.settle(1.0)
    assert callbacks.errors == []
    assert client.client_high_water_mark(0) == -1
    del harness.server_a.data_errors[0]
    harness.settle(0.5)
    assert callbacks.errors == []
    assert callbacks.applied[-1] == (0, b"z")
    assert client.client_high_water_mark(0) == 0


def test_mount_not_ready_reads_the_partition_map_again(harness):
    discovery = refreshing(harness)
    harness.server_a.partitions = {1}
    harness.client()
    assert discovery.refreshes >= 1


def test_an_unanswered_high_water_mark_request_is_sent_again(harness):
    harness.commit(0)
    client = harness.client()
    harness.server_a.partitions = {1}        # a server that does not serve partition 0 drops the request

    def dropped(proto, message):
        if message.req_id.partition_id not in harness.server_a.partitions:
            return
        proto.sendMessage(m.HighWaterMarkResponse(message.req_id, harness.logs[0].high_water_mark))
    harness.server_a.on_HighWaterMarkRequest = dropped
    d = client.high_water_mark(0)
    harness.settle()
    assert not d.called
    harness.server_a.partitions = {0, 1}
    harness.settle(5.0)                       # client.longWaitThreshold
    assert d.result == 0
    assert EP_A in client._servers


def test_a_read_of_a_client_that_mounts_nothing_reads_the_partition_map_again(harness):
    """A read-only client (Spark's) mounts no partition of its own: its reads are what notice a map that
    missed a change, whether the server answers the read's mount NOT_READY or its batch 'not served'."""
    harness.commit(0, data=b"r")
    discovery = refreshing(harness)
    client = harness.client(**{"client.autoMount": False})
    harness.server_a.partitions = {1}                   # the map still says A serves partition 0
    read = []
    client.read_transactions(0, 0, 0, headers={0}).addCallback(read.append)      # through a mount
    harness.settle()
    assert discovery.refreshes == 1 and read == []
    harness.server_a.partitions = {0, 1}
    harness.settle(0.5)                                 # client.mountRetryInterval
    assert [r.data for r in read.pop()] == [b"r"]

    harness.server_a.batch_errors.append("partition 0 is not served here")
    client.read_transactions(0, 0, 0, committed=True).addCallback(read.append)     # batches, no mount
    harness.settle(0.5)
    assert discovery.refreshes == 2
    harness.settle(0.5)
    assert [r.data for r in read.pop()] == [b"r"]
