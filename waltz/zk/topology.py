"""Admin edits of the storage topology: pure functions over the three store znodes.

:class:`StoreTopology` bundles ``/store/assignment`` (storage -> partitions),
``/store/group`` (storage -> group) and ``/store/connection`` (storage -> admin
port). Each edit returns a new topology or raises
:class:`~waltz.zk.errors.TopologyError` saying why it was refused; the rules
are the original's (``StoreMetadata``):

* a storage node is added to all three maps at once, with no partitions, and
  only if none of them knows it yet;
* a storage node is removed only while it holds no partition;
* a partition is assigned only to a known storage node that lacks it, and
  only if the cluster has it;
* a partition is unassigned only if another storage node *of the same group*
  still holds it, so every group keeps a full replica of what it had;
* ``auto_assign`` spreads all partitions round-robin over a group's storage
  nodes (sorted by connect string) and is refused when any of them already
  holds partitions.
"""

import attr

from waltz.zk.errors import TopologyError
from waltz.zk.znodes import ConnectionMetadata, GroupDescriptor, ReplicaAssignments


def format_ids(ids):
    """Partition ids as a compact list such as ``0-3,7`` (``-`` when empty)."""
    ids = sorted(set(ids))
    if not ids:
        return "-"
    ranges = []
    start = previous = ids[0]
    for value in ids[1:] + [None]:
        if value is not None and value == previous + 1:
            previous = value
            continue
        ranges.append(str(start) if start == previous else "%d-%d" % (start, previous))
        start = previous = value
    return ",".join(ranges)


def check_storage(storage):
    """Insist on a ``host:port`` connect string; returns it."""
    host, sep, port = str(storage).rpartition(":")
    if (not sep or not host.strip("[]") or any(c.isspace() or not c.isprintable() for c in host)
            or not port.isdigit() or not 1 <= int(port) <= 65535):
        raise TopologyError("bad storage connect string %r: expected HOST:PORT" % (storage,))
    return storage


@attr.s(frozen=True, slots=True, auto_attribs=True)
class StoreTopology:
    """The storage nodes of a cluster: their partitions, groups and admin ports."""

    assignments: ReplicaAssignments = ReplicaAssignments()
    groups: GroupDescriptor = GroupDescriptor()
    connections: ConnectionMetadata = ConnectionMetadata()

    def storages(self):
        """Every storage node any of the three znodes knows, sorted."""
        return tuple(sorted(set(self.assignments.keys()) | set(self.groups.keys())
                            | set(self.connections.keys())))

    def storages_in_group(self, group):
        return tuple(sorted(storage for storage, g in self.groups.entries if g == group))

    def partitions_of(self, storage):
        return self.assignments.get(storage, ())

    def unreplicated(self, num_partitions):
        """Partitions no storage node holds."""
        held = {pid for _, ids in self.assignments.entries for pid in ids}
        return tuple(pid for pid in range(num_partitions) if pid not in held)

    def _known(self, storage):
        if storage not in self.storages():
            raise TopologyError("unknown storage node %s (known: %s)"
                                % (storage, ", ".join(self.storages()) or "none"))

    def _with_partitions(self, storage, ids):
        return attr.evolve(self, assignments=ReplicaAssignments(
            {**self.assignments.as_dict(), storage: tuple(sorted(ids))}))

    def add_storage(self, storage, admin_port, group):
        """Add ``storage`` (``host:port``) with its admin port to ``group``, holding nothing."""
        check_storage(storage)
        if not 1 <= admin_port <= 65535:
            raise TopologyError("bad admin port %d: expected 1-65535" % admin_port)
        if group < 0:
            raise TopologyError("bad group %d: expected a non-negative integer" % group)
        if storage in self.storages():
            raise TopologyError("storage node %s already exists" % storage)
        return StoreTopology(
            ReplicaAssignments({**self.assignments.as_dict(), storage: ()}),
            GroupDescriptor({**self.groups.as_dict(), storage: group}),
            ConnectionMetadata({**self.connections.as_dict(), storage: admin_port}))

    def remove_storage(self, storage):
        """Remove ``storage``; refused while it holds partitions."""
        self._known(storage)
        held = self.partitions_of(storage)
        if held:
            raise TopologyError("storage node %s still holds partitions %s; unassign them first"
                                % (storage, format_ids(held)))

        def without(mapping):
            return {k: v for k, v in mapping.as_dict().items() if k != storage}
        return StoreTopology(ReplicaAssignments(without(self.assignments)),
                             GroupDescriptor(without(self.groups)),
                             ConnectionMetadata(without(self.connections)))

    def assign(self, storage, partition_ids, num_partitions):
        """Add ``partition_ids`` to ``storage``."""
        self._known(storage)
        bad = [pid for pid in partition_ids if not 0 <= pid < num_partitions]
        if bad:
            raise TopologyError("partition %d does not exist (the cluster has %d partitions)"
                                % (bad[0], num_partitions))
        current = set(self.partitions_of(storage))
        already = current.intersection(partition_ids)
        if already:
            raise TopologyError("storage node %s already holds partitions %s" % (storage, format_ids(already)))
        return self._with_partitions(storage, current.union(partition_ids))

    def unassign(self, storage, partition_ids):
        """Remove ``partition_ids`` from ``storage``; refused when that would leave the
        storage's group without a replica of one of them."""
        self._known(storage)
        current = set(self.partitions_of(storage))
        missing = set(partition_ids) - current
        if missing:
            raise TopologyError("storage node %s does not hold partitions %s" % (storage, format_ids(missing)))
        group = self.groups.get(storage)
        if group is None:
            raise TopologyError("storage node %s belongs to no group" % storage)
        result = self._with_partitions(storage, current.difference(partition_ids))
        peers = result.storages_in_group(group)
        orphaned = [pid for pid in partition_ids
                    if not any(pid in result.partitions_of(peer) for peer in peers)]
        if orphaned:
            raise TopologyError("unassigning would leave group %d without a replica of partitions %s; "
                                "assign them to another storage node of the group first"
                                % (group, format_ids(orphaned)))
        return result

    def auto_assign(self, group, num_partitions):
        """Give every partition exactly one replica in ``group``, round-robin over its storages."""
        members = self.storages_in_group(group)
        if not members:
            raise TopologyError("group %d has no storage nodes; add some with add-storage" % group)
        busy = [storage for storage in members if self.partitions_of(storage)]
        if busy:
            raise TopologyError("storage nodes of group %d already hold partitions (%s); "
                                "auto-assign only fills an empty group" % (group, ", ".join(busy)))
        replicas = self.assignments.as_dict()
        for index, storage in enumerate(members):
            replicas[storage] = tuple(range(index, num_partitions, len(members)))
        return attr.evolve(self, assignments=ReplicaAssignments(replicas))
