"""Memory planner (DESIGN.md §4): how many GPUs, which strategy, micro-batch and checkpointing.

Public API: `plan_job(spec) -> Plan`, `PlanningError`, and the per-candidate estimator
`estimate_memory(model, TrainingShape, Candidate) -> MemoryEstimate` with `resolve_model` /
`shape_of` to build its `ModelShape`. Nothing here imports torch.
"""

from finetune_operator.planner.architecture import ModelShape, resolve_model, shape_of
from finetune_operator.planner.configuration import Candidate, TrainingShape
from finetune_operator.planner.errors import PlanningError
from finetune_operator.planner.memory import MemoryEstimate, estimate_memory
from finetune_operator.planner.planning import plan_job
from finetune_operator.planner.report import render_plan

__all__ = [
    "Candidate",
    "MemoryEstimate",
    "ModelShape",
    "PlanningError",
    "TrainingShape",
    "estimate_memory",
    "plan_job",
    "render_plan",
    "resolve_model",
    "shape_of",
]
