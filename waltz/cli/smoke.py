"""``waltz smoke``: the smoke test with faults, self-contained (its own cluster in a temporary directory).

3 storages, 2 servers, 3 partitions, 2 producing and consuming clients; each transaction a random UUID with a
write lock on ("test", random of 1000); storages, servers and ZooKeeper killed (SIGKILL) and restarted on a fixed
schedule. Prints throughput, latency, the faults injected and every anomaly found; exits 1 on any anomaly.
"""

import shutil
import sys
import tempfile

from waltz.cli.cluster import quiet_kazoo, run_reactor
from waltz.cli.common import CliError, error_message, non_negative_int, positive_int, positive_seconds
from waltz.local.daemons import stop_recorded_processes
from waltz.local.smoke import SmokeSettings, run_smoke


def smoke(args):
    settings = SmokeSettings(transactions=args.transactions, faults=not args.no_faults, seed=args.seed,
                             fault_interval=args.fault_interval, min_faults=args.min_faults, timeout=args.timeout)
    if settings.transactions < settings.clients:
        raise CliError("argument --transactions: must be at least %d (one per client)" % settings.clients, exit_code=2)
    quiet_kazoo()
    run_dir = tempfile.mkdtemp(prefix="waltz-smoke-")
    progress = _progress if sys.stdout.isatty() or args.progress else None
    try:
        report = run_reactor(lambda reactor: run_smoke(reactor, run_dir, settings, progress))
    except Exception as exc:
        raise CliError("smoke test did not finish: %s (logs kept in %s)" % (_failure_text(exc), run_dir)) from None
    finally:
        # After an interrupt the run's own clean-up may not have run: stop whatever is still recorded.
        stop_recorded_processes(run_dir)
    print(format_report(settings, report))
    if report.anomalies:
        print("logs kept in %s" % run_dir)
        return 1
    shutil.rmtree(run_dir, ignore_errors=True)
    return 0


def _failure_text(exc):
    """What stopped the run, in one line (the run's own failures are RuntimeErrors written for the user)."""
    return str(exc) if isinstance(exc, RuntimeError) else error_message(exc)


def _progress(done, total, seconds):
    print("\r%d/%d transactions committed (%.0f/s)" % (done, total, done / seconds if seconds else 0),
          end="", flush=True)


def format_report(settings, report):
    latencies = sorted(report.latencies)

    def pct(q):
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000 if latencies else float("nan")

    lines = ["", "smoke test: %d transactions on %d partitions, %d clients, %d storages, %d servers"
             % (settings.transactions, settings.partitions, settings.clients, settings.storages, settings.servers),
             "  throughput: %.0f transactions/s (%d committed in %.1f s); %d attempts ended without committing "
             "and were replaced" % (report.throughput, report.committed, report.seconds, report.unfinished),
             "  latency (execute to committed): p50 %.1f ms, p99 %.1f ms, max %.1f ms"
             % (pct(0.5), pct(0.99), latencies[-1] * 1000 if latencies else float("nan")),
             "  faults injected: %d" % len(report.faults)]
    lines += ["    " + fault for fault in report.faults]
    lines.append("  anomalies: %d" % len(report.anomalies))
    lines += ["    " + anomaly for anomaly in report.anomalies]
    return "\n".join(lines)


def register(subparsers):
    """Add ``waltz smoke``."""
    parser = subparsers.add_parser("smoke", help="the smoke test with faults (starts its own cluster)",
                                   description=__doc__.split("\n\n")[1])
    parser.add_argument("--transactions", type=positive_int, default=20_000,
                        help="transactions to commit (default 20000; 1000000 is the full run)")
    parser.add_argument("--no-faults", action="store_true", help="do not kill anything")
    parser.add_argument("--fault-interval", type=positive_seconds, default=4.0,
                        help="seconds between faults (default 4)")
    parser.add_argument("--min-faults", type=non_negative_int, default=0,
                        help="go on committing past --transactions until this many faults were injected (default 0)")
    parser.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    parser.add_argument("--timeout", type=positive_seconds, default=1800.0, help="give up after this many seconds")
    parser.add_argument("--progress", action="store_true", help="show progress even when not on a terminal")
    parser.set_defaults(func=smoke)
