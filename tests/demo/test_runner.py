"""The demo runner's waits: a timeout says what did not happen, and the first failure comes out unwrapped."""

import os

import pytest
from twisted.internet import defer, task

from waltz.demo.runner import InstanceError, InstanceProcess, _all, _last_progress, _with_timeout


def outcome(d):
    results = []
    d.addBoth(results.append)
    return results


def test_a_wait_that_expires_says_what_did_not_happen():
    clock = task.Clock()
    events = [defer.Deferred(), defer.Deferred()]
    waited = outcome(_with_timeout(clock, _all(events), 30, "the instances did not all join the cluster"))
    events[0].callback("a")
    clock.advance(29)
    assert waited == []
    clock.advance(1)
    with pytest.raises(InstanceError, match="the instances did not all join the cluster within 30 s"):
        waited[0].raiseException()
    events[1].errback(RuntimeError("late"))         # a late outcome is ignored, not reported as unhandled


def test_a_wait_gives_the_results_or_the_first_failure_itself():
    clock = task.Clock()
    events = [defer.Deferred(), defer.Deferred()]
    waited = outcome(_with_timeout(clock, _all(events), 30, "x"))
    events[1].callback(2)
    events[0].callback(1)
    assert waited == [[1, 2]] and clock.getDelayedCalls() == []
    events = [defer.Deferred(), defer.Deferred()]
    waited = outcome(_with_timeout(clock, _all(events), 30, "x"))
    events[0].errback(InstanceError("instance-0 exited (status 1)"))
    assert isinstance(waited[0].value, InstanceError) and str(waited[0].value) == "instance-0 exited (status 1)"
    events[1].callback(None)


def test_a_wait_with_progress_counts_its_deadline_from_the_last_progress():
    clock = task.Clock()
    last = [None]
    event = defer.Deferred()
    waited = outcome(_with_timeout(clock, event, 30, "the instances did not all join the cluster", lambda: last[0]))
    for _ in range(10):                 # 200 s of steady progress, far beyond 30 s
        clock.advance(20)
        last[0] = clock.seconds()
    assert waited == []
    clock.advance(29)
    assert waited == []
    clock.advance(1)
    with pytest.raises(InstanceError, match=r"did not all join the cluster \(no progress for 30 s\)"):
        waited[0].raiseException()
    assert clock.getDelayedCalls() == []


def test_a_wait_with_progress_still_expires_when_nothing_ever_progresses():
    clock = task.Clock()
    waited = outcome(_with_timeout(clock, defer.Deferred(), 30, "x", lambda: None))
    clock.advance(30)
    with pytest.raises(InstanceError, match=r"x \(no progress for 30 s\)"):
        waited[0].raiseException()


def test_only_a_catching_up_event_with_more_applied_counts_as_progress(tmp_path):
    clock = task.Clock()
    process = InstanceProcess("instance-0", str(tmp_path / "instance.log"), clock)
    clock.advance(5)
    process.outReceived(b'{"event": "catching_up", "applied": 0}\n')
    assert (process.applied, process.progressed_at) == (0, 5)
    clock.advance(5)
    process.outReceived(b'{"event": "catching_up", "applied": 0}\n{"event": "catching_up", "applied": "9"}\n')
    assert (process.applied, process.progressed_at) == (0, 5)
    clock.advance(5)
    process.outReceived(b'{"event": "catching_up", "applied": 40}\n')
    assert (process.applied, process.progressed_at) == (40, 15)
    assert process.stats == {} and not process.events["started"].called
    last = _last_progress([process, InstanceProcess("instance-1", str(tmp_path / "other.log"), clock)])
    assert last() == 15


class HeldThreads:
    """Stands in for ``threads.deferToThread`` in the fault plan: look-ups answer at once, kills and starts
    wait until the test finishes them (a twistd start-up under way)."""

    def __init__(self):
        self.held = []          # (what, Deferred)
        self.calls = []

    def __call__(self, function, *args):
        name = getattr(function, "__name__", "")
        if name in ("kill", "start", "<lambda>"):
            what = "start" if name in ("start", "<lambda>") else "kill"
            self.calls.append(what)
            d = defer.Deferred()
            self.held.append((what, d))
            return d
        return defer.succeed(function(*args))

    def finish(self, what):
        for index, (held_what, d) in enumerate(self.held):
            if held_what == what:
                del self.held[index]
                d.callback(None)
                return
        raise AssertionError("no %s under way" % what)


class Daemons:
    num_storages = 3

    class Daemon:
        pid = 1234

        def kill(self):
            pass

        def start(self):
            pass

    def daemon(self, kind, index):
        return self.Daemon()

    def served_partitions(self):
        return {}


def fault_plan(monkeypatch):
    from waltz.demo import runner
    held = HeldThreads()
    monkeypatch.setattr(runner.threads, "deferToThread", held)
    clock = task.Clock()
    plan = runner.FaultPlan(clock, Daemons(), 10.0, lambda line: None)
    run = plan.run(0.0)
    run.addErrback(lambda f: f.trap(defer.CancelledError))
    return plan, held, clock


def test_a_plan_stopped_while_it_restarts_a_daemon_does_not_start_it_twice(monkeypatch):
    # Before: restore() started storage-1 again while the plan's own restart was under way (two twistd
    # processes on one port, the pid file overwritten), then raised ValueError removing it from `down`.
    plan, held, clock = fault_plan(monkeypatch)
    clock.advance(2.0)
    held.finish("kill")
    clock.advance(2.0)                       # the restart at 0.4 of the run is under way
    assert held.calls == ["kill", "start"]
    plan.stop()
    restored = outcome(plan.restore())
    assert restored == [] and held.calls == ["kill", "start"]     # it waits for the restart under way
    held.finish("start")
    assert restored == [None] and held.calls == ["kill", "start"] and plan.down == []


def test_a_plan_stopped_while_it_kills_a_daemon_starts_it_again(monkeypatch):
    # Before: the kill under way was not in `down` yet, so restore() restarted nothing, and the plan then
    # slept until its own restart time, after the demo had ended.
    plan, held, clock = fault_plan(monkeypatch)
    clock.advance(2.0)
    assert held.calls == ["kill"]
    plan.stop()
    restored = outcome(plan.restore())
    held.finish("kill")
    assert held.calls == ["kill", "start"] and restored == []
    held.finish("start")
    assert restored == [None] and plan.down == [] and clock.getDelayedCalls() == []


@pytest.mark.parametrize("tls", [False, True])
def test_a_run_gives_its_instances_the_clusters_client_config_with_its_tls_keys(tmp_path, tls):
    import yaml
    from waltz.client.config import client_config
    from waltz.demo.runner import prepare_run
    from waltz.local.devcluster import DevCluster
    cluster = DevCluster(str(tmp_path / "dev"), zookeeper_port=42999, tls=tls)
    cluster.prepare_files()
    path, number = prepare_run(cluster, 2)
    assert number == 1 and sorted(os.listdir(path)) == ["client.yaml", "instance-0", "instance-1"]
    with open(os.path.join(path, "client.yaml"), encoding="utf-8") as stream:
        config = yaml.safe_load(stream)
    assert config["zookeeper.connectString"] == "127.0.0.1:42999" and config["cluster.root"] == cluster.root
    assert ("client.ssl.certificate" in config) is tls
    client_config(config)   # a valid client config, its TLS files included
