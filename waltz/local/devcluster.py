"""The local development cluster: ZooKeeper, three storages and two servers under one run directory.

Layout of the run directory (default ``./.waltz-dev``)::

    zookeeper/            LocalZooKeeper (config, data, log, pid)
    storage-0/ ...        one storage daemon each: storage.yaml, storage.log, storage.pid, data/
    server-0/ ...         one server daemon each: server.yaml, server.log, server.pid
    tools.yaml            the ``-c`` file of the ``waltz`` commands (ZooKeeper keys, and ``ssl.*`` with TLS)
    client.yaml           an application's client config (ZooKeeper keys, and ``client.ssl.*`` with TLS)
    pki/                  with TLS only: the cluster's CA and every process's certificate (LocalPKI)

:meth:`DevCluster.up` is idempotent: it starts whatever is not running,
creates the cluster in ZooKeeper the first time, registers each new storage
in its own group with every partition, and pushes that assignment to it.
:meth:`DevCluster.down` stops only the processes recorded in the run
directory, by pid. Ports are chosen once (free loopback ports) and kept in
each daemon's config file, so a cluster comes back on the same ports.

With TLS (``waltz dev up --tls`` the first time; the run directory keeps it), every storage, admin and client
port speaks mutual TLS with certificates of the run directory's own CA, and the two files above carry the
keys a command or an application needs to connect.
"""

import os
import re

from twisted.internet import defer, threads

from waltz.local.cluster import push_assignment
from waltz.local.daemons import LocalDaemon, local_server, local_storage, write_config
from waltz.local.pki import LocalPKI
from waltz.local.zookeeper import LocalZooKeeper
from waltz.zk.bridge import ZooKeeperClient
from waltz.zk.errors import ClusterNotFoundError
from waltz.zk.metadata import ClusterMetadata

DEFAULT_RUN_DIR = ".waltz-dev"
DEFAULT_ZOOKEEPER_PORT = 42181
DEFAULT_ROOT = "/waltz_cluster"

#: A local server's ZooKeeper session expires 6 s after it dies (30 s by default), so its partitions move
#: to the other server quickly when the demo kills it.
SERVER_OVERRIDES = {"zookeeper.sessionTimeout": 6000}

_HTTP_PORT_KEYS = {"storage": "storage.http.port", "server": "server.http.port"}
_HWM_LINE = re.compile(r'^waltz_server_partition_high_water_mark\{partition="(\d+)"\} (-?\d+)', re.M)
#: The key whose presence in a daemon's recorded config says it was made with TLS.
_TLS_KEYS = {"storage": "storage.ssl.certificate", "server": "server.ssl.certificate"}
#: The certificate the ``waltz`` commands (and ``dev up`` itself) present, and the applications'.
TOOLS_CERTIFICATE, CLIENT_CERTIFICATE = "tools", "client"


class DevClusterError(Exception):
    """The run directory cannot give what was asked (e.g. TLS for daemons made without it)."""


def _holding_every_partition(topology, storage, admin_port, group, partitions, num_partitions):
    """``topology`` with ``storage`` in it (in ``group``) and holding ``partitions``."""
    if storage not in topology.storages():
        topology = topology.add_storage(storage, admin_port, group)
    missing = sorted(set(partitions) - set(topology.partitions_of(storage)))
    return topology.assign(storage, missing, num_partitions) if missing else topology


