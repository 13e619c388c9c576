"""``waltz perf producers|consumers`` as processes against a real local cluster (``waltz dev``)."""

import re

import pytest

from tests.cli.helpers import refused, waltz


@pytest.mark.timeout(300)
def test_producers_then_consumers_report_what_they_did(dev_cluster):
    connect, _ = dev_cluster
    conn = ["--zookeeper", connect, "--root", "/waltz_cluster"]
    produced = waltz("perf", "producers", *conn, "--transactions", "600", "--size", "64", timeout=200)
    assert produced.returncode == 0, produced.stdout + produced.stderr
    assert re.search(r"producers: 600 committed in [\d.]+ s: \d+ transactions/s, [\d.]+ MB/s; latency p50 [\d.]+ ms",
                     produced.stdout), produced.stdout
    consumed = waltz("perf", "consumers", *conn, timeout=200)
    assert consumed.returncode == 0, consumed.stdout + consumed.stderr
    assert "consumers: 600 transactions (38400 bytes)" in consumed.stdout, consumed.stdout


def test_producers_give_up_after_their_timeout(serverless_cluster):
    line = refused("perf", "producers", *serverless_cluster, "--transactions", "5", "--timeout", "2")
    assert line == "waltz: error: perf producers did not finish within 2 s (0 of 5 transactions committed)"


def test_consumers_give_up_on_unserved_partitions_within_their_timeout(serverless_cluster):
    line = refused("perf", "consumers", *serverless_cluster, "--partitions", "3", "--timeout", "1")
    assert line == ("waltz: error: no high-water mark within 1.0 s for partition(s) 3: not served, or their "
                    "server does not answer")
