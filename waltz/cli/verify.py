"""``waltz cluster verify``: the ZooKeeper assignment against what the servers and storage nodes report.

For every partition: it must be assigned to a live server that reports it healthy, and a quorum of its replicas
(assigned in ``<root>/store/assignment``) must be on reachable storage nodes that hold it and have it online.
Prints one line per partition and every problem; the exit status is 1 when there is any.
"""

from twisted.internet import defer

from waltz.cli.common import CliError
from waltz.cli.server import partition_health
from waltz.cli.storage import StorageNodeClient
from waltz.recovery.voting import quorum_of


@defer.inlineCallbacks
def verify(metadata, args):
    """Fires with the exit status after printing the report."""
    params = yield metadata.store_params()
    assignment = (yield metadata.partition_assignment()).value
    descriptors = {d.server_id: d for _, d in (yield metadata.server_descriptors())}
    topology = (yield metadata.topology()).value
    server_health = yield _server_health(metadata, descriptors, args.timeout, args.tls)
    storage_status = yield _storage_status(metadata, topology, params, args.timeout, args.tls)
    owners = {info.partition_id: (server_id, info.generation)
              for server_id, infos in assignment.servers for info in infos}
    problems, lines = [], []
    for pid in range(params.num_partitions):
        lines.append(_check_partition(pid, owners.get(pid), descriptors, server_health, topology, storage_status,
                                      problems))
    print("\n".join(lines))
    for problem in problems:
        print("PROBLEM: " + problem)
    print("%d problem(s) found" % len(problems) if problems else "the cluster is consistent")
    return 1 if problems else 0


@defer.inlineCallbacks
def _server_health(metadata, descriptors, timeout, tls):
    health = {}
    for server_id, descriptor in descriptors.items():
        try:
            health[server_id] = yield partition_health(metadata.reactor, descriptor.host, descriptor.port, timeout,
                                                       tls)
        except Exception:
            health[server_id] = None  # unreachable
    return health


@defer.inlineCallbacks
def _storage_status(metadata, topology, params, timeout, tls):
    status = {}
    for storage, admin_port in topology.connections.entries:
        client = StorageNodeClient(metadata.reactor, storage, admin_port, params, timeout=timeout, tls=tls)
        try:
            status[storage] = dict((yield client.assigned_partitions()))
        except CliError:
            status[storage] = None  # unreachable
        finally:
            client.close()
    return status


def _check_partition(pid, owner, descriptors, server_health, topology, storage_status, problems):
    if owner is None:
        problems.append("partition %d is not assigned to any server" % pid)
        where = "no server"
    else:
        server_id, generation = owner
        health = server_health.get(server_id)
        where = "server %d (generation %d)" % (server_id, generation)
        if server_id not in descriptors:
            problems.append("partition %d is assigned to server %d, which is not live" % (pid, server_id))
        elif health is None:
            problems.append("partition %d: server %d at %s does not answer" % (pid, server_id,
                                                                              descriptors[server_id].endpoint))
        elif not health.get(pid, False):
            problems.append("partition %d: server %d reports it %s" % (pid, server_id,
                                                                      "unhealthy" if pid in health else "missing"))
    replicas = topology.assignments.replicas_of(pid)
    if not replicas:
        problems.append("partition %d has no replica in <root>/store/assignment (give it some with "
                        "'waltz cluster assign' or 'waltz cluster auto-assign')" % pid)
        return "partition %d: %s; no replicas assigned" % (pid, where)
    healthy = [s for s in replicas if storage_status.get(s) and storage_status[s].get(pid)]
    for storage in replicas:
        held = storage_status.get(storage)
        if held is None:
            problems.append("partition %d: storage node %s does not answer" % (pid, storage))
        elif pid not in held:
            problems.append("partition %d: storage node %s does not hold it (run waltz storage sync-partitions)"
                            % (pid, storage))
        elif not held[pid]:
            problems.append("partition %d: offline on storage node %s" % (pid, storage))
    quorum = quorum_of(len(replicas))
    if len(healthy) < quorum:
        problems.append("partition %d: %d of %d replicas healthy, below the quorum of %d"
                        % (pid, len(healthy), len(replicas), quorum))
    return "partition %d: %s; replicas %d/%d healthy (quorum %d)" % (pid, where, len(healthy), len(replicas), quorum)
