"""The ``waltz`` command: one entry point, one module per subcommand group.

Each module in :data:`COMMAND_MODULES` defines ``register(subparsers)``, which
adds its parser and sets ``func`` (called with the parsed arguments, returning
an exit status). User errors are :class:`CliError`: one line on stderr and a
non-zero exit, never a traceback.
"""

import argparse
import importlib
import sys

from waltz.cli.common import CliError
from waltz.config import ConfigError

COMMAND_MODULES = (
    "waltz.cli.cluster",
    "waltz.cli.zookeeper",
    "waltz.cli.disk",
    "waltz.cli.storage",
    "waltz.cli.dev",
    "waltz.cli.smoke",
    "waltz.cli.demo",
    "waltz.cli.client",
    "waltz.cli.server",
    "waltz.cli.perf",
)


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as one line with exit status 2."""

    def error(self, message):
        raise CliError("%s (see '%s --help')" % (message, self.prog), exit_code=2)


def build_parser():
    parser = _Parser(prog="waltz", description="Waltz: a quorum-replicated write-ahead log.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    subparsers.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv=None):
    """Run the ``waltz`` command; returns (and exits with) its status."""
    try:
        args = build_parser().parse_args(argv)
        status = args.func(args) or 0
    except (CliError, ConfigError) as exc:
        print("waltz: error: %s" % exc, file=sys.stderr)
        status = getattr(exc, "exit_code", 1)
    except KeyboardInterrupt:
        print("waltz: interrupted", file=sys.stderr)
        status = 130
    sys.exit(status)


if __name__ == "__main__":
    main()
