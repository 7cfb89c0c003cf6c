"""pdjax.ports.free_port: outside the kernel's ephemeral range, never twice, never a busy one."""

import socket

import pytest

from pdjax import ports


def test_ports_are_below_the_ephemeral_range_and_never_repeat():
    low = ports._ephemeral_low()
    got = [ports.free_port() for _ in range(300)]
    assert len(set(got)) == len(got)
    assert all(ports._LOW <= p < low for p in got)
    for p in got[:20]:                      # each one binds on every interface
        with socket.socket() as s:
            s.bind(("0.0.0.0", p))


def test_a_port_in_use_or_handed_out_is_skipped(monkeypatch):
    monkeypatch.setattr(ports, "_handed_out", set())
    first = ports.free_port()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))             # busy on one interface is busy
        busy.listen()
        taken = busy.getsockname()[1]
        spare = ports.free_port()               # a port known free; handed out, so cleared
        ports._handed_out.discard(spare)
        draws = iter([taken, first, spare])
        monkeypatch.setattr(ports.random, "randrange", lambda lo, hi: next(draws))
        assert ports.free_port() == spare


def test_no_free_port_raises(monkeypatch):
    monkeypatch.setattr(ports, "_bindable", lambda p: False)
    with pytest.raises(RuntimeError, match="no free TCP port"):
        ports.free_port(attempts=5)
