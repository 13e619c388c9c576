"""The bank application: how it applies the log to SQLite, and the locks and refusals of its transactions."""

import sqlite3

import pytest
from twisted.internet import defer

from waltz.client import TransactionBuilder
from waltz.client.api import Transaction
from waltz.demo.bank import (
    HEADERS, Bank, Deactivation, Deposit, Withdrawal, decode_change, encode_change)
from waltz.protocols.locks import lock_hash
from waltz.protocols.values import ReqId


class DataReader:
    def __init__(self, data):
        self.data = data

    def fetch_data(self, transaction_id):
        return defer.succeed(self.data[transaction_id])


@pytest.fixture
def bank(tmp_path):
    connection = sqlite3.connect(str(tmp_path / "bank.db"))
    bank = Bank(lambda: connection, run=lambda function, *args: defer.maybeDeferred(function, *args))
    bank.create_tables()
    return bank


def apply(bank, changes, partition=0):
    """Apply ``changes`` ((header, data) pairs) as transactions 0, 1, ... of ``partition``."""
    reader = DataReader({i: data for i, (_, data) in enumerate(changes)})
    bank.get_client_high_water_mark(partition)
    for txn, (header, _) in enumerate(changes):
        result = []
        bank.apply_transaction(Transaction(partition, txn, header, ReqId(1, 1, partition, txn), reader)) \
            .addBoth(result.append)
        assert result == [True]


def rows(bank, sql):
    return bank.connection().execute(sql).fetchall()


def change(kind, account, amount=None):
    return HEADERS[kind], encode_change(kind, account, amount)


def test_changes_are_applied_and_recorded_in_the_ledger(bank):
    apply(bank, [change("deposit", 3, 100), change("withdrawal", 3, 30), (7, b"not the bank's"),
                 change("deactivate", 3)])
    assert rows(bank, "SELECT account, balance, active FROM accounts") == [(3, 70, 0)]
    assert rows(bank, "SELECT * FROM ledger ORDER BY rowid") == [
        (0, 0, "deposit", 3, 100), (0, 1, "withdrawal", 3, 30), (0, 2, "other", -1, 0), (0, 3, "deactivate", 3, 0)]
    assert rows(bank, "SELECT HIGH_WATER_MARK FROM WALTZ_CLIENT_HIGH_WATER_MARK") == [(3,)]


def test_change_encoding_round_trips_and_rejects_other_data():
    assert decode_change(encode_change("withdrawal", 4, 12)) == {"type": "withdrawal", "account": 4, "amount": 12}
    assert decode_change(encode_change("deactivate", 4)) == {"type": "deactivate", "account": 4}
    for bad in (b'{"type": "loan", "account": 1, "amount": 1}', b'{"type": "deposit", "account": 1}'):
        with pytest.raises(ValueError):
            decode_change(bad)


def execute(context, hwm=5):
    builder = TransactionBuilder(ReqId(1, 1, 0, 9), hwm)
    result = []
    context.execute(builder).addBoth(result.append)
    return result[0], builder


def test_a_withdrawal_takes_the_original_demos_locks(bank):
    apply(bank, [change("deposit", 3, 100)])
    appended, builder = execute(Withdrawal(bank, 3, 100))
    assert appended is True
    request = builder.build_request()
    assert request.header == HEADERS["withdrawal"]
    assert decode_change(request.data) == {"type": "withdrawal", "account": 3, "amount": 100}
    assert list(request.write_locks) == [lock_hash("withdrawal", 3)]
    assert list(request.read_locks) == [lock_hash("account", 3)]


def test_a_withdrawal_is_refused_without_funds_or_after_a_deactivation(bank):
    apply(bank, [change("deposit", 3, 100), change("deposit", 4, 100), change("deactivate", 4)])
    overdraw = Withdrawal(bank, 3, 101)
    assert execute(overdraw)[0] is False and overdraw.refusal == "insufficient funds"
    closed = Withdrawal(bank, 4, 1)
    assert execute(closed)[0] is False and closed.refusal == "account deactivated"
    assert execute(Withdrawal(bank, 99, 1))[0] is False


def test_a_deactivation_write_locks_the_account_and_a_deposit_locks_nothing(bank):
    appended, builder = execute(Deactivation(bank, 5))
    request = builder.build_request()
    assert appended is True and list(request.write_locks) == [lock_hash("account", 5)]
    assert list(request.read_locks) == []
    appended, builder = execute(Deposit(bank, 5, 10))
    request = builder.build_request()
    assert appended is True and list(request.write_locks) == [] and list(request.read_locks) == []
    apply(bank, [change("deactivate", 5)])
    again = Deactivation(bank, 5)
    assert execute(again)[0] is False and again.refusal == "already deactivated"
