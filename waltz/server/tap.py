"""``twistd waltz-server``: options and the service that runs a Waltz server.

The config file is read and checked by :class:`Options`, before twistd
forks or anything binds: a bad config is one line naming the key and a
non-zero exit. Everything else (ZooKeeper, the store, the ports, membership)
starts in :class:`~waltz.server.service.WaltzServerService`'s
``startService``; see that module for the order.
"""

from twisted.python import usage

from waltz.daemon import load_config_or_exit
from waltz.server.config import load_server_config
from waltz.server.service import WaltzServerService


class Options(usage.Options):
    """``twistd waltz-server --config FILE``."""

    synopsis = "--config FILE"
    longdesc = "Run a Waltz Server (see docs/operations.md)."
    optParameters = [["config", "c", None, "server configuration file (YAML)"]]

    def postOptions(self):
        if not self["config"]:
            raise usage.UsageError("--config FILE is required")
        self.config = load_config_or_exit(load_server_config, self["config"], "waltz-server")


def makeService(options, reactor=None):
    if reactor is None:
        from twisted.internet import reactor
    return WaltzServerService(options.config, reactor)