class DevCluster:
    """A local cluster whose processes outlive the command that started them."""

    def __init__(self, run_dir=DEFAULT_RUN_DIR, zookeeper_port=DEFAULT_ZOOKEEPER_PORT, root=DEFAULT_ROOT,
                 num_partitions=4, num_storages=3, num_servers=2, name="dev", tls=False):
        """``zookeeper_port`` None: the port of the run directory's ZooKeeper, else the default one. ``tls``: make
        a new cluster's daemons speak mutual TLS (a run directory made with TLS keeps it without asking)."""
        self.run_dir = os.path.abspath(run_dir)
        self.pki_dir = os.path.join(self.run_dir, "pki")
        self._tls_asked = tls
        #: The :class:`~waltz.tls.TLSConfig` of this cluster's own connections to admin ports (None: plain TCP);
        #: set by :meth:`load_tls` (which :meth:`prepare_files` and so :meth:`up` call).
        self.tls = None
        self._pki = None            # the run directory's LocalPKI, with TLS (set by load_tls)
        self.root = root
        self.name = name
        self.num_partitions = num_partitions
        self.num_storages = num_storages
        self.num_servers = num_servers
        zookeeper_dir = os.path.join(self.run_dir, "zookeeper")
        if zookeeper_port is None:      # the port of the run directory's ZooKeeper, if it has one
            self.zookeeper = LocalZooKeeper.from_run_dir(zookeeper_dir)
            if self.zookeeper.port is None:
                self.zookeeper.port = DEFAULT_ZOOKEEPER_PORT
        else:
            self.zookeeper = LocalZooKeeper(zookeeper_dir, port=zookeeper_port)

    @property
    def connect_string(self):
        return self.zookeeper.connect_string

    @property
    def tools_config_path(self):
        """The ``-c`` file of the ``waltz`` commands for this cluster."""
        return os.path.join(self.run_dir, "tools.yaml")

    @property
    def client_config_path(self):
        """An application's client config for this cluster."""
        return os.path.join(self.run_dir, "client.yaml")

    def uses_tls(self) -> bool:
        """Whether the cluster speaks TLS: asked for, or made so earlier (blocking: looks at the run directory)."""
        return self._tls_asked or os.path.exists(os.path.join(self.pki_dir, "ca.pem"))

    def prepare_files(self):
        """Make the run directory's PKI (with TLS), set :attr:`tls`, and write :attr:`tools_config_path` and
        :attr:`client_config_path` (blocking: run it in a thread). :class:`DevClusterError` when TLS is asked
        of a run directory whose daemons were made without it."""
        zookeeper = {"zookeeper.connectString": self.connect_string, "cluster.root": self.root}
        tools, client = dict(zookeeper), dict(zookeeper)
        if self.load_tls() is not None:
            tools.update(self._pki.keys("ssl.", TOOLS_CERTIFICATE))
            client.update(self._pki.keys("client.ssl.", CLIENT_CERTIFICATE))
        os.makedirs(self.run_dir, exist_ok=True)
        write_config(self.tools_config_path, tools)
        write_config(self.client_config_path, client)

    def load_tls(self):
        """Set and return :attr:`tls` (None for a plain cluster), making the run directory's CA the first time
        (blocking). :class:`DevClusterError` when TLS is asked of a run directory whose daemons were made
        without it."""
        if not self.uses_tls():
            self.tls = self._pki = None
            return None
        plain = [name for name, daemon in self.daemons() if _TLS_KEYS[daemon.kind] not in daemon.config]
        if plain:
            raise DevClusterError("%s in %s %s made without TLS: stop the cluster ('waltz dev down') and use "
                                  "another --run-dir for a TLS cluster" % (
                                      ", ".join(plain), self.run_dir, "was" if len(plain) == 1 else "were"))
        self._pki = LocalPKI(self.pki_dir)
        self.tls = self._pki.tls(TOOLS_CERTIFICATE)
        return self.tls

    def _tls_keys(self, kind, index):
        """The TLS keys of daemon ``kind``-``index``'s config, or none (blocking)."""
        if self._pki is None:
            return {}
        name = "%s-%d" % (kind, index)
        return self._pki.keys("storage.ssl.", name) if kind == "storage" else self._pki.server_keys(name)

    def daemon_dir(self, kind, index):
        return os.path.join(self.run_dir, "%s-%d" % (kind, index))

    def daemon(self, kind, index):
        """The recorded daemon ``kind``-``index``, or ``None`` if it was never started."""
        run_dir = self.daemon_dir(kind, index)
        if not os.path.exists(os.path.join(run_dir, "%s.yaml" % kind)):
            return None
        return LocalDaemon.from_run_dir(kind, run_dir, _HTTP_PORT_KEYS[kind])

    def daemons(self):
        """Every recorded daemon as ``(name, LocalDaemon)``, storages first."""
        found = []
        for kind, count in (("storage", self.num_storages), ("server", self.num_servers)):
            for index in range(count):
                daemon = self.daemon(kind, index)
                if daemon is not None:
                    found.append(("%s-%d" % (kind, index), daemon))
        return found

    def served_partitions(self):
        """``{server name: {partition: high-water mark}}`` as each running server's ``/metrics`` reports
        (blocking: HTTP requests)."""
        served = {}
        for name, daemon in self.daemons():
            if daemon.kind == "server" and daemon.is_running():
                try:
                    code, text = daemon.http_get("/metrics")
                except OSError:
                    continue
                served[name] = {int(p): int(h) for p, h in _HWM_LINE.findall(text)} if code == 200 else {}
        return served

    # -- up -----------------------------------------------------------------------------------------

    @defer.inlineCallbacks
    def up(self, reactor, report=print):
        """Start everything that is not running; fires when every daemon answers ``/ping``.

        What touches files or processes (configs, pid files, ``/proc``, starts) runs in threads, off the
        reactor."""
        yield threads.deferToThread(self.prepare_files)
        report((yield threads.deferToThread(self._start_zookeeper)))
        if self.tls is not None:
            report("tls         every storage, admin and client port speaks mutual TLS (CA %s)"
                   % os.path.join(self.pki_dir, "ca.pem"))
        zk = ZooKeeperClient(self.connect_string, reactor=reactor)
        try:
            yield zk.connect()
            metadata = ClusterMetadata(zk, self.root, reactor)
            params = yield self._ensure_cluster(metadata, report)
            for index in range(self.num_storages):
                yield self._ensure_storage(reactor, metadata, params, index, report)
        finally:
            yield zk.close()
        for index in range(self.num_servers):
            yield self._ensure_daemon("server", index, lambda run_dir, index=index: local_server(
                run_dir, self.connect_string, self.root, **SERVER_OVERRIDES, **self._tls_keys("server", index)),
                report)

    def _start_zookeeper(self):
        """Start ZooKeeper unless it runs; returns the line saying which (blocking)."""
        if self.zookeeper.is_running():
            state = "running"
        else:
            self.zookeeper.start()
            state = "started"
        return "zookeeper   %s on %s (pid %s)" % (state, self.connect_string, self.zookeeper.pid)

    @defer.inlineCallbacks
    def _ensure_cluster(self, metadata, report):
        try:
            params = yield metadata.store_params()
        except ClusterNotFoundError:
            params = yield metadata.create_cluster(self.name, self.num_partitions)
            report("cluster     created at %s with %d partitions" % (self.root, self.num_partitions))
        else:
            if params.num_partitions != self.num_partitions:
                report("cluster     exists at %s with %d partitions (a cluster's partitions are fixed; %d "
                       "applies to a new one)" % (self.root, params.num_partitions, self.num_partitions))
        return params

    @defer.inlineCallbacks
    def _ensure_storage(self, reactor, metadata, params, index, report):
        """Run storage ``index`` and make sure ZooKeeper lists it holding every partition, and the node holds
        them: decided from ZooKeeper, not from whether the node was started before (a ``dev up`` that
        failed between starting it and registering it left it unregistered for good)."""
        daemon, _ = yield self._ensure_daemon("storage", index, lambda run_dir: local_storage(
            run_dir, self.connect_string, self.root, **self._tls_keys("storage", index)), report)
        name = "127.0.0.1:%d" % daemon.config["storage.port"]
        admin_port = daemon.config["storage.admin.port"]
        partitions = list(range(params.num_partitions))
        topology = (yield metadata.topology()).value
        if name not in topology.storages() or set(topology.partitions_of(name)) != set(partitions):
            yield metadata.edit_topology(lambda t, p: _holding_every_partition(t, name, admin_port, index, partitions,
                                                                               p.num_partitions))
        yield push_assignment(reactor, name, admin_port, partitions, params, self.tls)

    @defer.inlineCallbacks
    def _ensure_daemon(self, kind, index, make, report):
        """Fires with ``(daemon, fresh)`` once the daemon ``kind``-``index`` runs (see :meth:`_start_daemon`)."""
        daemon, fresh, line = yield threads.deferToThread(self._start_daemon, kind, index, make)
        report(line)
        return daemon, fresh

    def _start_daemon(self, kind, index, make):
        """Start the daemon ``kind``-``index`` unless it runs, made with ``make(run_dir)`` when it was never
        started (``fresh``); returns ``(daemon, fresh, the line saying what happened)`` (blocking)."""
        name = "%s-%d" % (kind, index)
        daemon = self.daemon(kind, index)
        fresh = daemon is None
        if fresh:
            daemon = make(self.daemon_dir(kind, index))
        if daemon.is_running():
            return daemon, fresh, "%-11s running (pid %s)" % (name, daemon.pid)
        daemon.start()
        return daemon, fresh, "%-11s started (pid %s, http port %d)" % (name, daemon.pid, daemon.http_port)

    # -- down ---------------------------------------------------------------------------------------

    def down(self, report=print):
        """Stop the servers, then the storages, then ZooKeeper: only processes recorded here, by pid."""
        for name, daemon in reversed(self.daemons()):
            if daemon.is_running():
                daemon.stop()
                report("%-11s stopped (pid %s)" % (name, daemon.pid))
        if self.zookeeper.is_running():
            pid = self.zookeeper.pid
            self.zookeeper.stop()
            report("zookeeper   stopped (pid %s)" % pid)
