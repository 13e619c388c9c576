"""The demo: a bank whose instances move money under optimistic locks while the cluster fails.

:mod:`~waltz.demo.bank` is the application, :mod:`~waltz.demo.instance` one instance of it as a
process, :mod:`~waltz.demo.runner` the run (instances, faults, live progress) and
:mod:`~waltz.demo.checks` the proof at the end. ``waltz demo`` runs it; ``docs/demo.md`` explains it.
"""
