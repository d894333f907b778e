"""Bounded input (issue 11.5): the API refuses out-of-range counts, and the planner's cost
depends on the batch's divisors, never on resources.maxGPUs."""

from __future__ import annotations

import tracemalloc

import pytest
from planner_specs import make_spec
from pydantic import ValidationError

from finetune_operator.api import limits
from finetune_operator.api.spec import FineTuneJobSpec
from finetune_operator.planner import plan_job
from finetune_operator.planner.planning import build_problem
from finetune_operator.planner.search import divisors, world_sizes


def _forced(spec: FineTuneJobSpec, max_gpus: int) -> FineTuneJobSpec:
    """The spec with a maxGPUs the API refuses, set past validation (model_copy)."""
    return spec.model_copy(
        update={"resources": spec.resources.model_copy(update={"max_gpus": max_gpus})}
    )


@pytest.mark.parametrize(
    ("section", "values", "field"),
    [
        ("resources", {"maxGPUs": 10**8}, "maxGPUs"),
        ("resources", {"maxNodes": limits.MAX_NODES + 1}, "maxNodes"),
        ("training", {"globalBatchSize": 10**18}, "globalBatchSize"),
        ("training", {"maxSteps": 10**55}, "maxSteps"),
        ("training", {"microBatchSize": limits.MAX_MICRO_BATCH + 1}, "microBatchSize"),
        ("training", {"learningRate": float("inf")}, "learningRate"),
        ("training", {"epochs": float("nan")}, "epochs"),
        ("faultTolerance", {"maxRestarts": 1e55}, "maxRestarts"),
    ],
    ids=["maxGPUs", "maxNodes", "batch", "steps", "micro-batch", "inf", "nan", "restarts"],
)
def test_out_of_range_values_are_refused_naming_the_field(
    section: str, values: dict[str, object], field: str
) -> None:
    with pytest.raises(ValidationError) as err:
        make_spec(**{section: values})
    assert field in str(err.value)


def test_divisors_are_exact_and_ascending() -> None:
    for n in (1, 2, 12, 97, 720720, limits.MAX_GLOBAL_BATCH):
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]


@pytest.mark.timeout(120)
def test_world_sizes_do_not_grow_with_max_gpus() -> None:
    spec = make_spec(training={"globalBatchSize": 720720, "maxSteps": 10})  # 240 divisors
    sizes = world_sizes(build_problem(_forced(spec, 10**18)))
    # Whole 8-GPU nodes dividing the batch, below the API's pod limit: a few dozen, not 10^18.
    assert len(sizes) <= len(divisors(720720))
    assert max(sizes) <= limits.MAX_NODES * 8
    assert all(720720 % n == 0 and (n <= 8 or n % 8 == 0) for n in sizes)


@pytest.mark.timeout(120)
def test_a_huge_max_gpus_plans_like_the_largest_allowed_in_bounded_memory() -> None:
    spec = make_spec(
        model={"name": "meta-llama/Llama-3.1-405B"},
        training={"sequenceLength": 4096, "globalBatchSize": 512, "maxSteps": 10},
        resources={"maxGPUs": limits.MAX_GPUS},
    )
    allowed = plan_job(spec)
    tracemalloc.start()
    try:
        huge = plan_job(_forced(spec, 10**18))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert huge == allowed
    assert huge.candidates_evaluated == allowed.candidates_evaluated
    assert peak < 64 * 2**20, f"planning took {peak / 2**20:.0f} MiB"


def test_a_plan_never_launches_more_pods_than_the_api_allows() -> None:
    spec = make_spec(
        training={"globalBatchSize": 2**20, "maxSteps": 10},
        resources={"gpusPerNode": 1, "gpu": {"product": "L4"}},
        model={"name": "meta-llama/Llama-3.1-70B"},
    )
    sizes = world_sizes(build_problem(_forced(spec, limits.MAX_GPUS)))
    assert max(sizes) <= limits.MAX_NODES
