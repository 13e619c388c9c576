"""DbApiClientCallbacks on sqlite3: the high-water mark moves in the same database transaction as the
application's change, so a crash before the commit applies nothing and nothing is applied twice."""

import json
import os
import sqlite3
import subprocess
import sys
import textwrap

import pytest
import pytest_twisted
from twisted.internet import defer

from tests.client.conftest import Harness
from waltz.client.api import JsonSerializer, Transaction, TransactionContext
from waltz.client.dbapi import (
    AutocommitError, CallbacksClosedError, DatabaseBehindError, DbApiClientCallbacks, _params, _sql, autocommits)
from waltz.protocols import client_messages as m
from waltz.protocols.values import ReqId


class Bank(DbApiClientCallbacks):
    """Each transaction's data is {"account": id, "amount": n}; ``crash_after_write`` raises mid-apply."""

    crash_after_write = False

    def apply_to_database(self, transaction, data, cursor):
        change = json.loads(data)
        cursor.execute("UPDATE ACCOUNTS SET BALANCE = BALANCE + ? WHERE ID = ?", (change["amount"], change["account"]))
        if self.crash_after_write:
            raise RuntimeError("crash between the write and the commit")


def sync(function, *args):
    return defer.maybeDeferred(function, *args)


def make_db(path):
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE ACCOUNTS (ID INTEGER PRIMARY KEY, BALANCE INTEGER NOT NULL)")
    conn.execute("INSERT INTO ACCOUNTS VALUES (1, 100)")
    conn.commit()
    conn.close()


def state(path, partition=0):
    conn = sqlite3.connect(path)
    try:
        balance = conn.execute("SELECT BALANCE FROM ACCOUNTS WHERE ID = 1").fetchone()[0]
        row = conn.execute("SELECT HIGH_WATER_MARK FROM WALTZ_CLIENT_HIGH_WATER_MARK WHERE PARTITION_ID = ?",
                           (partition,)).fetchone()
        return balance, (row[0] if row else None)
    finally:
        conn.close()


class DataReader:
    def __init__(self, data):
        self.data = data

    def fetch_data(self, transaction_id):
        return defer.succeed(self.data[transaction_id])


def transaction(txn, amount, pid=0):
    data = json.dumps({"account": 1, "amount": amount}).encode()
    return Transaction(pid, txn, 0, ReqId(1, 1, pid, txn), DataReader({txn: data}))


@pytest.fixture
def bank(tmp_path):
    path = str(tmp_path / "bank.db")
    make_db(path)
    callbacks = Bank(lambda: sqlite3.connect(path), run=sync)
    callbacks.create_table()
    callbacks.path = path
    return callbacks


def test_the_first_read_stores_minus_one(bank):
    assert bank.get_client_high_water_mark(0).result == -1
    assert state(bank.path) == (100, -1)
    assert bank.get_client_high_water_mark(0).result == -1


def test_apply_moves_the_mark_with_the_change(bank):
    bank.get_client_high_water_mark(0)
    assert bank.apply_transaction(transaction(0, 5)).result is True
    assert bank.apply_transaction(transaction(1, -20)).result is True
    assert state(bank.path) == (85, 1)


def test_a_transaction_already_applied_elsewhere_is_skipped(bank, tmp_path):
    bank.get_client_high_water_mark(0)
    other = Bank(lambda: sqlite3.connect(bank.path), run=sync)    # another application process
    assert other.apply_transaction(transaction(0, 5)).result is True
    assert bank.apply_transaction(transaction(0, 5)).result is False
    assert state(bank.path) == (105, 0)


def test_a_failure_before_the_commit_applies_nothing(bank):
    bank.get_client_high_water_mark(0)
    bank.crash_after_write = True
    failures = []
    bank.apply_transaction(transaction(0, 5)).addErrback(failures.append)
    assert failures and state(bank.path) == (100, -1)
    bank.crash_after_write = False
    assert bank.apply_transaction(transaction(0, 5)).result is True
    assert state(bank.path) == (105, 0)


