"""Errors raised by the ZooKeeper layer.

Kazoo's own exceptions (``NoNodeError``, ``NodeExistsError``, ``BadVersionError``,
``ConnectionLoss``, ...) pass through unchanged; these are the conditions this
layer itself detects. Every message is one line a user can act on.
"""


from kazoo.exceptions import ConnectionLoss


class ZooKeeperLayerError(Exception):
    """Base class of the errors raised by :mod:`waltz.zk`."""


class ZooKeeperRequestTimeout(ConnectionLoss, ZooKeeperLayerError):
    """A request got no answer in time (ZooKeeper unreachable). Like kazoo's ``ConnectionLoss``,
    which it is, the outcome is unknown: a request queued by kazoo may still be applied later."""


class ZooKeeperConnectError(ZooKeeperLayerError):
    """No ZooKeeper server answered within the connect timeout."""


class ZnodeDecodeError(ZooKeeperLayerError):
    """A znode's bytes are not the encoding the reader expected; names the znode."""


class ClusterNotFoundError(ZooKeeperLayerError):
    """The cluster root (or one of its required znodes) does not exist."""


class ClusterExistsError(ZooKeeperLayerError):
    """``create`` found the cluster root already there."""


class PartialClusterError(ZooKeeperLayerError):
    """``create`` failed, or was interrupted, after the cluster root was created and before every partition's
    metadata znode was: the message says how far it got and how to start again."""


class ServersRegisteredError(ZooKeeperLayerError):
    """A destructive edit was refused because Waltz servers are registered."""


class GenerationMismatchError(ZooKeeperLayerError):
    """The stored partition generation is newer than the caller's: another server owns it."""

    def __init__(self, partition_id, stored_generation, generation):
        super().__init__(
            "partition %d: stored generation %d is greater than this server's generation %d"
            % (partition_id, stored_generation, generation))
        self.partition_id = partition_id
        self.stored_generation = stored_generation
        self.generation = generation


class ConcurrentUpdateError(ZooKeeperLayerError):
    """A compare-and-set update lost the race too many times in a row."""


class TopologyError(ZooKeeperLayerError, ValueError):
    """An admin edit of storage nodes or replica assignments was refused; says why."""


class LockTimeoutError(ZooKeeperLayerError):
    """The admin lock was not acquired within the allowed time."""


def swallow(reason, error, value=None):
    """Errback: turn the kazoo ``error`` (a class or tuple) into ``value``; pass others on.

    ``d.addErrback(swallow, NoNodeError)`` makes a missing znode read as ``None``.
    """
    reason.trap(error)
    return value
