"""A server whose store partition is lost (another server opened a store session at a newer generation:
``StorePartition.lost``, after ``GenerationMismatchError``) closes that partition instead of answering as
its owner, asks for the assignment again, and opens it again only at another generation."""

from twisted.internet import defer
from twisted.internet.task import Clock

from waltz.protocols import client_messages as cm
from waltz.protocols.values import ReqId
from waltz.server.protocol import ServerProtocol
from waltz.server.service import ServerPartitions


class DummyStorePartition:
    def __init__(self, partition_id, generation):
        self.partition_id, self.generation = partition_id, generation
        self.lost = None
        self.closed = False
        self._lost_listeners = []

    def add_lost_listener(self, listener):
        self._lost_listeners.append(listener)

    def lose(self, reason):
        """As StorePartition._lose: ``lost`` set, then the listeners told."""
        self.lost = reason
        for listener in self._lost_listeners:
            listener(reason)


class DummyStore:
    def __init__(self):
        self.partitions = {}
        self.closed = []

    def partition(self, partition_id, generation):
        self.partitions[partition_id] = DummyStorePartition(partition_id, generation)
        return self.partitions[partition_id]

    def close_partition(self, partition_id):
        self.closed.append(partition_id)
        return defer.succeed(None)


class DummyPartition:
    def __init__(self, partition_id, generation, store):
        self.partition_id, self.generation, self.store = partition_id, generation, store
        self.closed = False
        self.healthy = True

    def start(self):
        return defer.succeed(self)

    def close(self):
        self.closed = True


def make(clock=None):
    store, made, lost = DummyStore(), [], []

    def factory(partition_id, generation, store_partition):
        made.append(DummyPartition(partition_id, generation, store_partition))
        return made[-1]
    partitions = ServerPartitions(store, factory, reactor=clock,
                                  on_lost=lambda pid, gen, why: lost.append((pid, gen, why)))
    return store, made, lost, partitions


def test_a_lost_partition_is_closed_and_reported():
    store, made, lost, partitions = make()
    partitions.assign({0: 3, 1: 2})
    assert partitions.partition(0) is not None
    store.partitions[0].lost = "generation 3 is stale: stored generation 4"
    assert partitions.check_lost() == [0]
    assert partitions.partition(0) is None and 0 not in partitions.opened
    assert made[0].closed and store.closed == [0]
    assert lost == [(0, 3, "generation 3 is stale: stored generation 4")]
    assert partitions.partition(1) is not None
    assert any("another server took it over" in p for p in partitions.problems())
    # The same assignment again does not reopen it at the lost generation ...
    partitions.assign({0: 3, 1: 2})
    assert 0 not in partitions.opened and len(made) == 2
    # ... a newer generation does.
    partitions.assign({0: 5, 1: 2})
    assert partitions.opened[0].generation == 5
    assert partitions.lost == {} and partitions.problems() == []


def test_a_lost_partition_is_given_out_no_more_at_once_and_closed_in_the_next_turn():
    # It was found by a poll every half second, answering mounts (READY at its old mark) and flushes meanwhile.
    clock = Clock()
    store, made, lost, partitions = make(clock)
    partitions.assign({2: 1, 3: 1})
    assert partitions.partition(2) is made[0]
    store.partitions[2].lose("taken over")
    assert partitions.partition(2) is None, "not given to any request from now on"
    assert partitions.partition(3) is made[1]
    assert not made[0].closed and lost == [], "closed in the next turn, not inside the store's own failure"
    clock.advance(0)
    assert 2 not in partitions.opened and made[0].closed and lost == [(2, 1, "taken over")]
    assert clock.getDelayedCalls() == [], "no poll left running"


def test_a_partition_closed_before_its_store_partition_is_lost_is_left_alone():
    clock = Clock()
    store, made, lost, partitions = make(clock)
    partitions.assign({2: 1})
    old_store_partition = store.partitions[2]
    partitions.assign({2: 4})                      # reopened at a newer generation
    old_store_partition.lose("taken over")         # the old session's loss, late
    clock.advance(0)
    assert partitions.partition(2) is made[1] and lost == []


def test_clients_are_told_a_lost_partition_is_not_served_here():
    store, made, lost, partitions = make()
    partitions.assign({0: 1})
    store.partitions[0].lost = "taken over"
    partitions.check_lost()
    proto = ServerProtocol(partitions)
    sent = []
    proto.sendMessage = sent.append
    proto.messageReceived(cm.TransactionDataRequest(ReqId(1, 1, 0, 1), 7))
    proto.messageReceived(cm.MountRequest(ReqId(1, 1, 0, 2), -1, 0))
    assert not sent[0].ok and "is not served here" in sent[0].error
    assert sent[1].state is cm.MountState.NOT_READY


def test_once_closed_for_a_stop_an_assignment_opens_nothing():
    store, made, lost, partitions = make()
    partitions.assign({0: 3})
    partitions.close_all()
    assert made[0].closed and partitions.opened == {}
    partitions.assign({0: 3, 1: 2})         # a watch event while the membership is still stopping
    assert partitions.opened == {} and len(made) == 1


def test_a_stopping_server_closes_its_partitions_before_its_membership_stops():
    # Before: membership.stop() came first. It stops every give-up, then waits for ZooKeeper to delete the
    # descriptor: a follower cut off from the leader answers only after the request timeout, and the partitions
    # stayed open past the session's expiry, while another server opened them at the next generation.
    from types import SimpleNamespace

    from waltz.config import build_config
    from waltz.server.config import SERVER_KEYS
    from waltz.server.service import WaltzServerService
    clock, steps, delete = Clock(), [], defer.Deferred()
    config = build_config({"zookeeper.connectString": "127.0.0.1:2181", "cluster.root": "/c"}, SERVER_KEYS)
    service = WaltzServerService(config, clock, partition_factory=lambda *a: None, clock=clock.seconds)
    store, made, lost, partitions = make()
    partitions.assign({0: 3, 1: 2})
    service.partitions = partitions
    service.membership = SimpleNamespace(stop=lambda: (steps.append(sorted(partitions.opened)), delete)[1])
    stopped = service.stop()
    assert steps == [[]] and all(partition.closed for partition in made)
    delete.callback(None)
    assert stopped.called