def test_a_broken_database_connection_is_replaced_by_the_next_call(bank):
    # The database restarted or the network was cut: the connection is dead. It used to be kept, and every
    # apply and high-water-mark read failed (retried for ever) until the process restarted.
    bank.get_client_high_water_mark(0)
    assert bank.apply_transaction(transaction(0, 5)).result is True
    bank._connection.close()
    failures = []
    bank.apply_transaction(transaction(1, 5)).addErrback(failures.append)
    assert failures and failures[0].check(sqlite3.ProgrammingError)
    assert bank.apply_transaction(transaction(1, 5)).result is True
    assert bank.get_client_high_water_mark(0).result == 1
    assert state(bank.path) == (110, 1)


def test_the_error_that_broke_an_apply_is_the_one_reported(bank):
    # The connection dies in the middle of the apply: rolling back and closing the cursor fail too, and
    # must not replace the error that broke the apply.
    bank.get_client_high_water_mark(0)

    def dying(transaction, data, cursor):
        cursor.connection.close()
        raise RuntimeError("the database went away")
    bank.apply_to_database = dying
    failures = []
    bank.apply_transaction(transaction(0, 5)).addErrback(failures.append)
    assert failures and failures[0].check(RuntimeError)
    del bank.apply_to_database
    assert bank.apply_transaction(transaction(0, 5)).result is True
    assert state(bank.path) == (105, 0)


def test_a_failed_run_in_database_leaves_nothing_for_the_next_apply_to_commit(bank):
    # The helper's own connection ran the failed call: its write used to stay in the open database
    # transaction, and the next apply committed it together with that transaction's mark.
    bank.get_client_high_water_mark(0)

    def half_done(connection):
        connection.execute("UPDATE ACCOUNTS SET BALANCE = BALANCE + 1000 WHERE ID = 1")
        raise RuntimeError("application error half-way")
    failures = []
    bank.run_in_database(half_done).addErrback(failures.append)
    assert failures and failures[0].check(RuntimeError)
    assert bank.apply_transaction(transaction(0, 5)).result is True
    assert state(bank.path) == (105, 0)


def test_what_run_in_database_leaves_uncommitted_is_rolled_back_and_what_it_commits_stays(bank):
    bank.get_client_high_water_mark(0)

    def forgets_to_commit(connection):
        connection.execute("UPDATE ACCOUNTS SET BALANCE = BALANCE + 1000 WHERE ID = 1")
        return "done"

    def commits(connection):
        connection.execute("UPDATE ACCOUNTS SET BALANCE = BALANCE + 1 WHERE ID = 1")
        connection.commit()
    assert bank.run_in_database(forgets_to_commit).result == "done"
    bank.run_in_database(commits)
    assert bank.apply_transaction(transaction(0, 5)).result is True
    assert state(bank.path) == (106, 0)


class FailingCursor:
    def execute(self, *args):
        raise RuntimeError("permission denied")

    def close(self):
        pass


def test_a_failed_create_table_rolls_back(tmp_path):
    # Some drivers (psycopg) abort the whole transaction on an error: the next call on the connection
    # failed too unless it was rolled back.
    calls = []
    connection = FakeConnection(cursor=FailingCursor, rollback=lambda: calls.append("rollback"),
                                commit=lambda: calls.append("commit"))
    callbacks = Bank(lambda: connection, run=sync)
    failures = []
    callbacks.create_table().addErrback(failures.append)
    assert failures and failures[0].check(RuntimeError)
    assert calls == ["rollback"]


def test_a_mark_behind_the_transaction_is_an_error(bank):
    bank.get_client_high_water_mark(0)
    failures = []
    bank.apply_transaction(transaction(3, 5)).addErrback(failures.append)
    assert failures[0].check(DatabaseBehindError)
    assert state(bank.path) == (100, -1)


