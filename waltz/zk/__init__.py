"""The ZooKeeper layer: cluster metadata in ZooKeeper, reached through Deferreds.

* :mod:`waltz.zk.bridge` — :class:`~waltz.zk.bridge.ZooKeeperClient`, kazoo behind Deferreds
  fired on the reactor thread (watches and session events too);
* :mod:`waltz.zk.znodes` — :class:`~waltz.zk.znodes.ClusterPaths` and the value classes stored
  in each znode, with the original's byte encodings (:mod:`waltz.zk.encoding`);
* :mod:`waltz.zk.metadata` — :class:`~waltz.zk.metadata.ClusterMetadata`: typed reads,
  compare-and-set updates, id allocation, store sessions, cluster create/delete, admin edits;
* :mod:`waltz.zk.topology` — the admin edits of storage nodes and replica assignments (pure);
* :mod:`waltz.zk.lock` — the ephemeral-znode admin mutex;
* :mod:`waltz.zk.errors` — the errors this layer raises (kazoo's pass through unchanged).

Nothing here imports from the rest of ``waltz`` except :mod:`waltz.config`.
"""
