"""``waltz zookeeper start|stop|status``: a local ZooKeeper for development.

``start`` launches a standalone server (see :mod:`waltz.local.zookeeper`) in
``--run-dir`` and returns once it answers, leaving it running; it is a no-op
when that run directory's server already runs. ``stop`` stops it by the pid
recorded there. ``status`` exits 0 when it runs and 3 when it does not.
"""

from waltz.cli.common import CliError, port, positive_seconds
from waltz.local.zookeeper import LocalZooKeeper, ZooKeeperLaunchError

DEFAULT_RUN_DIR = "./.waltz-dev/zookeeper"
DEFAULT_PORT = 42181
#: ``status`` exit code when the server is not running (the LSB convention).
NOT_RUNNING = 3


def _server(args):
    server = LocalZooKeeper.from_run_dir(args.run_dir)
    if getattr(args, "port", None) is not None:
        server.port = args.port
    return server


def start(args):
    server = _server(args)
    if server.is_running():
        print("ZooKeeper is already running on %s (pid %d, run dir %s)"
              % (server.connect_string, server.pid, server.run_dir))
        return 0
    if server.port is None:
        server.port = DEFAULT_PORT
    try:
        server.start(timeout=args.timeout)
    except ZooKeeperLaunchError as exc:
        raise CliError(str(exc).splitlines()[0] + " (log: %s)" % server.log_path) from None
    print("ZooKeeper started on %s (pid %d, run dir %s)" % (server.connect_string, server.pid, server.run_dir))
    return 0


def stop(args):
    server = _server(args)
    try:
        stopped = server.stop(timeout=args.timeout)
    except ZooKeeperLaunchError as exc:
        raise CliError(str(exc)) from None
    print("ZooKeeper stopped" if stopped else "ZooKeeper is not running (run dir %s)" % server.run_dir)
    return 0


def status(args):
    server = _server(args)
    if not server.is_running():
        print("ZooKeeper is not running (run dir %s)" % server.run_dir)
        return NOT_RUNNING
    health = "serving requests" if server.ready() else "NOT serving requests"
    print("ZooKeeper is running on %s (pid %d), %s" % (server.connect_string, server.pid, health))
    return 0


def register(subparsers):
    """Add ``waltz zookeeper`` and its subcommands."""
    parser = subparsers.add_parser("zookeeper", help="run a local ZooKeeper for development",
                                   description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="zookeeper_command", metavar="SUBCOMMAND")
    commands.required = True
    table = (
        (start, "start", "start ZooKeeper in the background (no-op if running)", True),
        (stop, "stop", "stop the ZooKeeper started in the run directory", False),
        (status, "status", "say whether it runs (exit 0) or not (exit 3)", False),
    )
    for func, name, text, with_port in table:
        sub = commands.add_parser(name, help=text, description=text)
        sub.add_argument("--run-dir", default=DEFAULT_RUN_DIR,
                         help="directory for zoo.cfg, data, log and pid (default %(default)s)")
        if with_port:
            sub.add_argument("--port", type=port, default=None,
                             help="client port on 127.0.0.1 (default %d, or the run dir's last one)"
                             % DEFAULT_PORT)
        sub.add_argument("--timeout", type=positive_seconds, default=30.0,
                         help="seconds to wait for it to start or stop (default %(default)s)")
        sub.set_defaults(func=func)
