"""Every ``async def`` test is bounded on the reactor (tests/conftest.py): a test awaiting something that never
comes fails within its timeout, and its fixtures' teardown runs."""

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
    """ % str(tmp_path / "teardown.txt")))
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                             "--rootdir", str(tmp_path), str(tmp_path / "test_hang.py")],
                            capture_output=True, text=True, timeout=60, cwd=str(tmp_path),
                            env={"PYTHONPATH": ":".join(sys.path), "PATH": "/usr/bin:/bin"})
    elapsed = time.monotonic() - started
    assert result.returncode == 1, result.stdout + result.stderr
    assert "did not finish within 3 s (cancelled on the reactor)" in result.stdout
    assert (tmp_path / "teardown.txt").read_text() == "torn down"
    assert elapsed < 40
