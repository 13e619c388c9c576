"""Callbacks for applications whose state lives in a SQL database (any DB-API 2.0 driver).

Like the original's ``AbstractClientCallbacksForJDBC``: each committed transaction is
applied in one database transaction that also advances the client high-water mark
stored in a table of the same database::

    CREATE TABLE WALTZ_CLIENT_HIGH_WATER_MARK (
        PARTITION_ID INTEGER NOT NULL PRIMARY KEY,
        HIGH_WATER_MARK BIGINT NOT NULL
    )

The update of the high-water mark comes first and is conditional
(``... SET HIGH_WATER_MARK = txn WHERE PARTITION_ID = p AND HIGH_WATER_MARK = txn - 1``):
it takes the row's write lock, so when several application processes share the
database exactly one of them applies each transaction; the others find the mark
already moved and skip it. Then :meth:`DbApiClientCallbacks.apply_to_database`
runs on the same cursor, and one commit makes both durable. A crash anywhere
before the commit leaves both unchanged: the transaction is applied again after
restart, never twice.

The connection must run statements inside transactions the helper commits: a
connection in autocommit mode would make the mark durable before the data (a failed
apply would then be skipped for good), so it is refused with :class:`AutocommitError`.
For the same reason ``apply_to_database`` must not commit, nor call anything that
commits by itself (sqlite3's ``executescript``).

Database calls block, so they run in a thread of their own (one thread: the
connection is used from it only), never on the reactor. The transaction's data is
fetched on the reactor first and handed to ``apply_to_database``.
"""

import sqlite3

from twisted.internet import defer, threads
from twisted.logger import Logger
from twisted.python.failure import Failure

from waltz.client.api import WaltzClientCallbacks
from waltz.client.workers import WorkerThread

log = Logger()

DEFAULT_TABLE = "WALTZ_CLIENT_HIGH_WATER_MARK"

#: How the k-th (from 1) parameter of a statement is written, per DB-API ``paramstyle``.
_PLACEHOLDERS = {"qmark": lambda k: "?", "format": lambda k: "%s", "pyformat": lambda k: "%%(p%d)s" % k,
                 "numeric": lambda k: ":%d" % k, "named": lambda k: ":p%d" % k}
#: Styles whose parameters are passed as a mapping (names ``p1``, ``p2``...) rather than a sequence.
_NAMED_STYLES = ("pyformat", "named")


def check_paramstyle(paramstyle):
    """Raise :class:`ValueError` unless ``paramstyle`` is one of the five DB-API styles."""
    if paramstyle not in _PLACEHOLDERS:
        raise ValueError("unsupported DB-API paramstyle %r (use one of %s)"
                         % (paramstyle, ", ".join(sorted(_PLACEHOLDERS))))


def _sql(template, paramstyle):
    """``template`` with its ``{}`` placeholders written in the driver's ``paramstyle``."""
    check_paramstyle(paramstyle)
    parts = template.split("{}")
    placeholder = _PLACEHOLDERS[paramstyle]
    return parts[0] + "".join(placeholder(k) + part for k, part in enumerate(parts[1:], 1))


def _params(values, paramstyle):
    """``values`` as the driver takes them: a tuple, or ``{"p1": ..., "p2": ...}`` for named styles."""
    if paramstyle in _NAMED_STYLES:
        return {"p%d" % k: value for k, value in enumerate(values, 1)}
    return tuple(values)


class CallbacksClosedError(RuntimeError):
    """The callbacks were closed; no database connection is opened any more."""


class AutocommitError(RuntimeError):
    """The database connection commits every statement by itself; the helper needs transactions."""


def autocommits(connection) -> bool:
    """True when ``connection`` is in autocommit mode, as far as the common drivers tell.

    ``autocommit`` attribute set to True (psycopg 2 and 3, sqlite3 from Python 3.12), a
    ``get_autocommit()`` answering True (MySQLdb, PyMySQL), or a sqlite3 connection whose
    ``isolation_level`` is None under the legacy transaction control.
    """
    flag = getattr(connection, "autocommit", None)
    if callable(flag):
        flag = None          # a method (some drivers' setter), not the mode
    if flag is True:
        return True
    get_autocommit = getattr(connection, "get_autocommit", None)
    if callable(get_autocommit) and get_autocommit() is True:
        return True
    if isinstance(connection, sqlite3.Connection) and flag in (None, getattr(sqlite3, "LEGACY_TRANSACTION_CONTROL", -1)):
        return connection.isolation_level is None
    return False


