"""``waltz demo``: the bank demo on the local cluster (started if needed).

Several bank application instances (separate processes, each with its own SQLite database) deposit, withdraw and
deactivate accounts under optimistic locks while a storage and a server are killed (SIGKILL) and restarted; at the
end every instance catches up with the log and the run proves that no account went negative, no withdrawal followed
a deactivation, every committed transaction was applied exactly once by every instance, and all databases agree.
Exits 1 when a check fails. See docs/demo.md.
"""

import sqlite3
import sys

from waltz.cli.cluster import quiet_kazoo, run_reactor
from waltz.cli.common import (
    CliError, error_message, port, positive_int, positive_int_up_to, positive_seconds, znode_path)
from waltz.demo.runner import ACCOUNT_NUMBERS_PER_RUN, DemoSettings, InstanceError, load_run, run_demo
from waltz.demo.checks import verify
from waltz.local.daemons import DaemonError
from waltz.local.devcluster import DEFAULT_ROOT, DEFAULT_RUN_DIR, DEFAULT_ZOOKEEPER_PORT, DevCluster
from waltz.local.zookeeper import ZooKeeperLaunchError


def demo(args):
    if args.check:
        return _print_checks(verify(_load_run(args.check)))
    quiet_kazoo()
    cluster = DevCluster(args.run_dir, args.zookeeper_port, args.root)
    settings = DemoSettings(instances=args.instances, accounts=args.accounts, duration=args.duration,
                            concurrency=args.concurrency, faults=not args.no_faults, seed=args.seed)
    try:
        report = run_reactor(lambda reactor: run_demo(reactor, cluster, settings, say=_say))
    except (DaemonError, ZooKeeperLaunchError) as exc:
        raise CliError("the local cluster did not start: %s" % str(exc).splitlines()[0]) from None
    except InstanceError as exc:
        raise CliError("demo failed: %s" % exc) from None
    totals = report.totals
    print()
    print("demo: %d transactions committed in %.0f s; %d lock failures (each retried once the instance had caught "
          "up), %d refused by the application (insufficient funds or deactivated)"
          % (totals["committed"], report.seconds, totals["lock_failures"], totals["refused"]))
    for fault in report.faults:
        print("  fault: %s" % fault)
    return _print_checks(report.checks, report.run_dir)


def _load_run(run_dir):
    """The instances' final states in a finished run's directory; :class:`CliError` when they cannot be read."""
    try:
        return load_run(run_dir)
    except (OSError, sqlite3.Error, KeyError, ValueError) as exc:
        raise CliError("cannot read the demo run in %s: %s" % (run_dir, error_message(exc))) from None


def _say(line):
    print(line, flush=True)


def _print_checks(checks, run_dir=None):
    print("checks:")
    for check in checks:
        print("  [%s] %s (%s)" % ("ok" if check.passed else "FAILED", check.name, check.summary))
        for problem in check.problems[:20]:
            print("      " + problem)
        if len(check.problems) > 20:
            print("      ... and %d more" % (len(check.problems) - 20))
    passed = bool(checks) and all(check.passed for check in checks)
    print("demo: %s%s" % ("all checks passed" if passed else "CHECKS FAILED",
                          "; databases and logs in %s" % run_dir if run_dir else ""))
    sys.stdout.flush()
    return 0 if passed else 1


#: An argparse type: the accounts of a run (its account numbers must not reach the next run's).
_accounts = positive_int_up_to(ACCOUNT_NUMBERS_PER_RUN, "a number of accounts")


def register(subparsers):
    """Add ``waltz demo``."""
    parser = subparsers.add_parser("demo", help="the bank demo on the local cluster",
                                   description=__doc__.split("\n\n")[1])
    parser.add_argument("--run-dir", default=DEFAULT_RUN_DIR, help="the local cluster's run directory "
                        "(default %(default)s)")
    parser.add_argument("--zookeeper-port", type=port, default=None,
                        help="ZooKeeper client port on 127.0.0.1 (default: the run directory's last one, else %d)"
                        % DEFAULT_ZOOKEEPER_PORT)
    parser.add_argument("--root", default=DEFAULT_ROOT, type=znode_path, help="cluster root znode (default %(default)s)")
    parser.add_argument("--instances", type=positive_int, default=3, help="application instances (default 3)")
    parser.add_argument("--accounts", type=_accounts, default=20,
                        help="accounts (default 20, at most %d: each run has account numbers of its own)"
                        % ACCOUNT_NUMBERS_PER_RUN)
    parser.add_argument("--duration", type=positive_seconds, default=60.0, help="seconds of traffic (default 60)")
    parser.add_argument("--concurrency", type=positive_int, default=8,
                        help="transactions in flight per instance (default 8)")
    parser.add_argument("--no-faults", action="store_true", help="do not kill anything")
    parser.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    parser.add_argument("--check", metavar="RUN", help="only re-run the final checks on a finished run's directory")
    parser.set_defaults(func=demo)
