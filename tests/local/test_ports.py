"""Free ports for local daemons."""

from waltz.local.zookeeper import free_ports


def test_ports_taken_together_are_distinct():
    # One at a time, the kernel could hand the same port out twice, and a daemon given it twice failed to start.
    for _ in range(20):
        ports = free_ports(13)
        assert len(set(ports)) == 13 and all(1024 <= port <= 65535 for port in ports)
