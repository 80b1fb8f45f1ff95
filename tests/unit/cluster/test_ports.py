"""Ports for the servers kvmesh starts: outside the kernel's ephemeral range, free on every interface,
never the same twice in one process."""

from __future__ import annotations

import socket

from kvmesh.cluster import ports


def test_ports_are_below_the_ephemeral_range_above_rays_worker_ports_and_bindable_everywhere():
    low, _ = ports.ephemeral_range()
    got = ports.free_ports(40)
    assert len(set(got)) == 40
    for p in got:
        assert ports.LOW <= p < low
        with socket.socket() as s:
            s.bind(("0.0.0.0", p))  # raises if anything holds it on any address


def test_a_port_is_not_handed_out_twice_by_one_process():
    first = set(ports.free_ports(30))
    assert not first & set(ports.free_ports(30))


def test_a_port_some_server_holds_on_loopback_is_skipped(monkeypatch):
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    taken = held.getsockname()[1]
    spare = ports.free_port()  # known free, drawn second
    ports._given.discard(spare)

    class Draws:
        def __init__(self):
            self.left = [taken, spare]

        def randrange(self, a, b):
            return self.left.pop(0)

    monkeypatch.setattr(ports, "_rng", Draws())
    monkeypatch.setattr(ports, "LOW", 1024)
    try:
        assert ports.free_port() == spare
    finally:
        held.close()


def test_the_range_file_is_read_and_a_missing_one_gives_linuxs_default(tmp_path):
    f = tmp_path / "range"
    f.write_text("40000\t50000\n")
    assert ports.ephemeral_range(str(f)) == (40000, 50000)
    assert ports.ephemeral_range(str(tmp_path / "none")) == (32768, 60999)


def test_without_room_below_the_ephemeral_range_the_kernel_picks(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (20_500, 60_999))  # 500 ports: too few to draw from
    got = ports.free_ports(3)
    assert len(set(got)) == 3 and all(p > 0 for p in got)
