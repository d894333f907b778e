"""Spec builders shared by the planner tests."""

from __future__ import annotations

from typing import Any

from finetune_operator.api.spec import FineTuneJobSpec


def make_spec(**sections: dict[str, Any]) -> FineTuneJobSpec:
    """A job spec from camelCase sections merged over a 7B-on-H100 default."""
    base: dict[str, Any] = {
        "model": {"name": "meta-llama/Llama-2-7b-hf"},
        "dataset": {"uri": "data.jsonl"},
        "training": {"sequenceLength": 2048, "globalBatchSize": 16, "maxSteps": 100},
        "resources": {"gpu": {"product": "H100-80GB"}, "gpusPerNode": 8},
    }
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value}
    return FineTuneJobSpec.model_validate(base)
