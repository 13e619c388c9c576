"""The suite's own check (tests/conftest.py): a test during which a Deferred fails unhandled fails."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = '''
import gc
from twisted.internet import defer


def test_drops_a_failure():
    defer.fail(ValueError("nobody hears of this"))


def test_leaves_a_failure_in_a_cycle():
    d = defer.fail(KeyError("cyclic"))
    d.me = d            # freed only by the collector, after the module's last test


def test_handles_its_failure():
    defer.fail(ValueError("handled")).addErrback(lambda failure: None)
'''


@pytest.mark.timeout(60)
def test_a_failure_nobody_handles_fails_the_test_it_was_logged_in(tmp_path):
    (tmp_path / "test_probe.py").write_text(PROBE)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider", "-p", "tests.conftest",
         "--rootdir", str(tmp_path), str(tmp_path / "test_probe.py")],
        cwd=ROOT, capture_output=True, text=True, timeout=50, env=dict(os.environ, PYTHONPATH=ROOT))
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "ERROR at teardown of test_drops_a_failure" in output
    assert "unhandled error(s) in Deferred logged during this test: ValueError: nobody hears of this" in output
    # The cycle is collected after the module's last test, and reported there, saying it may be earlier's.
    assert "ERROR at teardown of test_handles_its_failure" in output
    assert ("unhandled error(s) in Deferred logged during this test (or, freed only by the garbage collector, "
            "during an earlier test of its module): KeyError: 'cyclic'") in output
    assert "3 passed, 2 errors" in output, output
