"""The demo's final checks: what the instances' databases and reports prove about the run.

Each instance's database holds its ``accounts`` view and its ``ledger`` (every transaction it applied, in
order); its report lists the transactions it committed. :func:`verify` checks:

- **exactly once**: every instance applied each partition's transactions 0..high-water mark once each,
  in order (transactions of other applications included, as ``other``), and its stored client
  high-water mark is the last one;
- **committed means applied**: every transaction any instance committed is in every instance's ledger,
  at the position the commit reported, with the same content;
- **applied means committed once**: every bank transaction in the log on this run's accounts is one that an
  instance was told committed, and no commit got into the log twice (an append retried after a lost answer,
  or a context reported failed whose append committed, would show here);
- **no overdraft**: replaying the ledger in log order, no balance ever goes below zero;
- **no withdrawal after a deactivation**;
- **the view matches the log**: the ``accounts`` table equals the replay of the ledger;
- **the instances agree**: every instance has the same ledger and the same accounts.
"""

import collections
import json
import sqlite3

import attr

from waltz.demo.bank import DEACTIVATE, DEPOSIT, WITHDRAWAL


@attr.s(frozen=True)
class InstanceState:
    """One instance at the end of the run. Ledger entries and commits are
    ``(partition, transaction_id, type, account, amount)`` tuples."""

    name = attr.ib()
    accounts = attr.ib()        # {account: (balance, active)}
    ledger = attr.ib()          # in the order the instance applied them
    marks = attr.ib()           # {partition: stored client high-water mark}
    committed = attr.ib()       # what this instance committed
    log_marks = attr.ib()       # {partition: the log's high-water mark at the end}
    accounts_range = attr.ib(default=None)   # range of this run's account numbers (None: an older report)


@attr.s(frozen=True)
class CheckResult:
    name = attr.ib()
    problems = attr.ib()        # list of strings; empty when the check passed
    summary = attr.ib(default="")

    @property
    def passed(self):
        return not self.problems


def load_instance(name, db_path, report_path):
    """Read an instance's database and report."""
    with open(report_path, encoding="utf-8") as stream:
        report = json.load(stream)
    connection = sqlite3.connect(db_path)
    try:
        accounts = {a: (b, bool(active)) for a, b, active in
                    connection.execute("SELECT account, balance, active FROM accounts")}
        ledger = [tuple(row) for row in connection.execute(
            "SELECT partition, transaction_id, type, account, amount FROM ledger ORDER BY rowid")]
        marks = dict(connection.execute("SELECT PARTITION_ID, HIGH_WATER_MARK FROM WALTZ_CLIENT_HIGH_WATER_MARK"))
    finally:
        connection.close()
    run_accounts = report.get("accounts")
    return InstanceState(name, accounts, ledger, marks, [tuple(c) for c in report["committed"]],
                         {int(p): m for p, m in report["high_water_marks"].items()},
                         range(run_accounts[0], run_accounts[1] + 1) if run_accounts else None)


def _by_partition(ledger):
    partitions = {}
    for entry in ledger:
        partitions.setdefault(entry[0], []).append(entry)
    return partitions


def check_exactly_once(state):
    """Each partition applied as 0, 1, ... high-water mark, once each, and the stored mark is the last."""
    problems = []
    applied = _by_partition(state.ledger)
    for partition, mark in sorted(state.log_marks.items()):
        ids = [entry[1] for entry in applied.get(partition, [])]
        if ids != list(range(mark + 1)):
            problems.append("%s: partition %d: applied %s" % (state.name, partition, _describe_ids(ids, mark)))
        stored = state.marks.get(partition, -1)
        if stored != mark:
            problems.append("%s: partition %d: stored high-water mark %d, the log's is %d"
                            % (state.name, partition, stored, mark))
    return problems


def _describe_ids(ids, mark):
    """What is wrong with a partition's applied ids, expected to be exactly 0..mark in order."""
    seen, twice = set(), set()
    for i in ids:
        (twice if i in seen else seen).add(i)
    missing = sorted(set(range(mark + 1)) - seen)
    beyond = sorted(i for i in seen if i > mark or i < 0)
    parts = []
    if twice:
        parts.append("more than once: %s" % sorted(twice)[:10])
    if missing:
        parts.append("never: %s" % missing[:10])
    if beyond:
        parts.append("beyond the high-water mark %d: %s" % (mark, beyond[:10]))
    if not parts:
        parts.append("out of order")
    return "; ".join(parts)


