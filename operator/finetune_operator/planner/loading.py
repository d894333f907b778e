"""The load-time peak per GPU: what remains of loading once the trainer builds on the meta
device, shards, then materialises (finetune_trainer.materialize / pretrained).

Each rank allocates its parameter shards in their training dtype (the same bytes the step's
breakdown counts as `parameters`; none on the GPU with CPU offload, which materialises on the
host) and fills them one module at a time from a full fp32 temporary (random init) or a
slice read from safetensors (never larger). So the peak is the resident shards plus the
largest module's parameters in fp32; nothing else of the model is ever whole on a rank. It is
reported as `Plan.loadPeakBytes` and always lies below the step's own peak (which holds those
shards plus gradients, optimizer states, a gathered layer and activations): a test keeps it so.

DeepSpeed (finetune_trainer.deepspeed_loading, `zero_load_peak_bytes`):
- ZeRO-3 builds under `deepspeed.zero.Init`: the partitions in the partition dtype (the
  breakdown's `parameters`; none on the GPU with parameter offload), then one module at a
  time gathered whole in that dtype on every rank beside its fp32 init (rank 0, the
  modifier). A tied head adds its dropped partition (1/N of the head; not counted).
- ZeRO-1/2 keep a full replica, built directly in the engine's parameter dtype (the
  breakdown's `parameters`), plus one module's fp32 init: the same rule as DDP's.

Pretrained weights on an object store, read by a replicated rank (DDP, ZeRO-1/2) of a job of
more than one rank (finetune_trainer.replica_loading, `striped_read_bytes`): each rank reads
a stripe of every tensor (1/N of its rows) in DCP loads of at most STRIPE_BYTES of stripes,
then gathers each tensor whole into the replica in place (its own rows copied into the
parameter, the others' received straight into it). Beside the replica it holds one load's
stripes plus, during the load, the raw bytes of the ranged GETs in flight (at most
READ_BATCH_BYTES, and at most those stripes' bytes as stored: fp32 files assumed, the widest
the trainer reads into a float replica; each slice's bytes go straight into its stripe,
finetune_trainer.slice_sink), plus the S3 client's join of one GET's blocks (at most
READ_PART_BYTES); the gathers allocate nothing. At 256 + 256 + 64 MiB that is up to 576 MiB
on top of the replica of a large model; the figure counted before (the replica plus one
module's fp32 init) left it out.

Where those buffers live: the stripes are DTensors on the parameters' device; the raw bytes
of the GETs and the client's join are host memory (Python bytes, copied into the stripes,
finetune_trainer.slice_sink), on a GPU job as on a CPU one. Every DCP load of object-store
weights (finetune_trainer.pretrained's ranged reader: FSDP2 shards, one rank's replica,
LoRA's base) holds them too. So on a GPU `Plan.loadPeakBytes` counts the stripes only and
the search counts the reads in host RAM (`ranged_read_bytes`); on CPU, one memory, the
striped figure keeps them.

A DeepSpeed resume (finetune_trainer.deepspeed_resume, `zero_resume_host_bytes`) reads the
checkpoint's fp32 tensors into host memory one group at a time: at most
`resume_chunk_budget` (1 GiB, or the largest trainable tensor), never more than the whole
checkpoint; the search adds it to the host RAM a DeepSpeed rank needs beside its offloaded
states. On the device it adds one tensor's copies, below the step's own peak. (It read every
tensor at once before: 12 bytes per trainable parameter on every rank.)
"""

from __future__ import annotations

import math

from finetune_operator.api.deepspeed_config import resume_chunk_budget
from finetune_operator.api.weights_reads import READ_BATCH_BYTES, READ_PART_BYTES, STRIPE_BYTES
from finetune_operator.planner.architecture import ModelShape
from finetune_operator.planner.configuration import TrainingShape
from finetune_operator.planner.lora import adapter_parameters

FP32 = 4


def largest_module_parameters(m: ModelShape) -> int:
    """Parameters of the largest module that owns them directly: the embedding, the untied
    head, one linear of a layer, or a MoE layer's experts when they are stacked tensors."""
    candidates = [m.embedding, m.lm_head, m.largest_linear]
    if m.experts:
        candidates.append(3 * m.arch.hidden_size * m.expert_inter * m.experts)
    return max(candidates)


def load_peak_bytes(m: ModelShape, resident_parameter_bytes: int) -> int:
    return resident_parameter_bytes + largest_module_parameters(m) * FP32


def zero_load_peak_bytes(
    m: ModelShape,
    stage: int,
    resident_parameter_bytes: int,
    *,
    partition_dtype_bytes: int,
    striped_world: int = 1,
    reads_on_host: bool = False,
) -> int:
    """Load peak of a DeepSpeed ZeRO `stage` rank (see the module docstring);
    `resident_parameter_bytes`: the breakdown's `parameters`; `partition_dtype_bytes`: the
    bytes per element of the training precision (the partitions' dtype); `striped_world`:
    the ranks reading the weights in stripes (1: not striped)."""
    if stage == 3:
        module = largest_module_parameters(m)
        return resident_parameter_bytes + module * (partition_dtype_bytes + FP32)
    return replicated_load_peak_bytes(
        m,
        resident_parameter_bytes,
        element_bytes=partition_dtype_bytes,
        striped_world=striped_world,
        reads_on_host=reads_on_host,
    )


