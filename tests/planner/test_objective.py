"""The planner's objective and the one story a plan tells (table, reason, Planned condition)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from finetune_operator.api.plan import Plan
from finetune_operator.api.spec import FineTuneJobSpec
from finetune_operator.planner import plan_job, render_plan
from tests.planner.planner_specs import make_spec

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))

# 8B LoRA on up to 8 H100s (the shape of examples/llama-3.1-8b-lora.yaml).
LORA_8B: dict[str, Any] = {
    "model": {"name": "meta-llama/Llama-3.1-8B"},
    "method": {"type": "lora"},
    "training": {"sequenceLength": 4096, "globalBatchSize": 64, "maxSteps": 2000},
    "resources": {"gpu": {"product": "H100-80GB"}, "gpusPerNode": 8, "maxGPUs": 8},
}


def _spec(objective: str | None, max_gpus: int | None = 8) -> FineTuneJobSpec:
    res = {**LORA_8B["resources"], "maxGPUs": max_gpus}
    if objective is not None:
        res["objective"] = objective
    return make_spec(**{**LORA_8B, "resources": res})


@pytest.mark.parametrize(
    ("objective", "max_gpus", "world"),
    [
        pytest.param("fewest-gpus", 8, 1, id="fewest-gpus-takes-one-gpu"),
        pytest.param("fastest", 8, 8, id="fastest-uses-the-bound"),
        pytest.param(None, 8, 8, id="auto-with-maxGPUs-is-fastest"),
        pytest.param(None, None, 1, id="auto-without-bound-is-fewest"),
    ],
)
def test_objective_picks_the_world_size(
    objective: str | None, max_gpus: int | None, world: int
) -> None:
    plan = plan_job(_spec(objective, max_gpus))
    assert plan.fits and plan.world_size == world


def test_fastest_is_faster_and_lowest_cost_is_cheapest() -> None:
    plans = {o: plan_job(_spec(o)) for o in ("fewest-gpus", "fastest", "lowest-cost")}
    assert plans["fastest"].estimated_step_seconds < plans["fewest-gpus"].estimated_step_seconds
    assert plans["lowest-cost"].gpu_hours <= min(p.gpu_hours for p in plans.values())
    for objective, plan in plans.items():
        assert plan.objective == objective and f"Objective {objective}" in plan.reason


def _story(plan: Plan) -> tuple[int, int, int]:
    """(world size, micro-batch, accumulation) as the reason's first sentence states them."""
    m = re.match(
        r"(\d+) x .*?: \S+(?:, offload \w+)?, micro-batch (\d+) x (\d+) accumulation", plan.reason
    )
    assert m, plan.reason
    return int(m[1]), int(m[2]), int(m[3])


def _table(text: str, key: str) -> str:
    line = next(ln for ln in text.splitlines() if ln.startswith(key))
    return line[len(key) :].strip()


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_example_tells_one_story(path: Path) -> None:
    """Table, reason (which is also the Planned condition's message) and Plan fields agree."""
    spec = FineTuneJobSpec.model_validate(yaml.safe_load(path.read_text())["spec"])
    plan = plan_job(spec)
    text = render_plan(plan)
    if not plan.fits:
        pytest.fail(f"{path.name} does not fit: {plan.reason}")
    assert _story(plan) == (
        plan.world_size,
        plan.micro_batch_size,
        plan.gradient_accumulation_steps,
    )
    assert _table(text, "World size").startswith(f"{plan.world_size} (")
    assert _table(text, "Micro-batch") == (
        f"{plan.micro_batch_size} x {plan.gradient_accumulation_steps} accumulation steps"
    )
    per = "per process" if spec.resources.device == "cpu" else "per GPU"
    assert per in plan.reason and ("Memory " + per) in text
    if spec.resources.device == "cpu":
        assert "Memory per GPU" not in text and "GPU:" not in plan.reason
