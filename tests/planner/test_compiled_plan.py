"""The plan carries the compile decision, and only compiled configurations it models get the
compiled activation count (planner/compiled.py)."""

from __future__ import annotations

from typing import Any

import pytest

from finetune_operator.planner import plan_job
from tests.planner.planner_specs import make_spec

PINNED = {"microBatchSize": 2, "activationCheckpointing": "none"}


def _plan(
    strategy: dict[str, Any], compile_blocks: bool = True, resources: dict[str, Any] | None = None
) -> Any:
    spec = make_spec(
        training=PINNED,
        strategy=strategy,
        resources={
            "gpusPerNode": 2,
            "maxGPUs": 2,
            "minNodes": 1,
            "maxNodes": 1,
            **(resources or {}),
        },
    )
    return plan_job(spec, compile_blocks=compile_blocks)


@pytest.mark.parametrize(
    ("strategy", "compiled", "fewer_activations"),
    [
        # FSDP2 casts parameters itself: no autocast, the compiled count applies.
        pytest.param({"type": "fsdp-full-shard"}, True, True, id="fsdp"),
        # DDP runs under autocast: compiled, but planned with the eager count (see memory.py).
        pytest.param({"type": "ddp"}, True, False, id="ddp-autocast"),
        # DeepSpeed's engine runs the blocks eager.
        pytest.param({"type": "zero2", "backend": "deepspeed"}, False, False, id="deepspeed"),
    ],
)
def test_plan_says_whether_blocks_compile(
    strategy: dict[str, Any], compiled: bool, fewer_activations: bool
) -> None:
    plan = _plan(strategy)
    eager = _plan(strategy, compile_blocks=False)
    assert plan.compiled_blocks is compiled
    assert eager.compiled_blocks is False
    assert (plan.memory.peak < eager.memory.peak) is fewer_activations
    assert plan.memory.peak <= eager.memory.peak


def test_cpu_jobs_never_compile() -> None:
    plan = _plan({"type": "ddp"}, resources={"device": "cpu", "gpu": {}, "memory": "200Gi"})
    assert plan.compiled_blocks is False
