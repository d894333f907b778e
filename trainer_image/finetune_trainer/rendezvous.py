"""The rendezvous pod: host a standalone `torch.distributed.TCPStore` for torchrun's c10d
rendezvous (`--rdzv-backend=c10d --rdzv-conf=is_host=false`), until SIGTERM.

    python -m finetune_trainer.rendezvous --port 29400

Because no training agent hosts the store, losing any worker pod leaves the rendezvous intact.

The store listens on the pod's own address (`$POD_IP`), never on every interface: TCPStore's
server binds `*` whatever host it is given, so the socket is bound here and handed over
(`master_listen_fd`). Two rendezvous stores on one host (two jobs of a local cluster, two local
clusters: pods share the host's network) then never take each other's port, and a store is
only reachable at its pod's address.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
from datetime import timedelta
from types import FrameType

from torch.distributed import TCPStore

from finetune_operator.api.constants import RDZV_PORT

log = logging.getLogger("finetune_trainer.rendezvous")


def listen_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket bound to exactly `host:port` (port 0: any free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted store rebinds
    sock.bind((host, port))
    sock.listen(1024)
    return sock


def serve_store(host: str, port: int) -> tuple[TCPStore, socket.socket | None]:
    """Start the store server: no fixed world size, does not wait for clients. Bound to
    `host` only, unless host is the wildcard. Keep the returned socket open while serving."""
    sock = None if host in ("", "0.0.0.0", "::") else listen_socket(host, port)
    store = TCPStore(
        host or "0.0.0.0",
        sock.getsockname()[1] if sock else port,
        world_size=None,
        is_master=True,
        wait_for_workers=False,
        # One server per process here; a listen fd is only honoured without multi-tenancy.
        multi_tenant=sock is None,
        timeout=timedelta(seconds=60),
        **({"master_listen_fd": sock.fileno()} if sock else {}),
    )
    return store, sock


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="finetune_trainer.rendezvous", description=__doc__)
    parser.add_argument("--port", type=int, default=RDZV_PORT)
    parser.add_argument(
        "--host", default=os.environ.get("POD_IP") or "0.0.0.0", help="default: $POD_IP"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    stop = threading.Event()

    def handle(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)
    store, _sock = serve_store(args.host, args.port)
    log.info("rendezvous TCPStore serving on %s:%d", args.host, store.port)
    print(f"READY {store.port}", flush=True)
    stop.wait()
    log.info("rendezvous store stopping")
    return 0


if __name__ == "__main__":
    sys.exit(main())
