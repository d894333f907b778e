"""kopf handlers: the only module that talks kopf. Glue only: read, call pure, apply, patch.

Run it with `kopf run -m finetune_operator.handlers [-n NS | -A] [--standalone|--peering=NAME]`,
`ftjob operator`, or in-process with `await operate(...)` / `run_operator(...)`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import threading
from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import kopf

from finetune_operator import metrics
from finetune_operator.api.constants import (
    ANNOTATION_PROGRESS_PREFIX,
    GROUP,
    LABEL_JOB,
    PHASE_FAILED,
    PHASE_SUCCEEDED,
    PLURAL,
    VERSION,
)
from finetune_operator.reconcile import (
    JobRef,
    Outcome,
    PodView,
    combine_progress,
    default_planner,
    merge_progress,
    note_apply_errors,
    note_checkpoint_health,
    observe_pod,
    parse_termination_message,
    parse_trainer_metrics,
    read_status,
    reconcile_job,
    scrape_targets,
    status_patch,
)
from finetune_operator.reconcile.apply import ClusterApi, load_api_client
from finetune_operator.scrape import scrape_all

FTJ = (GROUP, VERSION, PLURAL)
# Seconds between level-based passes over each job (observe pods, scrape, reconcile).
INTERVAL = float(os.environ.get("FINETUNE_OPERATOR_INTERVAL", "2"))
SCRAPE_TIMEOUT = float(os.environ.get("FINETUNE_OPERATOR_SCRAPE_TIMEOUT", "1"))
WATCH_TIMEOUT = float(os.environ.get("FINETUNE_OPERATOR_WATCH_TIMEOUT", "60"))
PEERING_ENV = "FINETUNE_OPERATOR_PEERING"
METRICS_PORT_ENV = "FINETUNE_OPERATOR_METRICS_PORT"


@dataclass
class JobState:
    """Per-job runtime state (kopf memo). Losing it on restart is safe: it only avoids work."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    deleted_uids: set[str] = field(default_factory=set)  # deletions the watch may not show yet
    ensured_generation: int | None = None  # ConfigMap/Services applied for this generation


def _job_state(memo: kopf.Memo) -> JobState:
    if "job_state" not in memo:
        memo["job_state"] = JobState()
    state: JobState = memo["job_state"]
    return state


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
    settings.watching.server_timeout = WATCH_TIMEOUT
    settings.watching.client_timeout = WATCH_TIMEOUT + 10
    settings.watching.connect_timeout = 10
    settings.networking.request_timeout = 60
    if os.environ.get(PEERING_ENV):
        settings.peering.name, settings.peering.mandatory = os.environ[PEERING_ENV], True
        settings.peering.standalone = False
    elif not settings.peering.mandatory:
        settings.peering.standalone = True  # one replica (local mode): no peering objects
    if memo.get("cluster") is None:
        memo["cluster"] = ClusterApi(load_api_client(memo.get("kubeconfig")))
    if memo.get("planner") is None:
        memo["planner"] = default_planner()
    port = memo.get("metrics_port") or os.environ.get(METRICS_PORT_ENV)
    if port:
        metrics.serve_metrics(int(port))


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
    await _reconcile(body, memo, patch, kw["job_pods"], logger)


@kopf.on.resume(*FTJ)
async def resumed(body: kopf.Body, memo: Any, patch: kopf.Patch, logger: kopf.Logger, **kw: Any) -> None:  # fmt: skip
    await _reconcile(body, memo, patch, kw["job_pods"], logger)


@kopf.on.update(*FTJ, field="spec")
async def spec_changed(body: kopf.Body, memo: Any, patch: kopf.Patch, logger: kopf.Logger, **kw: Any) -> None:  # fmt: skip
    await _reconcile(body, memo, patch, kw["job_pods"], logger)


@kopf.timer(*FTJ, interval=INTERVAL, initial_delay=INTERVAL)
async def observe(body: kopf.Body, memo: Any, patch: kopf.Patch, logger: kopf.Logger, **kw: Any) -> None:  # fmt: skip
    await _reconcile(body, memo, patch, kw["job_pods"], logger, scrape=True)


@kopf.on.delete(*FTJ, optional=True)
def deleted(namespace: str | None, name: str, **_: Any) -> None:
    # optional: no finalizer; children go by ownerReference garbage collection.
    metrics.set_job_phase(f"{namespace}/{name}", None)
    metrics.forget_job_series(name)


@kopf.on.probe(id="jobs")
def jobs_probe(**_: Any) -> int:
    return len(metrics.tracked_jobs())


def _job_ref(body: kopf.Body) -> JobRef:
    meta = body.get("metadata", {})
    return JobRef(
        name=meta.get("name", ""),
        namespace=meta.get("namespace", ""),
        uid=meta.get("uid", ""),
        generation=int(meta.get("generation") or 0),
    )


