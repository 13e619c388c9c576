"""The partition assignment policy: which live server holds which partition, at which generation.

A pure function of the live servers, the assignment currently stored in
``<root>/serverDescriptors`` and the partition count; the coordinator server
(:mod:`waltz.server.membership`) runs it whenever the membership changes.
It follows the original's ``DynamicPartitionAssignmentPolicy`` (zktools):

1. **Even shares.** With ``n`` partitions and ``k`` servers every server gets
   ``n // k`` partitions, and ``n % k`` of them one more.
2. **Preferred partitions first.** Servers, in ascending id order, claim their
   preferred partitions up to their share; the first claimant wins.
3. **Servers keep what they hold**, in the order of their current list, up to
   their share.
4. **The rest is spread**: the remaining partitions, in ascending id order,
   fill the servers, in ascending id order, up to their shares.
5. Each server's list is shuffled (with the injected ``rng``), so later
   rebalancing does not always move the same partitions.

**Generations.** A partition keeps its generation while it stays on the same
server; it gets ``generation + 1`` when it moves to another server (its owner
left, or gave it up to even out the shares or to a server preferring it), and
``1`` when it is assigned for the first time (new partitions count from 0).
A server's store sessions and clients' requests carry the generation, so the
previous owner of a moved partition is fenced out.
"""

import attr

from waltz.zk.znodes import PartitionAssignment, PartitionInfo


class AssignmentError(Exception):
    """The assignment cannot be computed (the partition count shrank, or it would be incomplete)."""


@attr.s(slots=True)
class _Share:
    """How many more partitions the servers may take: ``base`` each, ``extra`` of them one more."""

    base = attr.ib()
    extra = attr.ib()

    def admits(self, held):
        """Whether a server holding ``held`` partitions may take one more (and count it)."""
        if held < self.base:
            return True
        if held == self.base and self.extra > 0:
            self.extra -= 1
            return True
        return False


@attr.s(slots=True)
class _Draft:
    """The assignment being built: the partitions still unassigned and each server's new list."""

    unassigned = attr.ib()     # partition id -> its current PartitionInfo (generation to carry on)
    previous_owner = attr.ib()  # partition id -> server id holding it now (absent: nobody)
    lists = attr.ib()          # server id -> list of new PartitionInfo
    share = attr.ib()

    def take(self, server_id, partition_id):
        """Give ``partition_id`` to ``server_id`` if its share allows; returns whether it did."""
        if partition_id not in self.unassigned or not self.share.admits(len(self.lists[server_id])):
            return False
        info = self.unassigned.pop(partition_id)
        if self.previous_owner.get(partition_id) != server_id:
            info = PartitionInfo(partition_id, info.generation + 1)
        self.lists[server_id].append(info)
        return True


def _draft(current, num_partitions, server_ids):
    """Every partition starts unassigned, remembering its current owner and generation."""
    unassigned = {pid: PartitionInfo(pid, 0) for pid in range(num_partitions)}
    owner = {}
    for server_id, infos in current.servers:
        for info in infos:
            if info.partition_id < num_partitions:
                unassigned[info.partition_id] = info
                owner[info.partition_id] = server_id
    base, extra = divmod(num_partitions, len(server_ids))
    return _Draft(unassigned, owner, {server_id: [] for server_id in server_ids}, _Share(base, extra))


def _claim_preferred(draft, servers):
    for server in servers:
        for partition_id in server.preferred_partitions:
            draft.take(server.server_id, partition_id)


def _keep_current(draft, current, server_ids):
    for server_id in server_ids:
        for info in current.partitions_for(server_id):
            if info.partition_id in draft.unassigned and not draft.take(server_id, info.partition_id):
                break


def _spread_rest(draft, server_ids):
    remaining = sorted(draft.unassigned)
    for server_id in server_ids:
        while remaining and draft.take(server_id, remaining[0]):
            remaining.pop(0)


def compute_assignment(cversion, current, num_partitions, servers, rng):
    """The new :class:`PartitionAssignment` for ``cversion`` (the children version of
    ``serverDescriptors`` it is computed for).

    ``current`` is the stored assignment, ``servers`` the live servers (objects with
    ``server_id`` and ``preferred_partitions``, e.g. :class:`~waltz.zk.znodes.ServerDescriptor`;
    duplicates of an id are ignored), ``rng`` a ``random.Random``. With no live server the
    assignment is empty. Raises :class:`AssignmentError` if ``num_partitions`` is smaller
    than the current assignment's.
    """
    if num_partitions < current.num_partitions:
        raise AssignmentError("the number of partitions cannot decrease (from %d to %d)"
                              % (current.num_partitions, num_partitions))
    members = {}
    for server in sorted(servers, key=lambda s: s.server_id):
        members.setdefault(server.server_id, server)
    if not members:
        return PartitionAssignment(cversion, num_partitions, {})
    server_ids = sorted(members)
    draft = _draft(current, num_partitions, server_ids)
    _claim_preferred(draft, [members[server_id] for server_id in server_ids])
    _keep_current(draft, current, server_ids)
    _spread_rest(draft, server_ids)
    if draft.unassigned:
        raise AssignmentError("incomplete partition assignment: %s left over" % sorted(draft.unassigned))
    for partitions in draft.lists.values():
        rng.shuffle(partitions)
    return PartitionAssignment(cversion, num_partitions, draft.lists)


def partitions_of(assignment, server_id):
    """``{partition id: generation}`` of ``server_id`` in ``assignment``."""
    return {info.partition_id: info.generation for info in assignment.partitions_for(server_id)}
