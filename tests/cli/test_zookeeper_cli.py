"""``waltz zookeeper start|status|stop`` as subprocesses: daemonized, idempotent, stopped by pid."""

import pytest

from tests.cli.helpers import ok, refused, waltz
from waltz.local.ports import free_port
from waltz.local.zookeeper import LocalZooKeeper


@pytest.fixture
def run_dir(tmp_path):
    path = tmp_path / "zk"
    yield str(path)
    LocalZooKeeper.from_run_dir(path).stop()  # whatever the test left running, by its pid


def test_start_status_stop(run_dir):
    port = free_port()
    out = ok("zookeeper", "start", "--run-dir", run_dir, "--port", str(port))
    assert out.startswith("ZooKeeper started on 127.0.0.1:%d (pid " % port)
    server = LocalZooKeeper.from_run_dir(run_dir)
    assert server.port == port and server.ready()  # still serving after the command returned

    assert "already running on 127.0.0.1:%d" % port in ok("zookeeper", "start", "--run-dir", run_dir)
    assert "serving requests" in ok("zookeeper", "status", "--run-dir", run_dir)

    assert ok("zookeeper", "stop", "--run-dir", run_dir) == "ZooKeeper stopped\n"
    assert not server.ruok() and not server.is_running()
    status = waltz("zookeeper", "status", "--run-dir", run_dir)
    assert status.returncode == 3 and "not running" in status.stdout
    assert "not running" in ok("zookeeper", "stop", "--run-dir", run_dir)


def test_start_on_a_busy_port_is_one_line(run_dir, zookeeper):
    line = refused("zookeeper", "start", "--run-dir", run_dir, "--port", str(zookeeper.port))
    assert "port %d on 127.0.0.1 is already in use" % zookeeper.port in line
