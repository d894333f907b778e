"""Bytes saved for backward by one torch.compile'd decoder block (the trainer's per-block
compile, finetune_trainer.parallelize.compile_blocks), per token.

A compiled block's backward keeps what AOTAutograd's partitioner puts in the forward graph's
outputs, not what eager autograd saves: inductor partitions the joint graph with
`min_cut_rematerialization_partition`, which saves the cheapest cut and recomputes pointwise
ops (casts, RMSNorm's scaling, SiLU, RoPE's multiply-adds, residual adds) in backward. Read
off that partition (torch 2.13, inductor's own partition function and joint-graph passes, on
Llama and Qwen2 blocks: tests/planner/test_compiled_activations.py runs it), per token of one
layer, e = compute-dtype bytes, r = residual-stream bytes (fp32 under DDP's autocast, else e):

  layer input x               r H   (both RMSNorms' backward recompute from it and the rsqrt;
                                     eager keeps x.to(fp32) and the normalised fp32 tensor)
  rsqrt of each norm          2 x 4
  normed input of q/k/v        e H   (the weight gradients' input; the bf16 cast under autocast)
  q, k after RoPE, v, SDPA out e (2 Dq + 2 Dkv) + fp32 log-sum-exp per head (as eager)
  attention output            e H   (o_proj's output: the post-attention residual x + o is
                                     recomputed from it, never saved)
  normed input of the MLP     e H
  gate, up, act * up          3 e I (SiLU and act * up recomputed; eager keeps 4 e I)

  full fine-tuning: r H + 3 e H + e (2 Dq + 2 Dkv) + 4 heads + 3 e I + 8

With a frozen base (LoRA, no dropout), a tensor is kept only where an adapter needs it: the
normed inputs only if q/k/v (resp. gate/up) carry adapters, act * up only if down_proj does,
o_proj's input (e H) only under autocast when o_proj carries one (PEFT's fp32 cast of it,
cast back by autocast, is saved rather than recomputed), plus each adapter's rank-r output
(e r; under autocast up to one more e r cast, counted). The attention output is kept either
way (the norm's input gradient needs the residual).

Against eager this drops, per token and layer: the fp32 norm input and normalised tensor of
each norm (eager keeps (4 + e) H + e H per norm; under autocast 8 H plus an e-byte cast per
linear that reads it), SiLU's output (e I). Llama-3.2-1B full under autocast: 80,008
B/token/layer compiled, 129,152 eager.

Read on CPU. The partitioner makes no device-dependent choice but for RNG state; CUDA's SDPA
kernels (flash, efficient, cuDNN) save the same q, k, v, output and fp32 log-sum-exp per head
as CPU flash does. Fake CUDA tensors abort inside SDPA on a CPU-only torch build, so inductor's
CUDA-only joint-graph passes were not run. On the H100 (torch 2.11, bench/results/gpu-h100.md)
an FSDP2 run matched this count (+0.6% peak); DDP runs, whose forward is under autocast, kept
up to 7.4% more than it, for a reason not found without a GPU: memory.py uses it for
forwards without autocast only.

Modelled only for the blocks it was read from: dense decoders (Llama, Mistral, Qwen2) with
SDPA/flash attention, no q/k norms, not Gemma, no MoE, and no LoRA dropout (random ops change
the cut); `supports_compiled` says so and other blocks keep the eager model (conservative:
compile never saves more than eager autograd does).

Autocast's bf16 weight copies are saved by the compiled graph as by eager (memory.py's
`_autocast_weight_copies` counts them in both).
"""

from __future__ import annotations

from finetune_operator.planner.architecture import ModelShape

FP32 = 4
_QKV = ("q_proj", "k_proj", "v_proj")
_GATE_UP = ("gate_proj", "up_proj")


def supports_compiled(m: ModelShape, attention: str, lora_dropout: float, full: bool) -> bool:
    """Whether the compiled-block model applies (see the module docstring)."""
    family_ok = not (m.experts or m.family.qk_norm or m.arch.model_type.startswith("gemma"))
    return family_ok and attention != "eager" and (full or lora_dropout == 0)


def compiled_layer_bytes_per_token(
    m: ModelShape,
    e: int,
    *,
    autocast: bool = False,
    lora_targets: tuple[str, ...] = (),
    lora_rank: int = 0,
    lora_autocast: bool = False,
) -> int:
    """Saved-for-backward bytes per token of one compiled decoder layer.

    `autocast`: fp32 residual stream (DDP full fine-tuning under torch.autocast);
    `lora_targets` empty: full fine-tuning; `lora_autocast`: the adapters run under autocast
    (DDP LoRA), else they compute in the parameters' dtype (FSDP2's param_dtype).
    """
    h, inter = m.arch.hidden_size, m.expert_inter
    r = FP32 if autocast else e
    attn = e * (2 * m.q_dim + 2 * m.kv_dim) + FP32 * m.arch.num_attention_heads
    rsqrt = 2 * FP32
    if not lora_targets:
        return r * h + 3 * e * h + attn + 3 * e * inter + rsqrt
    targets = set(lora_targets)
    kept = r * h + e * h + attn + rsqrt  # layer input, attention output
    kept += e * h if targets & set(_QKV) else 0
    kept += e * h if lora_autocast and "o_proj" in targets else 0
    kept += e * h if targets & set(_GATE_UP) else 0
    kept += 2 * e * inter + (e * inter if "down_proj" in targets else 0)
    adapted = len(targets & set(m.linear_shapes()))
    kept += (2 if lora_autocast else 1) * e * lora_rank * adapted
    return kept
