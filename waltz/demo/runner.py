"""The demo run: bank instances as separate processes, faults in the middle, live progress, the proof at the end.

:func:`run_demo` makes sure the local cluster (:class:`~waltz.local.devcluster.DevCluster`) is up,
starts ``instances`` processes of :mod:`waltz.demo.instance`, each with its own SQLite database
under ``<run dir>/demo/run-N/``, prints their combined progress every ``progress_interval``
seconds, and, with faults on, kills (SIGKILL) a storage at 20 % of the run and restarts it at
40 %, then kills the server holding the most partitions at 50 % and restarts it at 75 %. When
every instance has finished its workload it tells them to drain (catch up with the whole log),
and runs :func:`waltz.demo.checks.verify` on their databases and reports.

Each run uses fresh account numbers (``(N - 1) * 1000 + 1`` onwards), while every instance
still rebuilds its database from the whole log, earlier runs included.
"""

import collections
import json
import os
import shutil
import sys
import time

import attr
from twisted.internet import defer, error, protocol, task, threads
from twisted.logger import Logger
from twisted.python.failure import Failure

from waltz.demo.checks import load_instance, verify

log = Logger()

ACCOUNT_NUMBERS_PER_RUN = 1000
#: Seconds allowed after the workload's duration for the transactions in flight to end.
PRODUCE_GRACE = 120.0
#: Seconds allowed for an instance to exit after it finished.
EXIT_TIMEOUT = 60.0


@attr.s(frozen=True, auto_attribs=True)
class DemoSettings:
    instances: int = 3
    accounts: int = 20
    duration: float = 60.0
    concurrency: int = 8
    faults: bool = True
    seed: int = 1
    progress_interval: float = 2.0
    #: Seconds an instance may go without progress while it joins the cluster (rebuilding its database from
    #: the whole log, which grows with every run) and, at the end, while it catches up.
    start_timeout: float = 120.0
    drain_timeout: float = 300.0


@attr.s(auto_attribs=True)
class DemoReport:
    run_dir: str
    checks: list = attr.Factory(list)
    faults: list = attr.Factory(list)
    totals: dict = attr.Factory(dict)
    seconds: float = 0.0

    @property
    def passed(self):
        return bool(self.checks) and all(check.passed for check in self.checks)


class InstanceError(RuntimeError):
    """An instance process failed."""


class InstanceProcess(protocol.ProcessProtocol):
    """One instance process: its JSON-lines events on stdout, its stderr in its log file.

    ``catching_up`` events (how many transactions it has applied while it catches up with the log) set
    :attr:`progressed_at`, the ``clock`` time of the last one that showed more applied than the one before.
    """

    EVENTS = ("started", "produced", "finished")

    def __init__(self, name, log_path, clock):
        self.name = name
        self.log_path = log_path        # the process's stderr goes straight there (see _spawn)
        self.clock = clock
        self.stats = {}
        self.started = {}
        self.applied = -1
        self.progressed_at = None
        self.error = None
        self.stray = collections.deque(maxlen=5)    # the last stdout lines that were not events
        self._buffer = b""
        self.events = {event: defer.Deferred() for event in self.EVENTS}
        self.ended = defer.Deferred()

    def outReceived(self, data):
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            self._line(line)

    def _line(self, line):
        try:
            message = json.loads(line)
        except ValueError:
            message = None
        if not isinstance(message, dict):
            self.stray.append(line.decode("utf-8", "replace"))
            return
        event = message.pop("event", None)
        if event == "error":
            self.error = message.get("message")
            return
        if event == "catching_up":
            applied = message.get("applied")
            if isinstance(applied, int) and applied > self.applied:
                self.applied = applied
                self.progressed_at = self.clock.seconds()
            return
        if event == "started":
            self.started = message
        elif event in ("progress",) + self.EVENTS:
            self.stats = message
        if event in self.events and not self.events[event].called:
            self.events[event].callback(self)

    def command(self, word):
        """Send ``go`` (start the workload) or ``drain`` (catch up and finish)."""
        self.transport.write(word.encode("ascii") + b"\n")

    def processEnded(self, reason):
        code = reason.value.exitCode if isinstance(reason.value, (error.ProcessDone, error.ProcessTerminated)) \
            else None
        said = self.error or " | ".join(self.stray)
        problem = InstanceError("%s exited (status %s)%s; see %s" % (
            self.name, code, ": " + said if said else "", self.log_path))
        for d in self.events.values():
            if not d.called:
                d.errback(problem)
        self.ended.callback(code)

    def kill(self):
        if not self.ended.called:
            try:
                self.transport.signalProcess("KILL")
            except error.ProcessExitedAlready:
                pass