def test_a_process_crash_between_apply_and_commit_applies_nothing(bank):
    bank.get_client_high_water_mark(0)
    script = textwrap.dedent("""
        import json, os, sqlite3, sys
        from twisted.internet import defer
        from tests.client.test_dbapi import Bank, sync, transaction
        class Crashing(Bank):
            def apply_to_database(self, txn, data, cursor):
                super().apply_to_database(txn, data, cursor)
                os._exit(3)              # the process dies after the write, before the commit
        Crashing(lambda: sqlite3.connect(sys.argv[1]), run=sync).apply_transaction(transaction(0, 5))
    """)
    result = subprocess.run([sys.executable, "-c", script, bank.path], cwd=os.getcwd(), timeout=60)
    assert result.returncode == 3
    assert state(bank.path) == (100, -1)
    assert bank.apply_transaction(transaction(0, 5)).result is True
    assert state(bank.path) == (105, 0)


def test_paramstyles():
    assert _sql("A = {} AND B = {}", "qmark") == "A = ? AND B = ?"
    assert _sql("A = {} AND B = {}", "format") == "A = %s AND B = %s"
    assert _sql("A = {} AND B = {}", "pyformat") == "A = %(p1)s AND B = %(p2)s"
    assert _sql("A = {} AND B = {}", "numeric") == "A = :1 AND B = :2"
    assert _sql("A = {} AND B = {}", "named") == "A = :p1 AND B = :p2"
    assert _params((5, 6), "qmark") == (5, 6) and _params((5, 6), "named") == {"p1": 5, "p2": 6}


def test_an_unknown_paramstyle_is_refused_when_the_callbacks_are_made(tmp_path):
    with pytest.raises(ValueError, match="unsupported DB-API paramstyle 'dollar'"):
        Bank(lambda: sqlite3.connect(str(tmp_path / "x.db")), paramstyle="dollar", run=sync)


@pytest.mark.parametrize("paramstyle", ["numeric", "named"])
def test_the_other_paramstyles_apply_with_a_driver_that_speaks_them(tmp_path, paramstyle):
    path = str(tmp_path / "bank.db")
    make_db(path)
    callbacks = Bank(lambda: sqlite3.connect(path), paramstyle=paramstyle, run=sync)
    callbacks.create_table()
    assert callbacks.get_client_high_water_mark(0).result == -1
    assert callbacks.apply_transaction(transaction(0, 5)).result is True
    assert callbacks.apply_transaction(transaction(0, 5)).result is False     # already applied: skipped
    assert state(path) == (105, 0)


def test_an_autocommit_connection_is_refused_before_anything_is_written(tmp_path):
    # In autocommit mode the mark would commit on its own before the data: a failed apply would then
    # be skipped on its retry, for good.
    path = str(tmp_path / "bank.db")
    make_db(path)
    callbacks = Bank(lambda: sqlite3.connect(path, isolation_level=None), run=sync)
    failure = callbacks.get_client_high_water_mark(0)
    assert isinstance(failure.result.value, AutocommitError)
    failure.addErrback(lambda _: None)
    failure = callbacks.apply_transaction(transaction(0, 5))
    assert isinstance(failure.result.value, AutocommitError)
    failure.addErrback(lambda _: None)
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("SELECT BALANCE FROM ACCOUNTS").fetchall() == [(100,)]
        assert conn.execute("SELECT name FROM sqlite_master WHERE name = 'WALTZ_CLIENT_HIGH_WATER_MARK'").fetchall() == []
    finally:
        conn.close()


class FakeConnection:
    def __init__(self, **attributes):
        self.__dict__.update(attributes)


def test_autocommit_is_recognised_across_drivers(tmp_path):
    assert autocommits(FakeConnection(autocommit=True))                         # psycopg 2 and 3
    assert not autocommits(FakeConnection(autocommit=False))
    assert autocommits(FakeConnection(get_autocommit=lambda: True))             # MySQLdb, PyMySQL
    assert not autocommits(FakeConnection(get_autocommit=lambda: False))
    assert not autocommits(FakeConnection())                                     # a driver that does not say
    path = str(tmp_path / "x.db")
    assert autocommits(sqlite3.connect(path, isolation_level=None))
    assert not autocommits(sqlite3.connect(path))


class Deposit(TransactionContext):
    def __init__(self, amount):
        self.amount = amount

    def partition_id(self, num_partitions):
        return 0

    def execute(self, builder):
        builder.set_transaction_data({"account": 1, "amount": self.amount}, JsonSerializer())
        return True


