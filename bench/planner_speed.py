"""Time plan_job over the whole candidate space (prints figures; not a timed test).

Usage: python bench/planner_speed.py
"""

from __future__ import annotations

import time

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


if __name__ == "__main__":
    main()
