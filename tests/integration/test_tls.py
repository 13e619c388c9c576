"""Mutual TLS on a cluster of real processes: ZooKeeper, three storage daemons and a server daemon whose ports
all speak TLS (``storage.ssl.*``, ``server.ssl.*``), with certificates of the cluster's own CA.

* a client with a certificate of the CA commits, follows the feed and reads data; the tools (``-c`` with
  ``ssl.*``) list the servers and storage nodes; a storage node killed (``kill -9``) and restarted rejoins;
* a client with a certificate of another CA, or without TLS, gets nothing from the server: its executions
  expire and nothing it sent is in the log;
* a server whose storage connections are plain TCP cannot use TLS storage nodes: its partitions stay
  unhealthy.
"""

import pytest
import pytest_twisted
import yaml
from twisted.internet import reactor, task, threads

from tests.cli.helpers import waltz
from tests.integration.test_client_server import (  # noqa: F401  (start_server: a fixture)
    Log, Plain, caught_up, new_client, start_server)
from waltz.client import Outcome
from waltz.local.cluster import LocalCluster
from waltz.local.pki import LocalPKI

pytestmark = pytest.mark.integration

PARTITIONS = 2


@pytest.fixture
def pki(tmp_path):
    return LocalPKI(str(tmp_path / "pki"))


@pytest_twisted.async_yield_fixture
async def tls_cluster(zookeeper, cluster_root, tmp_path, pki):
    """PARTITIONS partitions on three storage daemons whose storage and admin ports speak mutual TLS."""
    local = LocalCluster(str(tmp_path / "cluster"), num_partitions=PARTITIONS, num_storages=3, root=cluster_root,
                         zookeeper=zookeeper, pki=pki)
    try:
        await local.start(reactor)
        yield local
    finally:
        await local.stop()


async def health_becomes(server, healthy, timeout=30.0):
    """Poll the server's /health (in a thread) until it is (un)healthy; fail after ``timeout`` s."""
    deadline = reactor.seconds() + timeout
    while True:
        status, body = await threads.deferToThread(server.http_get, "/health")
        if (status == 200) == healthy:
            return body
        if reactor.seconds() > deadline:
            raise AssertionError("the server's /health stayed %s: %s" % (status, body))
        await task.deferLater(reactor, 0.2, lambda: None)


@pytest_twisted.ensureDeferred
async def test_a_tls_cluster_commits_feeds_reads_and_is_administered_over_tls(tls_cluster, start_server, clients,
                                                                             pki, tmp_path):
    server = await start_server(tls_cluster, **pki.server_keys("server-0"))
    log = Log()
    client = await new_client(tls_cluster, clients, log, **pki.keys("client.ssl.", "app-0"))
    for header in range(4):
        assert (await client.execute(Plain(header % PARTITIONS, 0, header=header))).committed
    await caught_up(client, log)
    assert [h for _, _, h in log.applied[0]] == [0, 2] and [h for _, _, h in log.applied[1]] == [1, 3]
    reader = await new_client(tls_cluster, clients, **{"client.autoMount": False},
                              **pki.keys("client.ssl.", "reader-0"))
    records = await reader.read_transactions(1, 0, 1)
    assert [(r.transaction_id, r.data) for r in records] == [(0, b"plain 1"), (1, b"plain 3")]

    # the tools, with ssl.* in their -c file
    config = tmp_path / "cli.yaml"
    config.write_text(yaml.safe_dump(dict({"zookeeper.connectString": tls_cluster.connect_string,
                                           "cluster.root": tls_cluster.root}, **pki.keys("ssl.", "operator"))))
    listed = await threads.deferToThread(waltz, "server", "list", "-c", str(config))
    assert listed.returncode == 0, listed.stderr
    assert "reachable" in listed.stdout and "UNREACHABLE" not in listed.stdout
    assert listed.stdout.count(", healthy") == PARTITIONS, listed.stdout
    storages = await threads.deferToThread(waltz, "storage", "list", "-c", str(config))
    assert storages.returncode == 0, storages.stderr
    assert "unreachable" not in storages.stdout.lower(), storages.stdout
    marks = await threads.deferToThread(waltz, "client", "high-water-mark", "-c", str(config))
    assert marks.returncode == 0, marks.stderr
    assert marks.stdout.split("\n")[:2] == ["partition 0: high-water mark 1", "partition 1: high-water mark 1"]
    # without ssl.* the same tools cannot reach the nodes
    plain = tmp_path / "plain.yaml"
    plain.write_text(yaml.safe_dump({"zookeeper.connectString": tls_cluster.connect_string,
                                     "cluster.root": tls_cluster.root}))
    unreachable = await threads.deferToThread(waltz, "storage", "list", "-c", str(plain), "--timeout", "2")
    assert "unreachable" in (unreachable.stdout + unreachable.stderr).lower()

    # a storage node killed and restarted comes back over TLS, and commits go on
    storage = tls_cluster.storages[0]
    await threads.deferToThread(storage.kill)
    assert (await client.execute(Plain(0, 0, header=10))).committed
    await threads.deferToThread(storage.start)
    await health_becomes(server, healthy=True)
    assert (await client.execute(Plain(0, 0, header=11))).committed
    await caught_up(client, log)
    assert [h for _, _, h in log.applied[0]] == [0, 2, 10, 11]


@pytest.mark.parametrize("how", ["another CA", "plain TCP"])
@pytest_twisted.ensureDeferred
async def test_a_client_without_a_certificate_of_the_cluster_gets_nothing(tls_cluster, start_server, clients, pki,
                                                                          tmp_path, how):
    await start_server(tls_cluster, **pki.server_keys("server-0"))
    log = Log()
    member = await new_client(tls_cluster, clients, log, **pki.keys("client.ssl.", "app-0"))
    assert (await member.execute(Plain(0, 0, header=1))).committed
    keys = {}
    if how == "another CA":
        # it trusts the cluster's CA (so it would accept the server): only the server's check can refuse it
        keys = dict(LocalPKI(str(tmp_path / "stranger")).keys("client.ssl.", "intruder"),
                    **{"client.ssl.trustRoots": pki.ca_path})
    intruder = await new_client(tls_cluster, clients, Log(), **{"client.transactionExpiration": 3000}, **keys)
    result = await intruder.execute(Plain(0, 0, header=99))
    assert result.outcome is Outcome.EXPIRED
    assert (await member.execute(Plain(0, 0, header=2))).committed
    await caught_up(member, log)
    assert [h for _, _, h in log.applied[0]] == [1, 2]


@pytest_twisted.ensureDeferred
async def test_a_server_without_tls_to_the_storages_has_no_healthy_partition(tls_cluster, start_server, pki):
    keys = {k: v for k, v in pki.server_keys("server-0").items() if k.startswith("server.ssl.")}
    server = await start_server(tls_cluster, **keys)
    storage = tls_cluster.storages[0]

    def refused_by_the_storage():
        with open(storage.log_path, encoding="utf-8") as log:
            return any("TLS handshake with 127.0.0.1:" in line and "failed" in line for line in log)
    deadline = reactor.seconds() + 30
    while not await threads.deferToThread(refused_by_the_storage):     # the server's plain connections are refused
        assert reactor.seconds() < deadline, "the storage logged no refused handshake"
        await task.deferLater(reactor, 0.2, lambda: None)
    body = await health_becomes(server, healthy=False)
    assert "partition 0 (generation 1): the store is not writing" in body
