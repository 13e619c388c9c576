"""The benchmark scripts in their CI setting: each one runs against real daemons, reports figures that
agree with what it was asked to do, and stops every process it started.

Their targets are not checked here: a CI machine's speed says nothing about them (see
``docs/performance.md``). What is checked is that the scripts work, so that the figures quoted from
them come from scripts that run.
"""

import json
import os
import signal
import subprocess
import sys

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                          "benchmarks")


def processes_under(directory):
    """PIDs of the processes (other than this one) whose working directory or command line is under
    ``directory``: the daemons and ZooKeeper a benchmark started in its work directory."""
    directory = str(directory)
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cwd = os.readlink("/proc/%s/cwd" % entry)
            with open("/proc/%s/cmdline" % entry, "rb") as stream:
                cmdline = stream.read().decode("utf-8", "replace")
        except OSError:
            continue   # gone, or not ours to look at
        if cwd.startswith(directory) or directory in cmdline:
            found.append(int(entry))
    return found


def run_benchmark(tmp_path, script, *args, timeout=150):
    """Run ``benchmarks/<script> <args> --json`` with its work directories under ``tmp_path``; the
    last line of its output, parsed. Kills (by PID) whatever it left running and fails if it left any."""
    env = dict(os.environ, TMPDIR=str(tmp_path))
    try:
        result = subprocess.run([sys.executable, os.path.join(BENCHMARKS, script), *args, "--json"],
                                capture_output=True, text=True, timeout=timeout, env=env)
    finally:
        left = processes_under(tmp_path)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    output = result.stdout + result.stderr[-3000:]
    assert result.returncode == 0, output
    assert not left, "%s left processes running: %s" % (script, left)
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(180)
def test_storage_append_reports_appends_and_its_limit(tmp_path):
    figures = run_benchmark(tmp_path, "storage_append.py", "--seconds", "1", "--single")
    assert figures["ops_per_s"] > 0 and figures["limit_ops_per_s"] > 0
    assert figures["ratio"] == pytest.approx(figures["ops_per_s"] / figures["limit_ops_per_s"], abs=0.01)


@pytest.mark.timeout(180)
def test_replication_reports_rate_failover_and_no_failed_append(tmp_path):
    figures = run_benchmark(tmp_path, "replication.py", "--seconds", "1", "--rounds", "1")
    assert figures["ops_per_s"] > 0 and figures["limit_ops_per_s"] > 0
    assert figures["failed_appends"] == 0
    assert 0 < figures["failover_s"] < 30


@pytest.mark.timeout(180)
def test_e2e_paced_phase_commits_what_it_offers_and_saturated_phase_reports_the_ratio(tmp_path):
    figures = run_benchmark(tmp_path, "e2e.py", "--seconds", "2", "--rounds", "1", "--rate", "500")
    # Open loop: the paced phase commits what it offers, whatever the machine's speed.
    assert figures["paced_ops_per_s"] == pytest.approx(500, rel=0.1)
    assert 0 < figures["paced_p50_ms"] <= figures["paced_p99_ms"]
    # Closed loop: the saturated phase commits more than the paced one offered, on any machine
    # that can run the suite, and the consumer saw the same stream.
    assert figures["ops_per_s"] > 500
    assert figures["feed_per_s"] == pytest.approx(figures["ops_per_s"], rel=0.1)
    assert figures["ratio"] == pytest.approx(figures["ops_per_s"] / figures["limit_ops_per_s"], abs=0.01)


@pytest.mark.timeout(240)
def test_spark_read_reads_every_row(tmp_path):
    # The script itself exits non-zero when the Spark read or the single client misses a row or a byte.
    figures = run_benchmark(tmp_path, "spark_read.py", "--transactions", "3000", "--rounds", "1", timeout=210)
    assert figures["transactions"] == 3000
    assert figures["rows_per_s"] > 0 and figures["limit_ops_per_s"] > 0
