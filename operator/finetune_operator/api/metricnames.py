"""Every Prometheus series the trainer and the operator export: the one contract that the
trainer, the operator (which scrapes the trainer), the chart's alerts and dashboards, the docs
(docs/metrics.md) and the tests read. A name spelled anywhere else is a defect.

Names are the exposed family names: a counter's samples are `<name>` (ending in `_total`), a
histogram's are `<name>_bucket`, `_sum` and `_count`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

MetricType = Literal["counter", "gauge", "histogram"]
COUNTER: Final = "counter"
GAUGE: Final = "gauge"
HISTOGRAM: Final = "histogram"

# Label keys. Never `job` (Prometheus owns it): the FineTuneJob is `finetunejob`.
LABEL_FINETUNEJOB: Final = "finetunejob"
LABEL_NAMESPACE: Final = "namespace"
LABEL_RANK: Final = "rank"
LABEL_STATE: Final = "state"
LABEL_ROUND: Final = "round"


@dataclass(frozen=True)
class Metric:
    name: str
    type: MetricType
    labels: tuple[str, ...]
    help: str

    @property
    def family(self) -> str:
        """The name prometheus_client is given (it appends `_total` to counters itself)."""
        return self.name.removesuffix("_total") if self.type == COUNTER else self.name


TRAINER_LABELS: Final = (LABEL_FINETUNEJOB, LABEL_RANK)
JOB_LABELS: Final = (LABEL_NAMESPACE, LABEL_FINETUNEJOB)


def _trainer(name: str, kind: MetricType, help_text: str) -> Metric:
    return Metric(f"finetune_trainer_{name}", kind, TRAINER_LABELS, help_text)


# --- trainer (one endpoint per local rank; namespace/pod come from the scrape target) ---
TRAINER_STEP: Final = _trainer("step", GAUGE, "Last completed optimizer step.")
TRAINER_TOTAL_STEPS: Final = _trainer("total_steps", GAUGE, "Optimizer steps the job runs in all.")
TRAINER_LOSS: Final = _trainer("loss", GAUGE, "Training loss of the last step (mean over ranks).")
TRAINER_PEAK_MEMORY: Final = _trainer(
    "peak_memory_bytes", GAUGE, "Peak memory: CUDA max allocated, or process peak RSS on CPU."
)
TRAINER_REFORMS: Final = _trainer(
    "reforms",
    GAUGE,
    "Times torchrun restarted this rank's worker group after a failed group "
    "(TORCHELASTIC_RESTART_COUNT): a worker failed in its pod, or a peer left (its "
    "collectives failed); a peer joining does not count.",
)
TRAINER_OWN_FAILURE_RESTARTS: Final = _trainer(
    "own_failure_restarts",
    GAUGE,
    "Times torchrun restarted this pod's worker group after a failure of the pod's own (a "
    "rank here raised or was killed; a peer that left is not one), as its launcher read "
    "torchelastic's error files: the operator adds it to status.restarts (restartLedger).",
)
TRAINER_OWN_FAILURE_ROUND: Final = Metric(
    "finetune_trainer_own_failure_round",
    GAUGE,
    (*TRAINER_LABELS, LABEL_ROUND),
    "1 per rendezvous round (worker-group incarnation, `round`: its id, the same in every pod "
    "of the round) in which this pod's group failed of its own and torchrun restarted it: "
    "the operator counts each round once in status.restarts (restartLedger), however many "
    "pods failed in it.",
)
TRAINER_ROUND: Final = Metric(
    "finetune_trainer_round",
    GAUGE,
    (*TRAINER_LABELS, LABEL_ROUND),
    "1 for the rendezvous round (worker-group incarnation, `round`: its id, the same in every "
    "pod of the round) this rank trains in. The operator remembers each pod's last: when a "
    "pod is lost with its node, the round its peers then fail in (their collectives time out "
    "on it) is a node loss, not counted against maxRestarts (status.nodeLosses).",
)
TRAINER_LAST_CHECKPOINT_STEP: Final = _trainer(
    "last_checkpoint_step", GAUGE, "Step of the last committed checkpoint."
)
TRAINER_LAST_CHECKPOINT_TIME: Final = _trainer(
    "last_checkpoint_timestamp_seconds", GAUGE, "Unix time of the last committed checkpoint."
)
TRAINER_RESUMED_FROM_STEP: Final = _trainer(
    "resumed_from_step", GAUGE, "Checkpoint step this run resumed from at start (0: started fresh)."
)
TRAINER_SKIPPED_CHECKPOINT_STEP: Final = _trainer(
    "skipped_checkpoint_step",
    GAUGE,
    "Newest committed checkpoint found unusable and skipped at start (0: none).",
)
TRAINER_HEARTBEAT: Final = _trainer(
    "heartbeat_timestamp_seconds",
    GAUGE,
    "Unix time at which this rank's loop last made progress (each micro-batch): a slow step "
    "still beats, a hung rank does not.",
)
TRAINER_PROCESS_START: Final = _trainer(
    "process_start_time_seconds",
    GAUGE,
    "Unix time at which this trainer process started: a new value is a new process, even on the "
    "same pod, rank and torchelastic restart count.",
)
TRAINER_TOKENS: Final = _trainer("tokens_total", COUNTER, "Tokens trained on by this rank.")
TRAINER_STEP_DURATION: Final = _trainer("step_duration_seconds", HISTOGRAM, "Wall time per step.")
TRAINER_COMPUTE_DURATION: Final = _trainer(
    "compute_duration_seconds",
    HISTOGRAM,
    "This rank's own work per step (forward, backward, optimizer), without waiting.",
)
TRAINER_WAIT_DURATION: Final = _trainer(
    "wait_duration_seconds", HISTOGRAM, "Time per step blocked at the sync point."
)
TRAINER_CHECKPOINT_BLOCKING: Final = _trainer(
    "checkpoint_blocking_seconds",
    HISTOGRAM,
    "Per save, time the loop was blocked in the save call and waiting for staging.",
)
TRAINER_CHECKPOINT_STALL: Final = _trainer(
    "checkpoint_stall_seconds",
    HISTOGRAM,
    "Per save, training time it cost: save call + excess step time while in flight.",
)
TRAINER_CHECKPOINT_FAILURES: Final = _trainer(
    "checkpoint_failures_total", COUNTER, "Checkpoint saves that failed (not committed)."
)
TRAINER_LAST_FAILED_CHECKPOINT_STEP: Final = _trainer(
    "last_failed_checkpoint_step", GAUGE, "Step of the last checkpoint save that failed; 0: none."
)
TRAINER_CHECKPOINT_SAVE_DURATION: Final = _trainer(
    "checkpoint_save_duration_seconds", HISTOGRAM, "Start of a save to its commit."
)

# --- operator (one endpoint; per-job series keyed by namespace and finetunejob) ---
OPERATOR_JOBS: Final = Metric(
    "finetune_operator_jobs",
    GAUGE,
    (LABEL_STATE,),
    "FineTuneJobs known to this operator, by phase.",
)
OPERATOR_RECONCILE_DURATION: Final = Metric(
    "finetune_operator_reconcile_duration_seconds",
    HISTOGRAM,
    (),
    "Wall time of one reconcile pass of one FineTuneJob (decide, apply, patch).",
)
OPERATOR_RECONCILE_ERRORS: Final = Metric(
    "finetune_operator_reconcile_errors_total",
    COUNTER,
    (),
    "Reconcile passes that failed (API errors, planner errors) and will be retried.",
)
OPERATOR_EVICTIONS: Final = Metric(
    "finetune_operator_evictions_total", COUNTER, JOB_LABELS, "Straggler pods evicted."
)
OPERATOR_STRAGGLER_RATIO: Final = Metric(
    "finetune_operator_straggler_ratio",
    GAUGE,
    (*JOB_LABELS, LABEL_RANK),
    "Per-rank median compute time over the other ranks' median in the latest detection window.",
)
OPERATOR_RESTARTS: Final = Metric(
    "finetune_operator_restarts_total",
    COUNTER,
    JOB_LABELS,
    "Failure restarts (failed pods replaced, hang restarts, torchrun's restarts inside a pod "
    "after failures of the pod's own, as its trainers or its end report them), as status.restarts "
    "counts them against faultTolerance.maxRestarts, also those counted in a pass that took "
    "others back.",
)
OPERATOR_FORGIVEN_RESTARTS: Final = Metric(
    "finetune_operator_forgiven_restarts_total",
    COUNTER,
    JOB_LABELS,
    "Restarts taken back out of status.restarts (rounds moved from restartLedger to "
    "forgivenRounds, or a decrease): a failure counted before "
    "the operator found that a pod of the round was lost with its node (status."
    "forgivenRounds). finetune_operator_restarts_total minus this follows status.restarts.",
)
OPERATOR_PREEMPTIONS: Final = Metric(
    "finetune_operator_preemptions_total",
    COUNTER,
    JOB_LABELS,
    "Worker pods replaced after a preemption (a graceful stop, eviction, node shutdown or the "
    "loss of the rendezvous store): the increments of status.preemptions, never counted "
    "against faultTolerance.maxRestarts.",
)
OPERATOR_HANGS: Final = Metric(
    "finetune_operator_hangs_total",
    COUNTER,
    JOB_LABELS,
    "Hangs detected (no progress for faultTolerance.hangTimeoutSeconds); each restarts the workers.",
)

TRAINER_METRICS: Final = (
    TRAINER_STEP,
    TRAINER_TOTAL_STEPS,
    TRAINER_STEP_DURATION,
    TRAINER_COMPUTE_DURATION,
    TRAINER_WAIT_DURATION,
    TRAINER_LOSS,
    TRAINER_TOKENS,
    TRAINER_CHECKPOINT_BLOCKING,
    TRAINER_CHECKPOINT_STALL,
    TRAINER_CHECKPOINT_FAILURES,
    TRAINER_LAST_FAILED_CHECKPOINT_STEP,
    TRAINER_CHECKPOINT_SAVE_DURATION,
    TRAINER_LAST_CHECKPOINT_STEP,
    TRAINER_LAST_CHECKPOINT_TIME,
    TRAINER_RESUMED_FROM_STEP,
    TRAINER_SKIPPED_CHECKPOINT_STEP,
    TRAINER_REFORMS,
    TRAINER_OWN_FAILURE_RESTARTS,
    TRAINER_OWN_FAILURE_ROUND,
    TRAINER_ROUND,
    TRAINER_PEAK_MEMORY,
    TRAINER_HEARTBEAT,
    TRAINER_PROCESS_START,
)
OPERATOR_METRICS: Final = (
    OPERATOR_JOBS,
    OPERATOR_RECONCILE_DURATION,
    OPERATOR_RECONCILE_ERRORS,
    OPERATOR_EVICTIONS,
    OPERATOR_STRAGGLER_RATIO,
    OPERATOR_RESTARTS,
    OPERATOR_FORGIVEN_RESTARTS,
    OPERATOR_PREEMPTIONS,
    OPERATOR_HANGS,
)
ALL_METRICS: Final = (*TRAINER_METRICS, *OPERATOR_METRICS)
