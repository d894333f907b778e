"""FineTuneJob status (DESIGN.md §3). Conditions are the source of truth; phase is derived."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from finetune_operator.api.base import ApiModel
from finetune_operator.api.plan import Plan


class Condition(ApiModel):
    type: str = Field(..., description="Planned, WorkersReady, Succeeded, Failed, ...")
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(..., description="One CamelCase word.")
    message: str = Field("", description="Human-readable detail.")
    last_transition_time: str = Field(..., description="RFC 3339 time of the last change.")
    observed_generation: int | None = Field(None, ge=0)


class CheckpointRef(ApiModel):
    step: int = Field(..., ge=0)
    uri: str
    time: str | None = None


class Eviction(ApiModel):
    pod: str
    node: str | None = None
    rank: int | None = None
    ratio: float | None = None
    time: str


class NodeLoss(ApiModel):
    """A pod lost with its node and force-deleted by the operator (reconcile/nodeloss.py)."""

    pod: str
    node: str
    time: str = Field(..., description="When the operator force-deleted it.")
    down_seconds: int | None = Field(
        None, ge=0, description="How long its node had not been Ready (absent: Node deleted)."
    )
    round: str | None = Field(
        None,
        description="The rendezvous round the pod was last seen training in: the failure its "
        "peers then report for that round (their collectives timed out on it) is not counted.",
    )


class StragglerState(ApiModel):
    """A rank the detector found slow in the latest window(s): the detection state a restarted
    operator picks up again."""

    rank: int = Field(..., ge=0)
    pod: str | None = None
    node: str | None = None
    ratio: float = Field(..., description="Compute time over the cross-rank median, last window.")
    streak: int = Field(..., ge=0, description="Consecutive slow windows.")
    step: int = Field(0, ge=0, description="Last step of the latest window.")
    confirmed: bool = Field(False, description="streak reached consecutiveWindows.")


class FineTuneJobStatus(ApiModel):
    conditions: list[Condition] = Field(default_factory=list)
    phase: str | None = Field(None, description="Derived from conditions, for kubectl get.")
    plan: Plan | None = None
    world_size: int | None = Field(None, ge=0, description="Planned world size (GPUs).")
    strategy: str | None = Field(None, description="Planned strategy.")
    ready_workers: int | None = Field(None, ge=0, description="Worker pods running.")
    step: int | None = Field(None, ge=0, description="Last optimizer step seen.")
    total_steps: int | None = Field(None, ge=0)
    loss: float | None = Field(None, description="Last reported loss.")
    last_checkpoint: CheckpointRef | None = None
    resumed_from_step: int | None = Field(
        None, ge=0, description="Checkpoint step the running trainers resumed from (0: fresh)."
    )
    skipped_checkpoints: list[int] = Field(
        default_factory=list,
        description="Committed checkpoint steps the trainers found unusable and skipped "
        "(newest 10).",
    )
    restarts: int = Field(
        0,
        ge=0,
        description="Failure restarts counted against faultTolerance.maxRestarts: failed pods "
        "replaced, hang restarts, and the restarts torchrun made inside a pod after a failure "
        "of the pod's own (its trainers export them while they run, its crash report says "
        "them when it gives up, its launcher when it is stopped). Each failed rendezvous "
        "round counts once (restartLedger): a failure every pod hits at once is one restart, "
        "failures in different rounds (alternating between pods) are each counted; peers "
        "that left and preemptions are not counted. Lowered only when a pod is found lost "
        "with its node: the round its peers failed in on its account, counted before that "
        "was known, is taken back (forgivenRounds).",
    )
    restart_ledger: list[str] = Field(
        default_factory=list,
        description="The ids of the failed rendezvous rounds (worker-group incarnations) "
        "counted in restarts, so that a round reported again (by another pod, on the "
        "next scrape, or in a pod's crash report) adds nothing. At most maxRestarts + 1 ids: "
        "each spends the budget.",
    )
    forgiven_rounds: list[str] = Field(
        default_factory=list,
        description="The ids of the failed rendezvous rounds a pod lost with its node accounts "
        "for (at most one each: nodeLosses): never counted in restarts, and taken out of "
        "restartLedger and restarts if they were counted before the loss was known.",
    )
    preemptions: int = Field(
        0,
        ge=0,
        description="Pods replaced after a preemption (a graceful SIGTERM stop, eviction, node "
        "shutdown) or the loss of the rendezvous store: not counted against maxRestarts.",
    )
    node_losses: list[NodeLoss] = Field(
        default_factory=list,
        description="Pods lost with their node and force-deleted so that their replacements "
        "could start (the newest 10): each a preemption, and the round it was training in is "
        "not counted against maxRestarts.",
    )
    evictions: list[Eviction] = Field(default_factory=list)
    excluded_nodes: list[str] = Field(default_factory=list)
    stragglers: list[StragglerState] = Field(
        default_factory=list, description="Ranks found slow in the latest detection windows."
    )
    last_progress_time: str | None = Field(
        None, description="When the step last advanced (or the workers last (re)started)."
    )
    hangs: int = Field(0, ge=0, description="Hangs detected (each restarted the workers).")
    start_time: str | None = None
    completion_time: str | None = None
    observed_generation: int | None = Field(None, ge=0)
    workload: str | None = Field(
        None,
        description="The job's Kueue Workload (its name, in the job's namespace) while the job "
        "is queued in Kueue: read on every pass, also once the queue-name label is removed, so "
        "that its quota is given back.",
    )
