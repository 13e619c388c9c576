"""Shared helpers of the benchmark scripts: clusters on loopback, latency stats, reporting.

Every benchmark is self-contained: it starts the ZooKeeper and daemons it
needs on 127.0.0.1 in a temporary directory, stops them by pid at the end
(also on failure), bounds its time, prints its figures with the limit they
are compared with, and with ``--json`` prints one JSON object as its last line.
"""

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from twisted.internet import defer

from waltz.local.daemons import local_storage
from waltz.local.zookeeper import LocalZooKeeper
from waltz.protocols.rpc import connect_storage_client
from waltz.zk.bridge import ZooKeeperClient
from waltz.zk.metadata import ClusterMetadata

ROOT = "/waltz_bench"


def parser(description):
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--seconds", type=float, default=5.0, help="measured seconds per run")
    return p


def percentile(values, q):
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def cpu_seconds(pid):
    """``(user, system)`` CPU seconds of process ``pid`` (all its threads), from /proc."""
    with open("/proc/%d/stat" % pid, encoding="ascii") as stream:
        fields = stream.read().rpartition(")")[2].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def machine_cpu_seconds():
    """``(user, system)`` CPU seconds of the whole machine (every process, all cores), from /proc/stat: user
    and nice, and system with interrupts. Idle, I/O wait and steal are left out."""
    with open("/proc/stat", encoding="ascii") as stream:
        fields = stream.readline().split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq = (int(f) for f in fields[:7])
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice) / tick, (system + irq + softirq) / tick


def run_processes(own_name, cluster, *named):
    """``{name: pid}`` of this process (as ``own_name``), of the ``(name, pid)`` pairs ``named`` and of the
    cluster's storage daemons: the processes whose CPU a benchmark reports."""
    processes = {own_name: os.getpid()}
    processes.update(named)
    processes.update(("storage%d" % i, storage.pid) for i, storage in enumerate(cluster.storages))
    return processes


def cpu_snapshot(processes):
    """CPU seconds so far of each named process (``{name: pid}``; a pid of None: the whole machine)."""
    return {name: cpu_seconds(pid) if pid is not None else machine_cpu_seconds() for name, pid in processes.items()}


def print_cpu(title, first, last, count, what="transaction"):
    """Under ``title``, each process's CPU milliseconds per ``what`` between two :func:`cpu_snapshot` s,
    over ``count``."""
    print("CPU per %s, %s:" % (what, title))
    for name in first:
        user, system = (1000 * (after - before) / max(count, 1) for before, after in zip(first[name], last[name]))
        print("  %-14s %6.3f ms (user %.3f, system %.3f)" % (name, user + system, user, system))


def ratio_line(ratio, target, met):
    """The closing line every benchmark prints: its ratio to the limit against the target."""
    return "  ratio to limit: %.2f (target >= %.1f): %s" % (ratio, target, "met" if met else "NOT met")


def add_rounds_argument(p, default=3):
    p.add_argument("--rounds", type=int, default=default,
                   help="rounds of (measurement, limit), each on fresh daemons; figures are medians and the "
                        "ratio is the median of the rounds' ratios (this machine's speed drifts between runs "
                        "a minute apart, and the two runs of one round are the closest in time)")


def round_summary(rounds):
    """``(median rate, median limit, median ratio)`` of ``[(rate, limit), ...]``, one pair per round
    (ratio 0 when there is no limit), printing each round on stderr when there are several."""
    for k, (rate, limit) in enumerate(rounds):
        if len(rounds) > 1:
            print("round %d: %.0f/s, limit %.0f/s, ratio %.2f" % (k + 1, rate, limit, rate / limit if limit else 0),
                  file=sys.stderr)
    ratios = [rate / limit for rate, limit in rounds if limit]
    return (statistics.median(r for r, _ in rounds), statistics.median(lim for _, lim in rounds),
            statistics.median(ratios) if ratios else 0.0)


def report(figures, as_json, lines):
    for line in lines:
        print(line)
    if as_json:
        print(json.dumps(figures, sort_keys=True))


@contextlib.contextmanager
def work_dir(prefix):
    path = tempfile.mkdtemp(prefix=prefix)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def processes():
    """Collects started daemons and stops every one of them (by pid) on exit."""
    started = []
    try:
        yield started
    finally:
        for proc in reversed(started):
            try:
                proc.stop()
            except Exception as exc:  # keep stopping the others
                print("warning: could not stop %r: %s" % (proc, exc), file=sys.stderr)


def start_zookeeper(run_dir, started):
    zk = LocalZooKeeper(run_dir)
    started.append(zk)
    zk.start()
    return zk


@defer.inlineCallbacks
def create_cluster(reactor, connect_string, num_partitions, root=ROOT):
    """Create a cluster in ZooKeeper; fires with its StoreParams (key, partition count)."""
    zk = ZooKeeperClient(connect_string, reactor=reactor)
    yield zk.connect()
    try:
        metadata = ClusterMetadata(zk, root, reactor)
        yield metadata.create_cluster("bench", num_partitions)
        params = yield metadata.store_params()
    finally:
        yield zk.close()
    return params


def start_storage(run_dir, connect_string, started, root=ROOT, **overrides):
    storage = local_storage(run_dir, connect_string, root, **overrides)
    started.append(storage)
    storage.start()
    return storage


@defer.inlineCallbacks
def connect_storage(reactor, storage, params, admin=False):
    """A connected, opened client of a storage daemon's storage (or admin) port."""
    port = storage.config["storage.admin.port" if admin else "storage.port"]
    proto = yield connect_storage_client(reactor, "127.0.0.1", port, params.key, params.num_partitions, admin)
    yield proto.opened
    return proto


def now():
    return time.perf_counter()
