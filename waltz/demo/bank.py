"""The bank of the demo: accounts in SQLite kept in step with the log, and its three kinds of transaction.

Every instance of the application has a database of its own with two tables::

    accounts (account INTEGER PRIMARY KEY, balance INTEGER NOT NULL, active INTEGER NOT NULL)
    ledger   (partition INTEGER, transaction_id INTEGER, type TEXT, account INTEGER, amount INTEGER)

``accounts`` is the materialized view; ``ledger`` records every transaction the
instance applied (``other`` for a transaction that is not the bank's), in the order it applied them (no uniqueness constraint: a
transaction applied twice would show up twice, which the demo's checks look for).
Both are written by :meth:`Bank.apply_to_database`, inside the database
transaction that also advances the client high-water mark
(:class:`~waltz.client.dbapi.DbApiClientCallbacks`).

A transaction's data is a UTF-8 JSON object ``{"type": "deposit" | "withdrawal" |
"deactivate", "account": int, "amount": int}`` (no amount for ``deactivate``); its
header says the type as well (:data:`HEADERS`), so readers can filter before
fetching any data. Accounts live in partition ``account % num_partitions``.

The locks are those of the original demo (``DemoBankApp``):

=============  =============================  ==========================
transaction    write locks                    read locks
=============  =============================  ==========================
deposit        none                           none
withdrawal     ``("withdrawal", account)``    ``("account", account)``
deactivation   ``("account", account)``       none
=============  =============================  ==========================

Two withdrawals computed from the same balance conflict on the withdrawal lock,
so at most one commits and the other is recomputed from the newer balance: no
overdraft. A withdrawal computed before the application saw a deactivation fails
its read lock: no withdrawal after a deactivation. Deposits only add money, so they
need no lock.
"""

import json
import sqlite3

from waltz.client import TransactionContext
from waltz.client.dbapi import DbApiClientCallbacks

DEPOSIT, WITHDRAWAL, DEACTIVATE = "deposit", "withdrawal", "deactivate"
#: The ledger type of a transaction that is not the bank's (another application sharing the log).
OTHER = "other"

#: Transaction header of each type (other headers are not the bank's and are skipped).
HEADERS = {DEPOSIT: 101, WITHDRAWAL: 102, DEACTIVATE: 103}
TYPES_BY_HEADER = {header: kind for kind, header in HEADERS.items()}

SCHEMA = (
    "CREATE TABLE IF NOT EXISTS accounts (account INTEGER PRIMARY KEY, balance INTEGER NOT NULL, "
    "active INTEGER NOT NULL)",
    "CREATE TABLE IF NOT EXISTS ledger (partition INTEGER NOT NULL, transaction_id INTEGER NOT NULL, "
    "type TEXT NOT NULL, account INTEGER NOT NULL, amount INTEGER NOT NULL)",
    "CREATE INDEX IF NOT EXISTS ledger_position ON ledger (partition, transaction_id)",
)


def encode_change(kind, account, amount=None) -> bytes:
    """The transaction data of one change."""
    change = {"type": kind, "account": account}
    if kind != DEACTIVATE:
        change["amount"] = amount
    return json.dumps(change, sort_keys=True).encode("utf-8")


def decode_change(data: bytes) -> dict:
    """The change a transaction's data describes; ValueError when it is not one."""
    change = json.loads(data.decode("utf-8"))
    if change.get("type") not in HEADERS or not isinstance(change.get("account"), int):
        raise ValueError("not a bank transaction: %r" % (data[:80],))
    if change["type"] != DEACTIVATE and not isinstance(change.get("amount"), int):
        raise ValueError("bank transaction without an integer amount: %r" % (data[:80],))
    return change


def open_database(path):
    """A connection to an instance's database, in WAL mode without an fsync per commit.

    Safe because the log is the source of truth: the high-water mark commits atomically with
    the changes, so a commit lost in a machine crash is one the instance applies again from the
    log after restart. A database kept durable commit by commit would spend most of the demo's
    time in fsync and fall behind the feed.
    """
    connection = sqlite3.connect(path)
    connection.execute("PRAGMA journal_mode=WAL")
    connection.execute("PRAGMA synchronous=NORMAL")
    return connection


