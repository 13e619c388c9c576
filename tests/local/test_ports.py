"""Free ports for local daemons."""

from waltz.local.zookeeper import free_ports


def test_ports_taken_together_are_distinct():
    # One at a time, the kernel could hand the same port out twice, and a daemon given it twice failed to start.
    for _ in range(20):
        ports = free_ports(13)
        assert len(set(ports)) == 13 and all(1024 <= port <= 65535 for port in ports)


class _ScriptedSocket:
    """A socket whose ``bind(0)`` gets the next port of ``PORTS``, as a kernel may choose them."""

    PORTS = []

    def __init__(self, *args):
        self.port = None

    def bind(self, address):
        self.port = self.PORTS.pop(0)

    def getsockname(self):
        return "127.0.0.1", self.port

    def close(self):
        pass


def test_a_port_handed_out_before_is_not_handed_out_again(monkeypatch):
    # LocalCluster configures its storages and then starts them together: two given the same port (the kernel
    # handed it out again once the first call's socket was closed), one failed to bind and the run stopped.
    from waltz.local import zookeeper
    monkeypatch.setattr(zookeeper.socket, "socket", _ScriptedSocket)
    monkeypatch.setattr(zookeeper, "_handed_out", zookeeper.collections.deque(maxlen=4096))
    _ScriptedSocket.PORTS[:] = [41000, 41001, 41000, 41002, 41001, 41003]
    assert free_ports(2) == [41000, 41001]
    assert free_ports(2) == [41002, 41003]
