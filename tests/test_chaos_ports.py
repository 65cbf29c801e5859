"""Harness ports are picked where the kernel never assigns any.

``free_port_run`` picks ports that a child binds a moment later. Picked in the ephemeral
range (``bind`` to port 0, as it used to), such a port could be handed to any outgoing
connection meanwhile (concurrent runs and busy load generators open thousands): the
child then failed with "address already in use". Now every pick is below the range, and
no amount of outgoing connections can land on it.
"""

from __future__ import annotations

import socket

from loadtest.fleet import ephemeral_ports, free_port_run


def test_picked_runs_are_free_and_below_the_ephemeral_range() -> None:
    low, _ = ephemeral_ports()
    for n in (1, 3, 12):
        base = free_port_run(n)
        assert 1024 <= base and base + n <= low, (base, n, low)
        socks = [socket.socket() for _ in range(n)]
        try:
            for i, s in enumerate(socks):
                s.bind(("127.0.0.1", base + i))  # all of them still free
        finally:
            for s in socks:
                s.close()


def test_outgoing_connections_never_take_a_picked_port() -> None:
    picked = {free_port_run(1) for _ in range(50)}
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(512)
        clients = []
        try:
            for _ in range(300):
                c = socket.create_connection(server.getsockname(), timeout=5)
                clients.append(c)
                assert c.getsockname()[1] not in picked
                server.accept()[0].close()
        finally:
            for c in clients:
                c.close()
