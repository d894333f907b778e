"""The rendezvous store binds its pod's address only: two stores share a port on two
addresses (two jobs, two local clusters on one host) and each is private to its address."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from finetune_trainer.rendezvous import serve_store


def _client(host: str, port: int) -> TCPStore:
    return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=5))


def test_two_stores_one_port_two_addresses() -> None:
    a, sock_a = serve_store("127.0.91.1", 0)
    port = a.port
    b, sock_b = serve_store("127.0.91.2", port)  # the same port: no clash
    assert b.port == port and sock_a is not None and sock_b is not None
    assert sock_a.getsockname() == ("127.0.91.1", port)
    _client("127.0.91.1", port).set("k", "from-a")
    _client("127.0.91.2", port).set("k", "from-b")
    assert _client("127.0.91.1", port).get("k") == b"from-a"
    assert _client("127.0.91.2", port).get("k") == b"from-b"
    with socket.socket() as probe, pytest.raises(ConnectionRefusedError):
        probe.connect(("127.0.91.3", port))  # not listening on every interface
    sock_a.close()
    sock_b.close()
