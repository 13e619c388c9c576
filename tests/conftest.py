"""Fixtures shared by the whole test suite.

Sections (add new ones at the end, each with its own heading):

* ZooKeeper: one real server for the session, a fresh cluster root per test,
  a connected :class:`~waltz.zk.bridge.ZooKeeperClient` and a created cluster for
  pytest-twisted tests, and a private server for tests that stop or kill it.

Tests that need ZooKeeper *fail* (a fixture error naming the Debian package),
never skip, when it is not installed.

* Timeouts: every ``async def`` test is also bounded on the reactor (pytest-timeout's
  alarm cannot stop a test the reactor is running).

* Unhandled errors in Deferreds: a test during which one is logged fails.
"""

import functools
import gc
import inspect
import os
import re
import sys
import uuid

import pytest
import pytest_twisted
from twisted.internet import defer
from twisted.logger import globalLogPublisher
from twisted.python.failure import Failure

from waltz.local.zookeeper import LocalZooKeeper
from waltz.zk.bridge import ZooKeeperClient
from waltz.zk.metadata import ClusterMetadata

# --- ZooKeeper ---------------------------------------------------------------------------------

#: Partitions of the cluster the ``cluster_metadata`` fixture creates.
TEST_PARTITIONS = 4


@pytest.fixture(scope="session")
def zookeeper(tmp_path_factory):
    """A real ZooKeeper on a free 127.0.0.1 port, shared by the session; never stop or kill it
    in a test (use ``private_zookeeper``)."""
    server = LocalZooKeeper(tmp_path_factory.mktemp("zookeeper"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def private_zookeeper(tmp_path):
    """A ZooKeeper of this test's own, which the test may stop, kill and restart."""
    server = LocalZooKeeper(tmp_path / "zookeeper")
    yield server
    server.stop()


@pytest.fixture
def cluster_root(request):
    """A cluster root path no other test uses, e.g. ``/waltz_test/test_create-1a2b3c4d``."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name)[:80]
    return "/waltz_test/%s-%s" % (name, uuid.uuid4().hex[:8])


def zk_client_for(server, **kwargs):
    """An unconnected :class:`ZooKeeperClient` for ``server`` with short test timeouts."""
    kwargs.setdefault("session_timeout_ms", 10000)
    kwargs.setdefault("connect_timeout_ms", 5000)
    return ZooKeeperClient(server.connect_string, **kwargs)


@pytest_twisted.async_yield_fixture
async def zk_client(zookeeper):
    """A connected :class:`ZooKeeperClient` on the session's ZooKeeper (closed afterwards)."""
    client = zk_client_for(zookeeper)
    await client.connect()
    yield client
    await client.close()


@pytest_twisted.async_fixture
async def cluster_metadata(zk_client, cluster_root):
    """A :class:`ClusterMetadata` for a freshly created cluster ("test", TEST_PARTITIONS partitions)."""
    metadata = ClusterMetadata(zk_client, cluster_root)
    await metadata.create_cluster("test", TEST_PARTITIONS)
    return metadata


# --- Debugging ---------------------------------------------------------------------------------

def pytest_configure(config):
    """With WALTZ_TEST_LOG=FILE, Twisted's log of the test process goes to FILE (for debugging). Under
    pytest-xdist, each worker chooses its daemons' ports from a slice of its own (waltz/local/ports.py)."""
    import os
    worker, workers = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if worker and workers:
        from waltz.local.ports import SLICE_ENV
        os.environ[SLICE_ENV] = "%d/%d" % (int(worker.lstrip("gw")), int(workers))
    path = os.environ.get("WALTZ_TEST_LOG")
    if path:
        from twisted.logger import globalLogPublisher, textFileLogObserver
        globalLogPublisher.addObserver(textFileLogObserver(open(path, "a")))


# --- Timeouts of tests that run on the reactor ------------------------------------------------------

#: Seconds before pytest-timeout's own limit at which a test running on the reactor is cancelled.
REACTOR_TIMEOUT_MARGIN = 5.0


def pytest_collection_modifyitems(config, items):
    """Bound every ``async def`` test on the reactor itself. pytest-timeout's alarm raises inside the
    reactor's loop, which catches it and goes on: a test awaiting something that never comes would hang
    the run. Cancelled by the reactor instead, the test fails with a TimeoutError and its fixtures stop
    what they started."""
    default = float(config.getini("timeout") or 0)
    for item in items:
        function = getattr(item, "obj", None)
        if not inspect.iscoroutinefunction(function):
            continue
        marker = item.get_closest_marker("timeout")
        seconds = float(marker.args[0]) if marker is not None and marker.args else default
        if seconds > 0:
            item.obj = _bounded_on_the_reactor(function, max(1.0, seconds - REACTOR_TIMEOUT_MARGIN))


def _bounded_on_the_reactor(function, seconds):
    @functools.wraps(function)      # (keeps pytest-twisted's mark on the function)
    async def bounded(**kwargs):
        from twisted.internet import reactor
        running = defer.ensureDeferred(function(**kwargs))
        running.addTimeout(seconds, reactor, onTimeoutCancel=_test_timed_out)
        return await running
    return bounded


def _test_timed_out(result, seconds):
    """Turns the cancellation of a test that ran out of time into a clear failure. Only the
    cancellation is translated: a test's own ``defer.TimeoutError`` (a wait inside the test that
    gave up) keeps its own traceback instead of being reported as the whole test running out."""
    if isinstance(result, Failure) and result.check(defer.CancelledError):
        raise TimeoutError("the test did not finish within %.0f s (cancelled on the reactor)" % seconds)
    return result


# --- Unhandled errors in Deferreds ---------------------------------------------------------------

#: The failures Twisted logged as "Unhandled error in Deferred" since the last check.
_unhandled_failures = []


def _record_unhandled_failure(event):
    if event.get("log_namespace") == "twisted.internet.defer" and event.get("log_failure") is not None:
        _unhandled_failures.append(event["log_failure"])


globalLogPublisher.addObserver(_record_unhandled_failure)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """Fail the test during which a Deferred failed with nobody to handle it: the error would otherwise only
    be logged, and a lost failure is a bug (an error nobody hears of, or a test that checks less than it
    says). Twisted logs it when the Deferred is freed: at once when nothing else holds it, or at a garbage
    collection when it sits in a reference cycle, so the collector is run after each test module's last test
    (after every test would cost about a minute of the whole run)."""
    result = yield
    last_of_its_module = nextitem is None or nextitem.module is not item.module
    if last_of_its_module:
        gc.collect()
    if _unhandled_failures:
        failures = list(_unhandled_failures)
        _unhandled_failures.clear()
        raise AssertionError("unhandled error(s) in Deferred logged during this test%s: %s" % (
            " (or, freed only by the garbage collector, during an earlier test of its module)"
            if last_of_its_module else "",
            "; ".join("%s: %s" % (f.type.__name__, f.getErrorMessage()) for f in failures)))
    return result


# --- Process exit ------------------------------------------------------------------------------

def pytest_sessionfinish(session, exitstatus):
    session.config._waltz_exit_status = int(exitstatus)


def pytest_unconfigure(config):
    """Leave as soon as pytest has reported: a kazoo client still retrying against a ZooKeeper a test
    stopped keeps a thread that the interpreter's exit would otherwise wait for, forever."""
    status = getattr(config, "_waltz_exit_status", None)
    if status is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
