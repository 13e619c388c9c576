"""The ledger job, run as a process (``python -m waltz.spark.jobs.ledger``) against a cluster holding bank
transactions in the documented format, compared with a SQLite accounts table."""

import contextlib
import io
import json
import os
import sqlite3
import subprocess
import sys
from unittest import mock

import pytest
import pytest_twisted
from twisted.internet import defer

from tests.spark.conftest import in_thread
from waltz.spark.jobs import ledger

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]


def entry(kind, account, amount=None):
    value = {"type": kind, "account": account}
    if amount is not None:
        value["amount"] = amount
    return json.dumps(value).encode("utf-8")


def write_accounts(path, accounts):
    with sqlite3.connect(str(path)) as db:
        db.execute("CREATE TABLE IF NOT EXISTS accounts (account INTEGER PRIMARY KEY, balance INTEGER, active INTEGER)")
        db.execute("DELETE FROM accounts")
        db.executemany("INSERT INTO accounts VALUES (?, ?, ?)", accounts)


def run_job(cluster, database, spark_submit=False):
    """The job as a process: ``python -m waltz.spark.jobs.ledger`` or ``spark-submit waltz/spark/jobs/ledger.py``
    (with the environment's ``bin`` first on PATH, as after ``source .venv/bin/activate``)."""
    arguments = ["--zookeeper", cluster.local.connect_string, "--cluster-root", cluster.local.root,
                 "--compare-sqlite", str(database)]
    env = dict(os.environ)
    if spark_submit:
        bin_dir = os.path.dirname(sys.executable)
        env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
        command = [os.path.join(bin_dir, "spark-submit"), "--master", "local[1]", ledger.__file__] + arguments
    else:
        command = [sys.executable, "-m", "waltz.spark.jobs.ledger", "--master", "local[2]"] + arguments
    return subprocess.run(command, capture_output=True, text=True, timeout=200, env=env)


@pytest_twisted.ensureDeferred
async def test_the_ledger_job_rebuilds_balances_and_reports_mismatches(spark, start_cluster, tmp_path):
    cluster = await start_cluster(partitions=2)
    entries = [entry("deposit", 1, 100), entry("deposit", 2, 50), entry("withdrawal", 1, 30), entry("deposit", 3, 5),
               entry("withdrawal", 2, 50), entry("deactivate", 3), entry("deposit", 1, 7)]
    await cluster.write([(account_partition(e), 0, e) for e in entries])
    database = tmp_path / "bank.db"
    write_accounts(database, [(1, 77, 1), (2, 0, 1), (3, 5, 0), (4, 0, 1)])

    # The job as production runs it: spark-submit, in a JVM of its own (most of the test's time).
    passed = await in_thread(run_job, cluster, database, True)
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert "7 transactions, 3 accounts" in passed.stdout and "consistent (0 mismatches" in passed.stdout

    # `python -m waltz.spark.jobs.ledger` (the demo's way) is the same main(): run here on the shared session,
    # since a second JVM costs ~20 s of the suite. It picks local[*] unless given a master or run by
    # spark-submit, and stops the session it built.
    built, out = [], io.StringIO()
    argv = ["--zookeeper", cluster.local.connect_string, "--cluster-root", cluster.local.root,
            "--compare-sqlite", str(database)]

    def shared_session(master, name):
        built.append(SessionKeptOpen(spark, master))
        return built[-1]
    with mock.patch("waltz.spark.session.build_session", shared_session), contextlib.redirect_stdout(out):
        assert await in_thread(ledger.main, argv) == 0
        assert await in_thread(ledger.main, argv + ["--master", "local[2]"]) == 0
    assert [(session.master, session.stopped) for session in built] == [("local[*]", 1), ("local[2]", 1)]
    assert out.getvalue().count("consistent (0 mismatches") == 2

    # The mismatching case runs the same job function on the shared session (a second JVM costs ~40 s).
    write_accounts(database, [(1, 78, 1), (2, 0, 1), (3, 5, 1)])
    out = io.StringIO()
    args = ledger.argument_parser().parse_args(["--zookeeper", cluster.local.connect_string, "--cluster-root",
                                                cluster.local.root, "--compare-sqlite", str(database)])
    assert await in_thread(ledger.run, spark, args, out) == 1
    assert "MISMATCH account 1: log balance 77" in out.getvalue()
    assert "MISMATCH account 3" in out.getvalue() and "2 mismatches" in out.getvalue()

    await cluster.write([(0, 0, b"not json")])
    out = io.StringIO()
    assert await in_thread(ledger.run, spark, args, out) == 2
    assert "not ledger entries: partition 0 transaction 2" in out.getvalue()

    # A job that cannot run says so, with a status of its own: not 1, which means "inconsistent".
    args.headers = "1,a"
    out = io.StringIO()
    assert await in_thread(ledger.run, spark, args, out) == ledger.JOB_FAILED
    assert "ledger: the job failed:" in out.getvalue() and "headers" in out.getvalue()


class SessionKeptOpen:
    """The shared session as built for ``master``; its stop() (the job's, at its end) is only counted."""

    def __init__(self, session, master):
        self._session = session
        self.master = master
        self.stopped = 0

    def __getattr__(self, name):
        return getattr(self._session, name)

    def stop(self):
        self.stopped += 1


def account_partition(data):
    return json.loads(data)["account"] % 2