def test_a_client_applies_the_feed_into_sqlite_and_resumes_after_a_restart(tmp_path):
    path = str(tmp_path / "bank.db")
    make_db(path)
    harness = Harness()
    deposit = lambda amount: json.dumps({"account": 1, "amount": amount}).encode()  # noqa: E731
    callbacks = Bank(lambda: sqlite3.connect(path), run=sync)
    callbacks.create_table()
    client = harness.client(callbacks)
    client.execute(Deposit(7))
    harness.commit(0, data=deposit(3))
    harness.settle()
    assert state(path) == (110, 1)
    client.close()
    harness.commit(0, data=deposit(-50))               # committed while the application is down
    restarted = harness.client(Bank(lambda: sqlite3.connect(path), run=sync))
    mounts = [r for r in harness.server_a.messages(m.MountRequest) if r.req_id.partition_id == 0]
    assert [r.client_hwm for r in mounts] == [-1, 1]   # the restart resumed from the stored mark
    assert state(path) == (60, 2) and restarted.client_high_water_mark(0) == 2


@pytest_twisted.ensureDeferred
async def test_database_work_runs_in_its_own_thread(tmp_path):
    import threading
    path = str(tmp_path / "bank.db")
    make_db(path)
    threads = set()

    class Recording(Bank):
        def apply_to_database(self, txn, data, cursor):
            threads.add(threading.current_thread().name)
            super().apply_to_database(txn, data, cursor)
    callbacks = Recording(lambda: sqlite3.connect(path))
    try:
        await callbacks.create_table()
        assert (await callbacks.get_client_high_water_mark(0)) == -1
        assert (await callbacks.apply_transaction(transaction(0, 1))) is True
    finally:
        await callbacks.close()
    assert threads and threading.main_thread().name not in threads
    assert state(path) == (101, 0)


@pytest_twisted.ensureDeferred
async def test_an_apply_after_close_does_not_open_the_database_again(tmp_path):
    path = str(tmp_path / "bank.db")
    make_db(path)
    opened = []

    def connect():
        opened.append(1)
        return sqlite3.connect(path)
    callbacks = Bank(connect)
    await callbacks.create_table()
    await callbacks.close()
    late = Bank(connect, run=sync)           # the same closing, on the caller's thread
    late.create_table()
    late.close()
    failure = late.apply_transaction(transaction(0, 5))
    assert isinstance(failure.result.value, CallbacksClosedError)
    failure.addErrback(lambda _: None)
    assert len(opened) == 2 and state(path) == (100, None)


@pytest_twisted.ensureDeferred
async def test_calls_after_close_fail_with_the_helpers_own_database_thread_and_a_second_close_fires(tmp_path):
    # Before: close() stopped the database thread's pool, which then took every later call and never ran
    # it: an apply (or a second close) after close() waited for ever instead of failing.
    path = str(tmp_path / "bank.db")
    make_db(path)
    callbacks = Bank(lambda: sqlite3.connect(path))     # its own database thread (run=None)
    await callbacks.create_table()
    first, second = callbacks.close(), callbacks.close()  # the second made before the first ended
    await defer.gatherResults([first, second])
    for late in (callbacks.apply_transaction(transaction(0, 5)), callbacks.get_client_high_water_mark(0)):
        assert late.called
        with pytest.raises(CallbacksClosedError):
            await late
    third = callbacks.close()
    assert third.called
    await third


@pytest_twisted.ensureDeferred
async def test_a_second_close_made_while_the_first_runs_fails_as_the_first_does(tmp_path):
    path = str(tmp_path / "bank.db")
    make_db(path)

    class FailingClose:
        def __init__(self, connection):
            self._connection = connection

        def __getattr__(self, name):
            return getattr(self._connection, name)

        def close(self):
            self._connection.close()
            raise sqlite3.OperationalError("disk I/O error")
    callbacks = Bank(lambda: FailingClose(sqlite3.connect(path)))
    await callbacks.create_table()
    first, second = callbacks.close(), callbacks.close()
    for closing in (first, second):
        with pytest.raises(sqlite3.OperationalError, match="disk I/O error"):
            await closing
