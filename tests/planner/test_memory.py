"""Memory model: textbook model-state formulas, LoRA/QLoRA sizes and activation terms."""

from __future__ import annotations

import pytest

from finetune_operator.api.spec import ModelArchitecture, StrategyName
from finetune_operator.planner import Candidate, TrainingShape, estimate_memory, shape_of
from finetune_operator.planner.activations import activation_model, layer_bytes_per_token
from finetune_operator.planner.catalog import lookup
from finetune_operator.planner.hardware import AGENT_RUNTIME_HOST_BYTES, TRAINER_RUNTIME_HOST_BYTES
from finetune_operator.planner.lora import adapter_parameters, nf4_bytes_per_weight

LLAMA2_7B = shape_of(lookup("Llama-2-7b-hf").architecture)  # type: ignore[union-attr]
P = LLAMA2_7B.total  # 6,738,415,616 = 2^? * ... divisible by 8
N = 8


def model_states(strategy: StrategyName, n: int, **shape: object) -> int:
    est = estimate_memory(
        LLAMA2_7B,
        TrainingShape(micro_batch_size=1, seq_len=512, **shape),  # type: ignore[arg-type]
        Candidate(strategy, n, 8),
    )
    b = est.breakdown
    return b.parameters + b.gradients + b.optimizer


