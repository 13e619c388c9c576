"""The ``waltz`` command: one entry point, one module per subcommand group.

Each module in :data:`COMMAND_MODULES` defines ``register(subparsers)``, which
adds its parser and sets ``func`` (called with the parsed arguments, returning
an exit status). User errors are :class:`CliError`: one line on stderr and a
non-zero exit, never a traceback. Any other exception is reported the same way (see
:func:`~waltz.cli.common.error_message`); with the environment variable ``WALTZ_DEBUG``
set, its traceback is printed first.
"""

import argparse
import importlib
import os
import signal
import sys
import traceback

# Only the standard library at the top: the console script imports this module before main() can catch a
# Ctrl-C, and the rest (Twisted, the client) takes a noticeable part of a second to import.

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
        from waltz.cli.common import CliError
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
        args = build_parser().parse_args(argv)     # (imports the command modules: interruptible here)
        status = args.func(args) or 0
        sys.stdout.flush()      # here, where a reader gone away is a BrokenPipeError below, not at exit
    except KeyboardInterrupt as interrupt:
        said = ": %s" % interrupt.args[0] if interrupt.args else ""     # what the command left behind, if it says
        print("waltz: interrupted" + said, file=sys.stderr)
        status = 130
    except BrokenPipeError:
        status = _output_closed()
    except Exception as exc:
        status = report_error(exc)
    sys.exit(status)


def _output_closed():
    """The reader of the output went away (``waltz ... | head -1``): end quietly with the status of a process
    killed by SIGPIPE, as other command-line tools do, and let nothing more be written to the closed pipe."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


def report_error(exc):
    """Print ``exc`` as one line ``waltz: error: ...`` on stderr (after its traceback when the
    environment variable ``WALTZ_DEBUG`` is set); returns the exit status (a :class:`CliError`'s
    ``exit_code``, else 1)."""
    from waltz.cli.common import CliError, debugging, error_message
    if debugging():
        traceback.print_exception(exc)
    print("waltz: error: %s" % error_message(exc), file=sys.stderr)
    return exc.exit_code if isinstance(exc, CliError) else 1


if __name__ == "__main__":
    main()
