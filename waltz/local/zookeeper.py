"""Run a standalone Apache ZooKeeper on loopback, for development, tests and benchmarks.

:class:`LocalZooKeeper` writes a ``zoo.cfg`` into a run directory and starts
``java ... org.apache.zookeeper.server.ZooKeeperServerMain zoo.cfg`` (the
Debian ``zookeeper`` package's jar) as a child in its own session, so it
outlives the process that started it. Its output goes to
``<run_dir>/zookeeper.log`` and its pid to ``<run_dir>/zookeeper.pid``; a later
process finds it again with :meth:`LocalZooKeeper.from_run_dir` and stops it
by that pid (checked against ``/proc/<pid>/cmdline`` first, so a recycled pid
is never signalled). :meth:`~LocalZooKeeper.start` returns once the server
answers ``ruok`` with ``imok`` and ``srvr`` says it serves requests.

This module blocks (it waits for processes); it is meant for fixtures, the
``waltz zookeeper`` command and benchmark scripts, not for reactor code.
"""

import os
import shutil
import signal
import socket
import subprocess
import time

from waltz.local.ports import free_port, port_in_use

ZOOKEEPER_JAR = os.environ.get("WALTZ_ZOOKEEPER_JAR", "/usr/share/java/zookeeper.jar")
#: Optional: gives the server's log output (without a binding slf4j stays silent).
SLF4J_SIMPLE_JAR = "/usr/share/java/slf4j-simple.jar"
MAIN_CLASS = "org.apache.zookeeper.server.ZooKeeperServerMain"
INSTALL_HINT = ("install the Debian package: apt-get install -y --no-install-recommends zookeeper "
                "(it brings a Java runtime)")

CONFIG_NAME = "zoo.cfg"
PID_NAME = "zookeeper.pid"
LOG_NAME = "zookeeper.log"
POLL_INTERVAL = 0.05


class ZooKeeperLaunchError(Exception):
    """ZooKeeper could not be started (or stopped); the message says why and what to do."""


