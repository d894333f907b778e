"""Host staging buffers for checkpoint saves, allocated once and reused.

A save must copy the state off the live tensors before the next optimizer step changes them;
DCP then writes the copy in the background. `HostStaging` owns the host memory for that copy:
one flat buffer (pinned on CUDA), sized from the first state dict and reallocated only when
the layout changes (another world size after an elastic re-form, another model). DCP's own
`DefaultStager` is not used: reused across saves it fails on CUDA with torch 2.11
(`KeyError(<class 'type'>)` in its deepcopy), and a fresh one per save pins new memory each
time (~3 GB/s), which stalls the next step by seconds.

A save is staged in two halves so that the copy overlaps the next step's forward/backward:
- `launch` (training thread): enqueue the device-to-host copies on a dedicated CUDA stream
  after the work already queued (the optimizer step that produced the state), and record an
  event. Training goes on at once.
- `copy_host` (background thread): copy the CPU tensors (CPU-only runs: all of them).
Before the next optimizer step the loop waits for the host half and makes its own stream wait
for the event (`release`): the GPU orders the optimizer after the copy, the host never blocks
on it. The writer thread calls `wait_device` (event.synchronize) before reading the buffers.
The caller keeps at most one save in flight, so a buffer is never overwritten while written.

Optional device snapshot (`device_snapshot=True`: spec.checkpoint.deviceSnapshot, or env
`FT_CHECKPOINT_DEVICE_SNAPSHOT=1` as an override, dcp_checkpointer.device_snapshot): the
state is first copied device-to-device into a second flat buffer on the GPU (HBM bandwidth:
milliseconds), and the optimizer only waits for that; the device-to-host copy of the snapshot
then runs on over the following steps. It costs one more copy of the checkpoint state in GPU
memory, which the planner counts when the spec turns it on (planner/checkpoint_memory.py; the
env override is not planned for): off by default.

DTensor (FSDP2) entries are staged as their local shard and handed to DCP as DTensors with
the same spec over the host buffer, so the checkpoint keeps its sharding metadata.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

log = logging.getLogger(__name__)

ALIGN_BYTES = 64  # every tensor starts at a 64-byte boundary of the flat buffer


@dataclass(frozen=True)
class _Slot:
    """Where one tensor leaf of the state dict lives in the flat buffer."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * torch.empty((), dtype=dtype).element_size()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _leaves(obj: Any) -> list[torch.Tensor]:
    """Tensor leaves of a nested dict/list/tuple, in a stable order (dict insertion order)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _leaves(v)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in _leaves(v)]
    return []


def _rebuild(obj: Any, take: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """The same structure with every tensor replaced by `take(tensor)` (same order as
    `_leaves`) and every other leaf deep-copied (it may change while the write runs)."""
    if isinstance(obj, torch.Tensor):
        return take(obj)
    if isinstance(obj, dict):
        return {k: _rebuild(v, take) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rebuild(v, take) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_rebuild(v, take) for v in obj)
    return copy.deepcopy(obj)


@dataclass
class StagedState:
    """One save's staged copy. `state_dict` is valid once `copy_host` ran and `wait_device`
    returned; the live tensors may change once `release` ran."""

    state_dict: dict[str, Any]
    _host_copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    _event: Any = None  # torch.cuda.Event of the device copies, None without any
    _device: torch.device | None = None
    _release_event: Any = None  # the live tensors may change after it (default: `_event`)

    def copy_host(self) -> None:
        for dst, src in self._host_copies:
            dst.copy_(src)
        self._host_copies = []

    def wait_device(self) -> None:
        if self._event is not None:
            self._event.synchronize()

    def release(self) -> None:
        """Order the current stream's next work (the optimizer step) after the copies."""
        event = self._release_event or self._event
        if event is not None:
            torch.cuda.current_stream(self._device).wait_event(event)


