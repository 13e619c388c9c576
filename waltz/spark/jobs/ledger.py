"""The bank ledger job: rebuild every account's balance from the log and compare it with the application's
database.

Input format: each transaction's data is a UTF-8 JSON object
``{"type": "deposit" | "withdrawal" | "deactivate", "account": int, "amount": int}``
(``amount`` absent for ``deactivate``). An account's balance is the sum of its deposits
minus the sum of its withdrawals; it is active unless a ``deactivate`` names it.

With ``--compare-sqlite PATH`` the balances are compared with the table
``accounts(account INTEGER PRIMARY KEY, balance INTEGER, active INTEGER)`` of that
SQLite file: an account whose balance or active flag differs, or that only one side
has (an account without transactions counts as balance 0, active), is a mismatch.
Every mismatch is printed and the exit status is 1; a transaction that is not a
ledger entry is an error (exit 2). Run it as::

    python -m waltz.spark.jobs.ledger --zookeeper 127.0.0.1:2181 --cluster-root /waltz_cluster \\
        [--master local[*]] [--compare-sqlite bank.db] [--headers 101,102,103]

or with ``--client-config FILE`` (an application's client config: its ZooKeeper keys, and for a cluster that
speaks TLS its ``client.ssl.*`` keys, e.g. ``.waltz-dev/client.yaml``) in place of the first two,

or ``spark-submit waltz/spark/jobs/ledger.py ...`` (``--master`` then defaults to what spark-submit gives).
"""

import argparse
import contextlib
import os
import pathlib
import sqlite3
import sys

from pyspark.sql import functions as F
from pyspark.sql.types import LongType, StringType, StructField, StructType

#: The JSON of one ledger entry.
ENTRY_SCHEMA = StructType([StructField("type", StringType()), StructField("account", LongType()),
                           StructField("amount", LongType())])
ENTRY_TYPES = ("deposit", "withdrawal", "deactivate")
DB_SCHEMA = "account long, balance long, active boolean"


class LedgerError(Exception):
    """A transaction of the log is not a ledger entry."""


def read_log(spark, zookeeper, cluster_root, **options):
    """The log of a cluster as a DataFrame (``partition, transaction_id, header, data``)."""
    reader = spark.read.format("waltz").option("zookeeper", zookeeper).option("cluster.root", cluster_root)
    for key, value in options.items():
        reader = reader.option(key, value)
    return reader.load()


def decode_entries(log):
    """``partition, transaction_id, type, account, amount`` of every transaction of ``log``."""
    entry = F.from_json(F.col("data").cast("string"), ENTRY_SCHEMA)
    return log.select("partition", "transaction_id", entry.alias("e")).select(
        "partition", "transaction_id", "e.type", "e.account", "e.amount")


def check_entries(entries, shown=5):
    """Raise :class:`LedgerError` naming the first transactions that are not ledger entries."""
    amount_needed = F.col("type").isin("deposit", "withdrawal")
    bad = entries.where(F.col("type").isNull() | ~F.col("type").isin(*ENTRY_TYPES) | F.col("account").isNull()
                        | (amount_needed & (F.col("amount").isNull() | (F.col("amount") < 0))))
    rows = bad.orderBy("partition", "transaction_id").limit(shown).collect()
    if rows:
        raise LedgerError("not ledger entries: " + ", ".join(
            "partition %d transaction %d" % (r.partition, r.transaction_id) for r in rows))


def balances(entries):
    """``account, balance, active, transactions``: the ledger rebuilt from decoded entries."""
    signed = (F.when(F.col("type") == "deposit", F.col("amount"))
              .when(F.col("type") == "withdrawal", -F.col("amount")).otherwise(F.lit(0)))
    return entries.groupBy("account").agg(
        F.sum(signed).cast("long").alias("balance"),
        (F.max((F.col("type") == "deactivate").cast("int")) == 0).alias("active"),
        F.count(F.lit(1)).alias("transactions"))


def read_sqlite_accounts(spark, path):
    """The ``accounts`` table of a SQLite file as a DataFrame (``account, balance, active``)."""
    # A file URI (read-only): quoted, so a path with '#', '?' or '%' opens that file, not another one it creates.
    with contextlib.closing(sqlite3.connect(pathlib.Path(path).absolute().as_uri() + "?mode=ro", uri=True)) as db:
        rows = [(int(a), int(b), bool(c)) for a, b, c in db.execute("SELECT account, balance, active FROM accounts")]
    return spark.createDataFrame(rows, DB_SCHEMA)


def mismatches(ledger, database):
    """``account, log_balance, log_active, db_balance, db_active`` of every account the two disagree on."""
    joined = ledger.select("account", F.col("balance").alias("log_balance"), F.col("active").alias("log_active")) \
        .join(database.select("account", F.col("balance").alias("db_balance"), F.col("active").alias("db_active")),
              "account", "full_outer")
    log_balance = F.coalesce("log_balance", F.lit(0))
    log_active = F.coalesce("log_active", F.lit(True))
    differs = (F.col("db_balance").isNull() | (log_balance != F.col("db_balance"))
               | (log_active != F.col("db_active")))
    return joined.where(differs).orderBy("account")


