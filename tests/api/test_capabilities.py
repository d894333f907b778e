"""Plan-time refusal of what the trainer does not implement (instead of a crash loop)."""

from __future__ import annotations

from typing import Any

import pytest

from finetune_operator.api.capabilities import trainer_refusals
from finetune_operator.api.plan import MemoryBreakdown, Plan
from finetune_operator.api.spec import FineTuneJobSpec
from finetune_operator.api.strategies import STRATEGIES

BASE: dict[str, Any] = {
    "model": {"name": "m", "source": "inline", "architecture": {
        "hiddenSize": 64, "numHiddenLayers": 2, "numAttentionHeads": 4,
        "intermediateSize": 128, "vocabSize": 259}},
    "dataset": {"uri": "builtin://quickstart"},
    "training": {"maxSteps": 10},
    "resources": {"device": "cpu"},
}  # fmt: skip


def _plan(strategy: str = "ddp", backend: str = "fsdp", offload: str = "none") -> Plan:
    zero = MemoryBreakdown(
        parameters=0, gradients=0, optimizer=0, activations=0, buffers=0, peak=0, reserved=0,
        total=0,
    )  # fmt: skip
    return Plan.model_validate({
        "fits": True, "worldSize": 2, "nodes": 2, "gpusPerNode": 1, "strategy": strategy,
        "backend": backend, "offload": offload, "microBatchSize": 1,
        "gradientAccumulationSteps": 1, "activationCheckpointing": False, "gpuMemoryBytes": 1,
        "headroom": 0.5, "estimatedStepSeconds": 1.0, "reason": "", "memory": zero.to_json_dict(),
    })  # fmt: skip


def _spec(**overrides: Any) -> FineTuneJobSpec:
    raw: dict[str, Any] = {k: dict(v) if isinstance(v, dict) else v for k, v in BASE.items()}
    for dotted, value in overrides.items():
        section, _, key = dotted.partition("__")
        raw.setdefault(section, {})[key] = value
    return FineTuneJobSpec.model_validate(raw)


def test_supported_job_has_no_refusal() -> None:
    assert trainer_refusals(_spec(), _plan()) == []
    assert trainer_refusals(_spec(), _plan("fsdp-full-shard", offload="cpu")) == []


@pytest.mark.parametrize("strategy", ["ddp", "fsdp-full-shard", "fsdp-shard-grad-op"])
def test_fp16_runs_on_the_torch_backend_on_cpu_too(strategy: str) -> None:
    assert trainer_refusals(_spec(training__precision="fp16"), _plan(strategy)) == []


def test_adamw8bit_runs_under_ddp_on_a_gpu() -> None:
    gpu = _spec(
        resources__device="gpu", resources__gpu={"memoryGiB": 80}, training__optimizer="adamw8bit"
    )
    assert trainer_refusals(gpu, _plan("ddp")) == []
    [problem] = trainer_refusals(gpu, _plan("fsdp-full-shard"))
    assert "use adamw, or strategy.type ddp" in problem


@pytest.mark.parametrize(
    ("strategy", "offload"),
    [("zero1", "none"), ("zero1", "cpu"), ("zero2", "cpu"), ("zero3", "none"), ("zero3", "cpu")],
)
def test_deepspeed_plans_are_accepted(strategy: str, offload: str) -> None:
    spec = _spec(strategy__backend="deepspeed", strategy__type=strategy)
    assert trainer_refusals(spec, _plan(strategy, "deepspeed", offload=offload)) == []
    gpu = _spec(
        strategy__backend="deepspeed",
        training__precision="fp16",
        resources__device="gpu",
        resources__gpu={"memoryGiB": 80},
    )
    assert trainer_refusals(gpu, _plan(strategy, "deepspeed", offload=offload)) == []
    # Pretrained weights on s3:// too (ZeRO-3: rank 0 reads by ranges; ZeRO-1/2: a stripe
    # per rank, all-gathered).
    s3 = _spec(strategy__backend="deepspeed", model__source="uri", model__path="s3://b/m")
    assert trainer_refusals(s3, _plan(strategy, "deepspeed", offload=offload)) == []


