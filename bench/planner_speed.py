"""Time plan_job over the whole candidate space (prints figures; not a timed test).

The second table shows that the cost of a plan does not grow with resources.maxGPUs (issue 11.5):
the same job planned with maxGPUs 8, the largest the API accepts, and 1e8 / 1e18 (which the API
refuses; forced past validation here to show the planner alone is bounded too), with the time
and the peak Python memory of each, as ratios to maxGPUs 8.

Usage: python bench/planner_speed.py
"""

from __future__ import annotations

import time
import tracemalloc

from pydantic import ValidationError

from finetune_operator.api.limits import MAX_GPUS
from finetune_operator.api.spec import FineTuneJobSpec
from finetune_operator.planner import plan_job

CASES = {
    "405B full, 8xH100 nodes, seq 4096 (fits)": {
        "training": {"sequenceLength": 4096, "globalBatchSize": 512, "maxSteps": 1000}
    },
    "405B full, seq 8192 (nothing fits: full search + hints)": {
        "training": {"sequenceLength": 8192, "globalBatchSize": 512, "maxSteps": 1000}
    },
    "405B full, L4 24 GB (nothing fits)": {
        "training": {"sequenceLength": 4096, "globalBatchSize": 512, "maxSteps": 1000},
        "resources": {"gpu": {"product": "L4"}, "gpusPerNode": 8},
    },
}


def spec(overrides: dict[str, dict[str, object]]) -> FineTuneJobSpec:
    base: dict[str, dict[str, object]] = {
        "model": {"name": "meta-llama/Llama-3.1-405B"},
        "dataset": {"uri": "data.jsonl"},
        "resources": {"gpu": {"product": "H100-80GB"}, "gpusPerNode": 8},
    }
    base.update(overrides)
    return FineTuneJobSpec.model_validate(base)


def main(repeats: int = 20) -> None:
    for name, overrides in CASES.items():
        job = spec(overrides)
        plan_job(job)  # warm the catalog cache
        start = time.perf_counter()
        for _ in range(repeats):
            plan = plan_job(job)
        ms = (time.perf_counter() - start) / repeats * 1000
        print(
            f"{name}: {ms:.1f} ms per plan_job, {plan.candidates_evaluated} candidates, "
            f"fits={plan.fits}, {plan.world_size} GPUs {plan.strategy}"
        )


MAX_GPUS_CASES = {
    "405B full seq 4096 (fits)": CASES["405B full, 8xH100 nodes, seq 4096 (fits)"],
    "405B full L4 (nothing fits)": CASES["405B full, L4 24 GB (nothing fits)"],
}


def measure(job: FineTuneJobSpec) -> tuple[float, float, int]:
    """(ms per plan, peak MiB traced, candidates) of one plan_job."""
    plan_job(job)
    tracemalloc.start()
    start = time.perf_counter()
    plan = plan_job(job)
    ms = (time.perf_counter() - start) * 1000
    peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    return ms, peak, plan.candidates_evaluated


def max_gpus_table() -> None:
    for name, overrides in MAX_GPUS_CASES.items():
        base = spec(overrides)
        rows = []
        for max_gpus in (8, 1024, MAX_GPUS, 10**8, 10**18):
            try:
                validated = spec(
                    {
                        **overrides,
                        "resources": {**base.resources.to_json_dict(), "maxGPUs": max_gpus},
                    }
                )
                note = "accepted by the API"
            except ValidationError:
                validated = None
                note = "refused by the API (planned here past validation)"
            job = validated or base.model_copy(
                update={"resources": base.resources.model_copy(update={"max_gpus": max_gpus})}
            )
            rows.append((max_gpus, note, *measure(job)))
        ms0, mib0 = rows[0][2], rows[0][3]
        print(f"\n{name}: cost by maxGPUs (ratios to maxGPUs 8)")
        for max_gpus, note, ms, mib, cands in rows:
            print(
                f"  maxGPUs {max_gpus:>20}: {ms:8.1f} ms ({ms / ms0:4.2f}x), peak {mib:6.2f} MiB "
                f"({mib / mib0:4.2f}x), {cands} candidates; {note}"
            )


if __name__ == "__main__":
    main()
    max_gpus_table()