def argument_parser():
    parser = argparse.ArgumentParser(prog="python -m waltz.spark.jobs.ledger", description=__doc__.split("\n\n")[0])
    parser.add_argument("--zookeeper", help="ZooKeeper connect string, e.g. 127.0.0.1:2181 (or from --client-config)")
    parser.add_argument("--cluster-root", help="the cluster's root znode, e.g. /waltz_cluster (or from --client-config)")
    parser.add_argument("--client-config", metavar="FILE",
                        help="YAML file of client keys passed to the reader (docs/spark.md, 'Options'): "
                             "zookeeper.connectString, cluster.root, client.ssl.* for a cluster that speaks TLS, ...")
    parser.add_argument("--master", default=None, help="Spark master (default local[*], or spark-submit's)")
    parser.add_argument("--compare-sqlite", metavar="PATH", help="compare with the accounts table of this file")
    parser.add_argument("--headers", metavar="LIST", help="read only transactions with these headers (e.g. "
                        "101,102,103, the bank demo's), skipping other applications' transactions in the same log "
                        "before any data is fetched; default: every transaction")
    parser.add_argument("--show", type=int, default=20, help="balances to print without --compare-sqlite")
    return parser


#: Exit status of a job that could not run to its verdict (cluster unreachable, a read failed, a bad
#: option, an unreadable database): distinct from 1, so that a script testing the status never takes
#: a crash for an inconsistent ledger.
JOB_FAILED = 3


def run(spark, args, out=None):
    """The job, reporting to ``out`` (standard output by default); returns the exit status: 0 consistent,
    1 mismatches, 2 a bad log entry or a missing database file, 3 the job failed (the reason on one line)."""
    out = sys.stdout if out is None else out
    try:
        return _verdict(spark, args, out)
    except Exception as exc:
        print("ledger: the job failed: %s" % failure_reason(exc), file=out)
        return JOB_FAILED


def failure_reason(exc) -> str:
    """One line saying why ``exc`` happened. A Python error inside Spark arrives as a JVM exception
    whose message holds the Python traceback: its last ``Type: message`` line is the reason."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in reversed(lines):
        name, sep, _ = line.partition(": ")
        if sep and name.split(".")[-1].endswith(("Error", "Exception")) and " " not in name:
            return line
    return "%s: %s" % (type(exc).__name__, lines[0] if lines else "")


def _verdict(spark, args, out):
    if args.compare_sqlite and not os.path.isfile(args.compare_sqlite):
        print("ledger: no such database file: %s" % args.compare_sqlite, file=out)
        return 2
    options = dict(getattr(args, "options", {}))     # (pyspark turns bools and numbers into option strings)
    if args.headers is not None:
        options["headers"] = args.headers       # "" is refused, not "all"
    entries = decode_entries(read_log(spark, args.zookeeper, args.cluster_root, **options)).cache()
    try:
        check_entries(entries)
    except LedgerError as exc:
        print("ledger: %s" % exc, file=out)
        return 2
    ledger = balances(entries).cache()
    accounts = ledger.count()
    print("ledger: %d transactions, %d accounts" % (entries.count(), accounts), file=out)
    if not args.compare_sqlite:
        for row in ledger.orderBy("account").limit(args.show).collect():
            print("  account %d: balance %d%s" % (row.account, row.balance, "" if row.active else " (inactive)"),
                  file=out)
        return 0
    wrong = mismatches(ledger, read_sqlite_accounts(spark, args.compare_sqlite)).collect()
    for row in wrong:
        print("  MISMATCH account %d: log balance %s active %s, database balance %s active %s"
              % (row.account, row.log_balance, row.log_active, row.db_balance, row.db_active), file=out)
    print("ledger: %s (%d mismatches with %s)" % ("consistent" if not wrong else "INCONSISTENT", len(wrong),
                                                  args.compare_sqlite), file=out)
    return 1 if wrong else 0


def parse_arguments(argv=None):
    """The job's arguments; ``args.options`` holds the reader options of ``--client-config`` (the ZooKeeper keys
    taken out into ``args.zookeeper`` and ``args.cluster_root`` unless given as flags). A missing connection or
    an unreadable file is a usage error (exit 2, one line)."""
    parser = argument_parser()
    args = parser.parse_args(argv)
    args.options = {}
    if args.client_config:
        from waltz.config import ConfigError, flatten, read_yaml
        try:
            args.options = flatten(read_yaml(args.client_config))
        except ConfigError as exc:
            parser.error(str(exc))
        zookeeper = args.options.pop("zookeeper.connectString", None)
        root = args.options.pop("cluster.root", None)
        args.zookeeper = args.zookeeper or zookeeper
        args.cluster_root = args.cluster_root or root
    for flag, key, value in (("--zookeeper", "zookeeper.connectString", args.zookeeper),
                             ("--cluster-root", "cluster.root", args.cluster_root)):
        if not value:
            parser.error("no %s given: use %s, or --client-config with %s" % (key, flag, key))
    return args


def main(argv=None):
    args = parse_arguments(argv)
    from waltz.spark.session import build_session
    master = args.master or (None if launched_by_spark_submit() else "local[*]")
    spark = build_session(master, "waltz-ledger")
    try:
        return run(spark, args)
    finally:
        spark.stop()


def launched_by_spark_submit():
    """True when spark-submit started this driver (it then decides the master unless --master is given)."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


if __name__ == "__main__":
    sys.exit(main())
