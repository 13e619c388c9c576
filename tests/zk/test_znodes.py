"""Znode value classes: golden bytes (the original's layouts), round trips, clear decode errors."""

import uuid

import pytest
from hypothesis import given, strategies as st

from waltz.zk.errors import ZnodeDecodeError
from waltz.zk.znodes import (CLUSTER_MAGIC, EMPTY_PARTITION_METADATA, UNRESOLVED, ClusterParams,
                             ClusterPaths, ConnectionMetadata, GroupDescriptor, IdCounter,
                             PartitionAssignment, PartitionInfo, PartitionMetadata, ReplicaAssignments,
                             ReplicaId, ReplicaState, ServerDescriptor, StoreParams)

KEY = uuid.UUID("00112233-4455-6677-8899-aabbccddeeff")

# Each golden vector is written out from the original's writeTo/serialize code, field by field.
GOLDEN = [
    (ClusterParams("demo", 4),
     "b4e87347"            # magic: "Cluster Manager".hashCode() = -1259834553
     "01"                  # version
     "0004" "64656d6f"     # writeUTF("demo")
     "00000004"),          # numPartitions
    (PartitionMetadata(2, 5, [ReplicaState(ReplicaId(0, "h:1"), 4, UNRESOLVED)]),
     "01"                  # version
     "00000002"            # generation
     "0000000000000005"    # sessionId
     "00000001"            # number of replica states
     "01"                  # ReplicaState version
     "01" "00000000" "0003" "683a31"   # ReplicaId: version, partitionId, writeUTF("h:1")
     "0000000000000004"    # sessionId
     "8000000000000000"),  # closingHighWaterMark = UNRESOLVED (Long.MIN_VALUE)
    (EMPTY_PARTITION_METADATA, "01" "ffffffff" "ffffffffffffffff" "00000000"),
    (StoreParams(KEY, 3), "01" "00112233445566778899aabbccddeeff" "00000003"),
    (ReplicaAssignments({"a:1": [0, 2]}), "01" "00000001" "0003" "613a31" "00000002" "00000000" "00000002"),
    (GroupDescriptor({"a:1": 1}), "01" "00000001" "0003" "613a31" "00000001"),
    (ConnectionMetadata({"a:1": 55281}), "01" "00000001" "0003" "613a31" "0000d7f1"),
    (PartitionAssignment(), "03" "ffffffff" "00000000" "00000000"),
    (PartitionAssignment(7, 2, {1: [(0, 3)]}),
     "03" "00000007" "00000002" "00000001" "00000001" "00000001" "00000000" "00000003"),
    (ServerDescriptor(9, "h", 80, [1]), "01" "00000009" "0001" "68" "00000050" "00000001" "00000001"),
    (IdCounter(5), "00000005"),
]


@pytest.mark.parametrize("value, golden", GOLDEN, ids=lambda v: type(v).__name__ if not isinstance(v, str) else "")
def test_golden_bytes(value, golden):
    assert value.encode().hex() == golden
    assert type(value).decode(bytes.fromhex(golden)) == value


def test_cluster_magic_is_the_java_hash_code():
    hash_code = 0
    for char in "Cluster Manager":
        hash_code = (31 * hash_code + ord(char)) & 0xFFFFFFFF
    assert hash_code - 2 ** 32 == CLUSTER_MAGIC


def test_map_values_compare_equal_whatever_the_order():
    one = ReplicaAssignments({"b:1": [1], "a:1": [0]})
    two = ReplicaAssignments([("a:1", (0,)), ("b:1", (1,))])
    assert one == two and hash(one) == hash(two)
    assert one.get("a:1") == (0,) and "b:1" in one and "c:1" not in one
    assert one.replicas_of(1) == ("b:1",)


def test_partition_metadata_keys_replica_states_by_replica_id():
    a, b = ReplicaId(0, "a:1"), ReplicaId(0, "b:1")
    meta = PartitionMetadata(1, 1, [ReplicaState(b, 1), ReplicaState(a, 1), ReplicaState(b, 2, 10)])
    assert [s.replica_id for s in meta.replica_states] == [a, b]
    assert meta.replica_state(b) == ReplicaState(b, 2, 10)
    assert meta.replica_state(ReplicaId(1, "a:1")) is None
    assert not meta.replica_state(a).is_resolved and meta.replica_state(b).is_resolved


storages = st.from_regex(r"[a-z0-9.]{1,12}:[0-9]{1,5}", fullmatch=True)
i32 = st.integers(-(2 ** 31), 2 ** 31 - 1)
i64 = st.integers(-(2 ** 63), 2 ** 63 - 1)