class DatabaseBehindError(RuntimeError):
    """The stored high-water mark is behind the transaction before the one being applied."""


class DbApiClientCallbacks(WaltzClientCallbacks):
    """Base class: override :meth:`apply_to_database` (and optionally ``fetch_data = False``).

    ``connect`` is a function returning a new DB-API connection (called in the database
    thread, e.g. ``lambda: sqlite3.connect(path)``); ``paramstyle`` is the driver's
    (``sqlite3.paramstyle``, ``psycopg.paramstyle``...); ``run`` replaces the database
    thread (``run(function, *args) -> Deferred``, e.g. for tests). Create the table with
    :meth:`create_table` or your own migration.
    """

    #: Used as they are by :class:`~waltz.client.blocking.BlockingWaltzClient` (they return Deferreds).
    runs_on_reactor = True
    #: Fetch each transaction's data before applying it (False: ``data`` is None).
    fetch_data = True

    def __init__(self, connect, table=DEFAULT_TABLE, paramstyle=sqlite3.paramstyle, reactor=None, run=None):
        if not table.replace("_", "").isalnum():
            raise ValueError("bad table name %r" % table)
        check_paramstyle(paramstyle)
        self._connect = connect
        self._connection = None
        self._closed = False
        self._close_waiters = None      # while a close() is under way: the Deferreds of later calls
        self._table = table
        self._paramstyle = paramstyle
        self._worker = None
        if run is None:
            if reactor is None:
                from twisted.internet import reactor
            self._worker = WorkerThread(reactor, "waltz-db")
            run = self._worker.run
        self._run = run

    # --- the application's part -------------------------------------------------------------------

    def apply_to_database(self, transaction, data, cursor):
        """Apply ``transaction`` (its ``data`` already fetched) with ``cursor``; do not commit.
        Runs in the database thread."""
        raise NotImplementedError

    # --- WaltzClientCallbacks ----------------------------------------------------------------

    def get_client_high_water_mark(self, partition_id):
        return self._run(self._read_high_water_mark, partition_id)

    def apply_transaction(self, transaction):
        d = transaction.get_data() if self.fetch_data else defer.succeed(None)
        return d.addCallback(lambda data: self._run(self._apply, transaction, data))

    def uncaught_exception(self, partition_id, transaction_id, exception):
        log.error("partition {pid} transaction {txn}: {error!r}", pid=partition_id, txn=transaction_id,
                  error=exception)

    # --- in the database thread ------------------------------------------------------------------

    def connection(self):
        """The database connection (database thread only); refused when it autocommits, or once
        :meth:`close` was called (an apply still queued then must not open a new one)."""
        if self._closed:
            raise CallbacksClosedError("the database callbacks are closed (close the Waltz client first)")
        if self._connection is None:
            connection = self._connect()
            if autocommits(connection):
                connection.close()
                raise AutocommitError(
                    "the database connection is in autocommit mode: the client high-water mark and the "
                    "transaction's changes must commit together (open it with transactions on, e.g. "
                    "sqlite3.connect(path) without isolation_level=None, psycopg with autocommit=False)")
            self._connection = connection
        return self._connection

    def _open_cursor(self):
        """``(connection, cursor)``; a connection that cannot give a cursor is dropped like a broken one."""
        conn = self.connection()
        try:
            return conn, conn.cursor()
        except Exception:
            self._roll_back(conn)
            raise

    def _roll_back(self, conn):
        """Roll back after a failure. A connection that cannot even roll back is broken (the database
        restarted, the network was cut): it is closed and dropped, and the next call opens a new one."""
        try:
            conn.rollback()
        except Exception as exc:
            log.warn("the database connection is broken ({error!r}); the next call opens a new one", error=exc)
            connection, self._connection = self._connection, None
            if connection is not None:
                try:
                    connection.close()
                except Exception:  # noqa: S110 (closing a broken connection: nothing more to do)
                    pass

    def _execute(self, cursor, template, *values):
        """Run ``template`` (``<table>`` and ``{}`` placeholders) with ``values`` in the driver's style."""
        cursor.execute(_sql(template.replace("<table>", self._table), self._paramstyle),
                       _params(values, self._paramstyle))

    def _read_high_water_mark(self, partition_id):
        conn, cursor = self._open_cursor()
        try:
            self._execute(cursor, "SELECT HIGH_WATER_MARK FROM <table> WHERE PARTITION_ID = {}", partition_id)
            row = cursor.fetchone()
            if row is None:
                self._execute(cursor, "INSERT INTO <table> (PARTITION_ID, HIGH_WATER_MARK) VALUES ({}, -1)",
                              partition_id)
                conn.commit()
                return -1
            conn.rollback()
            return int(row[0])
        except BaseException:
            self._roll_back(conn)
            raise
        finally:
            _close_quietly(cursor)

    def _apply(self, transaction, data):
        """Advance the mark from ``txn - 1`` to ``txn`` and apply, in one database transaction.
        True when applied here, False when another process had applied it already."""
        conn, cursor = self._open_cursor()
        pid, txn = transaction.partition_id, transaction.transaction_id
        try:
            self._execute(cursor,
                          "UPDATE <table> SET HIGH_WATER_MARK = {} WHERE PARTITION_ID = {} AND HIGH_WATER_MARK = {}",
                          txn, pid, txn - 1)
            if cursor.rowcount == 1:
                self.apply_to_database(transaction, data, cursor)
                conn.commit()
                return True
            self._execute(cursor, "SELECT HIGH_WATER_MARK FROM <table> WHERE PARTITION_ID = {}", pid)
            row = cursor.fetchone()
            conn.rollback()
            stored = row[0] if row is not None else None
            if stored is None or stored < txn:
                raise DatabaseBehindError("partition %d: the stored high-water mark is %s, cannot apply "
                                          "transaction %d" % (pid, stored, txn))
            return False
        except BaseException:
            self._roll_back(conn)
            raise
        finally:
            _close_quietly(cursor)

    # --- set-up and closing ----------------------------------------------------------------------

    def create_table(self):
        """Create the high-water mark table if it does not exist; fires when done."""
        def create():
            conn, cursor = self._open_cursor()
            try:
                cursor.execute("CREATE TABLE IF NOT EXISTS %s (PARTITION_ID INTEGER NOT NULL PRIMARY KEY, "
                               "HIGH_WATER_MARK BIGINT NOT NULL)" % self._table)
                conn.commit()
            except BaseException:
                self._roll_back(conn)
                raise
            finally:
                _close_quietly(cursor)
        return self._run(create)

    def run_in_database(self, function, *args):
        """Run ``function(connection, *args)`` in the database thread; fires with its result.

        Commit what is to be kept: whatever the function leaves uncommitted, because it failed or
        forgot, is rolled back when it returns. Left open, it would be committed by the next apply,
        together with that transaction's high-water mark."""
        def run():
            conn = self.connection()
            try:
                return function(conn, *args)
            finally:
                self._roll_back(conn)
        return self._run(run)

    def close(self):
        """Close the connection and stop the database thread; fires when both are done. Close the Waltz
        client first: an apply that comes after this fails (:class:`CallbacksClosedError`)."""
        if self._run is _refuse_closed:
            return defer.succeed(None)
        if self._close_waiters is not None:
            # A second close() made before the first ended waits for it: run through the database thread,
            # it could find the thread stopping, and fail.
            waiter = defer.Deferred()
            self._close_waiters.append(waiter)
            return waiter
        self._close_waiters = []

        def close_connection():
            self._closed = True
            if self._connection is not None:
                self._connection.close()
                self._connection = None
        d = self._run(close_connection)
        if self._worker is not None:
            d.addBoth(self._stop_worker)
        return d.addBoth(self._closed_now)

    def _stop_worker(self, result):
        # Joined in a thread of the reactor's pool, not on the reactor: an apply queued behind the close
        # would hold the reactor until it finished.
        worker, self._worker = self._worker, None
        self._run = _refuse_closed  # a stopped thread pool would never run (nor answer) what comes later
        return threads.deferToThread(worker.stop).addCallback(lambda _: result)

    def _closed_now(self, result):
        """The close under way ended: the calls that waited for it end the same way."""
        waiters, self._close_waiters = self._close_waiters, None
        for waiter in waiters:
            if isinstance(result, Failure):
                waiter.errback(result)
            else:
                waiter.callback(None)
        return result


def _refuse_closed(function, *args):
    """The database thread of closed callbacks: every call fails."""
    return defer.fail(CallbacksClosedError("the database callbacks are closed (close the Waltz client first)"))


def _close_quietly(cursor):
    """Close ``cursor``; on a connection that broke, that fails too, and must not hide the first error."""
    try:
        cursor.close()
    except Exception:  # noqa: S110 (the error that broke the call is the one reported)
        pass
