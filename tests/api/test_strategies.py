"""The strategy table (api/strategies.py): one row per (strategy, backend), read by the planner,
the capability check and the trainer."""

from __future__ import annotations

from typing import get_args

import pytest

from finetune_operator.api.plan import MemoryBreakdown, Plan
from finetune_operator.api.spec import StrategyName
from finetune_operator.api.strategies import STRATEGIES, Strategy, StrategyTable

DEEPSPEED_ROWS = [("zero1", "deepspeed"), ("zero2", "deepspeed"), ("zero3", "deepspeed")]
WITH_DEEPSPEED = STRATEGIES.implementing(DEEPSPEED_ROWS)
TORCH_ONLY = STRATEGIES.without("deepspeed")


def test_every_strategy_name_has_exactly_one_canonical_row() -> None:
    for name in get_args(StrategyName):
        rows = STRATEGIES.by_name(name)
        assert rows, name
        assert len([r for r in rows if r.runs_as is None]) == 1, name
        assert STRATEGIES.canonical(name).name == name


@pytest.mark.parametrize(
    ("name", "backend", "expected"),
    [
        ("ddp", "auto", ("ddp", "fsdp")),
        ("ddp", "deepspeed", ("ddp", "fsdp")),  # DDP is torch's under any backend
        ("zero1", "auto", ("zero1", "deepspeed")),
        ("zero3", "auto", ("zero3", "fsdp")),  # the torch alias first: FSDP2 full shard
        ("zero3", "fsdp", ("zero3", "fsdp")),
        ("zero3", "deepspeed", ("zero3", "deepspeed")),
        ("fsdp-hybrid", "auto", ("fsdp-hybrid", "fsdp")),
    ],
)
def test_resolve(name: StrategyName, backend: str, expected: tuple[str, str]) -> None:
    for table in (TORCH_ONLY, WITH_DEEPSPEED):
        row = table.resolve(name, backend)
        assert (row.name, row.backend) == expected


@pytest.mark.parametrize(
    ("name", "stage"),
    [("ddp", 0), ("zero1", 1), ("zero2", 2), ("zero3", 3), ("fsdp-full-shard", 3)],
)
def test_zero_stage_follows_what_is_sharded(name: StrategyName, stage: int) -> None:
    assert STRATEGIES.canonical(name).zero_stage == stage


def test_zero3_on_fsdp_runs_as_fsdp_full_shard() -> None:
    row = STRATEGIES.resolve("zero3", "fsdp")
    assert STRATEGIES.effective(row) == STRATEGIES.canonical("fsdp-full-shard")
    assert STRATEGIES.canonical("zero3").backend == "deepspeed"


def _names(rows: list[Strategy]) -> list[str]:
    return [f"{r.name}/{r.backend}" for r in rows]


def test_auto_backend_searches_what_the_trainer_implements() -> None:
    assert _names(TORCH_ONLY.searched("auto")) == [
        "ddp/fsdp", "fsdp-shard-grad-op/fsdp", "fsdp-hybrid/fsdp", "fsdp-full-shard/fsdp",
    ]  # fmt: skip
    assert _names(WITH_DEEPSPEED.searched("auto")) == [
        "ddp/fsdp", "zero1/deepspeed", "zero2/deepspeed", "fsdp-shard-grad-op/fsdp",
        "fsdp-hybrid/fsdp", "fsdp-full-shard/fsdp", "zero3/deepspeed",
    ]  # fmt: skip


def test_explicit_backend_searches_its_rows_first_implemented_or_not() -> None:
    for table in (TORCH_ONLY, WITH_DEEPSPEED):
        assert _names(table.searched("deepspeed")) == [
            "zero1/deepspeed", "zero2/deepspeed", "zero3/deepspeed", "ddp/fsdp",
        ]  # fmt: skip
        assert _names(table.searched("fsdp")) == _names(TORCH_ONLY.searched("auto"))


def test_table_copies_leave_the_original_alone() -> None:
    assert not STRATEGIES.without("fsdp").resolve("ddp", "auto").implemented
    assert STRATEGIES.resolve("ddp", "auto").implemented
    with pytest.raises(KeyError, match="no such rows"):
        STRATEGIES.implementing([("zero1", "fsdp")])


def test_duplicate_rows_are_rejected() -> None:
    row = STRATEGIES.canonical("ddp")
    with pytest.raises(ValueError, match="duplicate"):
        StrategyTable((row, row))


def test_plan_backend_uses_the_spec_vocabulary() -> None:
    zero = MemoryBreakdown(
        parameters=0, gradients=0, optimizer=0, activations=0, buffers=0, peak=0, reserved=0,
        total=0,
    )  # fmt: skip
    raw = {
        "fits": True, "worldSize": 1, "nodes": 1, "gpusPerNode": 1, "strategy": "ddp",
        "microBatchSize": 1, "gradientAccumulationSteps": 1, "activationCheckpointing": False,
        "gpuMemoryBytes": 1, "headroom": 0.5, "estimatedStepSeconds": 1.0, "reason": "",
        "memory": zero.to_json_dict(),
    }  # fmt: skip
    assert Plan.model_validate(raw).backend == "fsdp"
    # A plan written before the rename (status, ConfigMap) still reads, as fsdp.
    assert Plan.model_validate({**raw, "backend": "torch"}).backend == "fsdp"
    with pytest.raises(ValueError, match="backend"):
        Plan.model_validate({**raw, "backend": "megatron"})
