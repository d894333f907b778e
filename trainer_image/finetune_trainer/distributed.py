"""Process groups: the training group, the dedicated checkpoint group, and their teardown.

When `POD_IP` is set, gloo is bound to that address through a registered backend
(`podgloo`) whose devices are created for the pod's IP: stock gloo only binds the address the
machine's hostname resolves to, or an interface by name (`GLOO_SOCKET_IFNAME`), and several
local "pods" share one host and one loopback interface.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroupGloo

from finetune_trainer.config import RuntimeEnv

log = logging.getLogger(__name__)

POD_GLOO = "podgloo"
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


def select_device(resources_device: str, env: RuntimeEnv) -> torch.device:
    if resources_device == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    torch.cuda.set_device(env.local_rank)
    return torch.device("cuda", env.local_rank)


def init_distributed(
    device: torch.device, env: RuntimeEnv, timeout_s: float = 600.0
) -> Distributed:
    cpu = cpu_backend(env.pod_ip)
    # CUDA runs keep a CPU backend too: async_save's collectives run on CPU tensors.
    backend = f"cpu:{cpu},cuda:nccl" if device.type == "cuda" else cpu
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend=backend, timeout=timeout)
    ckpt_group = dist.new_group(backend=cpu, timeout=timeout)
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


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
