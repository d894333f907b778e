"""The host memory rank 0's export holds at the end of training (`spec.output`), pure.

What the trainer does (finetune_trainer.export; torch 2.13, transformers 5, safetensors 0.8):

- every rank gathers the model's full state dict; rank 0 receives all of it on its host. The
  torch path (`get_model_state_dict(full_state_dict, cpu_offload)`) copies each entry to the
  CPU, a tied embedding under both of its names (no memo of shared tensors); on a CPU device a
  replicated (DDP) model's entries are its parameters themselves, nothing copied. DeepSpeed's
  gather (deepspeed_checkpoint.gather_module_state_dict) copies each parameter once: the
  trainable ones as their fp32 masters, frozen ones in their dtype.
- what is gathered: the whole model for every method, trainable parameters as the rank holds
  them (fp32 masters under mixed precision: a mixed-precision full fine-tune exports fp32),
  and for LoRA/QLoRA the frozen base beside the adapters, even when only the adapter is
  written (peft picks it out of the gathered dict).
- the write adds no copy: the export model is built on the meta device and the gathered
  tensors assigned to it, and safetensors 0.8's `save_file` writes each tensor from its
  pointer. `mergeLora` clones entries shared with the live model (a CPU device's DDP: all of
  them) and merging computes one fp32 delta per adapted weight at a time.
- an s3:// output is staged on the pod's disk, and uploaded after the gathered dict is freed.

The staging buffer of async saves is freed before the export (trainer.py), so it is one more
phase after the saves, never beside them.
"""

from __future__ import annotations

from finetune_operator.planner.activations import FP32
from finetune_operator.planner.architecture import ModelShape
from finetune_operator.planner.configuration import PRECISION_BYTES, TrainingShape
from finetune_operator.planner.loading import largest_module_parameters
from finetune_operator.planner.lora import adapter_parameters, qlora_base_bytes


def gathered_state_bytes(m: ModelShape, shape: TrainingShape, *, deepspeed: bool) -> int:
    """Bytes of the full state dict rank 0 gathers (the module docstring)."""
    e = PRECISION_BYTES[shape.precision]
    mixed = e != FP32 and shape.master_weights is not False
    if shape.method == "full":
        # DeepSpeed exports its fp32 masters; the torch path the parameters as FSDP2/DDP
        # hold them (fp32 masters under mixed precision, else the precision's dtype).
        trainable_bytes = m.total * (FP32 if deepspeed or mixed else e)
        frozen_bytes, tied_e = 0, FP32 if mixed else e
    else:
        adapters = adapter_parameters(m, shape.lora_rank, shape.lora_targets)
        # PEFT's fp32 adapters (DeepSpeed's fp32 masters of them: fp32 either way).
        trainable_bytes = adapters * FP32
        frozen_bytes = qlora_base_bytes(m, e) if shape.method == "qlora" else m.total * e
        tied_e = e
    # The torch path gathers a tied embedding once per name; DeepSpeed's gather dedupes it.
    tied = m.embedding * tied_e if not m.lm_head and not deepspeed else 0
    return trainable_bytes + frozen_bytes + tied


def export_host_bytes(
    m: ModelShape,
    shape: TrainingShape,
    *,
    enabled: bool,
    deepspeed: bool,
    merge: bool,
    copied: bool,
) -> int:
    """Host bytes rank 0's export adds to what training keeps resident. `enabled`:
    `spec.output.uri` is set; `merge`: `mergeLora` on a LoRA/QLoRA job; `copied`: the gather
    copies the parameters (False only for a replicated torch model on a CPU device, whose
    gathered entries are the parameters themselves; a merge then clones them, so it holds a
    copy all the same)."""
    if not enabled or not (copied or merge):
        return 0
    # A merge's transient: one adapted weight's fp32 delta (the largest bounds it).
    delta = largest_module_parameters(m) * FP32 if merge else 0
    return gathered_state_bytes(m, shape, deepspeed=deepspeed) + delta
