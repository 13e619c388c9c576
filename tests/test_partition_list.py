"""The partition list syntax shared by the command line tools and the Spark source."""

import pytest

from waltz.partition_list import PartitionListError, check_partitions_exist, parse_partition_list


def test_lists_are_ids_and_increasing_ranges_sorted_without_repeats():
    assert parse_partition_list("7, 0-3,2") == (0, 1, 2, 3, 7)
    assert parse_partition_list("5") == (5,)
    assert parse_partition_list("9999") == (9999,)


@pytest.mark.parametrize("text, message", [
    ("", "'' has an empty item"),
    ("1,,2", "'1,,2' has an empty item"),
    ("x", "'x' is not a partition id or a range like 0-3"),
    ("1-x", "'1-x' is not a partition id or a range like 0-3"),
    ("3-1", "'3-1' is not a partition id or an increasing range"),
    ("-1", "'-1' is not a partition id or a range like 0-3"),
    # Refused before the range is expanded (it built 20 million ids first).
    ("0-20000000", "20000000 is not a partition id (a cluster has at most 10000 partitions)"),
])
def test_a_bad_list_is_refused_naming_the_bad_item(text, message):
    with pytest.raises(PartitionListError) as raised:
        parse_partition_list(text)
    assert str(raised.value) == message


def test_existence_is_checked_against_the_cluster_naming_the_highest_missing_id():
    check_partitions_exist((0, 3), 4)
    check_partitions_exist((), 4)
    with pytest.raises(PartitionListError, match=r"^partition 6 does not exist \(the cluster has 4\)$"):
        check_partitions_exist((1, 5, 6), 4)