def _sleep_until(reactor, when):
    return task.deferLater(reactor, max(0.0, when - reactor.seconds()), lambda: None)


def _all(deferreds):
    """Fires with every result, or fails with the first failure itself (not wrapped in FirstError)."""
    d = defer.gatherResults(deferreds, consumeErrors=True)
    return d.addErrback(lambda failure: failure.value.subFailure if failure.check(defer.FirstError) else failure)


def _stopped_is_fine(failure):
    """A fault plan stopped (after a failure elsewhere) ends with CancelledError: not an error of its own."""
    failure.trap(defer.CancelledError)


def _with_timeout(reactor, d, seconds, what, progressed_at=None):
    """``d``'s outcome, or :class:`InstanceError` saying ``what`` after ``seconds`` (``d`` goes on).

    With ``progressed_at`` (a function giving the time of the last progress, or None) the deadline is
    ``seconds`` after the later of the start and the last progress: work that takes long but keeps moving
    (an instance rebuilding its database from a long log) is waited for; work that has stopped is not.
    """
    outer = defer.Deferred()
    began = reactor.seconds()
    expiry = None

    def expire():
        nonlocal expiry
        last = progressed_at() if progressed_at is not None else None
        remaining = max(began, last if last is not None else began) + seconds - reactor.seconds()
        if remaining > 0:
            expiry = reactor.callLater(remaining, expire)
        elif progressed_at is None:
            outer.errback(InstanceError("%s within %.0f s" % (what, seconds)))
        else:
            outer.errback(InstanceError("%s (no progress for %.0f s)" % (what, seconds)))

    def settle(result):
        if expiry.active():
            expiry.cancel()
            (outer.errback if isinstance(result, Failure) else outer.callback)(result)
        return None                 # after the expiry the outcome no longer matters
    expiry = reactor.callLater(seconds, expire)
    d.addBoth(settle)
    return outer


def _last_progress(instances):
    """A function giving the time of the last progress any of ``instances`` reported (None: none yet)."""
    def progressed_at():
        times = [i.progressed_at for i in instances if i.progressed_at is not None]
        return max(times) if times else None
    return progressed_at


class FaultPlan:
    """Kill a storage and a server (SIGKILL) in the middle of the run and bring them back."""

    def __init__(self, reactor, cluster, duration, say):
        self.reactor = reactor
        self.cluster = cluster
        self.duration = duration
        self.say = say
        self.faults = []
        self.down = []
        self.stopped = False
        self._sleep = None
        self._ended = None          # fires when run()'s sequence of faults has ended, however

    def _until(self, when):
        """Sleep until ``when``; CancelledError once stopped (a plan stopped mid-step injects nothing more)."""
        if self.stopped:
            return defer.fail(defer.CancelledError())
        self._sleep = _sleep_until(self.reactor, when)
        return self._sleep

    def stop(self):
        """No more faults: a pending one is cancelled (see :meth:`restore` for those already injected)."""
        self.stopped = True
        if self._sleep is not None and not self._sleep.called:
            self._sleep.cancel()

    def _daemon(self, name):
        """The recorded daemon ``name`` (``storage-1``...); reads its files, so not on the reactor thread."""
        kind, index = name.rsplit("-", 1)
        return self.cluster.daemon(kind, int(index))

    @defer.inlineCallbacks
    def restore(self):
        """Once the plan's own steps have ended (:meth:`stop` first: a kill or restart under way finishes, and
        nothing follows), start again every process it killed and did not restart."""
        if self._ended is not None:
            yield self._ended
        for name in list(self.down):
            yield threads.deferToThread(lambda: self._daemon(name).start())
            self.down.remove(name)
            self.say("fault: %s restarted" % name)

    def run(self, began):
        """Fires when every process it killed runs again (CancelledError when stopped first)."""
        self._ended = defer.Deferred()
        d = self._run(began)
        d.addBoth(self._run_ended)
        return d

    def _run_ended(self, result):
        self._ended.callback(None)
        return result

    @defer.inlineCallbacks
    def _run(self, began):
        storage = "storage-%d" % min(1, self.cluster.num_storages - 1)
        yield self._outage(storage, began + 0.2 * self.duration, began + 0.4 * self.duration)
        yield self._until(began + 0.5 * self.duration)
        served = yield threads.deferToThread(self.cluster.served_partitions)
        if served:
            server = max(sorted(served), key=lambda name: len(served[name]))
            yield self._outage(server, began + 0.5 * self.duration, began + 0.75 * self.duration,
                               "holding partitions %s" % ",".join(map(str, sorted(served[server]))))

    @defer.inlineCallbacks
    def _outage(self, name, kill_at, restart_at, why=""):
        yield self._until(kill_at)
        daemon = yield threads.deferToThread(self._daemon, name)
        if self.stopped:
            return
        pid = daemon.pid
        self.down.append(name)      # before the kill: whatever happens next, restore() starts it again
        yield threads.deferToThread(daemon.kill)
        self.say("fault: %s (pid %s%s) killed with SIGKILL" % (name, pid, ", " + why if why else ""))
        killed = self.reactor.seconds()
        yield self._until(restart_at)
        yield threads.deferToThread(daemon.start)
        self.down.remove(name)
        self.faults.append("%s killed and restarted after %.1f s" % (name, self.reactor.seconds() - killed))
        self.say("fault: %s restarted (pid %s)" % (name, daemon.pid))


