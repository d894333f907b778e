"""The memory a checkpoint save holds per rank (pure), beside what training holds
(model_states.checkpoint_state_bytes: the state a save captures, `S` below).

What the trainer does (finetune_trainer.dcp_checkpointer, staging, deepspeed_checkpoint) and
what that holds, with torch 2.13's DCP writers:

- async (`checkpoint.async`, the default): `staging.HostStaging` keeps one flat host buffer of
  S (pinned on CUDA) from the first step until the final save is committed (the trainer frees
  it before the export gathers the model on rank 0's host). The commit thread then
  writes it with `dcp.save`, whose FileSystemWriter copies every tensor that is a view of a
  larger storage (each staged tensor is a view of the flat buffer) and keeps every tensor it
  wrote to a file until that file is closed (its `tensor_dict`); a rank writes one file, so
  while it writes, a second copy of what it writes: S where the state is sharded (FSDP2,
  DeepSpeed's chunks), about S/N for DDP's replicated state, which DCP's save planner
  deduplicates over the N ranks, balancing the bytes (dedup_save_plans). That write runs
  beside the following training steps.
- sync (`async: false`): nothing is staged. On CUDA the writer copies each device tensor to
  the host and keeps them all until the file is closed: what it writes (as above), less what
  offload already keeps on the host (written as it is), while the loop waits in the save
  (between steps: no activations). On a CPU device the tensors are written as they are,
  nothing copied. DeepSpeed's capture is always a fresh host copy of the rank's chunks
  (deepspeed_fragments.local_chunk): S during a sync save; during an async one it lives
  until the staging copy is made, and the staging buffer plus the writer's copies is 2 S
  either way.
- the device snapshot (`checkpoint.deviceSnapshot`, CUDA, async only): one more S, in GPU
  memory, from the first step until the final save is committed.
- an s3:// root: DCP's writer torch.saves each tensor into s3fs's file object in one write,
  which s3fs buffers whole (with what is left of its 50 MiB default_block_size) and then
  uploads as a part read out of that buffer (a copy), which the HTTP client copies once more
  while it sends it: up to three times the largest tensor the rank writes plus a block, one
  tensor at a time (measured through moto's server: tests/trainer/test_s3_write_memory.py).

Where it lives: on CUDA all of it is host memory except the snapshot; on a CPU device the
device is the host and it all comes out of the process's one budget.
"""

from __future__ import annotations

from dataclasses import dataclass

from finetune_operator.planner.hardware import MIB

# s3fs.S3FileSystem.default_block_size: an open object uploads a part once its buffer holds this.
S3_WRITE_BLOCK_BYTES = 50 * MIB


def object_store_write_bytes(largest_tensor: int) -> int:
    """Host bytes s3fs holds while DCP writes a rank's file (the module docstring): the
    buffer (less than a block left over, plus the tensor written whole), the part copied out
    of it, and the HTTP client's copy of that part."""
    return 3 * (S3_WRITE_BLOCK_BYTES + largest_tensor)


@dataclass(frozen=True)
class SaveMemory:
    """Bytes one rank holds for checkpoint saves, by where and when."""

    staging: int = 0  # host, held from the first step on (async)
    writing: int = 0  # host, only while a save is written
    during_step: bool = False  # the write overlaps training steps (async) or waits between them
    device_snapshot: int = 0  # GPU memory, held from the first step on

    @property
    def host_peak(self) -> int:
        return self.staging + self.writing


def save_memory(
    state_bytes: int,
    *,
    on_host: int = 0,
    replicas: int = 1,
    largest_tensor: int = 0,
    enabled: bool,
    async_: bool,
    cuda: bool,
    deepspeed: bool,
    object_store: bool,
    device_snapshot: bool,
) -> SaveMemory:
    """What a save holds per rank (see the module docstring); `state_bytes`: S; `on_host`:
    the part of it a GPU job's offload keeps in host memory; `replicas`: the ranks holding
    the same state (DDP: the world size), over which DCP spreads its writing;
    `largest_tensor`: the bytes of the largest tensor in it (an s3:// root buffers it)."""
    if not enabled:
        return SaveMemory()
    upload = object_store_write_bytes(min(largest_tensor, state_bytes)) if object_store else 0
    written = -(-state_bytes // max(1, replicas))
    if async_:
        return SaveMemory(
            staging=state_bytes,
            writing=written + upload,
            during_step=True,
            device_snapshot=state_bytes if cuda and device_snapshot else 0,
        )
    copied = state_bytes if deepspeed else max(0, written - on_host) if cuda else 0
    return SaveMemory(writing=copied + upload)
