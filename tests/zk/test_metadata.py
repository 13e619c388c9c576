"""ClusterMetadata against a real ZooKeeper: layout, CAS retries, ids, sessions, membership, admin edits."""

import attr
import pytest
import pytest_twisted
from kazoo.exceptions import BadVersionError, ConnectionLoss
from twisted.internet import defer, reactor, task

from tests.conftest import TEST_PARTITIONS, zk_client_for
from waltz.zk.errors import (ClusterExistsError, ClusterNotFoundError, ConcurrentUpdateError,
                             GenerationMismatchError, LockTimeoutError, PartialClusterError,
                             ServersRegisteredError,
                             TopologyError, ZnodeDecodeError)
from waltz.zk.lock import ZnodeMutex
from waltz.zk.metadata import ClusterMetadata, RetryPolicy
from waltz.zk.znodes import (EMPTY_PARTITION_METADATA, ClusterParams, ConnectionMetadata,
                             GroupDescriptor, IdCounter, PartitionAssignment, PartitionInfo,
                             PartitionMetadata, ReplicaAssignments, ReplicaId, ReplicaState,
                             ServerDescriptor, StoreParams)


async def connected(zookeeper):
    client = zk_client_for(zookeeper)
    await client.connect()
    return client


@pytest_twisted.ensureDeferred
async def test_create_cluster_writes_every_znode(zk_client, cluster_root):
    metadata = ClusterMetadata(zk_client, cluster_root)
    store = await metadata.create_cluster("demo", 3)
    paths = metadata.paths
    expected = {
        paths.root: ClusterParams("demo", 3),
        paths.server_descriptors: PartitionAssignment(-1, 0, {}),
        paths.client_ids: IdCounter(0),
        paths.server_ids: IdCounter(0),
        paths.store: store,
        paths.assignment: ReplicaAssignments(),
        paths.group: GroupDescriptor(),
        paths.connection: ConnectionMetadata(),
    }
    expected.update({paths.partition(pid): EMPTY_PARTITION_METADATA for pid in range(3)})
    for path, value in expected.items():
        data, _stat = await zk_client.get(path)
        assert type(value).decode(data, path) == value, path
    assert store.num_partitions == 3 and store.key.version == 4
    assert sorted(await zk_client.get_children(paths.partitions)) == ["0", "1", "2"]
    assert (await zk_client.get(paths.ids))[0] == b""


@pytest_twisted.ensureDeferred
async def test_create_refuses_an_existing_root(cluster_metadata):
    with pytest.raises(ClusterExistsError, match="already exists"):
        await cluster_metadata.create_cluster("again", 2)


@pytest.mark.parametrize("stop", ["error", "interrupt"])
@pytest_twisted.ensureDeferred
async def test_a_create_stopped_between_partition_batches_says_how_far_it_got_and_how_to_start_again(
        zk_client, cluster_root, monkeypatch, stop):
    # Before: the error was only the second batch's own ("connection lost", or "interrupted"), with nothing
    # saying that a cluster root with 2 of its 5 partitions had been left behind.
    from waltz.zk import metadata as metadata_module
    monkeypatch.setattr(metadata_module, "PARTITION_BATCH", 2)
    metadata = ClusterMetadata(zk_client, cluster_root)
    transaction, commits, second_batch_sent = zk_client.transaction, [], defer.Deferred()

    def failing_second_batch():
        txn = transaction()
        commit = txn.commit

        def counted():
            commits.append(True)
            if len(commits) < 3:        # the cluster's own znodes, then the first batch
                return commit()
            if stop == "error":
                return defer.fail(ConnectionLoss("connection lost"))
            reactor.callLater(0, second_batch_sent.callback, None)
            return defer.Deferred()     # hangs until cancelled
        txn.commit = counted
        return txn
    monkeypatch.setattr(zk_client, "transaction", failing_second_batch)
    created = metadata.create_cluster("demo", 5)
    if stop == "interrupt":
        await second_batch_sent
        created.cancel()
    with pytest.raises(PartialClusterError) as raised:
        await created
    cause = "connection lost" if stop == "error" else "an interrupt"
    assert str(raised.value) == (
        "cluster %s was left partly created (2 of 5 partition metadata znodes, at least) by: %s; delete it "
        "(waltz cluster delete) and create it again" % (cluster_root, cause))
    monkeypatch.setattr(zk_client, "transaction", transaction)
    await metadata.delete_cluster()
    assert await zk_client.exists(cluster_root) is None