@pytest.mark.parametrize(
    ("spec", "plan", "field"),
    [
        (
            _spec(strategy__backend="deepspeed", training__precision="fp16"),
            _plan("zero2", "deepspeed"),
            "spec.training.precision",
        ),
        (
            _spec(
                strategy__backend="deepspeed",
                method__type="qlora",
                resources__device="gpu",
                resources__gpu={"memoryGiB": 80},
            ),
            _plan("zero2", "deepspeed"),
            "spec.method.type",
        ),
        (_spec(), _plan("fsdp-full-shard", offload="nvme"), "spec.strategy.offload"),
        (_spec(), _plan("ddp", offload="cpu"), "spec.strategy.offload"),
        (_spec(training__optimizer="adamw8bit"), _plan(), "spec.training.optimizer"),
        (
            _spec(
                resources__device="gpu",
                resources__gpu={"memoryGiB": 80},
                training__optimizer="adamw8bit",
            ),
            _plan("fsdp-full-shard"),
            "spec.training.optimizer",
        ),
        (_spec(method__type="qlora"), _plan(), "spec.method.type"),
        (_spec(model__attention="flash"), _plan(), "spec.model.attention"),
        (
            _spec(method__type="qlora", resources__device="gpu", resources__gpu={"memoryGiB": 80}),
            _plan("fsdp-full-shard"),
            "spec.method.type",
        ),
    ],
    ids=[
        "fp16-deepspeed-cpu",
        "qlora-deepspeed",
        "nvme",
        "offload-ddp",
        "adamw8bit-cpu",
        "adamw8bit-fsdp",
        "qlora-cpu",
        "flash-cpu",
        "qlora-fsdp",
    ],
)
def test_refusals_name_the_field(spec: FineTuneJobSpec, plan: Plan, field: str) -> None:
    problems = trainer_refusals(spec, plan)
    assert len(problems) == 1 and problems[0].startswith(field + ":"), problems


DEEPSPEED_ROWS = [("zero1", "deepspeed"), ("zero2", "deepspeed"), ("zero3", "deepspeed")]


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_unimplemented_row_is_refused_from_the_table(strategy: str) -> None:
    """The refusal reads the table's `implemented` flag: the same plan is refused while the
    DeepSpeed rows are not implemented and accepted once they are."""
    plan = _plan(strategy, "deepspeed")
    problems = trainer_refusals(_spec(), plan, STRATEGIES.without("deepspeed"))
    assert problems == [
        f"spec.strategy: {strategy} on deepspeed is not implemented by the trainer yet; use one "
        "of ddp, fsdp-full-shard, fsdp-hybrid, fsdp-shard-grad-op, zero3"
    ]
    assert trainer_refusals(_spec(), plan, STRATEGIES.implementing(DEEPSPEED_ROWS)) == []


def test_zero3_on_fsdp_is_fsdp_full_shard_and_runs() -> None:
    assert trainer_refusals(_spec(), _plan("zero3", "fsdp"), STRATEGIES.without("deepspeed")) == []


@pytest.mark.parametrize(
    ("strategy", "backend", "offload_ok"),
    [
        ("ddp", "fsdp", False),
        ("zero1", "deepspeed", True),
        ("zero2", "deepspeed", True),
        ("zero3", "deepspeed", True),
        ("fsdp-full-shard", "fsdp", True),
    ],
)
def test_offload_follows_the_table(strategy: str, backend: str, offload_ok: bool) -> None:
    table = STRATEGIES.implementing(DEEPSPEED_ROWS)
    problems = trainer_refusals(_spec(), _plan(strategy, backend, offload="cpu"), table)
    assert (problems == []) is offload_ok, problems
    if not offload_ok:
        assert problems[0].startswith(f"spec.strategy.offload: {strategy} cannot offload")


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (_spec(training__precision="fp16"), "spec.training.precision"),
        (
            _spec(method__type="qlora", resources__device="gpu", resources__gpu={"memoryGiB": 80}),
            "spec.method.type",
        ),
    ],
    ids=["fp16-cpu", "qlora"],
)
def test_what_deepspeed_rows_do_not_run(spec: FineTuneJobSpec, field: str) -> None:
    table = STRATEGIES.implementing(DEEPSPEED_ROWS)
    problems = trainer_refusals(spec, _plan("zero2", "deepspeed"), table)
    assert len(problems) == 1 and problems[0].startswith(field + ":"), problems
