"""docs/client.md stays true: its bank example runs (on the unit-test fakes), its config table lists
every key, its lock hash example holds."""

import os
import re
import sqlite3

from twisted.internet import defer

from tests.client.conftest import Harness
from waltz.client.api import Outcome
from waltz.client.config import CLIENT_KEYS
from waltz.protocols import client_messages as m
from waltz.protocols.locks import lock_hash
from waltz.protocols.values import checksum

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "client.md")


def doc_text():
    with open(DOC, encoding="utf-8") as stream:
        return stream.read()


def bank_module():
    """The bank example of docs/client.md, executed as a module named 'bank' (main() not run)."""
    blocks = re.findall(r"```python\n(.*?)```", doc_text(), re.S)
    [code] = [b for b in blocks if b.startswith("# bank.py")]
    namespace = {"__name__": "bank"}
    exec(compile(code, "docs/client.md#bank.py", "exec"), namespace)
    return namespace


def sync(function, *args):
    return defer.maybeDeferred(function, *args)


def test_the_bank_example_runs(tmp_path):
    bank_ns = bank_module()
    path = str(tmp_path / "bank.db")
    harness = Harness()
    bank = bank_ns["Bank"](lambda: sqlite3.connect(path), run=sync)
    bank.create_tables()
    client = harness.client(bank)
    results = []

    def run(context):
        client.execute(context).addCallback(results.append)
        harness.settle()
        return results[-1]

    deposit = run(bank_ns["Deposit"](1, 100))
    assert deposit.outcome is Outcome.COMMITTED
    assert client.when_applied(deposit.partition_id, deposit.transaction_id).called
    assert run(bank_ns["Withdrawal"](bank, 1, 60)).outcome is Outcome.COMMITTED
    refused = bank_ns["Withdrawal"](bank, 1, 60)
    assert run(refused).outcome is Outcome.IGNORED and refused.refused
    assert bank.balance(1).result == 40
    [withdrawal] = [a for a in harness.server_a.messages(m.AppendRequest) if a.header == bank_ns["WITHDRAWAL"]]
    assert withdrawal.write_locks == (lock_hash("account", 1),) and withdrawal.req_id.partition_id == 1
    assert sqlite3.connect(path).execute(
        "SELECT HIGH_WATER_MARK FROM WALTZ_CLIENT_HIGH_WATER_MARK WHERE PARTITION_ID = 1").fetchone() == (1,)


def test_the_config_table_lists_every_key_with_its_default():
    text = doc_text()
    for key in CLIENT_KEYS:
        row = re.search(r"^\| `%s` \| ([^|]+) \|" % re.escape(key.name), text, re.M)
        assert row, "%s is missing from docs/client.md" % key.name
        shown = row.group(1).strip()
        expected = "required" if key.default.__class__ is object else str(key.default).lower()
        assert shown == expected, key.name


def test_the_lock_hash_example_holds():
    assert 'lock_hash("account", 42) == checksum(b"account" + (42).to_bytes(8, "big"))' in doc_text()
    assert lock_hash("account", 42) == checksum(b"account" + (42).to_bytes(8, "big"))
