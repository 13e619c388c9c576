"""LocalZooKeeper: start, stop by pid from another handle, kill, restart with the same data."""

import os
import socket

import pytest
from kazoo.client import KazooClient

from waltz.local.zookeeper import LocalZooKeeper, ZooKeeperLaunchError, four_letter_word


def write_and_read(server, path, value=None):
    """Blocking kazoo round trip: write ``value`` (if given) at ``path`` and return what is there."""
    client = KazooClient(hosts=server.connect_string, timeout=10)
    client.start(5)
    try:
        if value is not None:
            client.create(path, value)
        return client.get(path)[0] if client.exists(path) else None
    finally:
        client.stop()
        client.close()


def test_start_kill_restart_keeps_port_and_data(private_zookeeper):
    server = private_zookeeper.start()
    assert server.is_running() and server.ruok()
    assert server.pid == int(open(server.pid_path).read())
    assert four_letter_word(server.host, server.port, b"srvr").startswith(b"Zookeeper version: 3.")
    config = open(server.config_path).read()
    assert "clientPortAddress=127.0.0.1" in config and "admin.enableServer=false" in config
    write_and_read(server, "/kept", b"data")
    port = server.port

    server.kill()
    assert not server.is_running() and not server.ruok()
    assert not os.path.exists(server.pid_path)

    server.restart()
    assert server.port == port and server.ruok()
    assert write_and_read(server, "/kept") == b"data"


def test_another_handle_finds_and_stops_it_by_pid(private_zookeeper):
    server = private_zookeeper.start()
    found = LocalZooKeeper.from_run_dir(server.run_dir)
    assert (found.port, found.host, found.pid) == (server.port, "127.0.0.1", server.pid)
    assert found.is_running()
    assert found.start() is found  # already running: nothing to do
    assert found.pid == server.pid
    assert found.stop() is True
    assert not server.is_running() and not server.ruok()
    assert found.stop() is False


def test_a_stale_pid_file_is_not_trusted(private_zookeeper):
    server = private_zookeeper
    os.makedirs(server.run_dir, exist_ok=True)
    with open(server.pid_path, "w") as stream:
        stream.write("%d\n" % os.getpid())  # a live process, but not this run dir's ZooKeeper
    assert not server.is_running()
    assert server.stop() is False  # and it was not signalled: we are still here
    assert not os.path.exists(server.pid_path)


def test_missing_jar_names_the_debian_package(tmp_path):
    server = LocalZooKeeper(tmp_path, jar=str(tmp_path / "nothing.jar"))
    with pytest.raises(ZooKeeperLaunchError, match="nothing.jar not found: install the Debian package.*zookeeper"):
        server.start()


def test_missing_java_names_the_debian_package(tmp_path):
    server = LocalZooKeeper(tmp_path, java="no-such-java-binary")
    with pytest.raises(ZooKeeperLaunchError, match="java .* not found: install the Debian package"):
        server.start()


def test_a_port_in_use_is_refused_at_once(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        server = LocalZooKeeper(tmp_path, port=busy.getsockname()[1])
        with pytest.raises(ZooKeeperLaunchError, match="already in use"):
            server.start()
    assert not server.is_running()


def test_a_server_that_dies_during_start_up_reports_its_log(tmp_path):
    server = LocalZooKeeper(tmp_path, heap="1k")  # the JVM refuses to start with such a heap
    with pytest.raises(ZooKeeperLaunchError, match="exited with status .* during start-up") as info:
        server.start(timeout=20)
    assert "zookeeper.log ends with" in str(info.value)
