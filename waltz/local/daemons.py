"""Waltz daemons as local processes: start with twistd, wait until they serve, stop or kill by pid.

Used by the integration tests, the benchmarks and the local development
cluster. Each daemon runs ``twistd --nodaemon waltz-<kind> --config FILE`` in
its own process group, writes its log to a file in its run directory, and is
ready when its HTTP ``/ping`` answers. Stopping and killing go by the pid this
object started, never by name.
"""

import http.client
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import yaml

from waltz.local.ports import free_ports


class DaemonError(Exception):
    """A daemon did not start, or died; the message carries the tail of its log."""




def log_tail(path, lines=30):
    try:
        with open(path, "rb") as stream:
            return b"".join(stream.readlines()[-lines:]).decode("utf-8", "replace")
    except OSError:
        return "(no log)"


class LocalDaemon:
    """One twistd daemon (``kind`` is ``storage`` or ``server``) with its config, log and pid.

    The pid is also written to ``<run_dir>/<kind>.pid``, so a later process (``waltz dev down``) can
    find the daemon with :meth:`from_run_dir` and stop it; the pid is only signalled after
    ``/proc/<pid>/cmdline`` shows it is this run directory's daemon.
    """

    def __init__(self, kind, run_dir, config, http_port_key):
        self.kind = kind
        self.run_dir = os.path.abspath(run_dir)
        self.config = dict(config)
        self.http_port_key = http_port_key
        self.http_port = self.config[http_port_key]
        self.config_path = os.path.join(self.run_dir, "%s.yaml" % kind)
        self.log_path = os.path.join(self.run_dir, "%s.log" % kind)
        self.pid_path = os.path.join(self.run_dir, "%s.pid" % kind)
        self.process = None
        self._pid = None

    @classmethod
    def from_run_dir(cls, kind, run_dir, http_port_key):
        """The daemon a previous process started in ``run_dir`` (from its config and pid files)."""
        config_path = os.path.join(os.path.abspath(run_dir), "%s.yaml" % kind)
        with open(config_path, encoding="utf-8") as stream:
            daemon = cls(kind, run_dir, yaml.safe_load(stream), http_port_key)
        try:
            with open(daemon.pid_path, encoding="ascii") as stream:
                daemon._pid = int(stream.read().strip())
        except (OSError, ValueError):
            daemon._pid = None
        return daemon

    @property
    def pid(self):
        return self.process.pid if self.process is not None else self._pid

    def write_config(self):
        os.makedirs(self.run_dir, exist_ok=True)
        write_config(self.config_path, self.config)

    def command(self):
        twistd = os.path.join(os.path.dirname(sys.executable), "twistd")
        return [twistd, "--nodaemon", "--pidfile=", "--logfile=%s" % self.log_path,
                "waltz-%s" % self.kind, "--config", self.config_path]

    def start(self, timeout=30.0):
        """Start the daemon and wait until ``/ping`` answers; :class:`DaemonError` if it dies first."""
        if self.is_running():
            return self
        if self.ping():
            # Another process serves this daemon's HTTP port (one started by hand, or not recorded here): the new
            # one would die at once, and its /ping would be answered by the other, reported as started.
            raise DaemonError("%s: http port %d already answers /ping: another process serves it; stop it first"
                              % (self.kind, self.http_port))
        self.write_config()
        with open(os.path.join(self.run_dir, "%s.stdout" % self.kind), "ab") as out:
            self.process = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.run_dir)
        with open(self.pid_path, "w", encoding="ascii") as stream:
            stream.write("%d\n" % self.process.pid)
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout=30.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.is_running():
                status = self.process.returncode if self.process is not None else "unknown"
                raise DaemonError("%s exited with status %s:\n%s" % (self.kind, status, log_tail(self.log_path)))
            if self.ping():
                return
            time.sleep(0.05)
        self.kill()
        raise DaemonError("%s did not answer /ping within %.0f s:\n%s" % (self.kind, timeout,
                                                                           log_tail(self.log_path)))

    def ping(self):
        """Whether the daemon's HTTP port answers ``/ping``. Another process on that port, answering something
        else than HTTP (a Waltz port), is no answer either: the daemon then fails to bind and exits, and
        :meth:`wait_ready` reports why from its log."""
        try:
            with urllib.request.urlopen("http://127.0.0.1:%d/ping" % self.http_port, timeout=1) as response:
                return response.status == 200
        except (OSError, urllib.error.URLError, http.client.HTTPException):
            return False

    def http_get(self, path):
        """(status, body) of an HTTP GET on the daemon's HTTP port."""
        try:
            with urllib.request.urlopen("http://127.0.0.1:%d%s" % (self.http_port, path), timeout=5) as response:
                return response.status, response.read().decode("utf-8")
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode("utf-8")

    def is_running(self):
        if self.process is not None:
            return self.process.poll() is None
        return self._pid is not None and self._is_ours(self._pid)

    def _is_ours(self, pid):
        """Whether ``pid`` is a live twistd running this daemon's config file."""
        try:
            with open("/proc/%d/cmdline" % pid, "rb") as stream:
                argv = stream.read().split(b"\0")
        except OSError:
            return False
        return self.config_path.encode() in argv and ("waltz-%s" % self.kind).encode() in argv

    def stop(self, timeout=15.0):
        """SIGTERM, then SIGKILL after ``timeout``; returns the exit status (``None`` if not ours to reap)."""
        if self.process is None:
            return self._stop_adopted(timeout)
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.process.wait()

    def _stop_adopted(self, timeout):
        """Stop a daemon another process started (by its recorded pid); wait until it is gone."""
        for signum, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            if not self.is_running():
                return None
            os.kill(self._pid, signum)
            deadline = time.monotonic() + wait
            while self.is_running() and time.monotonic() < deadline:
                time.sleep(0.05)
        return None

    def kill(self, timeout=5.0):
        """``kill -9`` the daemon (fault tests) and reap it (one another process started: wait, up to
        ``timeout`` seconds, until it is gone, so that it can be started again at once)."""
        if self.process is None:
            if self.is_running():
                os.kill(self._pid, signal.SIGKILL)
                deadline = time.monotonic() + timeout
                while self.is_running() and time.monotonic() < deadline:
                    time.sleep(0.02)
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        return self.process.wait()


