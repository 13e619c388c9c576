"""A process that exits with a ZooKeeper session still open (a command interrupted before its clean-up) exits
even when ZooKeeper is gone and a kazoo thread is blocked in a request."""

import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

SCRIPT = textwrap.dedent("""
    import os, signal, sys
    from kazoo.protocol.states import Callback
    from twisted.internet import defer, task
    from waltz.zk.bridge import ZooKeeperClient

    @defer.inlineCallbacks
    def main(reactor, connect_string, zookeeper_pid):
        zk = ZooKeeperClient(connect_string, connect_timeout_ms=20000)
        yield zk.connect()
        os.kill(int(zookeeper_pid), signal.SIGKILL)
        while zk.connected:
            yield task.deferLater(reactor, 0.05, lambda: None)
        # What a watch does when it fires: re-read its znode on kazoo's callback thread, retrying
        # on connection loss. ZooKeeper is gone, so the request waits for a connection.
        zk.kazoo.handler.dispatch_callback(Callback("watch", zk.kazoo.retry, (zk.kazoo.get, "/")))
        yield task.deferLater(reactor, 0.5, lambda: None)
        print("exiting with the session open", flush=True)

    task.react(main, sys.argv[1:])
""")


def test_an_open_session_does_not_hold_the_process_at_exit(private_zookeeper):
    private_zookeeper.start()
    started = time.monotonic()
    try:
        result = subprocess.run([sys.executable, "-c", SCRIPT, private_zookeeper.connect_string,
                                 str(private_zookeeper.pid)], capture_output=True, text=True, timeout=40)
    except subprocess.TimeoutExpired:     # (run kills the process)
        pytest.fail("the process did not exit within 40 s of its ZooKeeper being killed")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "exiting with the session open" in result.stdout
    assert time.monotonic() - started < 30