@pytest.mark.parametrize(
    ("strategy", "expected"),
    [
        ("ddp", 16 * P),
        ("fsdp-full-shard", 16 * P // N),
        # DeepSpeed's engine, not the textbook 4P + 12P/N, 2P + 14P/N, 16P/N: the step holds
        # an fp32 gradient partition (tests/planner/test_zero.py, bench/deepspeed_memory.py).
        ("zero1", 2 * P + 16 * P // N),
        ("zero2", 2 * P + 16 * P // N),
        ("zero3", 20 * P // N),
    ],
    ids=["ddp-16P", "fsdp-16P/N", "zero1-2P+16P/N", "zero2-2P+16P/N", "zero3-20P/N"],
)
def test_mixed_precision_adamw_model_states(strategy: StrategyName, expected: int) -> None:
    assert P % N == 0
    assert model_states(strategy, N) == expected


def test_ddp_split_is_autocast_4_4_8_and_zero_is_2_4_12() -> None:
    """DDP mixed precision is an fp32 model under autocast (fp32 params, grads, m, v);
    DeepSpeed ZeRO keeps bf16 params, fp32 master + m + v, and hands the optimizer an fp32
    gradient partition at the step."""
    shape = TrainingShape(micro_batch_size=1, seq_len=512)
    b = estimate_memory(LLAMA2_7B, shape, Candidate("ddp", 1, 1)).breakdown
    assert (b.parameters, b.gradients, b.optimizer) == (4 * P, 4 * P, 8 * P)
    z = estimate_memory(LLAMA2_7B, shape, Candidate("zero1", 1, 1)).breakdown
    assert (z.parameters, z.gradients, z.optimizer) == (2 * P, 4 * P, 12 * P)


@pytest.mark.parametrize(
    ("precision", "optimizer", "master", "per_param"),
    [
        ("fp32", "adamw", None, 16),
        ("bf16", "adamw", False, 8),
        ("bf16", "sgd", None, 12),
        ("bf16", "adamw8bit", None, 2 + 2 + 4 + 2 * (1 + 4 / 256)),
    ],
    ids=["fp32-adamw", "pure-bf16-adamw", "bf16-sgd-momentum", "bf16-adamw8bit"],
)
def test_other_precisions_and_optimizers(
    precision: str, optimizer: str, master: bool | None, per_param: float
) -> None:
    got = model_states("ddp", 1, precision=precision, optimizer=optimizer, master_weights=master)
    assert got == pytest.approx(per_param * P, rel=1e-9)


def test_offload_moves_states_to_host() -> None:
    shape = TrainingShape(micro_batch_size=1, seq_len=512)
    est = estimate_memory(LLAMA2_7B, shape, Candidate("zero3", N, 8, offload="cpu"))
    b = est.breakdown
    assert b.parameters + b.gradients + b.optimizer == 0
    # bf16 partition + fp32 master, m, v + bf16 and fp32 gradient partitions.
    assert est.host_bytes == 20 * P // N


def test_peak_is_not_the_sum_and_reserved_total_order() -> None:
    est = estimate_memory(
        LLAMA2_7B,
        TrainingShape(micro_batch_size=4, seq_len=4096),
        Candidate("fsdp-full-shard", N, 8),
    )
    b = est.breakdown
    assert est.peak_phase == "loss"  # 32k vocab x 16k tokens: the loss region dominates
    assert b.peak < b.parameters + b.gradients + b.optimizer + b.activations + b.buffers
    assert b.peak < b.reserved < b.total


def test_optimizer_step_is_the_peak_for_tiny_batches_off_cuda() -> None:
    """Off CUDA torch's multi-tensor AdamW allocates sqrt(v), a state-sized temporary."""
    est = estimate_memory(
        LLAMA2_7B,
        TrainingShape(micro_batch_size=1, seq_len=128),
        Candidate("ddp", 1, 1, cuda=False),
    )
    assert est.peak_phase == "optimizer"
    assert est.breakdown.activations == 0


def test_fused_adamw_on_cuda_has_no_optimizer_temporaries() -> None:
    est = estimate_memory(
        LLAMA2_7B, TrainingShape(micro_batch_size=1, seq_len=128), Candidate("ddp", 1, 1)
    )
    b = est.breakdown
    assert est.phases["optimizer"] == b.parameters + b.gradients + b.optimizer
    assert est.peak_phase != "optimizer"


@pytest.mark.parametrize("per_node", [1, 4])
def test_cpu_has_no_cuda_overheads_but_the_runtime(per_node: int) -> None:
    shape = TrainingShape(micro_batch_size=1, seq_len=128, precision="fp32")
    cand = Candidate("ddp", per_node, per_node, cuda=False)
    b = estimate_memory(LLAMA2_7B, shape, cand).breakdown
    # The trainer's own runtime and its share of the pod's torchrun agent, nothing of CUDA.
    agent_share = -(-AGENT_RUNTIME_HOST_BYTES // per_node)
    assert b.total == b.reserved + TRAINER_RUNTIME_HOST_BYTES + agent_share


TINY = ModelArchitecture(
    hidden_size=256,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    intermediate_size=704,
    vocab_size=1000,
)


@pytest.mark.parametrize(
    ("attention", "seq", "expected"),
    # Hand-derived from the Llama modeling code (see activations.py docstring):
    # 2 norms x (6H + output eH) + rotated q/k e(D+Dkv) + v eDkv + out eD + 4 heads lse + 4e I.
    [
        ("sdpa", 64, 2 * 8 * 256 + 2 * 320 + 2 * 64 + 2 * 256 + 4 * 8 + 8 * 704),
        (
            "eager",
            64,
            2 * 8 * 256 + 2 * 320 + 2 * 64 + 2 * 256 + 8 * 704 + 4 * (256 - 64) + 6 * 8 * 64,
        ),
    ],
    ids=["sdpa-no-s2", "eager-s2-term"],
)
def test_activation_bytes_per_token(attention: str, seq: int, expected: int) -> None:
    assert layer_bytes_per_token(shape_of(TINY), 2, seq, attention) == expected


def test_checkpointing_keeps_layer_inputs_plus_one_layer() -> None:
    # FSDP: bf16 compute without autocast (DDP's autocast weight copies also depend on AC).
    m = LLAMA2_7B
    fsdp = Candidate("fsdp-full-shard", 8, 8)
    no = estimate_memory(m, TrainingShape(micro_batch_size=2, seq_len=4096), fsdp)
    ck = estimate_memory(
        m, TrainingShape(micro_batch_size=2, seq_len=4096, checkpointing=True), fsdp
    )
    act = activation_model(m, tokens=2 * 4096, seq=4096, e=2, attention="sdpa")
    layers = m.arch.num_hidden_layers
    assert no.phases["loss"] - ck.phases["loss"] == layers * (act.per_layer - act.layer_input)
    assert no.phases["backward"] - ck.phases["backward"] == (
        (layers - 1) * act.per_layer - layers * act.layer_input
    )


@pytest.mark.parametrize(
    ("targets", "rank"),
    [
        (("q_proj", "v_proj"), 8),
        (("q_proj", "k_proj", "v_proj", "o_proj"), 16),
        (("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), 64),
    ],
    ids=["qv-r8", "attn-r16", "all-linear-r64"],
)
def test_lora_adapter_count_matches_peft(targets: tuple[str, ...], rank: int) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    cfg = transformers.LlamaConfig(
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=704,
        vocab_size=1000,
    )
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=rank, target_modules=list(targets)))
    trainable = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert adapter_parameters(shape_of(TINY), rank, targets) == trainable


@pytest.mark.parametrize(
    ("double", "expected"),
    [(True, 0.5 + 1 / 64 + 4 / (64 * 256)), (False, 0.5 + 4 / 64)],
    ids=["double-quant", "single-quant"],
)
def test_nf4_bytes_per_weight(double: bool, expected: float) -> None:
    assert nf4_bytes_per_weight(double) == pytest.approx(expected)


def test_qlora_base_is_nf4_linears_plus_bf16_rest() -> None:
    m = LLAMA2_7B
    est = estimate_memory(
        m, TrainingShape(micro_batch_size=1, seq_len=512, method="qlora"), Candidate("ddp", 1, 1)
    )
    adapters = adapter_parameters(m, 16, ("q_proj", "k_proj", "v_proj", "o_proj"))
    linear = m.layer_linear * m.arch.num_hidden_layers
    base = int(linear * nf4_bytes_per_weight()) + (m.total - linear) * 2
    assert est.breakdown.parameters == base + 4 * adapters  # adapters in fp32
    assert est.breakdown.optimizer == 8 * adapters
