"""Per-GPU memory of one fully specified training configuration (pure, no torch): the
resident model states (model_states.py) and the step's transient peak, walked phase by phase.

`estimate_memory(model, shape, candidate)` is the contract the tracing accuracy matrix checks:
it returns the resident model states (parameters, gradients, optimizer), and the step's peak of
allocated tensor memory found by walking the phases of a steady-state step (optimizer states
already exist):

  loss      end of forward: every saved activation + logits, fp32 log-softmax and the two
            fp32 b*s*V gradients of the loss backward (the peak of long-vocab models)
  backward  first decoder layer in backward: activations (checkpointing: layer inputs + one
            recomputed layer) + that layer's gradient temporaries + gathered units/buckets
  optimizer optimizer step: all states + gradients + the optimizer's temporaries

Mixed precision (bf16/fp16 with fp32 master weights) is split as the textbooks do for DDP
(2 B params + 2 B grads + 12 B master/m/v per parameter), as FSDP2 really allocates for the
fsdp-* strategies (sharded fp32 params are the masters: 4 + 4 + 8 B), and as DeepSpeed's
engine really allocates for zero1/2/3 (planner/zero.py: an fp32 gradient partition at the step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The bucket size the generated DeepSpeed config sets (reduce/allgather_bucket_size): one
# constant, so the planner counts what the engine is told to allocate.
from finetune_operator.api.deepspeed_config import ZERO_BUCKET_ELEMENTS
from finetune_operator.api.plan import MemoryBreakdown
from finetune_operator.planner.activations import FP32, activation_model
from finetune_operator.planner.architecture import ModelShape
from finetune_operator.planner.configuration import PRECISION_BYTES, Candidate, TrainingShape
from finetune_operator.planner.hardware import (
    CUBLAS_WORKSPACE_BYTES,
    CUDA_CONTEXT_BYTES,
    MIB,
    NCCL_BUFFER_BYTES,
    runtime_host_bytes,
)
from finetune_operator.planner.lora import adapter_parameters, qlora_base_bytes
from finetune_operator.planner.model_states import ModelStates, model_states

# PyTorch's caching allocator (default configuration: the trainer leaves
# PYTORCH_CUDA_ALLOC_CONF alone) rounds blocks (512 B small / 2 MiB large), keeps freed blocks
# cached and split, and keeps one pool per stream: a block freed on one stream is never reused
# by another. Measured on an H100 (bench/gpu.py, bench/results/gpu-h100.md): the compute
# stream's pool reserves 1.07-1.14x its own allocated peak (DDP and FSDP, full and LoRA, with
# and without checkpointing; 1.105 leaves every eager or checkpointed configuration within
# +-3%), and FSDP2's reduce-scatter stream holds a second pool as large as the sharded fp32
# gradients it produces (11.2 GB beside 63.8 GB for an 8B-class full fine-tune), idle while
# the next step's forward allocates on the compute stream.
ALLOCATOR_FRAGMENTATION = 1.105
# torch DDP bucket_cap_mb default (25 MiB); with gradient_as_bucket_view=True the grads live in
# the buckets, so the extra is one bucket in flight for NCCL.
DDP_BUCKET_BYTES = 25 * MIB


@dataclass(frozen=True)
class MemoryEstimate:
    breakdown: MemoryBreakdown
    peak_phase: str  # loss | backward | optimizer
    host_bytes: int  # offloaded states per process (CPU RAM)
    phases: dict[str, int] = field(default_factory=dict)


def _gathered_units(m: ModelShape, shape: TrainingShape, cand: Candidate) -> tuple[int, int]:
    """(loss-phase, backward-phase) bytes of all-gathered parameters and unsharded grads.

    Wrapping as the trainer does (finetune_trainer.parallelize.apply_fsdp): each decoder layer
    is a unit, the root (embedding, final norm, head: both matrices when untied) is one more
    unit that is never resharded after forward, so it stays unsharded from forward through
    backward. At the start of backward the next layer is prefetched (FSDP2 implicit backward
    prefetch: one all-gather buffer); in a layer's backward, its params, the prefetched next
    layer and its unsharded gradient. Full fine-tuning also holds the root's unsharded head
    gradient until the root's reduce-scatter at the very end of backward.
    """
    e = PRECISION_BYTES[shape.precision]
    layer = m.layer * e
    head_grad = (m.lm_head or m.embedding) * e if shape.method == "full" else 0
    root = (m.embedding + m.lm_head + m.arch.hidden_size) * e
    if shape.method == "qlora":
        layer = int(qlora_base_bytes(m, e) / max(1, m.total) * m.layer)
    row = cand.row
    if row.shards_params and not row.reshard_after_forward:
        # reshard_after_forward=False: every unit stays unsharded from forward to backward.
        full = m.total * e
        return full, full + layer + head_grad
    if row.shards_params:
        grad_unit = layer if shape.method == "full" else 0
        return root + layer, root + head_grad + 2 * layer + grad_unit
    return 0, 0


def _backward_tail(m: ModelShape, shape: TrainingShape, cand: Candidate) -> int:
    """FSDP full fine-tuning at the end of backward, every sharded gradient already made and
    the activations gone: the root unit (embedding, head) still unsharded with its unsharded
    head and embedding gradients, the first layer's gathered parameters, its prefetch buffer
    and unsharded gradient, and that gradient's fp32 copy for the reduce-scatter. It has the
    optimizer phase's resident states, so it is counted there (with fused AdamW it is that
    phase's only buffer). Traced (FSDPMemTracker, 8 ranks, s=4096, checkpointing): Llama-2-7B's
    peak of the step (here -0.9%), below Llama-3.1-8B's loss-phase peak (+1.6% if it were)."""
    if shape.method != "full" or not cand.row.torch_fsdp or cand.offloads:
        return 0
    e = PRECISION_BYTES[shape.precision]
    root = (m.embedding + m.lm_head + m.arch.hidden_size) * e
    root_grads = (m.embedding + m.lm_head) * e
    return root + root_grads + 3 * m.layer * e + m.layer * FP32