@pytest.mark.parametrize("count", [0, 10001, 2 ** 31 - 1])
@pytest_twisted.ensureDeferred
async def test_create_refuses_a_partition_count_out_of_bounds_and_writes_nothing(zk_client, cluster_root, count):
    metadata = ClusterMetadata(zk_client, cluster_root)
    with pytest.raises(ValueError, match="a cluster has 1 to 10000 partitions, not %d" % count):
        await metadata.create_cluster("demo", count)
    assert await zk_client.exists(cluster_root) is None


@pytest_twisted.ensureDeferred
async def test_reads_of_a_missing_cluster_say_so(zk_client, cluster_root):
    metadata = ClusterMetadata(zk_client, cluster_root)
    with pytest.raises(ClusterNotFoundError, match="no Waltz cluster at %s" % cluster_root):
        await metadata.store_params()
    with pytest.raises(ClusterNotFoundError):
        await metadata.allocate_client_id()


@pytest_twisted.ensureDeferred
async def test_garbage_in_a_znode_is_a_decode_error_naming_it(cluster_metadata, zk_client):
    await zk_client.set(cluster_metadata.paths.group, b"\x07garbage")
    with pytest.raises(ZnodeDecodeError, match="znode %s does not hold valid GroupDescriptor data"
                       % cluster_metadata.paths.group):
        await cluster_metadata.group_descriptor()


class HeldWrites:
    """Wraps a client so that its writes wait until ``release`` fires."""

    def __init__(self, client, release):
        self._client = client
        self._release = release

    def __getattr__(self, name):
        return getattr(self._client, name)

    def set(self, path, value, version=-1):
        gate = defer.Deferred()
        self._release.addCallback(lambda result: gate.callback(None) or result)
        return gate.addCallback(lambda _: self._client.set(path, value, version))


@pytest_twisted.ensureDeferred
async def test_concurrent_updates_both_land(cluster_metadata, zookeeper):
    # Both updaters read version 0 before either writes (their writes are held until both
    # have read): one write loses with BadVersion, and that updater reads and applies again.
    other_zk = await connected(zookeeper)
    both_read = defer.Deferred()
    changes = []

    def add(storage):
        def change(assignments):
            changes.append(storage)
            if len(changes) == 2:
                both_read.callback(None)
            return ReplicaAssignments({**assignments.as_dict(), storage: (0,)})
        return change
    root, path = cluster_metadata.paths.root, cluster_metadata.paths.assignment
    try:
        await defer.gatherResults([
            ClusterMetadata(HeldWrites(cluster_metadata.zk, both_read), root).update(
                path, ReplicaAssignments, add("a:1")),
            ClusterMetadata(HeldWrites(other_zk, both_read), root).update(path, ReplicaAssignments, add("b:1")),
        ])
    finally:
        await other_zk.close()
    assert (await cluster_metadata.replica_assignments()).as_dict() == {"a:1": (0,), "b:1": (0,)}
    assert sorted(changes[:2]) == ["a:1", "b:1"] and len(changes) == 3  # the loser applied again


@pytest_twisted.ensureDeferred
async def test_cas_gives_up_after_the_policy_attempts(cluster_metadata, zk_client):
    class AlwaysConflicting:
        """A client whose writes always lose the race."""

        def __getattr__(self, name):
            return getattr(zk_client, name)

        def set(self, path, value, version=-1):
            return defer.fail(BadVersionError())

    metadata = ClusterMetadata(AlwaysConflicting(), cluster_metadata.paths.root,
                               retry=RetryPolicy(attempts=3, first_delay=0.001))
    with pytest.raises(ConcurrentUpdateError, match="3 attempts"):
        await metadata.allocate_server_id()


@pytest_twisted.ensureDeferred
async def test_ids_are_unique_under_concurrency(cluster_metadata, zookeeper):
    other = ClusterMetadata(await connected(zookeeper), cluster_metadata.paths.root)
    try:
        allocations = [m.allocate_client_id() for _ in range(10) for m in (cluster_metadata, other)]
        ids = await defer.gatherResults(allocations)
        assert sorted(ids) == list(range(1, 21))
        assert await cluster_metadata.allocate_server_id() == 1  # a separate counter
    finally:
        await other.zk.close()


@pytest_twisted.ensureDeferred
async def test_new_store_session_increments_the_session_and_fences_old_generations(cluster_metadata):
    first = await cluster_metadata.new_store_session(1, generation=5)
    assert (first.generation, first.session_id) == (5, 0)
    second = await cluster_metadata.new_store_session(1, generation=6)
    assert (second.generation, second.session_id) == (6, 1)
    with pytest.raises(GenerationMismatchError, match="partition 1: stored generation 6 is greater than .* 5"):
        await cluster_metadata.new_store_session(1, generation=5)
    stored = await cluster_metadata.partition_metadata(1)
    assert stored.value == second