@given(st.integers(0, 2 ** 31 - 1), i64,
       st.lists(st.builds(ReplicaState, st.builds(ReplicaId, st.integers(0, 1000), storages), i64, i64)))
def test_partition_metadata_round_trips(generation, session_id, states):
    meta = PartitionMetadata(generation, session_id, states)
    assert PartitionMetadata.decode(meta.encode()) == meta


@given(st.text(max_size=50), i32)
def test_cluster_params_round_trip(name, partitions):
    params = ClusterParams(name, partitions)
    assert ClusterParams.decode(params.encode()) == params


@given(st.dictionaries(storages, st.lists(st.integers(0, 100), max_size=10)),
       st.dictionaries(storages, i32), st.dictionaries(st.integers(0, 99), st.tuples(st.integers(0, 50), i32)))
def test_maps_round_trip(assignments, groups, holders):
    servers = {}
    for partition_id, (server_id, generation) in holders.items():     # each partition held once
        servers.setdefault(server_id, []).append(PartitionInfo(partition_id, generation))
    for value in (ReplicaAssignments(assignments), GroupDescriptor(groups), ConnectionMetadata(groups),
                  PartitionAssignment(3, 100, servers)):
        assert type(value).decode(value.encode()) == value


@pytest.mark.parametrize("cls, data, message", [
    (ClusterParams, "00000000" "01" "0000" "00000001", "magic number mismatch: 0"),
    (ClusterParams, "b4e87347" "02" "0000" "00000001", "unsupported version 2"),
    (PartitionMetadata, "01" "00000001", "truncated: need 8 bytes for sessionId"),
    (PartitionMetadata, "01" "00000001" "0000000000000001" "7fffffff", "bad replica state count"),
    (StoreParams, "01" "00112233445566778899aabbccddeeff" "00000003" "00", "1 unexpected trailing bytes"),
    (PartitionAssignment, "01" "ffffffff" "00000000" "00000000", "unsupported version 1 (expected 3)"),
    # Two holders of one partition would both serve it at the same generation.
    (PartitionAssignment, "03" "00000001" "00000002" "00000002" "00000001" "00000001" "00000000" "00000003"
     "00000002" "00000001" "00000000" "00000003", "partition 0 is assigned twice"),
    (PartitionAssignment, "03" "00000001" "00000002" "00000001" "00000001" "00000001" "ffffffff" "00000003",
     "partition -1 of server 1 is not one of the 2 partitions"),
    (PartitionAssignment, "03" "00000001" "00000002" "00000002" "00000001" "00000000" "00000001" "00000000",
     "server 1 is listed twice"),
    (ReplicaAssignments, "", "is empty"),
])
def test_garbage_raises_a_clear_error_naming_the_znode(cls, data, message):
    with pytest.raises(ZnodeDecodeError) as info:
        cls.decode(bytes.fromhex(data), "/cluster/store/partition/3")
    assert "/cluster/store/partition/3" in str(info.value)
    assert message in str(info.value)
    assert cls.__name__ in str(info.value)


@given(st.binary(max_size=64))
def test_any_bytes_decode_or_raise_znode_decode_error(data):
    for cls in (ClusterParams, PartitionMetadata, StoreParams, ReplicaAssignments, GroupDescriptor,
                PartitionAssignment, ServerDescriptor):
        try:
            cls.decode(data, "/x")
        except ZnodeDecodeError:
            pass


def test_cluster_paths():
    paths = ClusterPaths("/waltz_cluster")
    assert paths.server_descriptors == "/waltz_cluster/serverDescriptors"
    assert paths.server_descriptor_prefix == "/waltz_cluster/serverDescriptors/s_"
    assert (paths.client_ids, paths.server_ids) == ("/waltz_cluster/ids/client", "/waltz_cluster/ids/server")
    assert paths.store == "/waltz_cluster/store"
    assert paths.partition(12) == "/waltz_cluster/store/partition/12"
    assert (paths.assignment, paths.group, paths.connection, paths.admin_lock) == (
        "/waltz_cluster/store/assignment", "/waltz_cluster/store/group", "/waltz_cluster/store/connection",
        "/waltz_cluster/store/adminLock")


@pytest.mark.parametrize("root", ["waltz", "/", "/a/", "/a//b"])
def test_cluster_paths_refuse_bad_roots(root):
    with pytest.raises(ValueError, match="absolute znode path"):
        ClusterPaths(root)
