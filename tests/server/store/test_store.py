"""Store: store sessions follow the replica assignment in ZooKeeper."""

import uuid

from twisted.internet import defer
from twisted.internet.task import Clock

from waltz.server.store.store import Store, StoreSessionManager
from waltz.zk.znodes import PartitionMetadata, ReplicaAssignments, StoreParams


class UnreachableConnection:
    """A storage connection that never opens (recovery just waits on it)."""

    connected = False

    def add_close_listener(self, listener):
        pass

    def remove_close_listener(self, listener):
        pass

    def when_open(self):
        return defer.Deferred()


class Pool:
    def connection(self, storage):
        return UnreachableConnection()

    def release_unwanted(self):
        pass


class ClusterWithHeldSessionCreation:
    """Cluster metadata whose new-session compare-and-set answers when the test says."""

    def __init__(self):
        self.created = defer.Deferred()
        self.paths = type("Paths", (), {"assignment": "/c/store/assignment"})()

    def new_store_session(self, partition_id, generation):
        return self.created


def assignment(*storages):
    return ReplicaAssignments(tuple((storage, (0,)) for storage in storages))


def test_a_session_created_across_an_assignment_change_gets_the_new_replicas():
    clock, cluster = Clock(), ClusterWithHeldSessionCreation()
    store = Store(cluster, clock)
    store.params = StoreParams(uuid.uuid4(), 1)
    store.pool = Pool()
    store.sessions = StoreSessionManager(cluster, store.pool, clock, store.replicas_of)
    store._apply_assignment(assignment("a:1", "b:1", "c:1"))
    partition = store.partition(0, 5)                        # its first session is being created
    store._assignment_changed(assignment("a:1", "b:1", "d:1").encode(), None)
    cluster.created.callback(PartitionMetadata(5, 1, ()))   # ZooKeeper answers after the change
    assert sorted(partition.session.replicas) == ["a:1", "b:1", "d:1"]


def test_closing_a_partition_forgets_its_recovery_state_metric():
    # Before: the gauge kept the last state of a partition served elsewhere since.
    from waltz.metrics import Registry
    from waltz.server.store.metrics import StoreMetrics
    registry = Registry()
    metrics = StoreMetrics(registry)
    store = Store(cluster=None, reactor=Clock(), metrics=metrics)

    class Partition:
        def close(self):
            metrics.recovery_transition(3, "failed")      # its session's last transition
            return defer.succeed(None)
    store.partitions[3] = Partition()
    metrics.recovery_transition(3, "complete")
    assert 'waltz_server_recovery_state{partition="3"}' in registry.prometheus_text()
    store.close_partition(3)
    assert 'waltz_server_recovery_state{partition="3"}' not in registry.prometheus_text()


def test_a_partition_closed_while_its_session_is_created_leaves_no_recovery_state_metric():
    # The session created after the close is closed at once, which stopped its recovery, which recorded a
    # FAILED transition: the gauge came back for a partition served elsewhere. A recovery that never ran has
    # no state to leave.
    from waltz.metrics import Registry
    from waltz.server.store.metrics import StoreMetrics
    registry = Registry()
    metrics = StoreMetrics(registry)
    clock, cluster = Clock(), ClusterWithHeldSessionCreation()
    store = Store(cluster, clock, metrics=metrics)
    store.params = StoreParams(uuid.uuid4(), 1)
    store.pool = Pool()
    store.sessions = StoreSessionManager(cluster, store.pool, clock, store.replicas_of, metrics)
    store._apply_assignment(assignment("a:1", "b:1", "c:1"))
    store.partition(0, 5)                                   # its first session is being created
    store.close_partition(0)
    cluster.created.callback(PartitionMetadata(5, 1, ()))   # ZooKeeper answers after the close
    assert 'waltz_server_recovery_state{partition="0"}' not in registry.prometheus_text()


def test_an_assignment_change_disconnects_the_nodes_it_removed():
    from twisted.internet.testing import MemoryReactorClock
    from waltz.protocols import storage_messages as sm
    from waltz.server.store.replica import StorageConnectionPool
    clock, cluster = MemoryReactorClock(), ClusterWithHeldSessionCreation()
    store = Store(cluster, clock)
    store.params = StoreParams(uuid.uuid4(), 1)
    store.pool = StorageConnectionPool(sm.OpenRequest.create(None, 1), clock, wanted=store.assigned_storages)
    store._apply_assignment(assignment("a:1", "b:1", "c:1"))
    removed = store.pool.connection("c:1")
    store._assignment_changed(assignment("a:1", "b:1").encode(), None)
    assert "c:1" not in store.pool.connections and not removed._service.running
    assert store.assigned_storages() == {"a:1", "b:1"}


def test_a_session_asks_the_members_the_assignment_dropped_for_their_votes_then_lets_them_go():
    from waltz.zk.znodes import UNRESOLVED, ReplicaId, ReplicaState

    class RecordingPool(Pool):
        def __init__(self):
            self.connections = {}

        def connection(self, storage):
            return self.connections.setdefault(storage, RecordingConnection())

    class RecordingConnection(UnreachableConnection):
        def __init__(self):
            self.listeners = set()

        def add_close_listener(self, listener):
            self.listeners.add(listener)

        def remove_close_listener(self, listener):
            self.listeners.discard(listener)

    clock, cluster = Clock(), ClusterWithHeldSessionCreation()
    store = Store(cluster, clock)
    store.params = StoreParams(uuid.uuid4(), 1)
    store.pool = RecordingPool()
    store.sessions = StoreSessionManager(cluster, store.pool, clock, store.replicas_of)
    store._apply_assignment(assignment("a:1", "new:1"))
    partition = store.partition(0, 5)
    # The last session had old and a; old was unassigned (replaced by new).
    cluster.created.callback(PartitionMetadata(5, 2, (ReplicaState(ReplicaId(0, "old:1"), 1, UNRESOLVED),
                                                      ReplicaState(ReplicaId(0, "a:1"), 1, UNRESOLVED))))
    session = partition.session
    assert sorted(session.replicas) == ["a:1", "new:1"] and sorted(session.departing) == ["old:1"]
    assert sorted(session.recovery.electorate) == ["a:1", "old:1"]
    assert store.pool.connections["old:1"].listeners       # in use: the pool keeps the connection
    session.close("test")
    assert not store.pool.connections["old:1"].listeners   # released: the pool may stop it