def four_letter_word(host, port, word=b"ruok", timeout=1.0):
    """Send a ZooKeeper four-letter command and return the reply (``b""`` when unreachable)."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(word)
            chunks = []
            while True:
                chunk = sock.recv(4096)
                if not chunk:
                    return b"".join(chunks)
                chunks.append(chunk)
    except OSError:
        return b""


def _read_config(path):
    """``key=value`` lines of a zoo.cfg as a dict (empty when the file is missing)."""
    try:
        with open(path, encoding="utf-8") as stream:
            lines = stream.read().splitlines()
    except FileNotFoundError:
        return {}
    pairs = (line.split("=", 1) for line in lines if "=" in line and not line.lstrip().startswith("#"))
    return {key.strip(): value.strip() for key, value in pairs}


class LocalZooKeeper:
    """One standalone ZooKeeper server in ``run_dir``, listening on ``host:port``.

    ``port=None`` picks a free port at the first :meth:`start`; later starts
    (:meth:`restart`) reuse it and the same data directory.
    """

    def __init__(self, run_dir, port=None, host="127.0.0.1", tick_time=2000,
                 max_session_timeout=600000, java="java", jar=ZOOKEEPER_JAR, heap="256m"):
        self.run_dir = os.path.realpath(run_dir)
        self.port = port
        self.host = host
        self.tick_time = tick_time
        self.max_session_timeout = max_session_timeout
        self.java = java
        self.jar = jar
        self.heap = heap
        self._process = None

    @classmethod
    def from_run_dir(cls, run_dir, **kwargs):
        """The server a previous :meth:`start` left in ``run_dir`` (port and host from its zoo.cfg)."""
        config = _read_config(os.path.join(os.path.realpath(run_dir), CONFIG_NAME))
        if "clientPort" in config:
            kwargs.setdefault("port", int(config["clientPort"]))
        if "clientPortAddress" in config:
            kwargs.setdefault("host", config["clientPortAddress"])
        return cls(run_dir, **kwargs)

    # --- paths and state ------------------------------------------------------------------------

    @property
    def config_path(self):
        return os.path.join(self.run_dir, CONFIG_NAME)

    @property
    def pid_path(self):
        return os.path.join(self.run_dir, PID_NAME)

    @property
    def log_path(self):
        return os.path.join(self.run_dir, LOG_NAME)

    @property
    def data_dir(self):
        return os.path.join(self.run_dir, "data")

    @property
    def connect_string(self):
        """``host:port`` for clients (``zookeeper.connectString``)."""
        if self.port is None:
            raise ZooKeeperLaunchError("no port yet: start the server first")
        return "%s:%d" % (self.host, self.port)

    @property
    def pid(self):
        """The pid recorded in the pid file, or ``None``."""
        try:
            with open(self.pid_path, encoding="ascii") as stream:
                return int(stream.read().strip())
        except (FileNotFoundError, ValueError):
            return None

    def _alive(self, pid):
        """Whether ``pid`` is *this* run directory's ZooKeeper and still running."""
        if self._process is not None and self._process.pid == pid:
            return self._process.poll() is None
        try:
            with open("/proc/%d/cmdline" % pid, "rb") as stream:
                argv = stream.read().split(b"\0")
        except OSError:
            return False  # gone (a zombie has an empty cmdline, so it does not count either)
        return MAIN_CLASS.encode() in argv and self.config_path.encode() in argv

    def is_running(self):
        """Whether the server recorded in the pid file is running."""
        pid = self.pid
        return pid is not None and self._alive(pid)

    def ruok(self, timeout=1.0):
        """Whether the server answers ``ruok`` with ``imok``."""
        return self.port is not None and four_letter_word(self.host, self.port, b"ruok", timeout) == b"imok"

    def serving(self, timeout=1.0):
        """Whether the server serves client requests (``srvr`` reports its version; right
        after start-up ``ruok`` already says ``imok`` while ``srvr`` says it is not serving)."""
        return (self.port is not None
                and four_letter_word(self.host, self.port, b"srvr", timeout).startswith(b"Zookeeper version:"))

    def ready(self, timeout=1.0):
        """Whether the server answers ``ruok`` with ``imok`` and serves requests."""
        return self.ruok(timeout) and self.serving(timeout)

    def log_tail(self, lines=20):
        """The last ``lines`` lines of the server's log."""
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as stream:
                return "".join(stream.readlines()[-lines:])
        except FileNotFoundError:
            return "(no log at %s)\n" % self.log_path

    # --- life cycle -------------------------------------------------------------------------------

    def _command(self):
        java = shutil.which(self.java)
        if java is None:
            raise ZooKeeperLaunchError("java (%s) not found: %s" % (self.java, INSTALL_HINT))
        if not os.path.isfile(self.jar):
            raise ZooKeeperLaunchError("ZooKeeper jar %s not found: %s" % (self.jar, INSTALL_HINT))
        classpath = [self.jar] + ([SLF4J_SIMPLE_JAR] if os.path.isfile(SLF4J_SIMPLE_JAR) else [])
        return [java, "-Xmx" + self.heap, "-XX:+UseSerialGC", "-Djava.net.preferIPv4Stack=true",
                "-cp", os.pathsep.join(classpath), MAIN_CLASS, self.config_path]

    def _write_config(self):
        lines = (
            "# written by waltz.local.zookeeper",
            "tickTime=%d" % self.tick_time,
            "dataDir=%s" % self.data_dir,
            "clientPort=%d" % self.port,
            "clientPortAddress=%s" % self.host,
            "maxSessionTimeout=%d" % self.max_session_timeout,
            "maxClientCnxns=0",
            "admin.enableServer=false",
            "4lw.commands.whitelist=ruok,srvr,mntr",
        )
        with open(self.config_path, "w", encoding="utf-8") as stream:
            stream.write("\n".join(lines) + "\n")

    def start(self, timeout=30):
        """Start the server and wait until it is :meth:`ready`; returns ``self``.

        Does nothing if it is already running. Raises :class:`ZooKeeperLaunchError`
        with the log's tail if it exits or does not answer within ``timeout`` s.
        """
        if self.is_running():
            return self
        command = self._command()
        if self.port is None:
            self.port = free_port(self.host)
        elif port_in_use(self.host, self.port):
            raise ZooKeeperLaunchError("port %d on %s is already in use by another process"
                                       % (self.port, self.host))
        os.makedirs(self.data_dir, exist_ok=True)
        self._write_config()
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(
                command, cwd=self.run_dir, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, close_fds=True)
        _write_atomically(self.pid_path, "%d\n" % self._process.pid)
        deadline = time.monotonic() + timeout
        while not self.ready(timeout=0.5):
            if self._process.poll() is not None:
                raise ZooKeeperLaunchError("ZooKeeper exited with status %s during start-up; %s ends with:\n%s"
                                           % (self._process.returncode, self.log_path, self.log_tail()))
            if time.monotonic() > deadline:
                self.kill()
                raise ZooKeeperLaunchError("ZooKeeper on %s was not ready within %s s; %s ends with:\n%s"
                                           % (self.connect_string, timeout, self.log_path, self.log_tail()))
            time.sleep(POLL_INTERVAL)
        return self

    def _signal_and_wait(self, pid, signum, timeout):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            return True
        deadline = time.monotonic() + timeout
        while self._alive(pid):
            if time.monotonic() > deadline:
                return False
            time.sleep(POLL_INTERVAL)
        return True

    def stop(self, timeout=10):
        """Stop the server (SIGTERM, then SIGKILL after ``timeout`` s), by its recorded pid.

        Returns whether a running server was stopped.
        """
        pid = self.pid
        running = pid is not None and self._alive(pid)
        if running and not self._signal_and_wait(pid, signal.SIGTERM, timeout):
            if not self._signal_and_wait(pid, signal.SIGKILL, timeout):
                raise ZooKeeperLaunchError("ZooKeeper (pid %d) survived SIGKILL" % pid)
        self._forget()
        return running

    def kill(self):
        """SIGKILL the server at once (a crash, for fault tests); waits until it is gone."""
        pid = self.pid
        if pid is not None and self._alive(pid):
            self._signal_and_wait(pid, signal.SIGKILL, 10)
        self._forget()

    def restart(self, timeout=30):
        """Stop (if running) and start again on the same port with the same data."""
        self.stop()
        return self.start(timeout)

    def _forget(self):
        if self._process is not None:
            self._process.poll()  # reap our child
            self._process = None
        try:
            os.unlink(self.pid_path)
        except FileNotFoundError:
            pass


def _write_atomically(path, text):
    temporary = path + ".tmp"
    with open(temporary, "w", encoding="ascii") as stream:
        stream.write(text)
    os.replace(temporary, path)
