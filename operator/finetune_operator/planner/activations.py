"""Bytes saved for backward by one micro-batch of an HF decoder, read off the modeling code.

Per token of one decoder layer (e = bytes of the compute dtype; HF Llama/Qwen/Mistral code):
  RMSNorm        x.to(fp32) saved by pow/mul (4H; the input itself when e = 4) and the
                 normalised e-byte tensor saved by `weight * x` (eH)           -> (4 + e) H
                 + its output, saved by the linears that read it (one tensor) -> eH
  q, k           the rotated result (saved by SDPA); `q * cos`, `rotate_half(q) * sin` save
                 only cos/sin (they do not require grad)                     -> e (Dq + Dkv)
  v              saved by SDPA                                                  -> e Dkv
  SDPA           its output (e Dq) and the fp32 log-sum-exp (4 heads); eager instead keeps the
                 fp32 softmax and its e-byte copy (heads * s each) and repeat_kv'd k, v
  MLP (SwiGLU)   gate (SiLU input), act, up, act*up (down_proj input)           -> 4e I
  residual adds  save nothing; the hidden states between layers are not kept.
Checked against `saved_tensors_hooks` and MemTracker on tiny Llamas (real and fake tensors
alike, bf16, no mask): H 256, head_dim 64: 9752 B/token measured, 9752 modelled. An earlier form
counted q, k three times (3e(Dq + Dkv)) and omitted the norm outputs (2eH): the two nearly cancel
when Dq = H (Llama, Mistral: 0.5-2% high) but not for Qwen3 (head_dim 128 x 16 heads = 2H:
+8 KB/token/layer, +8.7% on the traced 28-layer LoRA row once the tracer stopped materialising
a causal mask, see planner/trace_step.py `unpacked_positions`).

Autocast (`autocast=True`: fp32 model under `torch.autocast(bf16)`, the trainer's DDP path). The
embedding is not on any autocast list, so the residual stream is fp32, and every RMSNorm works
on fp32: it saves its fp32 input (4H) and the fp32 normalised tensor (4H, saved by `weight *`);
its fp32 output is cast to bf16 *separately by each linear that reads it* (autocast caches
casts of leaf weights only), and each linear saves its own e-byte copy: q, k, v -> 3eH, gate and
up -> 2eH. RoPE multiplies bf16 q/k by fp32 cos/sin (type promotion: fp32 result), which SDPA
casts back to bf16: the same 3e(Dq + Dkv) as without autocast. The bf16 copies of the weights
that autocast makes for every linear are saved by their matmuls (see `autocast_weight_copies`).
CPU and CUDA autocast lists differ (CUDA runs pow/rsqrt/softmax/log_softmax in fp32, CPU keeps
bf16: aten/src/ATen/autocast_mode.h AT_FORALL_FP32 vs the AutocastCPU list), but in these HF
decoders every such op already gets fp32 input or an explicit dtype (RMSNorm upcasts, router
softmax and loss use dtype=float32), so a CPU-autocast trace allocates what the GPU does.
"""

from __future__ import annotations

from dataclasses import dataclass

from finetune_operator.planner.architecture import ModelShape
from finetune_operator.planner.compiled import compiled_layer_bytes_per_token, supports_compiled

FP32 = 4
# Labels, shifted labels (int64) and per-norm rsqrt (fp32) per token: small, but counted.
PER_TOKEN_MISC_BYTES = 16


def layer_backward_transient(m: ModelShape, e: int, autocast: bool = False) -> int:
    """Bytes per token alive only while one layer runs backward.

    Gradient tensors next to the layer's saved activations: dgate, dup, dact (e I each),
    d(hidden) in and out plus the fp32 norm grads (~8e H) and dq. Fitted to MemTracker on
    tiny Llamas (model 10,240 B/token vs measured 10,107). Under autocast the residual-stream
    gradients are fp32 like the stream itself.
    """
    r = FP32 if autocast else e
    return (
        e * (4 * m.expert_inter * max(1, m.experts_active) + m.q_dim) + 8 * r * m.arch.hidden_size
    )


@dataclass(frozen=True)
class ActivationModel:
    """Bytes for the whole micro-batch (b*s tokens)."""

    per_layer: int  # one decoder layer's saved tensors
    layer_input: int  # what full checkpointing keeps per layer: the layer's input
    head: int  # final norm + labels (the logits are counted as loss buffers)
    backward_transient: int  # one layer's gradient temporaries


