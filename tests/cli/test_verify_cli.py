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


@pytest.mark.timeout(60)
def test_verify_names_partitions_without_replicas_instead_of_counting_zero_of_zero(zookeeper, cluster_root):
    conn = ["--zookeeper", zookeeper.connect_string, "--root", cluster_root]
    assert waltz("cluster", "create", "--name", "bare", "--partitions", "2", *conn).returncode == 0
    bare = waltz("cluster", "verify", *conn, "--timeout", "3")
    assert bare.returncode == 1, bare.stdout + bare.stderr
    assert re.findall(r"^partition (\d): no server; no replicas assigned$", bare.stdout, re.M) == ["0", "1"]
    assert re.findall(r"^PROBLEM: partition (\d) has no replica in <root>/store/assignment \(give it some with "
                      r"'waltz cluster assign' or 'waltz cluster auto-assign'\)$", bare.stdout, re.M) == ["0", "1"]
    assert "0/0" not in bare.stdout