def _comm_buffer(m: ModelShape, shape: TrainingShape, cand: Candidate, trainable: int) -> int:
    """Gradient bucket in flight (DDP) or DeepSpeed's reduce bucket."""
    if cand.world_size == 1:
        return 0
    e = PRECISION_BYTES[shape.precision]
    if cand.row.backend == "deepspeed":
        return min(ZERO_BUCKET_ELEMENTS, trainable) * e
    if cand.row.replicated:
        return min(DDP_BUCKET_BYTES, trainable * e)
    return 0


def _loss_buffers(m: ModelShape, tokens: int, e: int) -> tuple[int, int]:
    """(loss-phase, held-through-backward) bytes of logits and cross-entropy tensors.

    HF's ForCausalLMLoss upcasts logits to fp32 (`logits.float()`, a no-op in fp32);
    log_softmax saves its fp32 output; its backward holds the fp32 NLL gradient and its own
    fp32 output at once. The e-byte logits stay referenced by the model output.
    """
    bsv = tokens * m.arch.vocab_size
    held = e * bsv * (2 if m.family.logit_softcap else 0)  # softcap: x/c and tanh saved
    return held + 3 * FP32 * bsv, held


def _optimizer_temp(shape: TrainingShape, cand: Candidate, st: ModelStates) -> int:
    """The trainer's AdamW is torch's fused kernel on CUDA (no temporaries; on an H100 the
    measured peak of a 3B full fine-tune fell from the optimizer phase to the loss phase);
    elsewhere torch's multi-tensor path allocates sqrt(v) (one state-sized tensor) during the
    step. DeepSpeed's fused Adam and CPU Adam (offload) allocate nothing on the GPU."""
    if cand.row.backend == "deepspeed" or cand.offloads or shape.optimizer != "adamw":
        return 0
    if cand.cuda:
        return 0
    return st.optim // 2 if st.optim else 0