@pytest_twisted.ensureDeferred
async def test_new_store_session_keeps_replica_states_and_creates_missing_znodes(cluster_metadata, zk_client):
    replica = ReplicaState(ReplicaId(2, "h:1"), 0, 17)
    await cluster_metadata.update_partition_metadata(
        2, lambda meta: attr.evolve(meta, replica_states=[replica]))
    meta = await cluster_metadata.new_store_session(2, generation=1)
    assert meta.replica_states == (replica,)
    await zk_client.delete(cluster_metadata.paths.partition(3))
    assert await cluster_metadata.partition_metadata(3) is None
    meta = await cluster_metadata.new_store_session(3, generation=1)
    assert (meta.generation, meta.session_id, meta.replica_states) == (1, 0, ())


@pytest_twisted.ensureDeferred
async def test_concurrent_store_sessions_get_distinct_ids(cluster_metadata, zookeeper):
    other = ClusterMetadata(await connected(zookeeper), cluster_metadata.paths.root)
    try:
        metas = await defer.gatherResults([m.new_store_session(0, 1) for m in (cluster_metadata, other) * 3])
        assert sorted(meta.session_id for meta in metas) == list(range(6))
    finally:
        await other.zk.close()


@pytest_twisted.ensureDeferred
async def test_server_descriptors_are_ephemeral(cluster_metadata, zookeeper):
    server_zk = await connected(zookeeper)
    server = ClusterMetadata(server_zk, cluster_metadata.paths.root)
    server_id = await server.allocate_server_id()
    path = await server.register_server(ServerDescriptor(server_id, "127.0.0.1", 55180, [0]))
    assert path.startswith(cluster_metadata.paths.server_descriptor_prefix)
    seen = await cluster_metadata.server_descriptors()
    assert seen == ((path.rsplit("/", 1)[1], ServerDescriptor(1, "127.0.0.1", 55180, (0,))),)
    gone = defer.Deferred()
    await cluster_metadata.zk.exists(path, watch=gone.callback)
    await server_zk.close()
    event = await gone.addTimeout(5, cluster_metadata._reactor)
    assert event.type == "DELETED"
    assert await cluster_metadata.server_descriptors() == ()


@pytest_twisted.ensureDeferred
async def test_partition_assignment_is_written_with_a_version_check(cluster_metadata):
    current = await cluster_metadata.partition_assignment()
    assignment = PartitionAssignment(current.stat.cversion, TEST_PARTITIONS, {1: [PartitionInfo(0, 1)]})
    await cluster_metadata.write_partition_assignment(assignment, current.version)
    assert (await cluster_metadata.partition_assignment()).value == assignment
    with pytest.raises(BadVersionError):
        await cluster_metadata.write_partition_assignment(assignment, current.version)


@pytest_twisted.ensureDeferred
async def test_admin_lock_excludes_other_sessions_and_dies_with_its_holder(cluster_metadata, zookeeper):
    holder_zk = await connected(zookeeper)
    holder = ClusterMetadata(holder_zk, cluster_metadata.paths.root).admin_lock()
    await holder.acquire()
    with pytest.raises(LockTimeoutError, match="adminLock is still held"):
        await cluster_metadata.admin_lock().acquire(timeout=0.2)
    waiter = cluster_metadata.admin_lock().acquire(timeout=5)
    assert not waiter.called
    await holder_zk.close()  # the ephemeral lock znode goes with the session
    await waiter
    await cluster_metadata.admin_lock().release()
    assert await cluster_metadata.zk.exists(cluster_metadata.paths.admin_lock) is None


@pytest_twisted.ensureDeferred
async def test_releasing_never_deletes_another_sessions_lock(cluster_metadata, zookeeper):
    # A holder whose session expired mid-edit, releasing late, must not free the lock someone else took.
    other_zk = await connected(zookeeper)
    try:
        other = ClusterMetadata(other_zk, cluster_metadata.paths.root).admin_lock()
        await other.acquire()
        await cluster_metadata.admin_lock().release()
        assert (await cluster_metadata.zk.exists(cluster_metadata.paths.admin_lock)).ephemeralOwner == \
            other_zk.session_id
        await other.release()
        assert await cluster_metadata.zk.exists(cluster_metadata.paths.admin_lock) is None
    finally:
        await other_zk.close()


