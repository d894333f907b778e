"""Bytes saved for backward by one micro-batch of an HF decoder, read off the modeling code.

Per token of one decoder layer (e = bytes of the compute dtype; HF Llama/Qwen/Mistral code):
  RMSNorm        x.to(fp32) saved by pow/mul (4H; the input itself when e = 4) and the
                 normalised e-byte tensor saved by `weight * x` (eH)           -> (4 + e) H
  q, k           raw projection (saved by `q * cos`), rotate_half(q) (saved by `* sin`) and
                 the rotated result (saved by SDPA)                          -> 3e (Dq + Dkv)
  v              saved by SDPA                                                  -> e Dkv
  SDPA           its output (e Dq) and the fp32 log-sum-exp (4 heads); eager instead keeps the
                 fp32 softmax and its e-byte copy (heads * s each) and repeat_kv'd k, v
  MLP (SwiGLU)   gate (SiLU input), act, up, act*up (down_proj input)           -> 4e I
  residual adds  save nothing; the hidden states between layers are not kept.
Checked against `saved_tensors_hooks` and MemTracker on tiny Llamas: within 0.5%.
"""

from __future__ import annotations

from dataclasses import dataclass

from finetune_operator.planner.architecture import ModelShape

FP32 = 4
# Labels, shifted labels (int64) and per-norm rsqrt (fp32) per token: small, but counted.
PER_TOKEN_MISC_BYTES = 16


def layer_backward_transient(m: ModelShape, e: int) -> int:
    """Bytes per token alive only while one layer runs backward.

    Gradient tensors next to the layer's saved activations: dgate, dup, dact (e I each),
    d(hidden) in and out plus the fp32 norm grads (~8e H) and dq. Fitted to MemTracker on
    tiny Llamas (model 10,240 B/token vs measured 10,107).
    """
    return e * (4 * m.expert_inter * max(1, m.experts_active) + 8 * m.arch.hidden_size + m.q_dim)


@dataclass(frozen=True)
class ActivationModel:
    """Bytes for the whole micro-batch (b*s tokens)."""

    per_layer: int  # one decoder layer's saved tensors
    layer_input: int  # what full checkpointing keeps per layer: the layer's input
    head: int  # final norm + labels (the logits are counted as loss buffers)
    backward_transient: int  # one layer's gradient temporaries


def norm_bytes(m: ModelShape, e: int, width: int) -> int:
    """Saved bytes per token of one RMSNorm over `width` features."""
    if m.arch.model_type.startswith("gemma"):
        return 2 * FP32 * width  # Gemma normalises and scales in fp32, then casts.
    return (FP32 + e) * width


def layer_bytes_per_token(m: ModelShape, e: int, seq: int, attention: str) -> int:
    """Saved-for-backward bytes per token of one decoder layer."""
    a = m.arch
    heads = a.num_attention_heads
    norms = m.family.norms_per_layer * norm_bytes(m, e, a.hidden_size)
    qk_norm = norm_bytes(m, e, m.q_dim) + norm_bytes(m, e, m.kv_dim) if m.family.qk_norm else 0
    attn = 3 * e * (m.q_dim + m.kv_dim) + e * m.kv_dim + e * m.q_dim
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


def lora_bytes_per_token(m: ModelShape, e: int, targets: tuple[str, ...], dropout: float) -> int:
    """Extra saved bytes per token of one layer from PEFT LoRA branches.

    PEFT keeps adapters in fp32 and casts the input to fp32 before `lora_A(dropout(x))`:
    lora_A saves that fp32 input (with dropout: the dropout output plus its bool mask), and
    lora_B saves the fp32 rank-r output.
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
) -> ActivationModel:
    """Activation sizes for a micro-batch of `tokens` = b*s tokens."""
    per_tok = layer_bytes_per_token(m, e, seq, attention)
    if lora_targets:
        per_tok += lora_bytes_per_token(m, e, lora_targets, lora_dropout)
        per_tok += FP32 * lora_rank * len(lora_targets)
    head = norm_bytes(m, e, m.arch.hidden_size) + PER_TOKEN_MISC_BYTES
    return ActivationModel(
        per_layer=tokens * per_tok,
        layer_input=tokens * e * m.arch.hidden_size,
        head=tokens * head,
        backward_transient=tokens * layer_backward_transient(m, e),
    )
