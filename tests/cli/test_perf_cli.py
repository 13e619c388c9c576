"""``waltz perf producers|consumers`` as processes against a real local cluster (``waltz dev``)."""

import re

import pytest

from tests.cli.helpers import waltz


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