def _compute_regime(shape: TrainingShape, cand: Candidate) -> tuple[bool, str]:
    """(autocast, LoRA compute) of what the GPU runs for this strategy and precision.

    autocast: DDP with mixed precision keeps an fp32 model and runs forward under
    torch.autocast (finetune_trainer: trainer.precision_context), so the residual stream is
    fp32. FSDP2 casts parameters to bf16 itself (MixedPrecisionPolicy), DeepSpeed keeps a bf16
    module: no autocast there. LoRA compute: see activations.lora_bytes_per_token.
    """
    lowp = PRECISION_BYTES[shape.precision] != FP32
    mixed = lowp and shape.master_weights is not False
    full = shape.method == "full"
    row = cand.row
    if row.backend == "fsdp" and row.replicated and lowp:
        return full and mixed, "autocast"
    if row.torch_fsdp and mixed:
        return False, "param"
    return False, "fp32"


def _autocast_weight_copies(m: ModelShape, shape: TrainingShape) -> tuple[int, int, int]:
    """(forward end, loss, backward) bytes of autocast's bf16 copies of the fp32 weights.

    torch.autocast casts each fp32 weight once per forward and caches the copy
    (aten/src/ATen/autocast_mode.cpp `cached_cast`: leaf fp32 tensors that require grad); the
    matmul saves it for backward, so every linear's copy lives until that linear's backward.
    The cache itself is dropped when the outermost autocast exits (end of forward). With
    activation checkpointing the decoder layers save nothing in forward: after autocast exits
    only the head's copy is held, and recompute re-creates one layer's.
    """
    e = PRECISION_BYTES[shape.precision]
    layers = m.layer_linear * m.arch.num_hidden_layers * e
    head = (m.lm_head or m.embedding) * e
    one_layer = m.layer_linear * e
    if shape.checkpointing:
        return layers + head, head, one_layer
    return layers + head, layers + head, layers


def compiles_blocks(shape: TrainingShape, cand: Candidate) -> bool:
    """Whether the trainer compiles the decoder blocks for this configuration: asked for,
    on CUDA, on the torch backend (DDP and FSDP2; DeepSpeed's engine runs them eager). The
    plan carries the answer (Plan.compiled_blocks) and the trainer follows it."""
    return shape.compile_blocks and cand.cuda and cand.row.backend != "deepspeed"


def _reserved(phases: dict[str, int], st: ModelStates, cand: Candidate) -> int:
    """What the caching allocator reserves: the compute stream's pool (its own peak, which in
    the optimizer phase excludes FSDP's gradients, times the fragmentation factor) plus, for
    FSDP on CUDA, the reduce-scatter stream's pool holding the sharded gradients."""
    side = st.grads if cand.cuda and cand.row.torch_fsdp else 0
    compute = max(v - (side if k == "optimizer" else 0) for k, v in phases.items())
    return int(compute * ALLOCATOR_FRAGMENTATION) + side