def norm_bytes(m: ModelShape, e: int, width: int, readers: int = 0, autocast: bool = False) -> int:
    """Saved bytes per token of one RMSNorm over `width` features.

    Under autocast the output is fp32 and each of its `readers` (linears) saves an e-byte cast;
    without it the e-byte output is saved once, by whichever linears read it.
    """
    if autocast:
        return 2 * FP32 * width + readers * e * width
    # Without autocast every reader saves the same output tensor.
    out = e * width if readers else 0
    if m.arch.model_type.startswith("gemma"):
        return 2 * FP32 * width + out  # Gemma normalises and scales in fp32, then casts.
    return (FP32 + e) * width + out


def layer_bytes_per_token(
    m: ModelShape, e: int, seq: int, attention: str, autocast: bool = False
) -> int:
    """Saved-for-backward bytes per token of one decoder layer."""
    a = m.arch
    heads = a.num_attention_heads
    if autocast:
        # Input norm read by q, k, v; post-attention norm by gate and up (MoE: the router).
        mlp_readers = 1 if m.experts else 2
        norms = norm_bytes(m, e, a.hidden_size, 3, True) + norm_bytes(
            m, e, a.hidden_size, mlp_readers, True
        )
        norms += (m.family.norms_per_layer - 2) * norm_bytes(m, e, a.hidden_size, 0, True)
    else:
        # Input norm (read by q/k/v) and post-attention norm (MLP/router); Gemma's extra
        # post-norms feed residual adds, which save nothing.
        norms = 2 * norm_bytes(m, e, a.hidden_size, 1) + (
            m.family.norms_per_layer - 2
        ) * norm_bytes(m, e, a.hidden_size)
    # q_norm/k_norm outputs are read by RoPE, whose muls save only cos/sin.
    qk_norm = norm_bytes(m, e, m.q_dim) + norm_bytes(m, e, m.kv_dim) if m.family.qk_norm else 0
    # `q * cos` / `rotate_half(q) * sin` with cos/sin not requiring grad save only cos/sin; SDPA
    # saves the rotated q, k (under autocast: its bf16 cast of the fp32 result), v and its output.
    attn = e * (m.q_dim + m.kv_dim) + e * m.kv_dim + e * m.q_dim
    if attention == "eager":
        # k and v are repeat_kv'd to all heads, then the fp32 softmax and its copy (s^2 term).
        attn += 2 * e * (m.q_dim - m.kv_dim) + (FP32 + e) * heads * seq
    else:
        attn += FP32 * heads  # SDPA/flash log-sum-exp per head and query
    if m.experts:
        routed = m.experts_active
        # Router logits (e), softmax in fp32; each routed copy of a token keeps its gathered
        # input (e H) and the expert's SwiGLU tensors.
        mlp = (e + FP32) * m.experts + routed * (e * a.hidden_size + 4 * e * m.expert_inter)
    else:
        mlp = 4 * e * m.expert_inter
    return norms + qk_norm + attn + mlp


LoraCompute = str  # "fp32" | "autocast" | "param"
_QKV = ("q_proj", "k_proj", "v_proj")
_GATE_UP = ("gate_proj", "up_proj")


def frozen_base_savings(m: ModelShape, e: int, targets: tuple[str, ...]) -> int:
    """Bytes per token of one layer that full fine-tuning saves but a frozen (LoRA) base does
    not: autograd saves an input of a matmul or mul only when the *other* operand requires
    grad (torch codegen `should_compute_output`; checked with saved_tensors_hooks: a frozen
    `F.linear` saves nothing of its input). So with frozen weights:
      down_proj's input (act * up, e I per routed copy) unless down_proj has an adapter;
      each norm's normalised tensor (saved by `weight *`: eH, 4H under autocast);
      the norm outputs read only by frozen linears (q/k/v, gate/up: eH each, unless an adapter
      without dropout reads that same tensor; the adapters' own inputs are lora_bytes');
      Qwen3's q_norm/k_norm normalised tensors behind their frozen weights: e (Dq + Dkv)
      (traced 28-layer Qwen3-0.6B LoRA vs full: 6.1 KB/token/layer less, e (Dq + Dkv) = 6144).
    Measured on a 2-3-layer Llama (H 256/512, I 704/1408): LoRA q/k/v/o saves 8232 B/token
    per layer where this model predicts 8384 and full FT's formula 11296 (measured 11048).
    """
    h = m.arch.hidden_size
    copies = max(1, m.experts_active)
    saved = 0 if "down_proj" in targets else e * m.expert_inter * copies
    saved += m.family.norms_per_layer * e * h  # normalised tensors behind frozen weights
    saved += 2 * e * h  # input-norm output (q/k/v inputs) and post-norm output (gate/up)
    if m.family.qk_norm:
        saved += e * (m.q_dim + m.kv_dim)
    return saved