def write_config(path, config):
    """Write ``config`` (flat keys) to ``path`` as YAML, keys sorted."""
    with open(path, "w", encoding="utf-8") as stream:
        yaml.safe_dump(config, stream, default_flow_style=False, sort_keys=True)


def storage_config(run_dir, zookeeper, root, host="127.0.0.1", **overrides):
    """A storage config on free loopback ports with its directory under ``run_dir``."""
    port, admin_port, http_port = free_ports(3, host)
    config = {
        "zookeeper.connectString": zookeeper,
        "cluster.root": root,
        "storage.bindAddress": host,
        "storage.port": port,
        "storage.admin.port": admin_port,
        "storage.http.port": http_port,
        "storage.directory": os.path.join(os.path.abspath(run_dir), "data"),
    }
    config.update(overrides)
    return config


def local_storage(run_dir, zookeeper, root, **overrides):
    """A :class:`LocalDaemon` for a storage node (not started)."""
    return LocalDaemon("storage", run_dir, storage_config(run_dir, zookeeper, root, **overrides),
                       "storage.http.port")


def server_config(zookeeper, root, host="127.0.0.1", **overrides):
    """A server config on free loopback ports, advertising ``host`` to clients."""
    port, http_port = free_ports(2, host)
    config = {
        "zookeeper.connectString": zookeeper,
        "cluster.root": root,
        "server.bindAddress": host,
        "server.host": host,
        "server.port": port,
        "server.http.port": http_port,
    }
    config.update(overrides)
    return config


def local_server(run_dir, zookeeper, root, **overrides):
    """A :class:`LocalDaemon` for a Waltz server (not started)."""
    return LocalDaemon("server", run_dir, server_config(zookeeper, root, **overrides), "server.http.port")


def stop_recorded_processes(run_dir):
    """Stop every Waltz daemon and ZooKeeper whose pid file lies under ``run_dir`` (by pid, checked first).

    For clean-up after an interrupted run whose own bookkeeping did not get to stop them.
    """
    from waltz.local.zookeeper import LocalZooKeeper
    stopped = []
    for directory, _, files in os.walk(run_dir):
        for kind, key in (("server", "server.http.port"), ("storage", "storage.http.port")):
            if "%s.pid" % kind in files and "%s.yaml" % kind in files:
                daemon = LocalDaemon.from_run_dir(kind, directory, key)
                if daemon.is_running():
                    daemon.stop()
                    stopped.append(daemon.pid)
    for directory, _, files in os.walk(run_dir):
        if "zoo.cfg" in files:
            zookeeper = LocalZooKeeper.from_run_dir(directory)
            if zookeeper.is_running():
                pid = zookeeper.pid
                zookeeper.stop()
                stopped.append(pid)
    return stopped