def estimate_memory(m: ModelShape, shape: TrainingShape, cand: Candidate) -> MemoryEstimate:
    """Per-GPU (per-process) memory of one candidate configuration.

    Inputs: `m` from `architecture.shape_of`/`resolve_model`; `shape` is what one rank
    computes (micro-batch b, sequence s, precision, optimizer, method, checkpointing,
    gradient accumulation); `cand` is how states are placed (strategy, world size N, gpus
    per node, offload, CUDA or CPU). Returns the breakdown (parameters, gradients, optimizer
    are resident states; activations and buffers are their values at the peak phase; peak is
    the max over phases, reserved models the caching allocator (`_reserved`), total adds CUDA context
    and library workspaces on CUDA devices), the peak phase, the per-phase peaks and the
    bytes offloaded to host RAM.
    """
    e = PRECISION_BYTES[shape.precision]
    tokens = shape.micro_batch_size * shape.seq_len
    full = shape.method == "full"
    autocast, lora_compute = _compute_regime(shape, cand)
    # DDP in bf16/fp16 runs its forward under torch.autocast, full or LoRA (`autocast` above
    # is only whether the residual stream is fp32, which LoRA's frozen bf16 base is not).
    forward_under_autocast = lora_compute == "autocast"
    act = activation_model(
        m,
        tokens=tokens,
        seq=shape.seq_len,
        e=e,
        attention=shape.attention,
        lora_targets=() if full else shape.lora_targets,
        lora_rank=0 if full else shape.lora_rank,
        lora_dropout=shape.lora_dropout,
        lora_compute=lora_compute,
        autocast=autocast,
        # Under torch.autocast (DDP mixed precision) the H100 runs kept more than the
        # partitioner's saved set (bench/results/gpu-h100.md: -6.7% / -7.4% peak on two of
        # three DDP rows), so those keep the eager count, which over-predicts them.
        compiled=compiles_blocks(shape, cand) and not forward_under_autocast,
    )
    st = model_states(m, shape, cand)
    layers = m.arch.num_hidden_layers
    if shape.checkpointing:
        resident = layers * act.layer_input + act.head
        in_backward = resident + act.per_layer
    else:
        resident = in_backward = layers * act.per_layer + act.head
    copies = _autocast_weight_copies(m, shape) if autocast else (0, 0, 0)
    loss_buf, held = _loss_buffers(m, tokens, e)
    gather_loss, gather_bwd = _gathered_units(m, shape, cand)
    trainable = m.total if full else adapter_parameters(m, shape.lora_rank, shape.lora_targets)
    bucket = _comm_buffer(m, shape, cand, trainable)
    dequant = m.largest_linear * e if shape.method == "qlora" else 0
    # Torch FSDP frees sharded grads at zero_grad(set_to_none); DDP buckets and DeepSpeed
    # partitions persist. Under accumulation the grads exist through every micro-batch.
    grads_fwd = 0 if (cand.row.torch_fsdp and shape.grad_accumulation == 1) else st.grads
    grads_bwd, step_transient = grads_fwd, 0
    if st.zero is not None:
        grads_fwd, grads_bwd = st.zero.grads_forward, st.zero.grads_backward
        step_transient = st.zero.step_transient
    base = st.params + st.optim
    buffers = {
        # End of forward, inside the loss: e-byte logits, their fp32 upcast, log_softmax out.
        "forward": (e + 2 * FP32) * tokens * m.arch.vocab_size + gather_loss + copies[0],
        "loss": loss_buf + gather_loss + copies[1],
        "backward": held + act.backward_transient + gather_bwd + bucket + dequant + copies[2],
        "optimizer": max(
            _optimizer_temp(shape, cand, st)
            + (bucket if cand.row.backend == "deepspeed" else 0)
            + step_transient,
            _backward_tail(m, shape, cand),
        ),
    }
    acts = {"forward": resident, "loss": resident, "backward": in_backward, "optimizer": 0}
    grads = {"forward": grads_fwd, "loss": grads_fwd, "backward": grads_bwd, "optimizer": st.grads}
    phases = {k: base + grads[k] + acts[k] + buffers[k] for k in buffers}
    phase = max(phases, key=lambda k: phases[k])
    peak = phases[phase]
    reserved = _reserved(phases, st, cand)
    if cand.cuda:
        overhead = CUDA_CONTEXT_BYTES + CUBLAS_WORKSPACE_BYTES
        overhead += NCCL_BUFFER_BYTES if cand.world_size > 1 else 0
    else:
        # On CPU the device memory is the host's: the process's runtime shares it.
        overhead = runtime_host_bytes(cand.gpus_per_node)
    breakdown = MemoryBreakdown(
        parameters=st.params,
        gradients=st.grads,
        optimizer=st.optim,
        activations=acts[phase],
        buffers=buffers[phase],
        peak=peak,
        reserved=reserved,
        total=reserved + overhead,
    )
    return MemoryEstimate(breakdown, phase, st.host, phases)
