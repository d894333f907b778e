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
"""

from __future__ import annotations

from finetune_operator.planner.architecture import ModelShape

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
) -> int:
    """Load peak of a DeepSpeed ZeRO `stage` rank (see the module docstring);
    `resident_parameter_bytes`: the breakdown's `parameters`; `partition_dtype_bytes`: the
    bytes per element of the training precision (the partitions' dtype)."""
    if stage == 3:
        module = largest_module_parameters(m)
        return resident_parameter_bytes + module * (partition_dtype_bytes + FP32)
    return load_peak_bytes(m, resident_parameter_bytes)