class HostStaging:
    """Owns the host buffer; `allocations` counts buffer allocations (tests check reuse)."""

    def __init__(self, device: torch.device, *, device_snapshot: bool = False) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.device_snapshot = device_snapshot and self.cuda
        self._snapshot: torch.Tensor | None = None
        self.allocations = 0
        self._buffer: torch.Tensor | None = None
        self._registered = False
        self._layout: tuple[_Slot, ...] = ()
        self._stream: Any = torch.cuda.Stream(device) if self.cuda else None

    # ---- buffer -------------------------------------------------------------------------------

    @staticmethod
    def layout_of(state_dict: dict[str, Any]) -> tuple[_Slot, ...]:
        slots, offset = [], 0
        for t in _leaves(state_dict):
            local = _local(t)
            shape = tuple(local.shape)
            slots.append(_Slot(offset, local.dtype, shape))
            size = _nbytes(shape, local.dtype)
            offset += (size + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES
        return tuple(slots)

    def reserve(self, state_dict: dict[str, Any]) -> None:
        """Allocate the buffer for this layout unless the current one already fits it.
        Call only while no staged state is being written (the caller's one-in-flight rule)."""
        layout = self.layout_of(state_dict)
        if self._buffer is not None and layout == self._layout:
            return
        last = layout[-1] if layout else None
        nbytes = last.offset + _nbytes(last.shape, last.dtype) if last else 0
        self._free()
        self._buffer = self._allocate(max(nbytes, 1))
        if self.device_snapshot:
            self._snapshot = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)
        self._layout = layout
        self.allocations += 1
        log.info(
            "checkpoint staging: %.2f GB of %s host memory for %d tensors",
            nbytes / 1e9,
            "pinned" if self.cuda else "pageable",
            len(layout),
        )

    def _allocate(self, nbytes: int) -> torch.Tensor:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        if not self.cuda:
            return buf
        # cudaHostRegister pins exactly these pages; pin_memory=True goes through the caching
        # host allocator, which rounds every block up to a power of two (up to 2x the memory).
        err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0)
        if int(err) == 0:
            self._registered = True
            return buf
        log.warning("cudaHostRegister failed (%s): pinning through the caching allocator", err)
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def _free(self) -> None:
        if self._buffer is not None and self._registered:
            torch.cuda.cudart().cudaHostUnregister(self._buffer.data_ptr())
        self._buffer, self._registered, self._layout = None, False, ()
        self._snapshot = None

    def close(self) -> None:
        self._free()

    # ---- staging ------------------------------------------------------------------------------

    def _view(self, slot: _Slot, buffer: torch.Tensor | None = None) -> torch.Tensor:
        buffer = self._buffer if buffer is None else buffer
        assert buffer is not None
        size = _nbytes(slot.shape, slot.dtype)
        return buffer[slot.offset : slot.offset + size].view(slot.dtype).view(slot.shape)

    def launch(self, state_dict: dict[str, Any]) -> StagedState:
        """Stage `state_dict` into the buffer: device copies enqueued now (non-blocking),
        host copies deferred to `StagedState.copy_host`. Returns the staged state dict."""
        self.reserve(state_dict)
        slots = iter(self._layout)
        host_copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        device_copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        snapshot_copies: list[tuple[torch.Tensor, torch.Tensor]] = []

        def take(t: torch.Tensor) -> torch.Tensor:
            src = _local(t).detach()
            slot = next(slots)
            dst = self._view(slot)
            if src.device.type != "cuda":
                host_copies.append((dst, src))
            elif self._snapshot is not None:
                snap = self._view(slot, self._snapshot)
                snapshot_copies.append((snap, src))
                device_copies.append((dst, snap))
            else:
                device_copies.append((dst, src))
            if isinstance(t, DTensor):
                # Same spec (mesh, placements, global shape) over the host shard: DCP writes
                # it with the sharding metadata a resharded load needs.
                return DTensor.__new__(DTensor, dst, t._spec, requires_grad=False)  # type: ignore[call-arg]
            return dst

        staged_sd = _rebuild(state_dict, take)
        event = release = None
        if device_copies:
            stream = self._stream
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for snap, src in snapshot_copies:
                    snap.copy_(src, non_blocking=True)
                    src.record_stream(stream)
                if snapshot_copies:
                    release = torch.cuda.Event()
                    release.record(stream)
                for dst, src in device_copies:
                    dst.copy_(src, non_blocking=True)
                    # The caching allocator must not hand src's memory to another tensor
                    # before the side stream has read it (matters for temporaries).
                    src.record_stream(stream)
            event = torch.cuda.Event()
            event.record(stream)
        return StagedState(staged_sd, host_copies, event, self.device, release)
