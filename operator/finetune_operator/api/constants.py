"""Names shared by the operator, the trainer and the chart: one place for every key."""

from __future__ import annotations

from typing import Final

GROUP: Final = "finetune.dev"
VERSION: Final = "v1alpha1"
API_VERSION: Final = f"{GROUP}/{VERSION}"
KIND: Final = "FineTuneJob"
PLURAL: Final = "finetunejobs"
SINGULAR: Final = "finetunejob"
SHORT_NAMES: Final = ("ftj",)

# Inline (randomly initialised) models train with the trainer's byte-level tokenizer: ids 0-255
# are the bytes, then <bos>, <eos>, <pad>. Their vocabSize must hold every one of these ids.
BYTE_TOKENIZER_VOCAB: Final = 259
CRD_NAME: Final = f"{PLURAL}.{GROUP}"

# Labels on every object a job owns.
LABEL_JOB: Final = f"{GROUP}/job"
LABEL_ROLE: Final = f"{GROUP}/role"
LABEL_WORKER_INDEX: Final = f"{GROUP}/worker-index"
LABEL_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
MANAGED_BY: Final = "finetune-operator"
ROLE_RENDEZVOUS: Final = "rendezvous"
ROLE_WORKER: Final = "worker"

# Annotations.
ANNOTATION_RESTART_ATTEMPT: Final = f"{GROUP}/restart-attempt"
ANNOTATION_PROGRESS_PREFIX: Final = f"kopf.{GROUP}"

# Condition types (adjectives or past tense, Kubernetes API conventions).
COND_PLANNED: Final = "Planned"
COND_WORKERS_READY: Final = "WorkersReady"
COND_SUCCEEDED: Final = "Succeeded"
COND_FAILED: Final = "Failed"
COND_STRAGGLER_DETECTED: Final = "StragglerDetected"
COND_CHECKPOINT_FAILING: Final = "CheckpointFailing"
COND_HANG_DETECTED: Final = "HangDetected"
# Set only for gang-scheduled jobs, from the PodGroup's status (reconcile/gang.py).
COND_GANG_SCHEDULED: Final = "GangScheduled"
# Set only for jobs with Kueue's queue-name label once the label is not (or no longer) simply
# in effect: added or changed while the job ran, or Kueue unreadable (reconcile/queue_label.py).
COND_QUEUE_LABEL_APPLIED: Final = "QueueLabelApplied"

# Condition reasons: one CamelCase word each.
REASON_PLAN_FITS: Final = "PlanFits"
REASON_PLAN_INFEASIBLE: Final = "PlanInfeasible"
REASON_INVALID_SPEC: Final = "InvalidSpec"
REASON_UNSUPPORTED: Final = "Unsupported"  # valid, but not implemented by this trainer
REASON_NOT_ALLOWED: Final = "NotAllowed"  # valid, but outside the operator's job policy
# Refused for new jobs, kept with its old meaning for a job accepted before (api/spec_compat.py).
REASON_DEPRECATED_SPEC: Final = "DeprecatedSpec"
REASON_PENDING: Final = "Pending"
REASON_RUNNING: Final = "Running"
REASON_RESTARTING: Final = "Restarting"
REASON_SUSPENDED: Final = "Suspended"
REASON_COMPLETED: Final = "Completed"
REASON_BACKOFF_LIMIT_EXCEEDED: Final = "BackoffLimitExceeded"
# The trainer refused its configuration at start (e.g. a checkpoint or output directory that
# belongs to another job): restarting would refuse again, so the job fails at once.
REASON_TRAINER_REFUSED: Final = "TrainerRefused"
REASON_ALL_WORKERS_READY: Final = "AllWorkersReady"
REASON_WORKERS_NOT_READY: Final = "WorkersNotReady"
REASON_NO_STRAGGLER: Final = "NoStraggler"
REASON_STRAGGLER_FOUND: Final = "StragglerFound"  # confirmed; the action waits (budget, cooldown)
REASON_CHECKPOINT_SKIPPED: Final = "CheckpointSkipped"
REASON_PREEMPTED: Final = "Preempted"  # a pod stopped by a signal, eviction or node shutdown
# A pod lost with its node (Ready not True long enough), force-deleted (reconcile/nodeloss.py).
REASON_NODE_LOST: Final = "NodeLost"
# The operator may not read the Nodes of its pods (RBAC): it cannot tell a lost node's pods.
REASON_NODES_UNREADABLE: Final = "NodesUnreadable"
REASON_STRAGGLER_EVICTED: Final = "StragglerEvicted"
REASON_STRAGGLER_ALERTED: Final = "StragglerAlerted"
REASON_CHECKPOINT_SAVE_FAILED: Final = "CheckpointSaveFailed"
REASON_CHECKPOINTS_COMMITTING: Final = "CheckpointsCommitting"
REASON_NO_HANG: Final = "Progressing"
REASON_RANK_HUNG: Final = "RankHung"  # a rank's heartbeat went stale
REASON_NO_PROGRESS: Final = "NoProgress"  # no rank's step advanced
REASON_HANG_DETECTED: Final = "HangDetected"  # the Event of a hang restart
REASON_QUEUED: Final = "Queued"  # waiting for Kueue to admit the job's Workload
REASON_EVICTED: Final = "Evicted"  # Kueue evicted the Workload: workers stopped, waits
# The queue-name label was removed from a job Kueue knows: it leaves Kueue (workers stopped,
# its Workload deleted once they are gone, so the quota goes back), then runs outside it.
REASON_QUEUE_LABEL_REMOVED: Final = "QueueLabelRemoved"
# QueueLabelApplied's reasons (reconcile/queue_label.py).
REASON_ADDED_WHILE_RUNNING: Final = "AddedWhileRunning"  # runs on outside Kueue until it stops
REASON_CHANGED_WHILE_RUNNING: Final = "ChangedWhileRunning"  # runs on in the queue that admitted it
REASON_KUEUE_UNREADABLE: Final = "KueueUnreadable"  # its Workload cannot be read (kueue.enabled)
REASON_LABEL_APPLIED: Final = "Applied"
REASON_GANG_SCHEDULED: Final = "GangScheduled"  # the PodGroup's minMember placed together
REASON_WAITING_FOR_GANG: Final = "WaitingForGang"  # the gang scheduler cannot place it yet
REASON_GANG_TIMED_OUT: Final = "GangScheduleTimeout"  # Coscheduling's timeout; it retries
REASON_GANG_STATUS_UNKNOWN: Final = "GangStatusUnknown"  # unreadable, or a phase not known

