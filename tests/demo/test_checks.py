"""The demo's final checks: each one passes on a consistent run and catches what it is there to catch."""

import attr

from waltz.demo.checks import InstanceState, check_agreement, check_applied_committed, check_committed_applied, \
    check_exactly_once, check_ledger, replay, verify

LEDGER = [
    (0, 0, "deposit", 2, 100),
    (1, 0, "deposit", 1, 50),
    (0, 1, "withdrawal", 2, 60),
    (1, 1, "other", -1, 0),
    (0, 2, "deactivate", 2, 0),
    (1, 2, "withdrawal", 1, 50),
]
ACCOUNTS = {2: (40, False), 1: (0, True)}
MARKS = {0: 2, 1: 2}


def instance(name="a", ledger=LEDGER, accounts=ACCOUNTS, marks=MARKS, committed=(), log_marks=MARKS,
             accounts_range=range(1, 3)):
    return InstanceState(name, dict(accounts), list(ledger), dict(marks), list(committed), dict(log_marks),
                         accounts_range)


#: Every bank transaction of LEDGER, committed by one of two instances.
BANK = [entry for entry in LEDGER if entry[2] != "other"]


def test_a_consistent_run_passes_every_check():
    states = [instance("a", committed=BANK[:2]), instance("b", committed=BANK[2:])]
    results = verify(states)
    assert [r.passed for r in results] == [True, True, True]
    assert "2 accounts, 0 negative, 1 deactivated" in results[1].summary


def test_replay_follows_log_order_per_partition():
    shuffled = [LEDGER[i] for i in (5, 4, 3, 2, 1, 0)]
    assert replay(shuffled) == (ACCOUNTS, [])


def test_a_transaction_applied_twice_is_caught():
    problems = check_exactly_once(instance(ledger=LEDGER + [LEDGER[2]]))
    assert problems == ["a: partition 0: applied more than once: [1]"]


def test_a_transaction_never_applied_is_caught():
    problems = check_exactly_once(instance(ledger=[e for e in LEDGER if e[:2] != (1, 1)]))
    assert problems == ["a: partition 1: applied never: [1]"]


def test_a_stored_mark_other_than_the_logs_is_caught():
    assert check_exactly_once(instance(marks={0: 2, 1: 1})) == [
        "a: partition 1: stored high-water mark 1, the log's is 2"]


def test_a_committed_transaction_missing_or_different_is_caught():
    lost = (0, 3, "deposit", 2, 10)
    changed = (1, 2, "withdrawal", 1, 40)
    problems = check_committed_applied([instance(committed=[lost, changed])])
    assert problems == ["a: committed transaction 0/3 ('deposit', 2, 10) applied as nothing",
                        "a: committed transaction 1/2 ('withdrawal', 1, 40) applied as [('withdrawal', 1, 50)]"]


def test_an_overdraft_is_caught():
    ledger = LEDGER[:5] + [(1, 2, "withdrawal", 1, 51)]
    problems = check_ledger(instance(ledger=ledger, accounts={2: (40, False), 1: (-1, True)}))
    assert problems == ["a: withdrawal 1/2 overdrew account 1 to -1"]


def test_a_withdrawal_after_a_deactivation_is_caught():
    ledger = LEDGER + [(0, 3, "withdrawal", 2, 10)]
    problems = check_ledger(instance(ledger=ledger, accounts={2: (30, False), 1: (0, True)}))
    assert problems == ["a: withdrawal 0/3 of 10 from account 2 after its deactivation"]


def test_an_accounts_table_that_is_not_the_ledgers_replay_is_caught():
    problems = check_ledger(instance(accounts={2: (40, True), 1: (0, True)}))
    assert problems == ["a: accounts table differs from the replay of its ledger for accounts [2]"]


def test_instances_that_disagree_are_caught():
    other = instance("b", ledger=LEDGER[:5] + [(1, 2, "deposit", 1, 50)], accounts={2: (40, False), 1: (100, True)})
    assert check_agreement([instance("a"), other]) == ["a and b applied different transactions",
                                                       "a and b disagree on the accounts"]
    assert check_agreement([instance("a"), attr.evolve(instance("b"), ledger=list(reversed(LEDGER)))]) == []


def test_a_transaction_in_the_log_twice_or_never_reported_committed_is_caught():
    # Before: only committed -> applied was checked; a deposit appended twice (and the withdrawal it paid for)
    # passed every check.
    twice = (0, 3, "deposit", 2, 100)
    ledger = LEDGER + [twice]
    states = [instance("a", ledger=ledger, committed=BANK[:2] + [LEDGER[0]]),
              instance("b", ledger=ledger, committed=BANK[2:])]
    assert check_applied_committed(states) == [
        "transaction 0/0 ('deposit', 2, 100) is in the log 1 times but was committed 2 times",
        "transaction 0/3 ('deposit', 2, 100) is in the log 1 times but was committed 0 times",
        "two commits report position 0/0"]
    failed = verify(states)[0]
    assert not failed.passed
    # An entry of another run's accounts (or of another application) is not this run's to account for.
    assert check_applied_committed([instance("a", committed=BANK, accounts_range=range(1, 3)),
                                    instance("b", ledger=LEDGER, accounts_range=range(1, 3))]) == []
    assert check_applied_committed([instance("a", committed=BANK[1:], accounts_range=range(1, 2))]) == []
    # Reports written before the run's account range was recorded are not checked this way.
    assert check_applied_committed([instance("a", accounts_range=None)]) == []