@pytest_twisted.ensureDeferred
async def test_admin_lock_serialises_runs(cluster_metadata):
    lock = cluster_metadata.admin_lock()
    events = []

    async def critical(name):
        events.append(name + " in")
        await cluster_metadata.zk.sync("/")  # give the other run a chance to interleave
        events.append(name + " out")
        return name
    results = await defer.gatherResults([
        lock.run(lambda: defer.ensureDeferred(critical("a"))),
        lock.run(lambda: defer.ensureDeferred(critical("b"))),
    ])
    assert results == ["a", "b"]
    assert events in (["a in", "a out", "b in", "b out"], ["b in", "b out", "a in", "a out"])


class _FirstReadLost:
    """A real ZooKeeper client whose first create never answers (applied, its reply slower than the timeout),
    and whose first read without a watch loses its connection after ZooKeeper answered it."""

    def __init__(self, zk):
        self._zk = zk
        self.creates = 0
        self.lost_reads = 0

    def __getattr__(self, name):
        return getattr(self._zk, name)

    def create(self, *args, **kwargs):
        applied = self._zk.create(*args, **kwargs)
        self.creates += 1
        return applied if self.creates > 1 else defer.Deferred()

    def get(self, path, watch=None):
        if watch is None and not self.lost_reads:
            self.lost_reads += 1
            return self._zk.get(path).addCallback(lambda _: defer.fail(ConnectionLoss()))
        return self._zk.get(path, watch=watch)


@pytest_twisted.ensureDeferred
async def test_undoing_an_unanswered_lock_create_survives_a_lost_read(cluster_metadata):
    # The read that decides whether the late create made the znode lost its connection: it was not sent again,
    # and the znode stayed, holding the lock for nobody until the session ended.
    path = cluster_metadata.paths.admin_lock
    zk = _FirstReadLost(cluster_metadata.zk)
    with pytest.raises(LockTimeoutError, match="did not answer"):
        await ZnodeMutex(zk, path).acquire(timeout=0.3).addTimeout(10, reactor)
    for _ in range(100):
        if await cluster_metadata.zk.exists(path) is None:
            break
        await task.deferLater(reactor, 0.05, lambda: None)
    assert zk.lost_reads == 1
    assert await cluster_metadata.zk.exists(path) is None
    await cluster_metadata.admin_lock().acquire(timeout=1)


class _RepliesWithheld:
    """A real ZooKeeper client whose first create is applied by ZooKeeper but whose reply never arrives:
    with ``lose`` it fails with ``ConnectionLoss`` (the connection dropped before the reply), otherwise it
    never fires (ZooKeeper slower than the caller's timeout)."""

    def __init__(self, zk, lose):
        self._zk = zk
        self._lose = lose
        self.withheld = 0

    def __getattr__(self, name):
        return getattr(self._zk, name)

    def create(self, *args, **kwargs):
        applied = self._zk.create(*args, **kwargs)
        if self.withheld:
            return applied
        self.withheld += 1
        if self._lose:
            return applied.addCallback(lambda _path: defer.fail(ConnectionLoss()))
        return defer.Deferred()


@pytest_twisted.ensureDeferred
async def test_a_lock_whose_create_reply_was_lost_is_known_as_held(cluster_metadata, zookeeper):
    # The create was applied, but the caller only heard ConnectionLoss: the next attempt finds the znode. It is
    # this acquisition's own (its token, its session), so the lock is held, not waited for until the timeout.
    path = cluster_metadata.paths.admin_lock
    zk = _RepliesWithheld(cluster_metadata.zk, lose=True)
    await ZnodeMutex(zk, path).acquire(timeout=5).addTimeout(10, reactor)
    assert zk.withheld == 1
    assert (await cluster_metadata.zk.exists(path)).ephemeralOwner == cluster_metadata.zk.session_id
    other_zk = await connected(zookeeper)
    try:
        with pytest.raises(LockTimeoutError, match="adminLock is still held by another session after 0.2 s"):
            await ClusterMetadata(other_zk, cluster_metadata.paths.root).admin_lock().acquire(timeout=0.2)
    finally:
        await other_zk.close()
    # Another acquisition on the same session still waits for it (runs in one process are serialised).
    with pytest.raises(LockTimeoutError, match="still held"):
        await cluster_metadata.admin_lock().acquire(timeout=0.2)
    await cluster_metadata.admin_lock().release()
    assert await cluster_metadata.zk.exists(path) is None


