"""Process groups: the training group, the dedicated checkpoint group, and their teardown.

When `POD_IP` is set, gloo is bound to that address through a registered backend
(`podgloo`) whose devices are created for the pod's IP: stock gloo only binds the address the
machine's hostname resolves to, or an interface by name (`GLOO_SOCKET_IFNAME`), and several
local "pods" share one host and one loopback interface.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar, cast

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroupGloo, distributed_c10d

from finetune_trainer.config import RuntimeEnv

log = logging.getLogger(__name__)
T = TypeVar("T")

POD_GLOO = "podgloo"
# How a collective's timeout reads: gloo raises "Timed out waiting <ms>ms for recv operation
# to complete"; NCCL's watchdog "Watchdog caught collective operation timeout" (it aborts the
# process unless TORCH_NCCL_BLOCKING_WAIT is set, so the main thread rarely sees it).
COLLECTIVE_TIMEOUT_MARKERS = ("Timed out waiting", "collective operation timeout")
_pod_ip_for_gloo: str | None = None


def _create_pod_gloo(
    store: dist.Store, rank: int, size: int, timeout: datetime.timedelta
) -> ProcessGroupGloo:
    opts = ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [ProcessGroupGloo.create_device(hostname=_pod_ip_for_gloo or "")]
    return ProcessGroupGloo(store, rank, size, opts)


def cpu_backend(pod_ip: str | None) -> str:
    """`podgloo` bound to the pod address when one is given, else stock gloo."""
    global _pod_ip_for_gloo
    if not pod_ip:
        return "gloo"
    _pod_ip_for_gloo = pod_ip
    if POD_GLOO not in dist.Backend.backend_list:
        dist.Backend.register_backend(POD_GLOO, _create_pod_gloo, devices=["cpu"])
    return POD_GLOO


@dataclass
class Distributed:
    """The groups a run uses. `checkpoint_group` is never used by training collectives:
    async checkpoint saves run their own collectives from a background thread."""

    device: torch.device
    world_size: int
    rank: int
    checkpoint_group: dist.ProcessGroup

    def all_reduce_sum(self, values: list[float | torch.Tensor]) -> list[float]:
        """A small float64 all-reduce on the training group (the step's sync point). Values
        may be 0-d device tensors (a loss still on the GPU): read back once, here."""
        t = torch.stack(
            [torch.as_tensor(v, dtype=torch.float64, device=self.device) for v in values]
        )
        dist.all_reduce(t)
        return [float(v) for v in t.tolist()]

    def rank0s(self, value: T) -> T:
        """Rank 0's `value` on every rank (a small picklable object, on the training group:
        for what ranks must agree on while starting, e.g. a dataset's listing)."""
        box: list[Any] = [value]
        dist.broadcast_object_list(box, src=0)
        return cast(T, box[0])


def select_device(resources_device: str, env: RuntimeEnv) -> torch.device:
    if resources_device == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    torch.cuda.set_device(env.local_rank)
    return torch.device("cuda", env.local_rank)


def init_distributed(
    device: torch.device,
    env: RuntimeEnv,
    timeout_s: float = 600.0,
    checkpoint_timeout_s: float | None = None,
) -> Distributed:
    """The training group with `timeout_s` (the startup timeout: `set_training_timeout`
    shortens it once the run is warm) and the checkpoint group with `checkpoint_timeout_s`
    (its collectives wait for the slowest rank's write; default: `timeout_s`)."""
    cpu = cpu_backend(env.pod_ip)
    # CUDA runs keep a CPU backend too: async_save's collectives run on CPU tensors.
    backend = f"cpu:{cpu},cuda:nccl" if device.type == "cuda" else cpu
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend=backend, timeout=timeout)
    ckpt_timeout = datetime.timedelta(seconds=checkpoint_timeout_s or timeout_s)
    ckpt_group = dist.new_group(backend=cpu, timeout=ckpt_timeout)
    if ckpt_group is None:  # pragma: no cover - only for ranks outside the group
        raise RuntimeError("this rank is not part of the checkpoint group")
    log.info(
        "process group ready: rank %d/%d backend %s device %s",
        dist.get_rank(),
        dist.get_world_size(),
        backend,
        device,
    )
    return Distributed(
        device=device,
        world_size=dist.get_world_size(),
        rank=dist.get_rank(),
        checkpoint_group=ckpt_group,
    )


def default_store() -> dist.Store:
    """The training group's store (torchrun's TCPStore, namespaced per restart): what ranks
    meet through without a collective (finetune_trainer.startup_barrier)."""
    return distributed_c10d._get_default_store()


def set_training_timeout(seconds: float) -> None:
    """The default (training) group's timeout for the collectives issued from now on, on
    every backend it has (gloo for CPU tensors, NCCL for CUDA ones). The checkpoint group
    keeps its own."""
    setter = getattr(distributed_c10d, "_set_pg_timeout", None)
    if setter is None:  # a torch without it: keep the timeout the group was created with
        log.warning("torch %s cannot change a process group's timeout", torch.__version__)
        return
    setter(datetime.timedelta(seconds=seconds))


class CollectiveTimeoutError(RuntimeError):
    """A collective on the training group waited past its timeout: a peer stopped answering
    (node lost, network partition, a hung or frozen rank) without closing its connections."""


def is_collective_timeout(error: BaseException) -> bool:
    return isinstance(error, CollectiveTimeoutError) or any(
        marker in str(error) for marker in COLLECTIVE_TIMEOUT_MARKERS
    )


def describe_failure(error: Exception, timeout_s: float | None) -> Exception:
    """`error`, or for a collective timeout an error that says what it means (the crash
    report and the operator read it as a lost peer, not a bug)."""
    if not is_collective_timeout(error) or isinstance(error, CollectiveTimeoutError):
        return error
    after = f" after {timeout_s:.0f}s" if timeout_s else ""
    described = CollectiveTimeoutError(
        f"a collective timed out{after}: a peer stopped answering (node lost, network "
        f"partition, or a hung rank); torchrun re-forms the group. {type(error).__name__}: "
        f"{error}"
    )
    described.__cause__ = error
    return described


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """End a rank's process after its clean-up, without interpreter finalisation.

    Why: once a DTensor has been distributed over a gloo group (FSDP2 does, loading and
    training), torch keeps that group alive past `destroy_process_group`, so its worker
    threads are still running when the interpreter finalises; destroying them then calls
    std::terminate ("terminate called without an active exception", SIGABRT, exit -6). A
    rank that had finished cleanly would be reported failed and torchrun would restart the
    group. Seen about once in 20 runs of a 4-rank load on a busy 2-core machine. Everything
    worth keeping is written and flushed before this (checkpoints committed by
    `Trainer.close`, logs flushed here)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