def ranged_read_bytes(stored_bytes: int) -> int:
    """Host bytes of a DCP load of object-store weights reading `stored_bytes` (what the rank
    reads, as stored): the raw bytes of the ranged GETs in flight (at most READ_BATCH_BYTES)
    plus the S3 client's join of one part (at most READ_PART_BYTES)."""
    raw = min(READ_BATCH_BYTES, stored_bytes)
    return raw + min(READ_PART_BYTES, raw)


def weights_read_host_bytes(
    m: ModelShape, *, shard_size: int, striped_world: int, element_bytes: int
) -> int:
    """Host bytes a rank's DCP load of object-store weights holds (ranged_read_bytes) for
    what it reads as stored (fp32 files assumed, the widest): one load's stripes when
    `striped_world` ranks read a replica in stripes (of `element_bytes` elements), else its
    shard over `shard_size` ranks (1: the whole model)."""
    if striped_world > 1:
        largest = largest_module_parameters(m) * element_bytes
        group = stripe_group_bytes(m.total * element_bytes, largest, striped_world)
        return ranged_read_bytes(group * FP32 // element_bytes)
    return ranged_read_bytes(math.ceil(m.total / max(1, shard_size)) * FP32)


def stripe_group_bytes(
    replica_bytes: int, largest_tensor_bytes: int, world: int, *, stripe_bytes: int = STRIPE_BYTES
) -> int:
    """One DCP load's stripes on a replicated rank reading in stripes over `world` ranks: at
    most `stripe_bytes`, or one larger tensor's stripe alone, never more than its share."""
    return min(
        max(stripe_bytes, math.ceil(largest_tensor_bytes / world)),
        math.ceil(replica_bytes / world),
    )


def striped_read_bytes(
    replica_bytes: int,
    largest_tensor_bytes: int,
    world: int,
    *,
    element_bytes: int,
    stripe_bytes: int = STRIPE_BYTES,
    read_batch_bytes: int = READ_BATCH_BYTES,
    read_part_bytes: int = READ_PART_BYTES,
) -> int:
    """Bytes a replicated rank holds beside its replica (`replica_bytes`, of elements of
    `element_bytes`) while reading it in stripes over `world` ranks (see the module
    docstring): one DCP load's stripes (at most `stripe_bytes`, or one larger tensor's stripe
    alone), the raw reads in flight, and the client's join of one of them (one part). Nothing
    on one rank: it reads whole, as from a volume.

    Exactly one load's stripes: the gathers hand the collectives only views of the replica
    (finetune_trainer.replica_loading.gather_rows), so nothing the backend keeps past a
    collective's wait outlives the load. (Through a gather buffer, gloo's worker thread kept
    the last one alive beside the next load's stripes on a busy host: 137,933 bytes beside the
    replica in tests/trainer/test_zero3_loading.py in about 1 run in 5, 99,912 in the others.)
    """
    if world <= 1:
        return 0
    group = stripe_group_bytes(
        replica_bytes, largest_tensor_bytes, world, stripe_bytes=stripe_bytes
    )
    raw = min(read_batch_bytes, group * FP32 // element_bytes)
    return group + raw + min(read_part_bytes, raw)


def replicated_load_peak_bytes(
    m: ModelShape,
    replica_bytes: int,
    *,
    element_bytes: int,
    striped_world: int,
    reads_on_host: bool = False,
) -> int:
    """Load peak of a replicated rank (DDP, ZeRO-1/2): one module's fp32 init beside the
    replica, or, read in stripes from an object store by `striped_world` ranks (1: not
    striped), the stripes' bytes if more; with `reads_on_host` (a GPU) the stripes alone,
    the reads being host memory (ranged_read_bytes)."""
    largest = largest_module_parameters(m)
    if reads_on_host:
        striped = (
            stripe_group_bytes(replica_bytes, largest * element_bytes, striped_world)
            if striped_world > 1
            else 0
        )
    else:
        striped = striped_read_bytes(
            replica_bytes, largest * element_bytes, striped_world, element_bytes=element_bytes
        )
    return replica_bytes + max(largest * FP32, striped)


# Bytes a checkpoint holds per trainable parameter: the fp32 master copy plus the optimizer
# states the trainer saves (AdamW: two fp32 moments; 8-bit AdamW: ~1 byte each; SGD: one).
CHECKPOINT_BYTES_PER_PARAMETER = {"adamw": 4 + 8, "adamw8bit": 4 + 2, "sgd": 4 + 4}


def checkpoint_bytes(m: ModelShape, shape: TrainingShape) -> int:
    """One checkpoint, all ranks together (what the elastic timeouts scale with)."""
    trainable = (
        m.total
        if shape.method == "full"
        else adapter_parameters(m, shape.lora_rank, shape.lora_targets)
    )
    return int(trainable * CHECKPOINT_BYTES_PER_PARAMETER.get(shape.optimizer, 12))


def zero_resume_host_bytes(m: ModelShape, shape: TrainingShape) -> int:
    """Host bytes a DeepSpeed rank holds at once while resuming: one group of the
    checkpoint's fp32 tensors (see the module docstring)."""
    largest = largest_module_parameters(m) * FP32 if shape.method == "full" else 0
    return min(checkpoint_bytes(m, shape), resume_chunk_budget(largest))
