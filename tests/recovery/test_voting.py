"""Table tests for quorum voting on the closing high-water mark (seed 000)."""

import pytest

from waltz.recovery.voting import quorum_of, resolve_high_water_mark

# Seed 000's figure: H_C < H_A < H_B. A votes for {H_A, H_C}, B for all three, C for {H_C}.
H_C, H_A, H_B = 10, 20, 30


@pytest.mark.parametrize("replicas, quorum", [(1, 1), (2, 2), (3, 2), (4, 3), (5, 3), (6, 4)])
def test_quorum_is_a_majority_of_assigned_replicas(replicas, quorum):
    assert quorum_of(replicas) == quorum


@pytest.mark.parametrize("votes, replicas, expected", [
    # The seed's example: all three vote, H_A is the highest a majority holds.
    ((H_A, H_B, H_C), 3, H_A),
    # Its undecidable variant: B is offline; H_A has 1 vote + 1 offline = quorum, so it could be committed.
    ((H_A, H_C), 3, None),
    # Decidable again once C catches up with A.
    ((H_A, H_A), 3, H_A),
    # Quorum of 1.
    ((7,), 1, 7),
    ((-1,), 1, -1),
    ((), 1, None),
    # Quorum of 2 out of 2: both must hold it.
    ((5, 9), 2, 5),
    ((9,), 2, None),
    # Three replicas, everyone agrees, or all empty.
    ((4, 4, 4), 3, 4),
    ((-1, -1, -1), 3, -1),
    # Ties at the top.
    ((8, 8, 3), 3, 8),
    # Two offline of three: nothing is decidable.
    ((100,), 3, None),
    # One offline of three, but the top candidate cannot reach quorum even with it... it can: 1+1=2.
    ((100, 50), 3, None),
    # One offline of three and both voters agree: decided whatever the third holds.
    ((50, 50), 3, 50),
    # Five replicas (quorum 3).
    ((10, 20, 30, 40, 50), 5, 30),
    ((10, 20, 30, 40), 5, None),    # 50 could exist on the offline one: 40 has 1 + 1 offline < 3, 30 has 2 + 1 = 3
    ((10, 10, 10, 40), 5, 10),      # 40: 1 + 1 < 3; 10: 4 >= 3
    ((30, 30, 10), 5, None),        # 30: 2 + 2 offline >= 3
    ((30, 30, 30), 5, 30),
    # Every replica offline.
    ((), 3, None),
    ((), 5, None),
])
def test_resolved_high_water_mark(votes, replicas, expected):
    outcome = resolve_high_water_mark(votes, replicas)
    assert outcome.high_water_mark == expected
    assert outcome.decided == (expected is not None)
    if expected is None:
        assert "undecidable" in outcome.reason


def test_outcome_reason_names_the_quorum():
    assert resolve_high_water_mark((H_A, H_B, H_C), 3).reason == "2 of 3 replicas hold 20 (quorum 2)"


def test_more_votes_than_replicas_is_a_bug():
    with pytest.raises(ValueError):
        resolve_high_water_mark((1, 2, 3), 2)
    with pytest.raises(ValueError):
        quorum_of(0)