@pytest_twisted.ensureDeferred
async def test_an_unanswered_lock_create_is_bounded_by_the_timeout_and_undone(cluster_metadata):
    # The create is applied but its answer does not come within the timeout: acquire fails at the timeout
    # (it waited for ever), and the znode the late create left behind is deleted, not held until the session
    # ends.
    path = cluster_metadata.paths.admin_lock
    zk = _RepliesWithheld(cluster_metadata.zk, lose=False)
    started = reactor.seconds()
    with pytest.raises(LockTimeoutError, match="adminLock: ZooKeeper did not answer within 0.3 s"):
        await ZnodeMutex(zk, path).acquire(timeout=0.3).addTimeout(10, reactor)
    assert reactor.seconds() - started < 5
    for _ in range(100):
        if await cluster_metadata.zk.exists(path) is None:
            break
        await task.deferLater(reactor, 0.05, lambda: None)
    assert await cluster_metadata.zk.exists(path) is None
    await cluster_metadata.admin_lock().acquire(timeout=1)


@pytest_twisted.ensureDeferred
async def test_edit_topology_writes_all_three_znodes_or_none(cluster_metadata):
    await cluster_metadata.edit_topology(lambda t, store: t.add_storage("h:1", 2, 0))
    topology = await cluster_metadata.topology()
    assert topology.value.storages() == ("h:1",)
    assert [stat.version for stat in topology.stat] == [1, 1, 1]
    with pytest.raises(TopologyError, match="already exists"):
        await cluster_metadata.edit_topology(lambda t, store: t.add_storage("h:1", 2, 0))
    await cluster_metadata.edit_topology(lambda t, store: t.assign("h:1", [0, 3], store.num_partitions))
    after = await cluster_metadata.topology()
    assert after.value.partitions_of("h:1") == (0, 3)
    assert [stat.version for stat in after.stat] == [2, 1, 1]  # only the assignment changed
    assert await cluster_metadata.zk.exists(cluster_metadata.paths.admin_lock) is None


@pytest_twisted.ensureDeferred
async def test_edit_topology_checks_the_versions_of_the_znodes_it_does_not_change(cluster_metadata):
    # The edit changes only the assignment; a writer outside the lock rewrites the group znode between
    # the edit's read and its commit. Only the changed znode was checked, so the edit, computed from a
    # group that no longer held, was written.
    await cluster_metadata.edit_topology(lambda t, store: t.add_storage("h:1", 2, 0))
    zk, group, read_topology = cluster_metadata.zk, cluster_metadata.paths.group, cluster_metadata.topology
    reads = []

    async def read_then_overwritten():
        current = await read_topology()
        reads.append(current)
        if len(reads) == 1:
            data, _ = await zk.get(group)
            await zk.set(group, data)                   # the same bytes at a new version
        return current
    cluster_metadata.topology = lambda: defer.ensureDeferred(read_then_overwritten())
    await cluster_metadata.edit_topology(lambda t, store: t.assign("h:1", [1], store.num_partitions))
    assert len(reads) == 2                              # refused once, then read and applied again
    del cluster_metadata.topology
    after = await cluster_metadata.topology()
    assert after.value.partitions_of("h:1") == (1,) and [stat.version for stat in after.stat] == [2, 2, 1]


@pytest_twisted.ensureDeferred
async def test_describe(cluster_metadata):
    await cluster_metadata.edit_topology(lambda t, store: t.add_storage("h:1", 2, 0).auto_assign(0, 4))
    await cluster_metadata.new_store_session(0, 1)
    description = await cluster_metadata.describe()
    assert description.params == ClusterParams("test", TEST_PARTITIONS)
    assert description.store == await cluster_metadata.store_params()
    assert description.topology.partitions_of("h:1") == (0, 1, 2, 3)
    assert description.partitions[0] == (0, PartitionMetadata(1, 0, ()))
    assert description.partitions[1] == (1, EMPTY_PARTITION_METADATA)
    assert description.servers == () and description.assignment == PartitionAssignment()


@pytest_twisted.ensureDeferred
async def test_delete_refuses_while_servers_are_registered_unless_forced(cluster_metadata, zk_client):
    await cluster_metadata.register_server(ServerDescriptor(1, "h", 1, []))
    with pytest.raises(ServersRegisteredError, match="1 Waltz server"):
        await cluster_metadata.delete_cluster()
    await cluster_metadata.delete_cluster(force=True)
    assert await zk_client.exists(cluster_metadata.paths.root) is None
    with pytest.raises(ClusterNotFoundError):
        await cluster_metadata.delete_cluster()


@pytest_twisted.ensureDeferred
async def test_store_params_reads_the_key(cluster_metadata, zk_client):
    data, _ = await zk_client.get(cluster_metadata.paths.store)
    assert await cluster_metadata.store_params() == StoreParams.decode(data)
