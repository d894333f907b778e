"""A silent node loss under real torchrun: two elastic agents ("pods") on the standalone
rendezvous store, the operator's worker command and rendezvous conf, and one pod's processes
frozen with SIGSTOP (agent and worker: a node that lost power or was partitioned: its sockets
stay open, so the survivor learns nothing until a timeout). Shared by the slow test and
`bench/silent_peer_loss.py`."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from finetune_operator.api.jobconfig import JobConfig
from finetune_operator.resources.worker import rendezvous_conf
from tests.conftest import wait_until as shared_wait_until
from tests.trainer.conftest import (
    Proc,
    elastic_args,
    make_job,
    start_rendezvous_store,
    step_lines,
    tail,
    trainer_env,
    write_job,
)

TIMED_OUT = "a collective timed out"
# The trainer's log format (finetune_trainer.__main__): "2026-11-23 17:20:01,123 rank0 ERROR ..."
FAILED_LINE = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d+) rank\d+ ERROR [^\n]*" + TIMED_OUT, re.M
)
CHECKPOINT_EVERY = 5


def silent_loss_job(collective_timeout_s: int, *, max_steps: int = 400) -> JobConfig:
    job = make_job(training={"maxSteps": max_steps}, checkpoint={"intervalSteps": CHECKPOINT_EVERY})
    # A hang timeout above it: the operator's own hang detection is not part of this run.
    ft = job.spec.fault_tolerance.model_copy(
        update={
            "collective_timeout_seconds": collective_timeout_s,
            "hang_timeout_seconds": max(600, 2 * collective_timeout_s),
        }
    )
    spec = job.spec.model_copy(update={"fault_tolerance": ft})
    return JobConfig.model_validate({**job.model_dump(), "spec": spec.model_dump()})


def worlds(log: Path) -> list[int]:
    return [int(m) for m in re.findall(r"trainer: world (\d+),", log.read_text(errors="replace"))]


def committed(root: Path) -> list[int]:
    return sorted(int(p.parent.name.split("-")[1]) for p in root.glob("step-*/COMMITTED"))


@dataclass
class Frozen:
    survivor: Proc
    frozen: Proc
    step_at_freeze: int
    frozen_at: float  # time.monotonic()
    frozen_wall: float  # time.time()
    checkpoints: Path


def start_and_freeze(
    tmp: Path, procs: list[Proc], job: JobConfig, *, step_delay: str = "0.15"
) -> Frozen:
    """Run two agents at world 2, then SIGSTOP the second one's processes a few steps after a
    committed checkpoint, mid-interval (not in a save's relaxed window)."""
    config = write_job(tmp / "job.json", job)
    ckpt = tmp / "checkpoints" / job.name
    port = start_rendezvous_store(tmp, procs)

    def agent(name: str, ip: str) -> Proc:
        args = elastic_args(config=config, endpoint=f"127.0.0.1:{port}", pod_ip=ip, min_nodes=1,
                            max_nodes=2, restarts=3, rdzv_conf=rendezvous_conf(job.spec, job.plan))  # fmt: skip
        # torchrun's own files: each failed worker's error file (what launch.py reports from).
        args[-4:-4] = [f"--log-dir={tmp / (name + '-torchrun')}"]  # before "-m finetune_trainer"
        p = Proc(args, cwd=tmp, log=tmp / f"{name}.log",
                 env=trainer_env(ip, FT_STEP_DELAY_SECONDS=step_delay))  # fmt: skip
        procs.append(p)
        return p

    a, b = agent("a", "127.0.0.2"), agent("b", "127.0.0.3")

    def mid_interval() -> int | None:
        steps = [s["step"] for s in step_lines(a.log)]
        if 2 not in worlds(a.log) or not committed(ckpt) or not steps:
            return None
        step = steps[-1]
        # Past warm-up and the step after a save, well before the next save.
        return step if step % CHECKPOINT_EVERY in (2, 3) and step > CHECKPOINT_EVERY else None

    step = shared_wait_until(mid_interval, "world 2 past a committed checkpoint", 120,
                             detail=lambda: tail(a.log))  # fmt: skip
    freeze(b.popen.pid)
    return Frozen(a, b, step, time.monotonic(), time.time(), ckpt)


def process_tree(root: int) -> list[int]:
    """`root` and its descendants (/proc): torchrun starts each worker in its own session,
    so the agent's process group does not hold them."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            pid, _, rest = stat.read_text().partition(" (")
            ppid = int(rest.rsplit(") ", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        children.setdefault(ppid, []).append(int(pid))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def freeze(root: int) -> None:
    """A pod's node gone silent: every process of the pod stopped at once (workers first, so
    no agent notices a stopped worker), none exits, no socket closes."""
    for pid in reversed(process_tree(root)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)


def seconds_to_failure(run: Frozen, timeout: float) -> float:
    """From the freeze to the survivor's worker logging its collective timeout."""
    found = shared_wait_until(
        lambda: FAILED_LINE.search(run.survivor.log.read_text(errors="replace")),
        "the survivor's collective timeout", timeout, detail=lambda: tail(run.survivor.log),
    )  # fmt: skip
    detected = time.monotonic()
    # The log line's own time (local wall clock), a figure independent of the polling.
    logged = datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S").timestamp()
    at = logged + int(found.group(2)) / 1000
    return min(at - run.frozen_wall, detected - run.frozen_at)


def error_file(tmp: Path, name: str = "a") -> Path | None:
    """The survivor's first failed attempt's error file, as torchrun wrote it."""
    files = sorted((tmp / f"{name}-torchrun").glob("*/attempt_0/0/error.json"))
    return files[0] if files else None