async def _reconcile(
    body: kopf.Body,
    memo: kopf.Memo,
    patch: kopf.Patch,
    index: kopf.Index[tuple[str, str], PodView],
    logger: kopf.Logger,
    *,
    scrape: bool = False,
) -> None:
    """One level-based pass; serialised per job so two triggers never count a failure twice."""
    job, state = _job_ref(body), _job_state(memo)
    async with state.lock:
        with metrics.timed_reconcile():
            old = read_status(body.get("status"))
            pods = list(index.get((job.namespace, job.name), []))
            now = datetime.now(UTC)
            out = reconcile_job(
                job, body.get("spec", {}), old, pods, now,
                planner=memo["planner"],
                deleted_uids=state.deleted_uids,
                ensured_generation=state.ensured_generation,
            )  # fmt: skip
            cluster: ClusterApi = memo["cluster"]
            result = await cluster.apply(job.namespace, out.actions)
            state.deleted_uids = {u for u in state.deleted_uids if u in {p.uid for p in pods}}
            state.deleted_uids |= {d.uid for d in result.deleted}
            if out.actions.ensure and not result.errors:
                state.ensured_generation = job.generation
            new = note_apply_errors(out.status, result.errors, now, job.generation)
            if scrape and out.evaluation.ok and out.evaluation.spec and out.evaluation.plan:
                new = await _with_progress(new, out, pods)
            _publish(body, patch, job, old, new, out)
            if result.errors:
                logger.warning("apply failed: %s", "; ".join(result.errors))
                raise kopf.TemporaryError("; ".join(result.errors), delay=INTERVAL)


async def _with_progress(status: Any, out: Outcome, pods: list[PodView]) -> Any:
    """Merge what the trainers report: live metrics of running workers, and the final
    report (termination message) of workers that have exited."""
    assert out.evaluation.spec is not None and out.evaluation.plan is not None
    finals = [parse_termination_message(p.termination_message) for p in pods if p.is_worker]
    targets = scrape_targets(pods, out.evaluation.plan.gpus_per_node)
    finished = status.phase in (PHASE_SUCCEEDED, PHASE_FAILED)
    pages = await scrape_all(targets, SCRAPE_TIMEOUT) if targets and not finished else {}
    progress = combine_progress([*(parse_trainer_metrics(p) for p in pages.values()), *finals])
    merged = merge_progress(status, progress, out.evaluation.spec.checkpoint.uri)
    return note_checkpoint_health(merged, progress, datetime.now(UTC), out.evaluation.job.generation)


def _publish(body: kopf.Body, patch: kopf.Patch, job: JobRef, old: Any, new: Any, out: Outcome) -> None:  # fmt: skip
    """Status (only what changed, to the status subresource), Events, operator metrics."""
    for key, value in status_patch(body.get("status"), new).items():
        patch.status[key] = value
    for event in out.events:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)
    metrics.set_job_phase(f"{job.namespace}/{job.name}", new.phase)
    metrics.record_replacements(job.name, new.restarts - old.restarts)
    if new.phase in (PHASE_SUCCEEDED, PHASE_FAILED) and old.phase != new.phase:
        metrics.forget_job_series(job.name)


async def operate(
    namespaces: Collection[str] | None = None,
    *,
    kubeconfig: str | None = None,
    liveness: str | None = None,
    peering: str | None = None,
    metrics_port: int | None = None,
    planner: Any = None,
    ready_flag: asyncio.Event | threading.Event | None = None,
    stop_flag: asyncio.Event | threading.Event | None = None,
) -> None:
    """Run the operator in the current event loop until `stop_flag` is set.

    namespaces None watches all namespaces. peering None runs standalone (no leader election);
    a name joins the KopfPeering/ClusterKopfPeering of that name, so only one replica acts.
    """
    memo = kopf.Memo(kubeconfig=kubeconfig, metrics_port=metrics_port, planner=planner)
    if kubeconfig is not None:
        memo["cluster"] = ClusterApi(load_api_client(kubeconfig))
    await kopf.operator(
        # kopf freezes every peer whose priority is not higher than another's ("pausing all
        # operators, including self"): a distinct random priority per replica lets exactly one
        # replica act, and a rolling upgrade's overlap pause only the lower one.
        priority=secrets.randbelow(2**31 - 1) + 1 if peering else 0,
        clusterwide=not namespaces,
        namespaces=list(namespaces or ()),
        liveness_endpoint=liveness,
        peering_name=peering,
        standalone=peering is None,
        memo=memo,
        ready_flag=ready_flag,
        stop_flag=stop_flag,
    )


def run_operator(
    namespaces: Collection[str] | None = None,
    *,
    namespace: str | None = None,
    liveness: str | None = None,
    peering: str | None = None,
    metrics_port: int | None = None,
    kubeconfig: str | None = None,
) -> None:
    """Blocking entry point (`ftjob operator`): see `operate` for the arguments."""
    chosen = list(namespaces or ()) + ([namespace] if namespace else [])
    asyncio.run(
        operate(
            chosen or None,
            kubeconfig=kubeconfig,
            liveness=liveness,
            peering=peering,
            metrics_port=metrics_port,
        )
    )
