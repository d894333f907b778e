"""The DeepSpeed config generated from a plan, and the merge of a user's own keys (pure)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from finetune_operator.api.deepspeed_config import (
    ZERO_BUCKET_ELEMENTS,
    deepspeed_config,
    hpz_group,
    hpz_partition_size,
    planned_deepspeed_config,
    uses_deepspeed,
)
from finetune_operator.api.plan import MemoryBreakdown, Plan
from finetune_operator.api.spec import FineTuneJobSpec, StrategySpec
from finetune_operator.planner import memory

BASE: dict[str, Any] = {
    "model": {"name": "tiny", "source": "inline", "architecture": {
        "hiddenSize": 64, "numHiddenLayers": 2, "numAttentionHeads": 4, "intermediateSize": 128,
        "vocabSize": 259}},
    "dataset": {"uri": "builtin://quickstart"},
    "training": {"sequenceLength": 128, "globalBatchSize": 16, "maxSteps": 10,
                 "precision": "bf16", "maxGradNorm": 0.5},
    "resources": {"device": "gpu", "gpu": {"memoryGiB": 80}},
}  # fmt: skip


def _spec(strategy: dict[str, Any] | None = None, **training: Any) -> FineTuneJobSpec:
    raw = json.loads(json.dumps(BASE))
    raw["strategy"] = strategy or {"type": "zero2", "backend": "deepspeed"}
    raw["training"].update(training)
    return FineTuneJobSpec.model_validate(raw)


def _plan(strategy: str = "zero2", offload: str = "none", backend: str = "deepspeed") -> Plan:
    zero = MemoryBreakdown(parameters=0, gradients=0, optimizer=0, activations=0, buffers=0,
                           peak=0, reserved=0, total=0)  # fmt: skip
    return Plan(fits=True, world_size=4, nodes=1, gpus_per_node=4, strategy=strategy,  # type: ignore[arg-type]
                offload=offload, backend=backend, micro_batch_size=2,  # type: ignore[arg-type]
                gradient_accumulation_steps=2, activation_checkpointing=False,
                gpu_memory_bytes=1, headroom=0.5, estimated_step_seconds=1.0, reason="",
                memory=zero)  # fmt: skip


def test_bucket_size_is_the_planners() -> None:
    assert ZERO_BUCKET_ELEMENTS == memory.ZERO_BUCKET_ELEMENTS


@pytest.mark.parametrize(
    ("strategy", "backend", "expected"),
    [("zero1", "fsdp", True), ("zero2", "deepspeed", True), ("zero3", "deepspeed", True),
     ("zero3", "fsdp", False), ("ddp", "fsdp", False), ("fsdp-full-shard", "fsdp", False)],
)  # fmt: skip
def test_uses_deepspeed(strategy: str, backend: str, expected: bool) -> None:
    assert uses_deepspeed(_plan(strategy, backend=backend)) is expected


@pytest.mark.parametrize(
    ("strategy", "offload", "optimizer_device", "param_device"),
    [("zero1", "none", "none", None), ("zero2", "cpu", "cpu", None),
     ("zero3", "none", "none", "none"), ("zero3", "cpu", "cpu", "cpu")],
)  # fmt: skip
def test_generated_from_the_plan(
    strategy: str, offload: str, optimizer_device: str, param_device: str | None
) -> None:
    config, overridden = deepspeed_config(
        _spec({"type": strategy, "backend": "deepspeed"}), _plan(strategy, offload),
        world_size=2, grad_accum=4,
    )  # fmt: skip
    zero = config["zero_optimization"]
    assert overridden == []
    assert zero["stage"] == int(strategy[-1])
    assert config["train_micro_batch_size_per_gpu"] == 2
    assert config["gradient_accumulation_steps"] == 4
    assert config["train_batch_size"] == 2 * 4 * 2  # the world it runs at, not the plan's 4
    assert config["gradient_clipping"] == 0.5
    assert config["bf16"] == {"enabled": True} and config["fp16"] == {"enabled": False}
    assert zero["reduce_bucket_size"] == ZERO_BUCKET_ELEMENTS
    assert zero["offload_optimizer"]["device"] == optimizer_device
    assert zero.get("offload_param", {}).get("device") == param_device
    if offload == "cpu":
        assert zero["offload_optimizer"]["pin_memory"] is True  # a GPU plan pins


def test_fp16_gets_dynamic_loss_scaling() -> None:
    config, _ = deepspeed_config(_spec(precision="fp16"), _plan(), world_size=4, grad_accum=2)
    assert config["fp16"]["enabled"] is True and config["fp16"]["loss_scale"] == 0
    assert config["bf16"] == {"enabled": False}


MERGES = [
    pytest.param({}, {}, [], id="empty"),
    pytest.param(
        {"fp16": {"hysteresis": 1}, "zero_optimization": {"overlap_comm": True},
         "flops_profiler": {"enabled": False}},
        {"zero_optimization.overlap_comm": True, "flops_profiler.enabled": False},
        [], id="free-keys-are-kept",
    ),
    pytest.param(
        {"train_micro_batch_size_per_gpu": "auto", "gradient_clipping": 0.5,
         "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8}},
        {"zero_optimization.stage": 2},
        [], id="auto-and-equal-values-agree",
    ),
    pytest.param(
        {"gradient_accumulation_steps": 99, "bf16": {"enabled": False},
         "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}},
        {"gradient_accumulation_steps": 2, "bf16.enabled": True, "zero_optimization.stage": 2,
         "zero_optimization.offload_optimizer.device": "none"},
        ["bf16.enabled", "gradient_accumulation_steps", "zero_optimization.offload_optimizer.device",
         "zero_optimization.stage"],
        id="plan-wins-and-says-so",
    ),
    pytest.param(
        {"optimizer": {"type": "Adam"}, "scheduler": {"type": "WarmupLR"}, "steps_per_print": 5},
        {"steps_per_print": 5},
        ["optimizer", "scheduler"], id="trainer-owned-sections-dropped",
    ),
    pytest.param(
        {"bf16": True},  # a section given as a scalar: the plan's object replaces it
        {"bf16.enabled": True}, ["bf16"], id="scalar-for-object",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("user", "expected", "overridden"), MERGES)
def test_user_config_merge(
    user: dict[str, Any], expected: dict[str, Any], overridden: list[str]
) -> None:
    config, got = deepspeed_config(
        _spec({"type": "zero2", "backend": "deepspeed", "deepspeedConfig": user}),
        _plan(), world_size=4, grad_accum=2,
    )  # fmt: skip
    assert got == overridden
    for dotted, value in expected.items():
        node: Any = config
        for part in dotted.split("."):
            node = node[part]
        assert node == value, dotted
    assert "optimizer" not in config and "scheduler" not in config


def test_planned_config_only_for_deepspeed_plans() -> None:
    assert planned_deepspeed_config(_spec(), _plan("zero3", backend="fsdp")) is None
    text = planned_deepspeed_config(_spec(), _plan("zero2"))
    assert text is not None
    config = json.loads(text)
    assert config["train_batch_size"] == 2 * 2 * 4  # the plan's world size and accumulation


@pytest.mark.parametrize(
    ("strategy", "message"),
    [({"type": "auto", "deepspeedConfig": {"a": 1}}, "needs strategy.backend deepspeed"),
     ({"type": "ddp", "backend": "fsdp", "deepspeedConfig": {}}, "needs strategy.backend"),
     ({"type": "zero2", "deepspeedConfig": {"x": "y" * 70000}}, "bytes as JSON"),
     ({"type": "zero3", "backend": "deepspeed",
       "deepspeedConfig": {"zero_optimization": {"zero_hpz_partition_size": "8"}}},
      r"deepspeedConfig.zero_optimization.zero_hpz_partition_size is '8': a positive integer"),
     ({"type": "zero3", "backend": "deepspeed",
       "deepspeedConfig": {"zero_optimization": {"zero_hpz_partition_size": 0}}},
      "zero_hpz_partition_size is 0"),
     ({"type": "zero3", "backend": "deepspeed",
       "deepspeedConfig": {"zero_optimization": {"mics_shard_size": 8}}},
      "zero_optimization.mics_shard_size: MiCS was removed from DeepSpeed 0.19")],
)  # fmt: skip
def test_spec_refuses_misplaced_or_huge_configs(strategy: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        StrategySpec.model_validate(strategy)


def test_spec_accepts_a_config_on_deepspeed() -> None:
    for strategy in ({"type": "zero1", "deepspeedConfig": {"a": 1}},
                     {"type": "auto", "backend": "deepspeed", "deepspeedConfig": {"a": [1]}}):  # fmt: skip
        assert StrategySpec.model_validate(strategy).deepspeed_config is not None


def hpz_spec(size: Any) -> FineTuneJobSpec:
    return _spec({"type": "zero3", "backend": "deepspeed",
                  "deepspeedConfig": {"zero_optimization": {"zero_hpz_partition_size": size}}})  # fmt: skip


@pytest.mark.parametrize(
    ("size", "world", "effective", "overridden"),
    [
        pytest.param(2, 4, 2, [], id="divides"),
        pytest.param(8, 4, 8, [], id="larger-than-the-world: DeepSpeed takes the world"),
        pytest.param(
            4,
            6,
            1,
            ["zero_optimization.zero_hpz_partition_size"],
            id="re-formed-to-a-world-it-does-not-divide",
        ),
    ],
)
def test_hpz_runs_where_deepspeed_can_form_its_groups(
    size: int, world: int, effective: int, overridden: list[str]
) -> None:
    """hpZ's group is min(size, world) ranks, which must divide the world (DeepSpeed asserts
    it): at an elastic world it does not divide, the trainer runs without hpZ and says so."""
    config, got = deepspeed_config(hpz_spec(size), _plan("zero3"), world_size=world,
                                   grad_accum=1)  # fmt: skip
    assert config["zero_optimization"]["zero_hpz_partition_size"] == effective
    assert got == overridden
    assert hpz_group(size, world) == (1 if overridden else min(size, world))


def test_hpz_size_read_from_the_users_config() -> None:
    assert hpz_partition_size(None) == 1
    assert hpz_partition_size({"zero_optimization": {"stage": 3}}) == 1
    assert hpz_partition_size({"zero_optimization": {"zero_hpz_partition_size": 8}}) == 8
    assert hpz_partition_size({"zero_optimization": {"zero_hpz_partition_size": True}}) == 1
