"""Pieces shared by the twistd daemons: asynchronous start-up, fatal failures, listening.

twistd forks to daemonize after ``makeService`` returns, so a daemon service
starts its threads and connections in ``startService``. Its start-up is a
Deferred chain; if it fails (ZooKeeper has no cluster, the storage directory
is locked, a cluster key mismatch...) the reason is logged and the process
exits with status 1, because a half-started daemon must not look healthy.
"""

import logging
import os
import sys

from twisted.application import service
from twisted.internet import defer
from twisted.logger import Logger, LogLevel

from waltz.gc_tuning import tune_garbage_collector

log = Logger()

_LEVELS = ((logging.ERROR, LogLevel.error), (logging.WARNING, LogLevel.warn), (logging.INFO, LogLevel.info))


class TwistedLogHandler(logging.Handler):
    """Forwards standard-library log records (kazoo's) to ``twisted.logger``, so they reach the daemon's log."""

    def emit(self, record):
        level = next((twisted for threshold, twisted in _LEVELS if record.levelno >= threshold), LogLevel.debug)
        Logger(namespace=record.name).emit(level, "{message}", message=self.format(record))


def route_standard_logging(level=logging.INFO):
    """Send the standard library's log records to ``twisted.logger`` (once per process)."""
    root = logging.getLogger()
    if not any(isinstance(h, TwistedLogHandler) for h in root.handlers):
        root.addHandler(TwistedLogHandler())
        root.setLevel(level)


def load_config_or_exit(load, path, daemon):
    """``load(path)``: the daemon's validated config. A :class:`~waltz.config.ConfigError` is one line on stderr
    (``waltz-storage: config key 'storage.port': ...``) and exit status 1, before anything starts: not twistd's
    usage text, which would take a bad file for a bad command line (and fill a journal under systemd's
    restarts)."""
    from waltz.config import ConfigError
    try:
        return load(path)
    except ConfigError as exc:
        sys.stderr.write("%s: %s\n" % (daemon, exc))
        sys.stderr.flush()
        raise SystemExit(1) from None


def exit_after_failure(reactor, failure, what, expected=()):
    """Log ``failure`` as the reason ``what`` failed and end the process with status 1. A failure of one of the
    ``expected`` types (the operator's to fix: no cluster, a port in use...) is one line; any other (a bug) is
    logged with its traceback as well."""
    log.critical("{what} failed: {reason}", what=what, reason=failure.getErrorMessage())
    if not (expected and failure.check(*expected)):
        log.failure("{what} failed", failure, what=what)
    # os._exit after the reactor has shut down cleanly: twistd itself has no exit status.
    reactor.addSystemEventTrigger("after", "shutdown", os._exit, 1)
    if reactor.running:
        reactor.stop()
    else:
        reactor.callWhenRunning(reactor.stop)


class AsyncStartService(service.MultiService):
    """A MultiService whose :meth:`start` returns a Deferred; failure ends the process.

    Subclasses implement :meth:`start` (open files, connect ZooKeeper, listen)
    and :meth:`stop` (the reverse); both may return Deferreds.
    """

    name = "waltz-daemon"
    #: Start-up failures whose one-line reason says all (see :func:`exit_after_failure`).
    expected_failures = ()

    def __init__(self, reactor):
        super().__init__()
        self.reactor = reactor
        self.started = None

    def startService(self):
        super().startService()
        route_standard_logging()
        self.started = defer.maybeDeferred(self.start)
        self.started.addCallback(lambda result: (tune_garbage_collector(), result)[1])
        self.started.addErrback(lambda f: exit_after_failure(self.reactor, f, "%s start-up" % self.name,
                                                             self.expected_failures))

    def stopService(self):
        d = defer.maybeDeferred(super().stopService)
        d.addBoth(lambda _: self.stop())
        return d

    def start(self):
        raise NotImplementedError

    def stop(self):
        return None
