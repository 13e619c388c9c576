"""Table tests of the partition assignment policy (waltz/server/assignment.py)."""

import random

import pytest

from waltz.server.assignment import AssignmentError, compute_assignment, partitions_of
from waltz.zk.znodes import PartitionAssignment, PartitionInfo, ServerDescriptor

EMPTY = PartitionAssignment()


def server(server_id, *preferred):
    return ServerDescriptor(server_id, "127.0.0.1", 55180 + server_id, preferred)


def assignment(cversion, num_partitions, **servers):
    """``assignment(3, 4, s1={0: 1, 1: 1}, s2={2: 1})``: server id -> {partition: generation}."""
    return PartitionAssignment(cversion, num_partitions, {
        int(name[1:]): tuple(PartitionInfo(p, g) for p, g in partitions.items())
        for name, partitions in servers.items()})


def compute(current, num_partitions, servers, seed=0, cversion=7):
    return compute_assignment(cversion, current, num_partitions, servers, random.Random(seed))


def counts(result):
    return {server_id: len(infos) for server_id, infos in result.servers}


def owners(result):
    return {info.partition_id: server_id for server_id, infos in result.servers for info in infos}


def generations(result):
    return {info.partition_id: info.generation for _, infos in result.servers for info in infos}


def check_complete(result, num_partitions):
    """Every partition exactly once."""
    assigned = [info.partition_id for _, infos in result.servers for info in infos]
    assert sorted(assigned) == list(range(num_partitions))


# --- even spread ------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_partitions,num_servers,expected", [
    (4, 1, [4]),
    (4, 2, [2, 2]),
    (4, 3, [2, 1, 1]),
    (5, 3, [2, 2, 1]),
    (3, 5, [1, 1, 1, 0, 0]),
    (12, 4, [3, 3, 3, 3]),
    (1, 1, [1]),
])
def test_first_assignment_spreads_evenly_with_generation_one(num_partitions, num_servers, expected):
    result = compute(EMPTY, num_partitions, [server(i) for i in range(1, num_servers + 1)])
    check_complete(result, num_partitions)
    assert sorted(counts(result).values(), reverse=True) == expected
    assert set(counts(result)) == set(range(1, num_servers + 1)), "every live server is listed"
    assert set(generations(result).values()) == {1}
    assert (result.cversion, result.num_partitions) == (7, num_partitions)


def test_no_live_server_gives_an_empty_assignment():
    current = assignment(3, 4, s1={0: 1, 1: 1, 2: 1, 3: 1})
    result = compute(current, 4, [])
    assert result == PartitionAssignment(7, 4, {})


def test_each_list_is_shuffled_with_the_injected_rng():
    servers = [server(1)]
    orders = {tuple(i.partition_id for i in compute(EMPTY, 20, servers, seed=seed).partitions_for(1))
              for seed in range(5)}
    assert len(orders) > 1, "the order does not depend on the rng"
    assert compute(EMPTY, 20, servers, seed=3) == compute(EMPTY, 20, servers, seed=3)


# --- stability and generations ----------------------------------------------------------------------

def test_same_membership_keeps_everything_and_every_generation():
    current = assignment(3, 4, s1={0: 5, 2: 1}, s2={1: 2, 3: 9})
    result = compute(current, 4, [server(1), server(2)])
    assert owners(result) == owners(current)
    assert generations(result) == {0: 5, 1: 2, 2: 1, 3: 9}


def test_a_joining_server_takes_an_even_share_and_only_moved_partitions_bump():
    current = assignment(3, 4, s1={0: 1, 1: 1, 2: 1, 3: 1})
    result = compute(current, 4, [server(1), server(2)])
    check_complete(result, 4)
    assert counts(result) == {1: 2, 2: 2}
    for pid, owner in owners(result).items():
        assert generations(result)[pid] == (1 if owner == 1 else 2), "partition %d" % pid
    # server 1 kept the first two of its current list
    assert {i.partition_id for i in result.partitions_for(1)} == {0, 1}


def test_a_leaving_server_moves_its_partitions_with_bumped_generations():
    current = assignment(3, 4, s1={0: 1, 2: 4}, s2={1: 1, 3: 7})
    result = compute(current, 4, [server(1)])
    assert owners(result) == {0: 1, 1: 1, 2: 1, 3: 1}
    assert generations(result) == {0: 1, 1: 2, 2: 4, 3: 8}
    assert counts(result) == {1: 4}


