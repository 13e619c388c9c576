"""Running ``waltz`` as a subprocess and checking its output."""

import subprocess
import sys


def waltz(*args, timeout=30):
    """Run ``waltz ARGS`` and return the completed process (text output)."""
    return subprocess.run([sys.executable, "-m", "waltz.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout)


def ok(*args):
    """Run a command that must succeed silently on stderr; returns its stdout."""
    result = waltz(*args)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    return result.stdout


def refused(*args, code=1):
    """Run a command that must fail: one line on stderr, exit ``code``; returns that line."""
    result = waltz(*args)
    assert result.returncode == code, (result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("waltz: error: ")
    assert "Traceback" not in result.stderr
    return lines[0]
