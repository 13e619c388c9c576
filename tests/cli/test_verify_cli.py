"""``waltz cluster verify`` as a process against a real local cluster (``waltz dev``)."""

import re

import pytest

from tests.cli.helpers import waltz
from waltz.local.devcluster import DevCluster


@pytest.mark.timeout(300)
def test_verify_passes_on_a_healthy_cluster_and_names_every_problem(dev_cluster):
    connect, args = dev_cluster
    conn = ["--zookeeper", connect, "--root", "/waltz_cluster", "--timeout", "3"]
    healthy = waltz("cluster", "verify", *conn)
    assert healthy.returncode == 0, healthy.stdout + healthy.stderr
    assert len(re.findall(r"replicas 3/3 healthy \(quorum 2\)$", healthy.stdout, re.M)) == 4
    assert "the cluster is consistent" in healthy.stdout
    cluster = DevCluster(args[1])
    cluster.daemon("storage", 0).kill()
    cluster.daemon("storage", 1).kill()
    broken = waltz("cluster", "verify", *conn)
    assert broken.returncode == 1, broken.stdout + broken.stderr
    assert len(re.findall(r"^PROBLEM: partition \d: 1 of 3 replicas healthy, below the quorum of 2$",
                          broken.stdout, re.M)) == 4, broken.stdout
    assert broken.stdout.count("does not answer") == 8
