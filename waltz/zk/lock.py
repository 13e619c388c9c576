"""A mutex held as one ephemeral znode, compatible with the original's admin lock.

The original (zktools ``ZooKeeperClientImpl.mutex``) takes the lock by creating
an *ephemeral* znode at the lock path; whoever finds it already there watches it
and tries again once it is deleted. Because the znode is ephemeral, a holder
that dies releases the lock when its session ends. Waltz uses it at
``<root>/store/adminLock`` so that admin edits of the store znodes never
interleave. (Kazoo's ``Lock`` recipe uses sequential children instead, which
the original would not see, so it is not used here.)
"""

from kazoo.exceptions import NodeExistsError, NoNodeError
from twisted.internet import defer

from waltz.zk.errors import LockTimeoutError, swallow


class ZnodeMutex:
    """The mutex at ``path`` over a connected :class:`~waltz.zk.bridge.ZooKeeperClient`."""

    def __init__(self, zk, path, reactor=None):
        if reactor is None:
            from twisted.internet import reactor
        self._zk = zk
        self._reactor = reactor
        self.path = path

    @defer.inlineCallbacks
    def acquire(self, timeout=None):
        """Fires once this session holds the lock; fails with :class:`LockTimeoutError` after
        ``timeout`` seconds (``None``: wait as long as it takes)."""
        deadline = None if timeout is None else self._reactor.seconds() + timeout
        while True:
            try:
                yield self._zk.create(self.path, b"", ephemeral=True)
                return
            except NodeExistsError:
                pass
            released = defer.Deferred()
            stat = yield self._zk.exists(self.path, watch=lambda _event: released.called or released.callback(None))
            if stat is None:
                continue  # released between our create and exists: try again at once
            if deadline is not None:
                remaining = deadline - self._reactor.seconds()
                if remaining <= 0:
                    raise LockTimeoutError("lock %s is still held by another session after %.1f s"
                                           % (self.path, timeout))
                released.addTimeout(remaining, self._reactor)
            try:
                yield released
            except defer.TimeoutError:
                raise LockTimeoutError("lock %s is still held by another session after %.1f s"
                                       % (self.path, timeout)) from None

    @defer.inlineCallbacks
    def release(self):
        """Delete the lock znode if this session holds it (already gone is fine). A lock znode of
        another session is left alone: after this session expired, someone else may hold the lock."""
        stat = yield self._zk.exists(self.path)
        if stat is None or stat.ephemeralOwner != self._zk.session_id:
            return
        yield self._zk.delete(self.path, version=stat.version).addErrback(swallow, NoNodeError)

    @defer.inlineCallbacks
    def run(self, function, *args, timeout=None, **kwargs):
        """Call ``function(*args, **kwargs)`` (may return a Deferred) while holding the lock,
        and release it however that ends; fires with the function's result."""
        yield self.acquire(timeout)
        try:
            result = yield defer.maybeDeferred(function, *args, **kwargs)
        finally:
            yield self.release()
        return result
