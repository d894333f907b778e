"""kopf handlers of the operator itself and of FineTuneJobs: startup and login, the pods
index, the job's create/resume/update/timer/delete handlers (each one reconcile pass,
handlers.passes) and the liveness probe."""

from __future__ import annotations

import logging
import time
from typing import Any

import kopf

from finetune_operator import metrics
from finetune_operator.api.constants import (
    ANNOTATION_PROGRESS_PREFIX,
    GROUP,
    LABEL_JOB,
    PLURAL,
    VERSION,
)
from finetune_operator.handlers.passes import job_ref, job_state, reconcile_pass, settings_of
from finetune_operator.handlers.workloads import (
    forget_nudge,
    release_deleted_job_workload,
    take_nudge,
)
from finetune_operator.reconcile import PodView, default_planner, observe_pod
from finetune_operator.reconcile.apply import ClusterApi, load_api_client
from finetune_operator.resources.workload import KUEUE_GROUP, QUEUE_LABEL, WORKLOAD_PLURAL
from finetune_operator.settings import OperatorSettings

FTJ = (GROUP, VERSION, PLURAL)
# kopf fixes a timer's interval when the module is imported; the reconcile interval is a
# runtime setting, so the timer ticks often and each job's pass runs once its interval is due.
TIMER_TICK_SECONDS = 1.0


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # Progress and diff-base annotations under our own domain; nothing in status.kopf (the CRD
    # schema does not declare it and the API server would drop it silently).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix=ANNOTATION_PROGRESS_PREFIX
    )
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PROGRESS_PREFIX, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{ANNOTATION_PROGRESS_PREFIX}/finalizer"
    settings.posting.level = logging.WARNING  # our own Events say what happens; not kopf's
    ours: OperatorSettings = memo.setdefault("settings", OperatorSettings())
    settings.watching.server_timeout = ours.watch_timeout_seconds
    settings.watching.client_timeout = ours.watch_timeout_seconds + 10
    settings.watching.connect_timeout = 10
    # The pods and Workloads watched are the jobs' own: their handlers filter on LABEL_JOB
    # only in the operator (kopf's `labels=`), so without this the API server streams every
    # pod of the watched namespaces (the whole cluster when cluster-wide) for kopf to drop.
    # A kopf without server-side selectors (older releases) relies on the handlers' filter.
    selectors = getattr(settings.watching, "label_selectors", None)
    if selectors is not None:
        selectors["v1", "pods"] = LABEL_JOB
        selectors[KUEUE_GROUP, WORKLOAD_PLURAL] = LABEL_JOB
    settings.networking.request_timeout = 60
    if ours.peering:
        settings.peering.name, settings.peering.mandatory = ours.peering, True
        settings.peering.standalone = False
    elif not settings.peering.mandatory:
        settings.peering.standalone = True  # one replica (local mode): no peering objects
    if memo.get("cluster") is None:
        memo["cluster"] = ClusterApi(load_api_client(memo.get("kubeconfig")))
    # Jobs whose pass is due at the next timer tick (a Workload event; handlers.workloads). In
    # the root memo, which every object's memo copies shallowly: one dict shared by all handlers.
    memo.setdefault("nudged", {})
    memo.setdefault("awaiting_pods", set())  # jobs a pod's deletion nudges (handlers.workloads)
    if memo.get("planner") is None:
        memo["planner"] = default_planner()
    if ours.metrics_port:
        metrics.serve_metrics(ours.metrics_port)


@kopf.on.login()
def login(memo: kopf.Memo, **kwargs: Any) -> kopf.ConnectionInfo | None:
    """Log kopf in with the same credentials our client uses (a kubeconfig given in-process)."""
    cluster: ClusterApi | None = memo.get("cluster")
    if cluster is None:
        return kopf.login_via_client(**kwargs)
    cfg = cluster.core.api_client.configuration
    header = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix(
        "authorization"
    )
    scheme, _, token = (header or "").rpartition(" ")
    return kopf.ConnectionInfo(
        server=cfg.host,
        ca_path=cfg.ssl_ca_cert,
        insecure=not cfg.verify_ssl,
        scheme=scheme or None,
        token=token or None,
        certificate_path=cfg.cert_file,
        private_key_path=cfg.key_file,
    )


@kopf.index("v1", "pods", labels={LABEL_JOB: kopf.PRESENT})
def job_pods(
    namespace: str | None, body: kopf.Body, **_: Any
) -> dict[tuple[str | None, str], PodView]:
    view = observe_pod(body)
    return {(namespace, view.job): view}


@kopf.on.create(*FTJ)
async def created(body: kopf.Body, memo: Any, patch: kopf.Patch, logger: kopf.Logger, **kw: Any) -> None:  # fmt: skip
    await reconcile_pass(body, memo, patch, kw["job_pods"], logger)


@kopf.on.resume(*FTJ)
async def resumed(body: kopf.Body, memo: Any, patch: kopf.Patch, logger: kopf.Logger, **kw: Any) -> None:  # fmt: skip
    await reconcile_pass(body, memo, patch, kw["job_pods"], logger)


@kopf.on.update(*FTJ, field="spec")
async def spec_changed(body: kopf.Body, memo: Any, patch: kopf.Patch, logger: kopf.Logger, **kw: Any) -> None:  # fmt: skip
    await reconcile_pass(body, memo, patch, kw["job_pods"], logger)


@kopf.on.update(*FTJ, field=("metadata", "labels", QUEUE_LABEL))
async def queue_label_changed(body: kopf.Body, memo: Any, patch: kopf.Patch, logger: kopf.Logger, **kw: Any) -> None:  # fmt: skip
    # Added, changed or removed: the job joins, moves in or leaves Kueue now, not next pass.
    await reconcile_pass(body, memo, patch, kw["job_pods"], logger)


@kopf.timer(*FTJ, interval=TIMER_TICK_SECONDS, initial_delay=TIMER_TICK_SECONDS)
async def observe(body: kopf.Body, memo: Any, patch: kopf.Patch, logger: kopf.Logger, **kw: Any) -> None:  # fmt: skip
    state, interval = job_state(memo), settings_of(memo).reconcile_interval_seconds
    key = (body.get("metadata", {}).get("namespace"), body.get("metadata", {}).get("name"))
    # A nudge (its Workload changed) makes the pass due at this tick, not the interval's end.
    if not take_nudge(memo, key) and time.monotonic() - state.last_pass < interval:
        return
    state.last_pass = time.monotonic()
    await reconcile_pass(body, memo, patch, kw["job_pods"], logger, scrape=True)


@kopf.on.delete(*FTJ, optional=True)
async def deleted(namespace: str | None, name: str, body: kopf.Body, memo: Any, logger: kopf.Logger, **_: Any) -> None:  # fmt: skip
    # optional: no finalizer of its own (the timer's holds the job until this ran); children
    # go by ownerReference garbage collection, the Workload once its finalizer is off.
    metrics.set_job_phase(f"{namespace}/{name}", None)
    metrics.forget_job_series(namespace or "", name)
    forget_nudge(memo, (namespace, name))
    await release_deleted_job_workload(memo["cluster"], job_ref(body), body, logger)


@kopf.on.probe(id="jobs")
def jobs_probe(**_: Any) -> int:
    return len(metrics.tracked_jobs())
