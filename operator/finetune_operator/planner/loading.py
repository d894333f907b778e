"""The load-time peak per GPU: what remains of loading once the trainer builds on the meta
device, shards, then materialises (finetune_trainer.materialize / pretrained).

Each rank allocates its parameter shards in their training dtype (the same bytes the step's
breakdown counts as `parameters`; none on the GPU with CPU offload, which materialises on the
host) and fills them one module at a time from a full fp32 temporary (random init) or a
slice read from safetensors (never larger). So the peak is the resident shards plus the
largest module's parameters in fp32; nothing else of the model is ever whole on a rank. It is
reported as `Plan.loadPeakBytes` and always lies below the step's own peak (which holds those
shards plus gradients, optimizer states, a gathered layer and activations): a test keeps it so.
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
