"""``waltz smoke`` without a cluster: whatever stops the run is one line naming the kept logs, a producer timeout
says how far the producers got, and the replicas' segment files are compared off the reactor thread."""

import threading
from types import SimpleNamespace

import pytest
import pytest_twisted
from twisted.internet import defer, task

from waltz.cli import main, smoke
from waltz.local import smoke as local_smoke
from waltz.local.daemons import DaemonError
from waltz.client.config import client_config
from waltz.local.smoke import SmokeReport, SmokeSettings
from waltz.local.zookeeper import ZooKeeperLaunchError
from waltz.storage.index import FILE_HEADER_SIZE


@pytest.mark.parametrize("error, text", [
    (DaemonError("storage exited with status 1:\nits log tail"), "storage exited with status 1:"),
    (ZooKeeperLaunchError("ZooKeeper did not start within 30 s\nits log tail"), "ZooKeeper did not start within 30 s"),
    (RuntimeError("clients stopped catching up with the log"), "clients stopped catching up with the log"),
    (ConnectionRefusedError(111, "Connection refused"), "Connection refused"),
    (defer.TimeoutError(), "TimeoutError"),
])
def test_a_run_that_fails_is_one_line_naming_the_kept_logs(monkeypatch, capsys, tmp_path, error, text):
    def failing_run(function):
        raise error
    monkeypatch.setattr(smoke, "run_reactor", failing_run)
    monkeypatch.setattr(smoke.tempfile, "mkdtemp", lambda prefix: str(tmp_path))
    with pytest.raises(SystemExit) as exited:
        main.main(["smoke", "--transactions", "10"])
    assert exited.value.code == 1
    assert capsys.readouterr().err == "waltz: error: smoke test did not finish: %s (logs kept in %s)\n" % (
        text, tmp_path)


def test_a_timeout_past_a_day_bounds_the_clients_expiration_to_what_the_key_takes():
    # A --timeout over a day passed the option check, then failed the client config mid-run.
    config = local_smoke._client_config(_FakeCluster(), SmokeSettings(transactions=1, timeout=90_000))
    assert client_config(config)["client.transactionExpiration"] == 86_400_000


class _FakeCluster:
    connect_string, root = "127.0.0.1:2181", "/smoke"


def test_a_producer_timeout_says_how_far_the_producers_got():
    clock = task.Clock()
    producers = [SimpleNamespace(committed=n, done=defer.Deferred()) for n in (3, 4)]
    late = local_smoke._producers_late(producers, SmokeSettings(transactions=20, timeout=5))
    d = defer.gatherResults([p.done for p in producers], consumeErrors=True).addTimeout(5, clock, onTimeoutCancel=late)
    clock.advance(5)
    failure = pytest.raises(RuntimeError, d.result.raiseException)
    d.addErrback(lambda _: None)
    assert str(failure.value) == "the producers committed 7 of 20 transactions within 5 s (--timeout)"


def _segment(directory, partition, name, records):
    path = directory / str(partition) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes(FILE_HEADER_SIZE) + records)


@pytest_twisted.ensureDeferred
async def test_replicas_are_compared_off_the_reactor_thread(monkeypatch, tmp_path):
    storages = []
    for port, tail in ((1, b"C"), (2, b"C"), (3, b"Cdiff")):
        directory = tmp_path / ("storage%d" % port)
        _segment(directory, 0, "00000000000000000000.seg", b"AB")   # partition 0: identical everywhere
        _segment(directory, 1, "00000000000000000000.seg", b"AB")   # partition 1: the third holds more
        _segment(directory, 1, "00000000000000000010.seg", tail)
        storages.append(SimpleNamespace(config={"storage.directory": str(directory), "storage.port": port}))
    cluster = SimpleNamespace(storages=storages, storage_name=lambda storage: "s%d" % storage.config["storage.port"])
    opened_on = []

    def recording_open(*args, **kwargs):
        opened_on.append(threading.current_thread())
        return open(*args, **kwargs)
    monkeypatch.setattr(local_smoke, "open", recording_open, raising=False)
    report = SmokeReport()
    await defer.maybeDeferred(local_smoke._check_replicas, cluster, SmokeSettings(partitions=2), report)
    assert report.anomalies == ["partition 1: replicas differ (record bytes {'s1': 3, 's2': 3, 's3': 7})"]
    assert len(opened_on) == 9
    assert threading.main_thread() not in opened_on    # the reactor runs on the main thread


def test_every_kind_of_process_is_killed_within_the_first_four_faults():
    cluster = SimpleNamespace(storages=["s0", "s1", "s2"], zookeeper="zk")
    injector = local_smoke.FaultInjector(task.Clock(), cluster, ["v0", "v1"], SmokeSettings(), SmokeReport())
    assert injector.cycle == [("storage-0", "s0"), ("server-0", "v0"), ("storage-1", "s1"), ("zookeeper", "zk"),
                              ("storage-2", "s2"), ("server-1", "v1")]
