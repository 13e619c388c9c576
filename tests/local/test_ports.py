"""Listening ports for local daemons (waltz/local/ports.py)."""

import errno
import itertools
import socket

import pytest

from waltz.local import ports
from waltz.local.ports import (
    LISTEN_FLOOR, SLICE_ENV, ephemeral_start, free_port, free_ports, listening_range, port_slice)


def test_ports_taken_together_are_distinct_and_below_the_ephemeral_range():
    # One at a time, the kernel could hand the same port out twice, and a daemon given it twice failed to start.
    # In the ephemeral range, an outgoing connection could take a port before its daemon bound it.
    for _ in range(20):
        chosen = free_ports(13)
        assert len(set(chosen)) == 13
        assert all(LISTEN_FLOOR <= port < ephemeral_start() for port in chosen)


def test_a_port_handed_out_comes_round_again_only_after_the_others():
    # LocalCluster configures its storages and then starts them together: two given the same port, one failed
    # to bind and the run stopped.
    chosen = [port for _ in range(300) for port in free_ports(3)]
    assert len(set(chosen)) == len(chosen)


def _walk_from(monkeypatch, first):
    monkeypatch.setattr(ports._walk, "_ports", itertools.cycle(range(first, first + 50)))


def test_a_port_something_listens_on_or_holds_is_skipped(monkeypatch):
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        taken = listening.getsockname()[1]
        _walk_from(monkeypatch, taken)
        assert free_ports(2) == [taken + 1, taken + 2]


def test_a_bind_error_other_than_a_port_in_use_is_raised(monkeypatch):
    _walk_from(monkeypatch, LISTEN_FLOOR)
    with pytest.raises(OSError) as raised:
        free_port("192.0.2.1")            # TEST-NET-1: no address of this machine
    assert raised.value.errno == errno.EADDRNOTAVAIL


def test_giving_up_names_the_range(monkeypatch):
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        monkeypatch.setattr(ports._walk, "_ports", itertools.repeat(listening.getsockname()[1]))
        with pytest.raises(OSError, match=r"no 2 free ports at 127.0.0.1 in range\("):
            free_ports(2)


def test_the_range_is_below_the_ephemeral_one_and_sliced_for_parallel_workers():
    assert listening_range(32768, "") == range(LISTEN_FLOOR, 32768)
    halves = [listening_range(32768, "%d/2" % k) for k in range(2)]
    assert halves[0].stop == halves[1].start and halves[0].start == LISTEN_FLOOR and halves[1].stop <= 32768
    assert listening_range(10500, "") == range(1024, 65536)     # too little room below: the whole range


def test_ephemeral_start_reads_the_kernel_setting_and_defaults(tmp_path):
    setting = tmp_path / "range"
    setting.write_text("40000\t60999\n")
    assert ephemeral_start(str(setting)) == 40000
    assert ephemeral_start(str(tmp_path / "missing")) == 32768


@pytest.mark.parametrize("value", ["2/2", "1", "a/b", "-1/2", "0/0"])
def test_a_bad_slice_names_the_variable(value):
    with pytest.raises(ValueError, match=SLICE_ENV):
        port_slice(value)