def lora_reads_norm_output(targets: tuple[str, ...], dropout: float, compute: str) -> int:
    """Norm outputs an adapter saves as they are (no dropout, no cast): 0, 1 or 2 tensors."""
    if dropout > 0 or compute != "param":
        return 0
    return int(any(t in targets for t in _QKV)) + int(any(t in targets for t in _GATE_UP))


def lora_bytes_per_token(
    m: ModelShape, e: int, targets: tuple[str, ...], dropout: float, compute: LoraCompute = "fp32"
) -> int:
    """Extra saved bytes per token of one layer from PEFT LoRA branches (the rank-r output saved
    by lora_B is added by the caller).

    PEFT casts the input to `lora_A.weight.dtype` before `lora_A(dropout(x))`
    (peft.tuners.lora.layer.Linear.forward, `_cast_input_dtype`). How much that saves depends on
    the dtype the adapters compute in:
      fp32      adapters fp32, no autocast (DeepSpeed bf16, pure bf16): lora_A saves the fp32
                copy of x (with dropout: the fp32 dropout output plus its 1-byte mask);
      autocast  adapters fp32 under autocast (DDP bf16): x is cast to fp32 by PEFT and back to
                bf16 by autocast in lora_A, which saves that e-byte copy (+ mask with dropout);
      param     FSDP2 MixedPrecisionPolicy(param_dtype=bf16): the unsharded adapters are bf16,
                PEFT casts nothing; only dropout adds its e-byte output and the mask.
    """
    shapes = m.linear_shapes()
    total = 0
    for name in targets:
        if name not in shapes:
            continue
        fan_in = shapes[name][0]
        copies = (
            m.experts_active if m.experts and name in ("gate_proj", "up_proj", "down_proj") else 1
        )
        if compute == "autocast":
            cast = e * fan_in
        elif compute == "param":
            cast = e * fan_in if dropout > 0 else 0  # no dropout: see lora_reads_norm_output
        else:
            cast = FP32 * fan_in if (e != FP32 or dropout > 0) else 0
        mask = fan_in if dropout > 0 else 0
        total += copies * (cast + mask)
    return total


def activation_model(
    m: ModelShape,
    *,
    tokens: int,
    seq: int,
    e: int,
    attention: str,
    lora_targets: tuple[str, ...] = (),
    lora_rank: int = 0,
    lora_dropout: float = 0.0,
    lora_compute: LoraCompute = "fp32",
    autocast: bool = False,
    compiled: bool = False,
) -> ActivationModel:
    """Activation sizes for a micro-batch of `tokens` = b*s tokens.

    `autocast`: fp32 model under torch.autocast (fp32 residual stream, see module docstring).
    `compiled`: the trainer torch.compiles each block: what inductor's partitioner saves
    (planner/compiled.py) where that model applies, else the eager count.
    """
    full = not lora_targets
    if compiled and supports_compiled(m, attention, lora_dropout, full):
        per_tok = compiled_layer_bytes_per_token(
            m,
            e,
            autocast=autocast,
            lora_targets=lora_targets,
            lora_rank=lora_rank,
            lora_autocast=lora_compute == "autocast",
        )
    else:
        per_tok = _eager_layer_bytes(
            m, e, seq, attention, lora_targets, lora_rank, lora_dropout, lora_compute, autocast
        )
    head = norm_bytes(m, e, m.arch.hidden_size, 1, autocast) + PER_TOKEN_MISC_BYTES
    if lora_targets and "lm_head" not in lora_targets:
        head -= e * m.arch.hidden_size  # frozen final norm weight: its normalised input unsaved
        if not autocast:
            head -= e * m.arch.hidden_size  # frozen lm_head: its input (the norm output) unsaved
    return ActivationModel(
        per_layer=tokens * per_tok,
        layer_input=tokens * (FP32 if autocast else e) * m.arch.hidden_size,
        head=tokens * head,
        backward_transient=tokens * layer_backward_transient(m, e, autocast),
    )


def _eager_layer_bytes(
    m: ModelShape,
    e: int,
    seq: int,
    attention: str,
    lora_targets: tuple[str, ...],
    lora_rank: int,
    lora_dropout: float,
    lora_compute: LoraCompute,
    autocast: bool,
) -> int:
    """Per-token saved bytes of one eager layer, LoRA's frozen base and adapters included."""
    per_tok = layer_bytes_per_token(m, e, seq, attention, autocast)
    if lora_targets:
        per_tok -= frozen_base_savings(m, e, lora_targets)
        per_tok += (
            lora_reads_norm_output(lora_targets, lora_dropout, lora_compute)
            * e
            * (m.arch.hidden_size)
        )
        per_tok += lora_bytes_per_token(m, e, lora_targets, lora_dropout, lora_compute)
        per_tok += (FP32 if lora_compute == "fp32" else e) * lora_rank * len(lora_targets)
    return per_tok
