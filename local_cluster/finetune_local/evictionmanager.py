"""The kubelet's eviction manager, for what the local cluster enforces: a running pod whose
disk-backed emptyDir outgrew its ``sizeLimit`` is evicted (SIGTERM, SIGKILL after the 1 s
grace of an immediate eviction; phase Failed, reason Evicted: :mod:`.emptydir`), checked
every few seconds, not on each write."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from finetune_local import emptydir, podrunner
from finetune_local.podlaunch import PodRun

logger = logging.getLogger(__name__)


async def _kill_after(pid: int, grace: float) -> None:
    await asyncio.sleep(grace)
    await podrunner.kill_pod_processes(pid, 10)


def enforce_size_limits(
    runs: Iterable[PodRun], spawn: Callable[[Coroutine[Any, Any, None]], None]
) -> None:
    """Evict the pods of `runs` over an emptyDir's sizeLimit; `spawn` runs the delayed kill."""
    clock = asyncio.get_running_loop().time()
    for run in runs:
        if not run.size_limits or run.finished or run.evicted or run.terminating:
            continue
        if clock - run.usage_checked_at < emptydir.CHECK_INTERVAL_SECONDS:
            continue
        run.usage_checked_at = clock
        usage = {limit.volume: emptydir.disk_usage(limit.path) for limit in run.size_limits}
        message = emptydir.over_limit(run.size_limits, usage)
        if message and run.process is not None and run.process.returncode is None:
            run.evicted = message
            logger.info("evicting pod (uid %s): %s", run.uid, message)
            podrunner.signal_group(run.process.pid, signal.SIGTERM)
            spawn(_kill_after(run.process.pid, emptydir.EVICTION_GRACE_SECONDS))
