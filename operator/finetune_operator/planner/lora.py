"""LoRA adapter sizes and the QLoRA 4-bit base (pure arithmetic on a ModelShape)."""

from __future__ import annotations

from finetune_operator.planner.architecture import LINEAR_NAMES, ModelShape
from finetune_operator.planner.errors import PlanningError

# bitsandbytes NF4 (QLoRA paper, bnb `quantize_4bit`): 4 bits per weight, one absmax per block
# of 64 weights. Double quantisation stores that absmax in 8 bits and adds one fp32 absmax
# per 256 first-level blocks (QLoRA §3: 0.127 bit/param of constants instead of 0.5).
NF4_BYTES_PER_WEIGHT = 0.5
NF4_BLOCK = 64
DOUBLE_QUANT_BLOCK = 256
DOUBLE_QUANT = True


def nf4_bytes_per_weight(double_quant: bool = DOUBLE_QUANT) -> float:
    if double_quant:
        return NF4_BYTES_PER_WEIGHT + 1 / NF4_BLOCK + 4 / (NF4_BLOCK * DOUBLE_QUANT_BLOCK)
    return NF4_BYTES_PER_WEIGHT + 4 / NF4_BLOCK


def expand_targets(targets: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """PEFT names to our linear names; 'all-linear' means every decoder-layer linear."""
    out: list[str] = []
    for name in targets:
        names = LINEAR_NAMES if name == "all-linear" else (name.rsplit(".", 1)[-1],)
        for n in names:
            if n not in LINEAR_NAMES and n not in ("lm_head", "embed_tokens"):
                raise PlanningError(
                    "spec.method.lora.targetModules",
                    f"unknown target module {name!r}; use any of {', '.join(LINEAR_NAMES)}, "
                    "lm_head, embed_tokens or all-linear",
                )
            if n not in out:
                out.append(n)
    return tuple(out)


def adapter_parameters(m: ModelShape, rank: int, targets: tuple[str, ...]) -> int:
    """Exact PEFT LoRA parameter count: A (r x in) + B (out x r) per targeted linear.

    MoE expert linears get one adapter per expert; embed_tokens gets A (r x V) + B (H x r).
    """
    shapes = m.linear_shapes()
    h, v = m.arch.hidden_size, m.arch.vocab_size
    per_layer = 0
    for name in targets:
        if name in shapes:
            fan_in, fan_out = shapes[name]
            copies = m.experts if m.experts and name in ("gate_proj", "up_proj", "down_proj") else 1
            per_layer += copies * rank * (fan_in + fan_out)
    total = per_layer * m.arch.num_hidden_layers
    if "lm_head" in targets:
        total += rank * (h + v)
    if "embed_tokens" in targets:
        total += rank * (v + h)
    return total


def largest_adapter_tensor(m: ModelShape, rank: int, targets: tuple[str, ...]) -> int:
    """Elements of the largest LoRA tensor (adapter_parameters' A or B of one linear: rank x
    its wider side; the head's or embedding's: rank x the vocabulary)."""
    shapes = m.linear_shapes()
    sides = [max(shapes[name]) for name in targets if name in shapes]
    if "lm_head" in targets or "embed_tokens" in targets:
        sides.append(max(m.arch.vocab_size, m.arch.hidden_size))
    return rank * max(sides, default=0)


def qlora_base_bytes(m: ModelShape, e: int) -> int:
    """Frozen QLoRA base: decoder-layer linears in NF4, everything else (embeddings, head,
    norms, router) in the compute dtype, as transformers' bnb integration leaves them."""
    linear = m.layer_linear * m.arch.num_hidden_layers
    rest = m.total - linear
    return int(linear * nf4_bytes_per_weight()) + rest * e