# Phases, derived from conditions for `kubectl get` only.
PHASE_PENDING: Final = "Pending"
PHASE_RUNNING: Final = "Running"
PHASE_RESTARTING: Final = "Restarting"
PHASE_SUSPENDED: Final = "Suspended"
PHASE_SUCCEEDED: Final = "Succeeded"
PHASE_FAILED: Final = "Failed"
PHASES: Final = (
    PHASE_PENDING,
    PHASE_RUNNING,
    PHASE_RESTARTING,
    PHASE_SUSPENDED,
    PHASE_SUCCEEDED,
    PHASE_FAILED,
)

# Runtime topology (DESIGN.md §5).
RDZV_PORT: Final = 29400
METRICS_BASE_PORT: Final = 9400
CONFIG_MOUNT_DIR: Final = "/etc/finetune"
CONFIG_FILE_NAME: Final = "job.json"
CONFIG_PATH: Final = f"{CONFIG_MOUNT_DIR}/{CONFIG_FILE_NAME}"
# The worker pod's cache of tokenized training blocks (an emptyDir: it survives the trainer's
# restarts inside the pod and goes with the pod; finetune_trainer.data.cache).
DATA_CACHE_MOUNT_DIR: Final = "/var/cache/finetune"
DEFAULT_TRAINER_IMAGE: Final = "ghcr.io/finetune-operator/trainer:0.1.0"
# After SIGTERM, how long a worker's final checkpoint may take (the trainer's FT_GRACE_SECONDS
# default); torchrun SIGKILLs its workers TORCHRUN_STOP_SECONDS after forwarding SIGTERM.
FINAL_SAVE_GRACE_SECONDS: Final = 25.0
TORCHRUN_STOP_SECONDS: Final = 30.0

# The taints Kubernetes' node lifecycle controller puts on a node that stopped answering (Ready
# Unknown) or reports not ready (Ready False); pods tolerate them NoExecute for a bounded time.
TAINT_NODE_UNREACHABLE: Final = "node.kubernetes.io/unreachable"
TAINT_NODE_NOT_READY: Final = "node.kubernetes.io/not-ready"

# Checkpoint layout.
CHECKPOINT_STEP_PREFIX: Final = "step-"
CHECKPOINT_COMMITTED_MARKER: Final = "COMMITTED"


def config_map_name(job: str) -> str:
    return f"{job}-config"


def rendezvous_name(job: str) -> str:
    return f"{job}-rdzv"


def worker_name(job: str, index: int) -> str:
    return f"{job}-worker-{index}"


def checkpoint_dir_name(step: int) -> str:
    return f"{CHECKPOINT_STEP_PREFIX}{step:08d}"
