"""An interrupted command (SIGINT, SIGTERM) runs its own clean-up on the reactor, then exits with status 130 and
one line on stderr."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(60)

SCRIPT = textwrap.dedent("""
    import argparse
    import os
    from twisted.internet import defer, task
    from waltz.cli import main
    from waltz.cli.cluster import run_reactor

    @defer.inlineCallbacks
    def command(reactor):
        yield task.deferLater(reactor, 0, lambda: None)     # the reactor runs: its signal handlers are set
        print("running", flush=True)
        try:
            yield defer.Deferred()      # until interrupted
        finally:
            yield task.deferLater(reactor, 0.3, lambda: None)   # a clean-up that needs the reactor
            print("cleaned up", flush=True)
            if os.environ.get("SAY"):
                raise RuntimeError(os.environ["SAY"])    # what the command says of the interrupt

    class Parser:
        def parse_args(self, argv):
            return argparse.Namespace(func=lambda args: run_reactor(command))

    main.build_parser = Parser
    main.main([])
""")


@pytest.mark.parametrize("signum, said", [(signal.SIGINT, ""), (signal.SIGTERM, ""),
                                           (signal.SIGINT, "cluster /c was left partly created")])
def test_an_interrupted_command_cleans_up_and_exits_130(signum, said):
    # With ``said``: the error the command's clean-up raised follows "interrupted" (cluster create says what
    # it left behind); the bare cancellation says nothing more.
    process = subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env={**os.environ, "SAY": said})
    try:
        assert process.stdout.readline() == "running\n"
        process.send_signal(signum)
        out, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 130
    assert out == "cleaned up\n"
    assert err == ("waltz: interrupted: %s\n" % said if said else "waltz: interrupted\n")


def test_the_entry_module_imports_only_the_standard_library():
    # The console script imports waltz.cli.main before main() can catch a Ctrl-C: with Twisted and the client
    # imported there, an interrupt in the first half second printed a traceback instead of one line.
    probe = ("import sys; before = set(sys.modules); import waltz.cli.main; "
             "print(sorted(m for m in set(sys.modules) - before if m.split('.')[0] not in ('waltz',) "
             "and not m.startswith('_') and m.split('.')[0] in ('twisted', 'zope', 'attr', 'kazoo', 'yaml')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
    leaked = subprocess.run([sys.executable, "-c", "import sys, waltz.cli.main; "
                             "print([m for m in sys.modules if m.startswith('waltz.')])"],
                            capture_output=True, text=True, timeout=30)
    assert leaked.stdout.strip() == "['waltz.cli', 'waltz.cli.main']", leaked.stdout + leaked.stderr
