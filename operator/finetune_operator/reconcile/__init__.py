"""Pure reconcile functions (no API calls, no clocks) and, in `apply`, the thin API I/O."""

from finetune_operator.reconcile.actions import Actions, ObjectRef, PodDeletion, decide_actions
from finetune_operator.reconcile.conditions import EventSpec, derive_phase, set_condition
from finetune_operator.reconcile.core import Outcome, read_status, reconcile_job, status_patch
from finetune_operator.reconcile.evaluation import (
    Evaluation,
    JobRef,
    PlanFn,
    default_planner,
    evaluate_job,
)
from finetune_operator.reconcile.health import HealthInput
from finetune_operator.reconcile.observed import PodView, format_time, observe_pod
from finetune_operator.reconcile.progress import (
    ScrapeTarget,
    TrainerProgress,
    combine_progress,
    merge_progress,
    own_rounds_by_pod,
    parse_termination_message,
    parse_trainer_metrics,
    progress_events,
    rounds_by_pod,
    scrape_targets,
)
from finetune_operator.reconcile.samples import RankSample, RecordBuffer, parse_rank_samples
from finetune_operator.reconcile.status import (
    compute_status,
    note_apply_errors,
    note_checkpoint_health,
)

__all__ = [
    "Actions",
    "Evaluation",
    "EventSpec",
    "HealthInput",
    "JobRef",
    "ObjectRef",
    "Outcome",
    "PlanFn",
    "PodDeletion",
    "PodView",
    "RankSample",
    "RecordBuffer",
    "ScrapeTarget",
    "TrainerProgress",
    "combine_progress",
    "compute_status",
    "decide_actions",
    "default_planner",
    "derive_phase",
    "evaluate_job",
    "format_time",
    "merge_progress",
    "note_apply_errors",
    "note_checkpoint_health",
    "observe_pod",
    "own_rounds_by_pod",
    "parse_rank_samples",
    "parse_termination_message",
    "parse_trainer_metrics",
    "progress_events",
    "read_status",
    "reconcile_job",
    "rounds_by_pod",
    "scrape_targets",
    "set_condition",
    "status_patch",
]
