"""Self-tests of the memory tracer: its resident figures equal exact byte counts, its peak moves
the way the physics says, and importing it stays free of torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from finetune_operator.api.spec import LoraSpec, ModelArchitecture

pytest.importorskip("torch")
pytest.importorskip("transformers")

from finetune_operator.planner.trace import TraceResult, trace_memory

# Every dimension divisible by 2 and 8, so FSDP's dim-0 shards carry no padding.
TINY = ModelArchitecture(
    model_type="llama",
    hidden_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=512,
    vocab_size=4096,
)


def _params(a: ModelArchitecture) -> int:
    """Llama parameter count by hand: embeddings, q/k/v/o, SwiGLU, two norms per layer."""
    h, kv = a.hidden_size, (a.num_key_value_heads or a.num_attention_heads) * 64
    layer = 2 * h * h + 2 * h * kv + 3 * h * a.intermediate_size + 2 * h
    return 2 * a.vocab_size * h + a.num_hidden_layers * layer + h


def _trace(**kw: object) -> TraceResult:
    opts: dict[str, object] = {"micro_batch_size": 1, "seq_len": 256}
    opts.update(kw)
    return trace_memory(TINY, **opts)


def test_import_needs_no_torch() -> None:
    """Every planner module (the tracer's split ones included) imports without torch."""
    code = (
        "import importlib, pkgutil, sys; import finetune_operator.planner as p; "
        "names = [m.name for m in pkgutil.iter_modules(p.__path__)]; "
        "assert {'trace', 'trace_model', 'trace_step', 'trace_result'} <= set(names), names; "
        "[importlib.import_module('finetune_operator.planner.' + n) for n in names]; "
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; "
        "assert not bad, f'planner imported {bad}'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


@pytest.mark.parametrize(
    ("precision", "bytes_p", "bytes_g", "bytes_o"),
    [("bf16-pure", 2, 2, 4), ("bf16-mixed", 4, 4, 8), ("fp32", 4, 4, 8)],
    ids=["bf16-pure", "bf16-mixed", "fp32"],
)
def test_ddp_resident_bytes_are_exact(
    precision: str, bytes_p: int, bytes_g: int, bytes_o: int
) -> None:
    p = _params(TINY)
    r = _trace(precision=precision, ddp_bucket_view=True)
    assert (r.parameters, r.gradients, r.optimizer) == (bytes_p * p, bytes_g * p, bytes_o * p)


@pytest.mark.parametrize("world", [2, 8])
def test_fsdp_shards_params_grads_and_states(world: int) -> None:
    p = _params(TINY)
    r = _trace(strategy="fsdp-full-shard", world_size=world)
    # fp32 master shard, fp32 gradient shard (reduce_dtype), two fp32 AdamW states.
    assert (r.parameters, r.gradients, r.optimizer) == (
        4 * p // world,
        4 * p // world,
        8 * p // world,
    )
    assert "UNSHARDED_PARAM" in r.at_peak and "ALL_GATHER" in r.at_peak


def test_ddp_buckets() -> None:
    # Bucket view: the gradients are the buckets, resident through the whole step.
    as_view = _trace(ddp_bucket_view=True)
    assert as_view.at_peak["GRAD"] == as_view.gradients
    # torch's default: buckets + gradients allocated in backward and freed by zero_grad.
    default = _trace()
    assert as_view.peak <= default.peak <= as_view.peak + as_view.gradients


def test_lora_trains_only_fp32_adapters() -> None:
    import warnings

    lora = LoraSpec(rank=8, alpha=16, dropout=0.0, target_modules=["q_proj", "v_proj"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = _trace(method="lora", lora=lora)
    # torch's "The module hierarchy tracking maybe be messed up. Please file a bug to
    # PyTorch", 32 times under `ftjob plan --trace` of the 8B LoRA example (transformers'
    # kernel wrappers share one module name): the peaks below do not depend on the names.
    assert [str(w.message) for w in caught if "hierarchy" in str(w.message)] == []
    h, kv = TINY.hidden_size, 2 * 64
    adapters = TINY.num_hidden_layers * (8 * h + 8 * h + 8 * h + 8 * kv)  # A and B of q, v
    assert r.gradients == 4 * adapters  # peft keeps adapters fp32 over the bf16 base
    assert r.optimizer == 8 * adapters
    assert r.parameters == 2 * _params(TINY) + 4 * adapters


def test_peak_grows_with_sequence_and_batch() -> None:
    base = _trace().peak
    assert _trace(seq_len=512).peak > base
    assert _trace(micro_batch_size=2).peak > base


def test_checkpointing_lowers_the_peak_of_a_deeper_model() -> None:
    deep = TINY.model_copy(update={"num_hidden_layers": 6})
    off = trace_memory(deep, seq_len=512, ddp_bucket_view=True)
    on = trace_memory(deep, seq_len=512, ddp_bucket_view=True, checkpointing=True)
    assert on.peak < off.peak
    assert on.activations < off.activations


def test_sharding_lowers_the_peak() -> None:
    assert _trace(strategy="zero3", world_size=8).peak < _trace(strategy="zero3", world_size=2).peak


def test_no_s2_attention_term() -> None:
    # Many narrow heads: the math kernel's scores (heads·s²·2 bytes per layer, 128 MiB at
    # s=2048) would dwarf everything else and quadruple with s; the flash kernel stays linear.
    wide = TINY.model_copy(update={"num_attention_heads": 16, "num_key_value_heads": 16})
    p1, p2 = (trace_memory(wide, seq_len=s).peak_fwd_bwd for s in (1024, 2048))
    assert p2 < 2.0 * p1


def test_summary_and_notes() -> None:
    r = _trace(strategy="fsdp-shard-grad-op", world_size=2)
    assert "reshard_after_forward=False" in " ".join(r.notes)
    assert "peak" in r.summary() and r.seconds > 0


def test_trace_plan_traces_the_planned_configuration() -> None:
    from finetune_operator.api.spec import FineTuneJobSpec
    from finetune_operator.planner import plan_job
    from finetune_operator.planner.trace import format_trace_comparison, trace_plan

    spec = FineTuneJobSpec.model_validate(
        {
            "model": {"name": "tiny", "source": "inline", "architecture": TINY.to_json_dict()},
            "dataset": {"uri": "data.jsonl"},
            "training": {
                "sequenceLength": 512,
                "globalBatchSize": 8,
                "microBatchSize": 2,
                "maxSteps": 10,
                "activationCheckpointing": "full",
            },
            "resources": {
                "gpu": {"product": "H100-80GB"},
                "gpusPerNode": 2,
                "minNodes": 1,
                "maxNodes": 2,
            },
            "strategy": {"type": "fsdp-full-shard"},
        }
    )
    plan = plan_job(spec)
    r = trace_plan(spec, plan)
    c = r.config
    # Launched on 2 nodes; memory planned (so traced) at minNodes: 1 node of 2 ranks.
    assert plan.world_size == 4
    assert (c.strategy, c.world_size, c.micro_batch_size, c.seq_len) == (
        "fsdp-full-shard",
        2,
        2,
        512,
    )
    assert c.checkpointing and c.precision == "bf16-mixed"
    assert c.ddp_bucket_view  # as the trainer's DDP runs
    text = format_trace_comparison(plan, r)
    assert "peak" in text and "traced" in text
