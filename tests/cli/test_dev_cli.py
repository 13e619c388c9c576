"""``waltz dev up | status | down`` as processes: a real local cluster, idempotent, stopped by pid."""

import os
import re
import signal
import threading

import pytest
import pytest_twisted
from twisted.internet import defer, reactor

from tests.cli.conftest import stop_dev_cluster
from tests.conftest import zk_client_for
from tests.cli.helpers import refused, waltz
from waltz.local.ports import free_port
from waltz.local.devcluster import DevCluster


@pytest.fixture
def dev(tmp_path):
    """Arguments for a dev cluster of this test's own; whatever it started is stopped afterwards."""
    args = ["--run-dir", str(tmp_path / "dev"), "--zookeeper-port", str(free_port())]
    try:
        yield args
    finally:
        stop_dev_cluster(tmp_path / "dev", args)


def pids_of(run_dir):
    """Pids of processes whose command line mentions ``run_dir``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open("/proc/%s/cmdline" % entry, "rb") as stream:
                    if run_dir.encode() in stream.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found


@pytest.mark.timeout(240)
def test_up_status_up_again_and_down(dev):
    first = waltz("dev", "up", *dev, timeout=180)
    assert first.returncode == 0, first.stderr
    for name in ("zookeeper", "storage-0", "storage-1", "storage-2", "server-0", "server-1"):
        assert re.search(r"^%s\s+started" % name, first.stdout, re.M), first.stdout
    again = waltz("dev", "up", *dev, timeout=120)
    assert again.returncode == 0 and "started" not in again.stdout, again.stdout
    assert again.stdout.count(" running") == 6

    status = waltz("dev", "status", *dev, timeout=120)
    assert status.returncode == 0, status.stderr
    assert len(re.findall(r"^  (storage|server)-\d\s+\d+\s+healthy", status.stdout, re.M)) == 5, status.stdout
    partitions = re.findall(r"^  (\d): server 127\.0\.0\.1:\d+ \(id \d+\), generation \d+, high-water mark -1$",
                            status.stdout, re.M)
    assert partitions == ["0", "1", "2", "3"], status.stdout
    replicas = re.findall(r"^  127\.0\.0\.1:\d+  0: -1, 1: -1, 2: -1, 3: -1$", status.stdout, re.M)
    assert len(replicas) == 3, status.stdout

    # Another cluster root in the same ZooKeeper: its partitions (served by nobody) do not take the marks the
    # run directory's servers report for the partitions of the same numbers in theirs.
    other = ["--zookeeper", "127.0.0.1:%s" % dev[3], "--root", "/other"]
    assert waltz("cluster", "create", *other, "--name", "other", "--partitions", "2").returncode == 0
    status = waltz("dev", "status", *dev, "--root", "/other", timeout=120)
    assert re.findall(r"^  (\d): server unassigned \(id -\), generation -, high-water mark \?$",
                      status.stdout, re.M) == ["0", "1"], status.stdout

    run_dir = dev[1]
    cluster = DevCluster(run_dir)
    # A hung storage node is asked once, not once per partition (3 s each: minutes on a large cluster).
    hung = cluster.daemon("storage", 0)
    os.kill(hung.pid, signal.SIGSTOP)
    try:
        status = waltz("dev", "status", *dev, timeout=120)
    finally:
        os.kill(hung.pid, signal.SIGCONT)
    assert status.returncode == 0, status.stderr
    assert len(re.findall(r"^  127\.0\.0\.1:\d+  0: \? \(did not answer within 3 s\), 1: \?, 2: \?, 3: \?$",
                          status.stdout, re.M)) == 1, status.stdout

    recorded = [d.pid for _, d in cluster.daemons()] + [cluster.zookeeper.pid]
    assert set(recorded) <= set(pids_of(run_dir))
    down = waltz("dev", "down", *dev, timeout=120)
    assert down.returncode == 0 and down.stdout.count("stopped") == 6, down.stdout
    assert pids_of(run_dir) == []


@pytest.mark.timeout(240)
def test_up_with_tls_makes_every_port_speak_mutual_tls_and_writes_the_files_to_connect_with(dev):
    first = waltz("dev", "up", *dev, "--tls", timeout=180)
    assert first.returncode == 0, first.stderr
    assert "cluster is up" in first.stdout and "mutual TLS" in first.stdout, first.stdout
    run_dir = dev[1]
    tools, client = os.path.join(run_dir, "tools.yaml"), os.path.join(run_dir, "client.yaml")
    with open(tools, encoding="utf-8") as stream:
        assert "ssl.certificate:" in stream.read()
    with open(client, encoding="utf-8") as stream:
        assert "client.ssl.trustRoots:" in stream.read()

    # The tools connect with the run directory's tools.yaml: servers, and storage nodes' admin ports.
    servers = waltz("server", "list", "-c", tools, timeout=60)
    assert servers.returncode == 0 and "2 live server(s)" in servers.stdout, servers.stdout + servers.stderr
    storages = waltz("storage", "list", "-c", tools, timeout=60)
    assert storages.returncode == 0 and storages.stdout.count("reachable; assigned partitions: 0 online") == 3, \
        storages.stdout + storages.stderr
    # dev status asks the admin ports over TLS too (a plain request gets no answer: "?").
    status = waltz("dev", "status", *dev, timeout=120)
    assert status.returncode == 0, status.stderr
    assert len(re.findall(r"^  127\.0\.0\.1:\d+  0: -1, 1: -1, 2: -1, 3: -1$", status.stdout, re.M)) == 3, status.stdout
    # Without the certificates, a tool gets no answer from an admin port or a server, and is told why it
    # likely is.
    connection = ["--zookeeper", "127.0.0.1:%s" % dev[3], "--root", "/waltz_cluster"]
    plain = waltz("storage", "list", *connection, "--timeout", "3", timeout=60)
    assert "reachable; assigned" not in plain.stdout, plain.stdout
    hint = "the peer closed it before sending its Hello: not a Waltz port, or one that speaks TLS"
    assert plain.stdout.count(hint) == 3, plain.stdout
    plain = waltz("server", "list", *connection, "--timeout", "3", timeout=60)
    assert plain.stdout.count(hint) == 2, plain.stdout

    # The run directory keeps TLS: a later up without --tls neither restarts nor changes anything.
    again = waltz("dev", "up", *dev, timeout=120)
    assert again.returncode == 0 and "started" not in again.stdout and "mutual TLS" in again.stdout, again.stdout


def test_up_with_tls_refuses_a_run_directory_whose_daemons_were_made_without_it(dev, tmp_path):
    run_dir = dev[1]
    os.makedirs(os.path.join(run_dir, "storage-0"))
    with open(os.path.join(run_dir, "storage-0", "storage.yaml"), "w", encoding="utf-8") as stream:
        stream.write("storage.port: 40001\nstorage.admin.port: 40002\nstorage.http.port: 40003\n")
    line = refused("dev", "up", *dev, "--tls", code=1)
    assert "storage-0 in %s was made without TLS" % run_dir in line
    assert not os.path.exists(os.path.join(run_dir, "zookeeper")), "nothing started"


def test_status_without_a_cluster_says_so(dev):
    result = waltz("dev", "status", *dev)
    assert result.returncode == 3
    assert "ZooKeeper is not running" in result.stdout


def test_bad_arguments_are_one_line_errors(dev):
    assert "expected a port number 1-65535, got 'many'" in refused("dev", "up", "--zookeeper-port", "many", code=2)
    assert "expected a partition count from 1 to 10000, got '0'" in refused("dev", "up", "--partitions", "0", code=2)
    # Was taken as is: "status" went on and exited 3, "up" started ZooKeeper and the daemons first.
    for command in ("up", "status"):
        assert "argument --root: expected an absolute znode path" in refused("dev", command, "--root", "rel", code=2)


class _Recorder:
    """Stands for a local process: records the thread of every call that would read files or /proc."""

    def __init__(self, calls, name, **attributes):
        self.calls = calls
        self.name = name
        self.__dict__.update(attributes)

    def is_running(self):
        self.calls.append((self.name + ".is_running", threading.current_thread()))
        return True

    @property
    def pid(self):
        self.calls.append((self.name + ".pid", threading.current_thread()))
        return 4711


@pytest_twisted.ensureDeferred
async def test_up_reads_files_and_processes_off_the_reactor_thread_and_registers_a_running_storage(
        zookeeper, cluster_root, tmp_path, monkeypatch):
    # storage-0 runs but is not in ZooKeeper's topology (a dev up that failed between starting and
    # registering it): up registers it and pushes its partitions, which it used to do only for a storage
    # it started for the first time, leaving the cluster a replica short for good.
    from waltz.local import devcluster
    from waltz.zk.metadata import ClusterMetadata
    calls, pushed = [], []
    monkeypatch.setattr(devcluster, "push_assignment",
                        lambda reactor, *args: pushed.append(args[:3]) or defer.succeed(None))
    cluster = DevCluster(tmp_path / "dev", root=cluster_root, num_partitions=2, num_storages=1, num_servers=1)
    cluster.zookeeper = _Recorder(calls, "zookeeper", connect_string=zookeeper.connect_string)

    def daemon(kind, index):
        calls.append(("daemon(%s, %d)" % (kind, index), threading.current_thread()))
        return _Recorder(calls, "%s-%d" % (kind, index), http_port=1,
                         config={"storage.port": 40001, "storage.admin.port": 40002})
    cluster.daemon = daemon
    lines = []
    await cluster.up(reactor, report=lines.append)
    assert pushed == [("127.0.0.1:40001", 40002, [0, 1])]
    client = zk_client_for(zookeeper)
    await client.connect()
    try:
        topology = (await ClusterMetadata(client, cluster_root).topology()).value
    finally:
        await client.close()
    assert topology.partitions_of("127.0.0.1:40001") == (0, 1)
    assert lines == ["zookeeper   running on %s (pid 4711)" % zookeeper.connect_string,
                     "cluster     created at %s with 2 partitions" % cluster_root,
                     "storage-0   running (pid 4711)",
                     "server-0    running (pid 4711)"]
    assert {name for name, _ in calls} == {"zookeeper.is_running", "zookeeper.pid", "daemon(storage, 0)",
                                           "storage-0.is_running", "storage-0.pid", "daemon(server, 0)",
                                           "server-0.is_running", "server-0.pid"}
    on_the_reactor = [name for name, thread in calls if thread is threading.main_thread()]
    assert on_the_reactor == []    # the reactor runs on the main thread


def test_a_reader_that_goes_away_ends_the_command_quietly_as_sigpipe_would(tmp_path):
    # `waltz ... | head -1` printed "waltz: error: Broken pipe" and exited 1.
    import subprocess
    import sys
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run([sys.executable, "-m", "waltz.cli.main", "dev", "status", "--run-dir",
                                 str(tmp_path / "none")], stdout=write_end, stderr=subprocess.PIPE, text=True,
                                timeout=30)
    finally:
        os.close(write_end)
    assert result.returncode == 128 + signal.SIGPIPE and result.stderr == ""