def test_two_of_three_servers_leave_one_holds_all():
    current = assignment(3, 6, s1={0: 1, 1: 1}, s2={2: 1, 3: 1}, s3={4: 3, 5: 3})
    result = compute(current, 6, [server(2)])
    assert set(owners(result).values()) == {2}
    assert generations(result) == {0: 2, 1: 2, 2: 1, 3: 1, 4: 4, 5: 4}


def test_server_over_its_share_gives_up_the_tail_of_its_list():
    current = assignment(3, 6, s1={4: 1, 0: 1, 5: 1, 1: 1, 2: 1, 3: 1})
    result = compute(current, 6, [server(1), server(2), server(3)])
    assert counts(result) == {1: 2, 2: 2, 3: 2}
    assert {i.partition_id for i in result.partitions_for(1)} == {4, 0}
    # the rest goes out in ascending partition order: 1, 2 to server 2; 3, 5 to server 3
    assert {i.partition_id for i in result.partitions_for(2)} == {1, 2}
    assert {i.partition_id for i in result.partitions_for(3)} == {3, 5}
    assert generations(result) == {4: 1, 0: 1, 1: 2, 2: 2, 3: 2, 5: 2}


def test_new_partitions_start_at_generation_one_and_old_ones_keep_theirs():
    current = assignment(3, 2, s1={0: 3, 1: 4})
    result = compute(current, 4, [server(1), server(2)])
    check_complete(result, 4)
    assert owners(result)[0] == owners(result)[1] == 1
    assert generations(result) == {0: 3, 1: 4, 2: 1, 3: 1}


def test_the_partition_count_cannot_shrink():
    with pytest.raises(AssignmentError, match="cannot decrease"):
        compute(assignment(3, 4, s1={0: 1, 1: 1, 2: 1, 3: 1}), 2, [server(1)])


def test_a_server_id_listed_twice_counts_once():
    result = compute(EMPTY, 4, [server(1), server(1), server(2)])
    assert counts(result) == {1: 2, 2: 2}


# --- preferred partitions ---------------------------------------------------------------------------

def test_preferred_partitions_come_first():
    current = assignment(3, 4, s1={0: 1, 1: 1}, s2={2: 1, 3: 1})
    result = compute(current, 4, [server(1, 2, 3), server(2)])
    assert {i.partition_id for i in result.partitions_for(1)} == {2, 3}
    assert {i.partition_id for i in result.partitions_for(2)} == {0, 1}
    assert generations(result) == {0: 2, 1: 2, 2: 2, 3: 2}


def test_first_claimant_of_a_preferred_partition_wins():
    result = compute(EMPTY, 4, [server(2, 0), server(1, 0)])
    assert owners(result)[0] == 1


def test_preferred_partitions_are_limited_to_the_even_share():
    result = compute(EMPTY, 4, [server(1, 0, 1, 2, 3), server(2)])
    assert counts(result) == {1: 2, 2: 2}
    assert {i.partition_id for i in result.partitions_for(1)} == {0, 1}


def test_preferred_partition_out_of_range_is_ignored():
    result = compute(EMPTY, 2, [server(1, 9), server(2)])
    check_complete(result, 2)
    assert counts(result) == {1: 1, 2: 1}


def test_preferred_partition_held_already_keeps_its_generation():
    current = assignment(3, 2, s1={0: 6}, s2={1: 2})
    result = compute(current, 2, [server(1, 0), server(2, 1)])
    assert generations(result) == {0: 6, 1: 2}


# --- helpers ----------------------------------------------------------------------------------------

def test_partitions_of_maps_partition_to_generation():
    current = assignment(3, 4, s1={0: 5, 2: 1}, s2={1: 2, 3: 9})
    assert partitions_of(current, 2) == {1: 2, 3: 9}
    assert partitions_of(current, 3) == {}


@pytest.mark.parametrize("seed", range(20))
def test_random_membership_changes_stay_complete_even_and_bump_only_on_moves(seed):
    rng = random.Random(seed)
    num_partitions = rng.randint(1, 16)
    current = EMPTY
    for _ in range(10):
        live = [server(i, *rng.sample(range(num_partitions), rng.randint(0, 2)))
                for i in sorted(rng.sample(range(1, 7), rng.randint(1, 5)))]
        result = compute_assignment(0, current, num_partitions, live, rng)
        check_complete(result, num_partitions)
        sizes = counts(result).values()
        assert max(sizes) - min(sizes) <= 1
        before, after = owners(current), owners(result)
        for pid, generation in generations(result).items():
            old = generations(current).get(pid, 0)
            assert generation == (old if before.get(pid) == after[pid] else old + 1), "partition %d" % pid
        current = result