def partition_of(account, num_partitions):
    return account % num_partitions


class Bank(DbApiClientCallbacks):
    """The application's callbacks: applies the log to ``accounts`` and ``ledger``."""

    def create_tables(self):
        """Create the bank's tables and the high-water mark table; fires when done."""
        def create(connection):
            for statement in SCHEMA:
                connection.execute(statement)
            connection.commit()
        return self.create_table().addCallback(lambda _: self.run_in_database(create))

    def apply_to_database(self, transaction, data, cursor):
        kind = TYPES_BY_HEADER.get(transaction.header)
        if kind is None:
            # Another application's transaction in the same log: recorded, so the ledger still shows
            # every position of the log exactly once, but it changes no account.
            self._record(cursor, transaction, OTHER, -1, 0)
            return
        change = decode_change(data)
        account = change["account"]
        amount = change.get("amount", 0)
        cursor.execute("INSERT OR IGNORE INTO accounts (account, balance, active) VALUES (?, 0, 1)", (account,))
        # The log is the source of truth: a change is applied as it is. The locks are what keep a
        # withdrawal from overdrawing or following a deactivation; the demo's checks prove they did.
        if kind == DEPOSIT:
            cursor.execute("UPDATE accounts SET balance = balance + ? WHERE account = ?", (amount, account))
        elif kind == WITHDRAWAL:
            cursor.execute("UPDATE accounts SET balance = balance - ? WHERE account = ?", (amount, account))
        else:
            cursor.execute("UPDATE accounts SET active = 0 WHERE account = ?", (account,))
        self._record(cursor, transaction, kind, account, amount)

    @staticmethod
    def _record(cursor, transaction, kind, account, amount):
        cursor.execute("INSERT INTO ledger (partition, transaction_id, type, account, amount) VALUES (?, ?, ?, ?, ?)",
                       (transaction.partition_id, transaction.transaction_id, kind, account, amount))

    def account(self, account):
        """Deferred: ``(balance, active)`` of the account as this instance has applied it."""
        def read(connection):
            row = connection.execute("SELECT balance, active FROM accounts WHERE account = ?",
                                     (account,)).fetchone()
            connection.rollback()
            return (row[0], bool(row[1])) if row else (0, True)
        return self.run_in_database(read)


class BankTransaction(TransactionContext):
    """One change to one account. ``listener`` (optional) is told of every attempt and lock failure."""

    kind = None

    def __init__(self, bank, account, amount=None, listener=None):
        self.bank = bank
        self.account = account
        self.amount = amount
        self.listener = listener
        self.refusal = None
        self.attempts = 0

    def partition_id(self, num_partitions):
        return partition_of(self.account, num_partitions)

    def execute(self, builder):
        self.attempts += 1
        if self.listener is not None:
            self.listener.attempted(self)
        return self.bank.account(self.account).addCallback(self._decide, builder)

    def _decide(self, state, builder):
        balance, active = state
        self.refusal = self.refuse(balance, active)
        if self.refusal is not None:
            return False                # nothing is appended: the outcome is IGNORED
        builder.set_header(HEADERS[self.kind])
        builder.set_transaction_data(encode_change(self.kind, self.account, self.amount))
        builder.set_write_locks(self.write_locks())
        builder.set_read_locks(self.read_locks())
        return True

    def refuse(self, balance, active):
        """Why this change cannot be made on the current state (None: it can)."""
        return None

    def write_locks(self):
        return []

    def read_locks(self):
        return []

    def on_lock_failure(self):
        if self.listener is not None:
            self.listener.lock_failed(self)


class Deposit(BankTransaction):
    kind = DEPOSIT


class Withdrawal(BankTransaction):
    kind = WITHDRAWAL

    def refuse(self, balance, active):
        if not active:
            return "account deactivated"
        if balance < self.amount:
            return "insufficient funds"
        return None

    def write_locks(self):
        return [("withdrawal", self.account)]

    def read_locks(self):
        return [("account", self.account)]


class Deactivation(BankTransaction):
    kind = DEACTIVATE

    def refuse(self, balance, active):
        return None if active else "already deactivated"

    def write_locks(self):
        return [("account", self.account)]
