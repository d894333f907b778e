"""The rendezvous pod: host a standalone `torch.distributed.TCPStore` for torchrun's c10d
rendezvous (`--rdzv-backend=c10d --rdzv-conf=is_host=false`), until SIGTERM.

    python -m finetune_trainer.rendezvous --port 29400

Because no training agent hosts the store, losing any worker pod leaves the rendezvous intact.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from datetime import timedelta
from types import FrameType

from torch.distributed import TCPStore

from finetune_operator.api.constants import RDZV_PORT

log = logging.getLogger("finetune_trainer.rendezvous")


def serve_store(host: str, port: int) -> TCPStore:
    """Start the store server: no fixed world size, does not wait for clients,
    multi-tenant so every job round (and the agents' own clients) share one server."""
    return TCPStore(
        host,
        port,
        world_size=None,
        is_master=True,
        wait_for_workers=False,
        multi_tenant=True,
        timeout=timedelta(seconds=60),
    )


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
    store = serve_store(args.host, args.port)
    log.info("rendezvous TCPStore serving on %s:%d", args.host, store.port)
    print(f"READY {store.port}", flush=True)
    stop.wait()
    log.info("rendezvous store stopping")
    return 0


if __name__ == "__main__":
    sys.exit(main())
