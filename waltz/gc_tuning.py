"""Garbage-collector settings for a busy Waltz process: daemons and applications alike.

CPython's full (generation 2) collection walks every tracked object the process has, including the
hundreds of thousands that importing Twisted and building a daemon or a client create and never
free. Under load the young generations promote in-flight transactions' objects (contexts, Deferreds,
requests) often enough to start a full collection every few seconds; each one stopped the reactor
for 20 to 30 ms, and every transaction in flight waited that long (measured in the end-to-end
benchmark's client process: one of the stalls behind its p99, see docs/performance.md). ``gc.freeze()`` moves what exists at the end of start-up into a
permanent generation that collections skip, so a full collection only walks what the process
allocated since; a higher young-generation threshold collects less often.
"""

import gc

#: Young-generation threshold: allocations (minus deallocations) between two young collections.
YOUNG_THRESHOLD = 20_000


def tune_garbage_collector():
    """Collect once, freeze what survives, and collect the young generation less often.

    Call it once the process has started (connections open, caches built): the daemons do it at the
    end of their start-up; an application using :class:`~waltz.client.WaltzClient` does it once its
    clients have started. Safe to call again (it freezes whatever was allocated since).
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, 20, 20)
