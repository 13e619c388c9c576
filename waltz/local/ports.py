"""Listening ports for local daemons (``waltz dev``, the smoke run, tests and benchmarks), on loopback.

Ports are chosen **below the kernel's ephemeral range** (``/proc/sys/net/ipv4/ip_local_port_range``, from
:data:`LISTEN_FLOOR` up): the kernel takes the local port of every outgoing connection from that range, so
a port chosen there could be taken by some connection between the moment it is chosen and the moment its
daemon binds it, or again before a daemon restarts on it. Below the range only a process that binds that
very port can take it.

Each process walks the range from a random place, so a port it handed out comes round again only after
all the others; two processes rarely walk the same stretch, and a port something listens on (or that a
closed connection still holds) is skipped. Processes that run side by side with the same purpose
(parallel test workers) can each be given a slice of their own with :data:`SLICE_ENV`.

This module binds sockets to probe them: it is for tools, fixtures and scripts, not reactor code.
"""

import errno
import itertools
import os
import random
import socket

#: The lowest port chosen.
LISTEN_FLOOR = 10000
#: Where the kernel says which ports outgoing connections take.
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
#: With fewer ports than this below the ephemeral range, ports are chosen over the whole unprivileged range.
MIN_CHOICES = 1000
#: ``k/n``: this process chooses from the k-th (counted from 0) of n equal slices of the range.
SLICE_ENV = "WALTZ_PORT_SLICE"
#: Ports tried per port asked for, at most, before giving up (most of them in use).
_TRIES_PER_PORT = 64


def ephemeral_start(path=EPHEMERAL_RANGE_FILE) -> int:
    """The first port of the kernel's ephemeral range (Linux's default, 32768, when it cannot be read)."""
    try:
        with open(path) as stream:
            return int(stream.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def port_slice(value):
    """``(k, n)`` from a :data:`SLICE_ENV` value ``"k/n"`` (``(0, 1)`` when unset); ValueError naming it."""
    if not value:
        return 0, 1
    try:
        index, count = (int(part) for part in value.split("/"))
    except ValueError:
        index = count = -1
    if not 0 <= index < count:
        raise ValueError("%s=%r: expected k/n with 0 <= k < n, such as 0/2" % (SLICE_ENV, value))
    return index, count


def listening_range(first_ephemeral=None, slice_value=None) -> range:
    """The ports this process chooses from: below the ephemeral range, this process's slice of them."""
    end = ephemeral_start() if first_ephemeral is None else first_ephemeral
    start = LISTEN_FLOOR
    if end - start < MIN_CHOICES:
        start, end = 1024, 65536
    index, count = port_slice(os.environ.get(SLICE_ENV) if slice_value is None else slice_value)
    size = (end - start) // count
    return range(start + index * size, start + (index + 1) * size)


class _Walk:
    """The ports of :func:`listening_range`, in turn, from a random place, round and round."""

    def __init__(self):
        self._ports = None

    def next_ports(self):
        if self._ports is None:
            choices = listening_range()
            offset = random.randrange(len(choices))
            self._ports = itertools.cycle(itertools.chain(choices[offset:], choices[:offset]))
        return self._ports


_walk = _Walk()


def free_ports(count, host="127.0.0.1"):
    """``count`` distinct TCP ports at ``host`` that nothing listens on or holds right now (see the module).

    Each candidate is bound (without ``SO_REUSEADDR``, so a port a closed connection still holds is
    skipped too) and stays bound until all are chosen.
    """
    sockets, ports = [], []
    candidates = _walk.next_ports()
    try:
        for port in itertools.islice(candidates, count * _TRIES_PER_PORT):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.bind((host, port))
            except OSError as exc:
                sock.close()
                if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                    continue
                raise       # the host is not ours, say
            sockets.append(sock)
            ports.append(port)
            if len(ports) == count:
                return ports
        raise OSError("no %d free ports at %s in %s" % (count, host, listening_range()))
    finally:
        for sock in sockets:
            sock.close()


def free_port(host="127.0.0.1"):
    """One port, as :func:`free_ports` chooses them."""
    return free_ports(1, host)[0]


def port_in_use(host, port):
    """Whether something listens on ``host:port`` (TIME_WAIT leftovers do not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
        return False
