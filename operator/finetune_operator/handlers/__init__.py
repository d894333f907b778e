"""kopf handlers: the only package that talks kopf. Glue only: read, call pure, apply, patch.

Run it with `ftjob operator` (flags: `finetune_operator.settings`), or in-process with
`await operate(settings, ...)` / `run_operator(settings)`. Settings reach the handlers through
kopf's memo; nothing here reads the environment. Importing this package registers every
handler with kopf's default registry:

- jobs.py: startup and login, the pods index, each FineTuneJob's create/resume/update/timer/
  delete handlers, the liveness probe;
- workloads.py: Kueue's Workloads (read for a pass, events nudging the job's timer, as the
  deletion of a pod a Workload step waits on does, the resource-in-use finalizer of a job
  that is gone);
- passes.py: the reconcile pass every job handler runs (apply, status, Events, metrics);
- entry.py: operate / run_operator.
"""

from finetune_operator.handlers import jobs, workloads
from finetune_operator.handlers.entry import NoClusterError, operate, run_operator
from finetune_operator.handlers.jobs import TIMER_TICK_SECONDS
from finetune_operator.handlers.workloads import job_pod_deleted, owner_job, workload_changed

__all__ = [
    "TIMER_TICK_SECONDS",
    "NoClusterError",
    "job_pod_deleted",
    "jobs",
    "operate",
    "owner_job",
    "run_operator",
    "workload_changed",
    "workloads",
]
