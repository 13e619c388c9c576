"""Every ``async def`` test is bounded on the reactor (tests/conftest.py): a test awaiting something that never
comes fails within its timeout, and its fixtures' teardown runs; a wait inside a test that gives up is reported as
itself, not as the test running out of time."""

import subprocess
import sys
import textwrap
import time


def test_a_hung_async_test_fails_within_its_timeout_and_tears_down(tmp_path):
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_collection_modifyitems  # noqa\\n")
    (tmp_path / "test_hang.py").write_text(textwrap.dedent("""
        import pytest
        import pytest_twisted
        from twisted.internet import defer

        @pytest.fixture
        def marker(tmp_path_factory):
            yield
            open(%r, "w").write("torn down")

        @pytest.mark.timeout(8)
        @pytest_twisted.ensureDeferred
        async def test_hangs(marker):
            await defer.Deferred()      # never fires

        @pytest.mark.timeout(8)
        @pytest_twisted.ensureDeferred
        async def test_own_wait_gives_up():
            from twisted.internet import reactor
            await defer.Deferred().addTimeout(0.2, reactor)
    """ % str(tmp_path / "teardown.txt")))
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                             "-rf", "--rootdir", str(tmp_path), str(tmp_path / "test_hang.py")],
                            capture_output=True, text=True, timeout=60, cwd=str(tmp_path),
                            env={"PYTHONPATH": ":".join(sys.path), "PATH": "/usr/bin:/bin", "COLUMNS": "300"})
    elapsed = time.monotonic() - started
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAILED test_hang.py::test_hangs - TimeoutError: the test did not finish within 3 s " \
           "(cancelled on the reactor)" in result.stdout
    # The test's own wait timed out after 0.2 s: it used to be reported as the whole test running out.
    assert "FAILED test_hang.py::test_own_wait_gives_up - twisted.internet.defer.TimeoutError: " \
           "(0.2, 'Deferred')" in result.stdout
    assert (tmp_path / "teardown.txt").read_text() == "torn down"
    assert elapsed < 40