class Progress:
    """The combined progress line of every instance."""

    FIELDS = ("committed", "lock_failures", "retries", "refused", "expired", "failed")

    def __init__(self, reactor, instances, faults, say):
        self.reactor = reactor
        self.instances = instances
        self.faults = faults
        self.say = say
        self.began = reactor.seconds()
        self._last = (self.began, 0)
        self._rate = 0.0

    def totals(self):
        return {field: sum(i.stats.get(field, 0) for i in self.instances) for field in self.FIELDS}

    def show(self):
        now = self.reactor.seconds()
        totals = self.totals()
        last_time, last_committed = self._last
        if now - last_time >= 1.0:      # a rate over less than a second says little (the last line)
            self._rate = (totals["committed"] - last_committed) / (now - last_time)
            self._last = (now, totals["committed"])
        rate = self._rate
        down = " | down: %s" % ", ".join(self.faults.down) if self.faults and self.faults.down else ""
        self.say("[%4.0fs] committed %d (%.0f/s), lock failures %d, retries %d, refused %d, expired %d, "
                 "failed %d%s" % (now - self.began, totals["committed"], rate, totals["lock_failures"],
                                  totals["retries"], totals["refused"], totals["expired"], totals["failed"], down))


def prepare_run(cluster, instances):
    """Create ``<run dir>/demo/run-N`` for the next N, its client config (the cluster's, with its TLS keys if
    it has any) and one directory per instance (blocking: run it in a thread); returns ``(path, N)``."""
    demo_dir = os.path.join(cluster.run_dir, "demo")
    os.makedirs(demo_dir, exist_ok=True)
    taken = [int(name[4:]) for name in os.listdir(demo_dir) if name.startswith("run-") and name[4:].isdigit()]
    number = max(taken, default=0) + 1
    path = os.path.join(demo_dir, "run-%d" % number)
    for index in range(instances):
        os.makedirs(os.path.join(path, "instance-%d" % index))
    shutil.copyfile(cluster.client_config_path, os.path.join(path, "client.yaml"))
    return path, number