def check_committed_applied(states):
    """Every transaction any instance committed is in every ledger, where the commit said, with that content."""
    problems = []
    committed = [entry for state in states for entry in state.committed]
    for state in states:
        position = {}
        for entry in state.ledger:
            position.setdefault((entry[0], entry[1]), []).append(entry)
        for entry in committed:
            found = position.get((entry[0], entry[1]), [])
            if len(found) != 1 or found[0] != entry:
                problems.append("%s: committed transaction %d/%d %s applied as %s"
                                % (state.name, entry[0], entry[1], entry[2:], [f[2:] for f in found] or "nothing"))
    return problems


def check_applied_committed(states):
    """Every bank transaction in the log on this run's accounts was committed by an instance, once: the log's
    entries there (the first instance's ledger; :func:`check_agreement` compares the others) and the commits
    the instances reported are the same, entry for entry, repeats counted."""
    ranges = {state.accounts_range for state in states}
    if not states or None in ranges or len(ranges) != 1:
        return [] if not states or None in ranges else ["the instances report different account ranges"]
    run_accounts = ranges.pop()
    in_log = collections.Counter(entry for entry in states[0].ledger
                                 if entry[2] in (DEPOSIT, WITHDRAWAL, DEACTIVATE) and entry[3] in run_accounts)
    committed = collections.Counter(entry for state in states for entry in state.committed)
    problems = ["transaction %d/%d %s is in the log %d times but was committed %d times"
                % (entry[0], entry[1], entry[2:], count, committed[entry])
                for entry, count in sorted(in_log.items()) if count != committed[entry]]
    problems += ["committed transaction %d/%d %s was reported %d times" % (entry[0], entry[1], entry[2:], count)
                 for entry, count in sorted(committed.items()) if count > 1 and entry not in in_log]
    positions = collections.Counter(entry[:2] for entry in committed.elements())
    problems += ["two commits report position %d/%d" % position for position, count in sorted(positions.items())
                 if count > 1]
    return problems


def replay(ledger):
    """Replay a ledger in log order: ``(accounts {account: (balance, active)}, problems)``."""
    accounts, problems = {}, []
    for partition_entries in _by_partition(ledger).values():
        for partition, txn, kind, account, amount in sorted(partition_entries, key=lambda e: e[1]):
            if kind not in (DEPOSIT, WITHDRAWAL, DEACTIVATE):
                continue                # another application's transaction
            balance, active = accounts.get(account, (0, True))
            if kind == DEPOSIT:
                balance += amount
            elif kind == WITHDRAWAL:
                if not active:
                    problems.append("withdrawal %d/%d of %d from account %d after its deactivation"
                                    % (partition, txn, amount, account))
                balance -= amount
                if balance < 0:
                    problems.append("withdrawal %d/%d overdrew account %d to %d" % (partition, txn, account, balance))
            else:
                active = False
            accounts[account] = (balance, active)
    return accounts, problems


def check_ledger(state):
    """No overdraft, no withdrawal after a deactivation, and the accounts table is the ledger's replay."""
    accounts, problems = replay(state.ledger)
    problems = ["%s: %s" % (state.name, problem) for problem in problems]
    if accounts != state.accounts:
        differing = sorted(a for a in set(accounts) | set(state.accounts) if accounts.get(a) != state.accounts.get(a))
        problems.append("%s: accounts table differs from the replay of its ledger for accounts %s"
                        % (state.name, differing[:10]))
    return problems


def check_agreement(states):
    """Every instance has the same ledger (in log order) and the same accounts as the first one."""
    problems = []
    first = states[0]
    reference = sorted(first.ledger)
    for state in states[1:]:
        if sorted(state.ledger) != reference:
            problems.append("%s and %s applied different transactions" % (first.name, state.name))
        if state.accounts != first.accounts:
            problems.append("%s and %s disagree on the accounts" % (first.name, state.name))
    return problems


def verify(states):
    """Run every check; a list of :class:`CheckResult`."""
    applied = sum(len(s.ledger) for s in states)
    committed = sum(len(s.committed) for s in states)
    accounts, _ = replay(states[0].ledger) if states else ({}, [])
    negative = sum(1 for balance, _ in accounts.values() if balance < 0)
    deactivated = sum(1 for _, active in accounts.values() if not active)
    return [
        CheckResult("every committed transaction applied exactly once by every instance",
                    [p for s in states for p in check_exactly_once(s)] + check_committed_applied(states)
                    + check_applied_committed(states),
                    "%d committed in this run; %d applications in %d instances"
                    % (committed, applied, len(states))),
        CheckResult("no account went negative, no withdrawal after a deactivation",
                    [p for s in states for p in check_ledger(s)],
                    "%d accounts, %d negative, %d deactivated" % (len(accounts), negative, deactivated)),
        CheckResult("all instances' databases agree", check_agreement(states) if states else ["no instances"],
                    "%d ledger entries each" % (len(states[0].ledger) if states else 0)),
    ]
