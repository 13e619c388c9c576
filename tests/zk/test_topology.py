"""The admin edit rules on storage nodes and replica assignments (pure, no ZooKeeper)."""

import pytest

from waltz.zk.errors import TopologyError
from waltz.zk.topology import StoreTopology, format_ids

A, B, C = "10.0.0.1:55280", "10.0.0.2:55280", "10.0.0.3:55280"


def three_nodes():
    """A and B in group 0, C in group 1, nothing assigned."""
    return (StoreTopology().add_storage(A, 55281, 0).add_storage(B, 55281, 0).add_storage(C, 55281, 1))


@pytest.mark.parametrize("ids, text", [((), "-"), ((3,), "3"), ((0, 1, 2, 3, 7), "0-3,7"),
                                       ((5, 1, 2, 9, 10), "1-2,5,9-10")])
def test_format_ids(ids, text):
    assert format_ids(ids) == text


def test_add_storage_fills_all_three_maps():
    topology = StoreTopology().add_storage(A, 55281, 2)
    assert topology.assignments.as_dict() == {A: ()}
    assert topology.groups.as_dict() == {A: 2}
    assert topology.connections.as_dict() == {A: 55281}


@pytest.mark.parametrize("storage, port, group, message", [
    (A, 55281, 0, "already exists"),
    ("nohostport", 1, 0, "expected HOST:PORT"),
    ("h:70000", 1, 0, "expected HOST:PORT"),
    ('evil"\nhost:55280', 1, 0, "expected HOST:PORT"),   # before: written, then shown over two lines
    ("a b:55280", 1, 0, "expected HOST:PORT"),
    ("\t:55280", 1, 0, "expected HOST:PORT"),
    (C, 0, 0, "bad admin port"),
    (C, 1, -1, "bad group"),
])
def test_add_storage_refusals(storage, port, group, message):
    with pytest.raises(TopologyError, match=message):
        StoreTopology().add_storage(A, 55281, 0).add_storage(storage, port, group)


def test_assign_and_unassign():
    topology = three_nodes().assign(A, [0, 1], 4).assign(B, [0], 4)
    assert topology.partitions_of(A) == (0, 1)
    topology = topology.unassign(A, [0])
    assert topology.partitions_of(A) == (1,)
    assert topology.unreplicated(4) == (2, 3)


@pytest.mark.parametrize("storage, ids, message", [
    ("9.9.9.9:1", [0], "unknown storage node 9.9.9.9:1"),
    (A, [4], "partition 4 does not exist"),
    (A, [1, 0], "already holds partitions 1"),
])
def test_assign_refusals(storage, ids, message):
    with pytest.raises(TopologyError, match=message):
        three_nodes().assign(A, [1], 4).assign(storage, ids, 4)


def test_unassign_is_refused_when_the_group_would_lose_its_replica():
    # C (group 1) also holds partition 0, but A's group 0 would have none left.
    topology = three_nodes().assign(A, [0], 4).assign(C, [0], 4)
    with pytest.raises(TopologyError, match="leave group 0 without a replica of partitions 0"):
        topology.unassign(A, [0])
    assert topology.assign(B, [0], 4).unassign(A, [0]).partitions_of(A) == ()


def test_unassign_of_a_partition_not_held_is_refused():
    with pytest.raises(TopologyError, match="does not hold partitions 2"):
        three_nodes().assign(A, [0], 4).unassign(A, [0, 2])


def test_remove_storage_only_when_empty():
    topology = three_nodes().assign(C, [1, 2], 4)
    with pytest.raises(TopologyError, match="still holds partitions 1-2"):
        topology.remove_storage(C)
    assert topology.remove_storage(A).storages() == (B, C)
    with pytest.raises(TopologyError, match="unknown storage node"):
        topology.remove_storage("9.9.9.9:1")


def test_auto_assign_gives_each_partition_one_replica_in_the_group():
    topology = three_nodes().auto_assign(0, 5)
    assert topology.partitions_of(A) == (0, 2, 4)
    assert topology.partitions_of(B) == (1, 3)
    assert topology.partitions_of(C) == ()
    in_group = [pid for storage in topology.storages_in_group(0) for pid in topology.partitions_of(storage)]
    assert sorted(in_group) == list(range(5))


def test_auto_assign_refusals():
    with pytest.raises(TopologyError, match="group 7 has no storage nodes"):
        three_nodes().auto_assign(7, 4)
    with pytest.raises(TopologyError, match="already hold partitions"):
        three_nodes().assign(B, [3], 4).auto_assign(0, 4)