def _spawn(reactor, run_dir, index, first_account, settings):
    name = "instance-%d" % index
    directory = os.path.join(run_dir, name)
    process = InstanceProcess(name, os.path.join(directory, "instance.log"), reactor)
    argv = [sys.executable, "-m", "waltz.demo.instance", "--name", name,
            "--config", os.path.join(run_dir, "client.yaml"),
            "--db", os.path.join(directory, "bank.db"), "--report", os.path.join(directory, "report.json"),
            "--first-account", str(first_account), "--accounts", str(settings.accounts),
            "--duration", str(settings.duration), "--concurrency", str(settings.concurrency),
            "--seed", str(settings.seed * 1000 + index)]
    # Its stderr goes straight to its log file: nothing is written on the reactor thread.
    log_fd = os.open(process.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        reactor.spawnProcess(process, sys.executable, argv, env=dict(os.environ), path=directory,
                             childFDs={0: "w", 1: "r", 2: log_fd})
    finally:
        os.close(log_fd)
    return process


@defer.inlineCallbacks
def run_demo(reactor, cluster, settings=DemoSettings(), say=print):
    """Run the demo on ``cluster`` (started if needed); fires with a :class:`DemoReport`."""
    yield cluster.up(reactor, report=lambda line: None)
    run_dir, number = yield threads.deferToThread(prepare_run, cluster, settings.instances)
    first_account = (number - 1) * ACCOUNT_NUMBERS_PER_RUN + 1
    say("demo: %d bank instances, accounts %d-%d, %.0f s%s; files in %s"
        % (settings.instances, first_account, first_account + settings.accounts - 1, settings.duration,
           ", a storage and a server killed and restarted midway" if settings.faults else "", run_dir))
    instances = [_spawn(reactor, run_dir, i, first_account, settings) for i in range(settings.instances)]
    trigger = reactor.addSystemEventTrigger("before", "shutdown", lambda: [i.kill() for i in instances])
    faults = FaultPlan(reactor, cluster, settings.duration, say) if settings.faults else None
    report = DemoReport(run_dir)
    began = time.monotonic()
    try:
        yield _with_timeout(reactor, _all([i.events["started"] for i in instances]), settings.start_timeout,
                            "the instances did not all join the cluster", _last_progress(instances))
        say("demo: every instance has joined the cluster and rebuilt its database from the log (%d transactions)"
            % instances[0].started["rebuilt"])
        progress = yield _traffic(reactor, instances, faults, settings, say)
        report.faults = faults.faults if faults else []
        say("demo: every instance has stopped writing; each now catches up with the whole log")
        for instance in instances:
            instance.command("drain")
        yield _with_timeout(reactor, _all([i.events["finished"] for i in instances]), settings.drain_timeout,
                            "the instances did not all catch up", _last_progress(instances))
        codes = yield _with_timeout(reactor, _all([i.ended for i in instances]), EXIT_TIMEOUT,
                                    "the instances did not all exit")
        for instance, code in zip(instances, codes):
            if code != 0:
                raise InstanceError("%s exited with status %s after finishing; see %s"
                                    % (instance.name, code, instance.log_path))
        report.totals = progress.totals()
        report.seconds = time.monotonic() - began
        report.checks = verify((yield threads.deferToThread(load_run, run_dir)))
    finally:
        for instance in instances:
            instance.kill()
        reactor.removeSystemEventTrigger(trigger)
        if faults is not None:
            faults.stop()
            yield faults.restore()      # the cluster is left running as it was found
    return report


@defer.inlineCallbacks
def _traffic(reactor, instances, faults, settings, say):
    """Start every workload at once, inject the faults, show progress; fires with the Progress when every
    instance has stopped writing and every killed process runs again."""
    for instance in instances:
        instance.command("go")
    fault_run = faults.run(reactor.seconds()) if faults else defer.succeed(None)
    fault_run.addErrback(_stopped_is_fine)
    progress = Progress(reactor, instances, faults, say)
    display = task.LoopingCall(progress.show)
    display.start(settings.progress_interval, now=False)
    try:
        # Contexts still in flight at the end may wait for a lost server's partitions to move.
        yield _with_timeout(reactor, _all([i.events["produced"] for i in instances]),
                            settings.duration + PRODUCE_GRACE, "the instances did not all finish their workload")
        yield fault_run
    finally:
        if display.running:
            display.stop()
    progress.show()
    return progress


def load_run(run_dir):
    """Every instance's final state in a run directory (its ``instance-*`` directories)."""
    names = sorted((n for n in os.listdir(run_dir) if n.startswith("instance-")), key=lambda n: int(n[9:]))
    return [load_instance(n, os.path.join(run_dir, n, "bank.db"), os.path.join(run_dir, n, "report.json"))
            for n in names]
