"""The real kopf operator run in-process, in a thread, against a local cluster (slow tests)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.operator.factories import make_plan


def _run(kubeconfig: str, interval: int, stop: threading.Event, ready: threading.Event) -> None:
    from finetune_operator.handlers import operate
    from finetune_operator.settings import parse_operator_args

    # The chart's flags with the test's pass interval, and no metrics server: its fixed
    # default port (9090) may be taken on a shared machine.
    settings = parse_operator_args(
        ["--namespace=default", "--standalone", f"--reconcile-interval={interval}",
         "--metrics-port=0"]
    )  # fmt: skip
    asyncio.run(
        operate(
            settings,
            kubeconfig=kubeconfig,
            planner=lambda _: make_plan(2, 1),
            ready_flag=ready,
            stop_flag=stop,
        )
    )


@contextmanager
def running_operator(kubeconfig: Path, interval: int) -> Iterator[tuple[Any, Any]]:
    """The operator running until the block ends; yields (CustomObjectsApi, CoreV1Api)."""
    from kubernetes import client

    from finetune_operator.reconcile.apply import load_api_client

    stop, ready = threading.Event(), threading.Event()
    thread = threading.Thread(target=_run, args=(str(kubeconfig), interval, stop, ready),
                              daemon=True)  # fmt: skip
    thread.start()
    try:
        assert ready.wait(30), "operator did not start"
        api = load_api_client(str(kubeconfig))
        yield client.CustomObjectsApi(api), client.CoreV1Api(api)
    finally:
        stop.set()
        thread.join(30)
