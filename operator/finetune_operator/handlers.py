"""kopf handlers: the only module that talks kopf. Glue only: read, call pure, apply, patch.

Run it with `ftjob operator` (flags: `finetune_operator.settings`), or in-process with
`await operate(settings, ...)` / `run_operator(settings)`. Settings reach the handlers through
kopf's memo; nothing here reads the environment.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import kopf
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from finetune_operator import metrics
from finetune_operator.api.constants import (
    ANNOTATION_PROGRESS_PREFIX,
    GROUP,
    KIND,
    LABEL_JOB,
    PHASE_FAILED,
    PHASE_SUCCEEDED,
    PLURAL,
    VERSION,
)
from finetune_operator.api.policy import JobPolicy
from finetune_operator.reconcile import (
    EventSpec,
    HealthInput,
    JobRef,
    Outcome,
    PodView,
    RecordBuffer,
    ScrapeTarget,
    combine_progress,
    default_planner,
    merge_progress,
    note_apply_errors,
    note_checkpoint_health,
    observe_pod,
    parse_rank_samples,
    parse_termination_message,
    parse_trainer_metrics,
    progress_events,
    read_status,
    reconcile_job,
    scrape_targets,
    status_patch,
)
from finetune_operator.reconcile.admission import (
    QueueState,
    flavors_assigned,
    read_left_queue_state,
    read_queue_state,
)
from finetune_operator.reconcile.apply import ClusterApi, load_api_client
from finetune_operator.reconcile.gang import (
    pod_group_to_read,
    read_gang,
    released_gang,
    with_gang,
)
from finetune_operator.resources.workload import (
    KUEUE_GROUP,
    KUEUE_VERSION,
    QUEUE_LABEL,
    RESOURCE_IN_USE,
    WORKLOAD_PLURAL,
    priority_ref,
    queue_name_of,
    workload_name,
)
from finetune_operator.scrape import scrape_all
from finetune_operator.settings import OperatorSettings

FTJ = (GROUP, VERSION, PLURAL)
# kopf fixes a timer's interval when the module is imported; the reconcile interval is a
# runtime setting, so the timer ticks often and each job's pass runs once its interval is due.
TIMER_TICK_SECONDS = 1.0


@dataclass
class JobState:
    """Per-job runtime state (kopf memo). Losing it on restart is safe: it only avoids work."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    deleted_uids: set[str] = field(default_factory=set)  # deletions the watch may not show yet
    ensured_generation: int | None = None  # ConfigMap/Services applied for this generation
    last_pass: float = float("-inf")  # monotonic time of the last timer pass (scrape)
    # The straggler detector's rolling input. Losing it is safe too: status.stragglers
    # carries the streaks, and the records refill within a few windows.
    records: RecordBuffer | None = None


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
    ours: OperatorSettings = memo.setdefault("settings", OperatorSettings())
    settings.watching.server_timeout = ours.watch_timeout_seconds
    settings.watching.client_timeout = ours.watch_timeout_seconds + 10
    settings.watching.connect_timeout = 10
    settings.networking.request_timeout = 60
    if ours.peering:
        settings.peering.name, settings.peering.mandatory = ours.peering, True
        settings.peering.standalone = False
    elif not settings.peering.mandatory:
        settings.peering.standalone = True  # one replica (local mode): no peering objects
    if memo.get("cluster") is None:
        memo["cluster"] = ClusterApi(load_api_client(memo.get("kubeconfig")))
    # Jobs whose pass is due at the next timer tick (a Workload event). In the root memo, which
    # every object's memo copies shallowly: one set shared by all handlers.
    memo.setdefault("nudged", set())
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
    await _reconcile(body, memo, patch, kw["job_pods"], logger)


@kopf.on.resume(*FTJ)
async def resumed(body: kopf.Body, memo: Any, patch: kopf.Patch, logger: kopf.Logger, **kw: Any) -> None:  # fmt: skip
    await _reconcile(body, memo, patch, kw["job_pods"], logger)


@kopf.on.update(*FTJ, field="spec")
async def spec_changed(body: kopf.Body, memo: Any, patch: kopf.Patch, logger: kopf.Logger, **kw: Any) -> None:  # fmt: skip
    await _reconcile(body, memo, patch, kw["job_pods"], logger)


@kopf.on.update(*FTJ, field=("metadata", "labels", QUEUE_LABEL))
async def queue_label_changed(body: kopf.Body, memo: Any, patch: kopf.Patch, logger: kopf.Logger, **kw: Any) -> None:  # fmt: skip
    # Added, changed or removed: the job joins, moves in or leaves Kueue now, not next pass.
    await _reconcile(body, memo, patch, kw["job_pods"], logger)


@kopf.timer(*FTJ, interval=TIMER_TICK_SECONDS, initial_delay=TIMER_TICK_SECONDS)
async def observe(body: kopf.Body, memo: Any, patch: kopf.Patch, logger: kopf.Logger, **kw: Any) -> None:  # fmt: skip
    state, interval = _job_state(memo), _settings(memo).reconcile_interval_seconds
    key = (body.get("metadata", {}).get("namespace"), body.get("metadata", {}).get("name"))
    nudged: set[tuple[str | None, str | None]] = memo.get("nudged", set())
    if key in nudged:
        nudged.discard(key)  # its Workload changed: this tick, not the interval's end
    elif time.monotonic() - state.last_pass < interval:
        return
    state.last_pass = time.monotonic()
    await _reconcile(body, memo, patch, kw["job_pods"], logger, scrape=True)


@kopf.on.delete(*FTJ, optional=True)
async def deleted(namespace: str | None, name: str, body: kopf.Body, memo: Any, logger: kopf.Logger, **_: Any) -> None:  # fmt: skip
    # optional: no finalizer; children go by ownerReference garbage collection. The Workload's
    # resource-in-use finalizer comes off here (as Kueue's job reconciler drops it once the
    # job is gone), or garbage collection would wait on it forever.
    metrics.set_job_phase(f"{namespace}/{name}", None)
    metrics.forget_job_series(namespace or "", name)
    memo.get("nudged", set()).discard((namespace, name))
    job = _job_ref(body)
    if job.queue_name or (body.get("status") or {}).get("workload"):
        try:
            await memo["cluster"].release_workload(job.namespace, workload_name(job.owner), job.uid)
        except ApiException as err:
            logger.warning(
                "Workload %s keeps its finalizer: %s", workload_name(job.owner), err.reason
            )


def owner_job(body: kopf.Body | dict[str, Any]) -> dict[str, Any] | None:
    """The FineTuneJob ownerReference of a Workload (None: not one of ours)."""
    for ref in (body.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") == KIND and ref.get("apiVersion") == f"{GROUP}/{VERSION}":
            found: dict[str, Any] = dict(ref)
            return found
    return None


def _owned_by_a_job(body: kopf.Body, **_: Any) -> bool:
    return owner_job(body) is not None


# Kueue's CRDs not installed: kopf warns that the resource cannot be served and watches the
# rest (and starts watching once the CRD appears). On.event, not an index: an index kopf
# cannot fill (no permission to list Workloads) would hold every handler back.
@kopf.on.event(KUEUE_GROUP, KUEUE_VERSION, WORKLOAD_PLURAL, labels={LABEL_JOB: kopf.PRESENT}, when=_owned_by_a_job)  # fmt: skip
async def workload_changed(namespace: str | None, body: kopf.Body, memo: Any, logger: kopf.Logger, **_: Any) -> None:  # fmt: skip
    """Kueue admitted, evicted or finished a job's Workload: the job's pass runs at the next
    timer tick, not up to a reconcile interval later. A Workload being deleted whose job is
    gone (its delete handler missed, the operator down then) loses its finalizer here."""
    owner = owner_job(body)
    assert owner is not None  # when=
    nudged: set[tuple[str | None, str | None]] = memo.get("nudged", set())
    nudged.add((namespace, owner.get("name")))
    meta = body.get("metadata", {})
    if not meta.get("deletionTimestamp") or RESOURCE_IN_USE not in (meta.get("finalizers") or []):
        return
    cluster: ClusterApi = memo["cluster"]
    try:
        if not await cluster.job_exists(
            namespace or "", owner.get("name", ""), owner.get("uid", "")
        ):
            await cluster.release_workload(
                namespace or "", meta.get("name", ""), owner.get("uid", "")
            )
    except ApiException as err:
        logger.warning("Workload %s keeps its finalizer: %s", meta.get("name"), err.reason)


@kopf.on.probe(id="jobs")
def jobs_probe(**_: Any) -> int:
    return len(metrics.tracked_jobs())


def _settings(memo: kopf.Memo) -> OperatorSettings:
    settings: OperatorSettings = memo.get("settings") or OperatorSettings()
    return settings


def _job_ref(body: kopf.Body) -> JobRef:
    meta = body.get("metadata", {})
    return JobRef(
        name=meta.get("name", ""),
        namespace=meta.get("namespace", ""),
        uid=meta.get("uid", ""),
        generation=int(meta.get("generation") or 0),
        queue_name=queue_name_of(meta.get("labels")),
    )


async def _queue_state(cluster: ClusterApi, job: JobRef, body: kopf.Body) -> QueueState | None:
    """The job's standing in Kueue (its Workload and the flavors it was admitted to, or the
    priority its Workload is to be created with); None for a job not queued in Kueue."""
    if job.queue_name is None:
        return await _left_queue_state(cluster, job, body)
    workload, unreadable = await cluster.read_workload(job.namespace, workload_name(job.owner))
    if unreadable:
        return read_queue_state(job.queue_name, None, {}, unreadable=unreadable)
    if workload is not None:
        flavors = await cluster.read_flavors(flavors_assigned(workload))
        return read_queue_state(job.queue_name, workload, flavors, owner_uid=job.uid)
    pods_class = ((body.get("spec") or {}).get("resources") or {}).get("priorityClassName")
    ref = priority_ref(body.get("metadata", {}).get("labels"), pods_class)
    if ref is None:
        return read_queue_state(job.queue_name, None, {})
    value, problem = await cluster.read_priority(ref)
    priority = (ref, value) if value is not None else None
    return read_queue_state(job.queue_name, None, {}, priority=priority, priority_problem=problem)


async def _left_queue_state(cluster: ClusterApi, job: JobRef, body: kopf.Body) -> QueueState | None:
    """A job without the queue-name label that had a Workload (status.workload, written while
    it was queued): its Workload, if still there, is given back (admission.QueueState.left).
    A job never queued costs no API call."""
    if not (body.get("status") or {}).get("workload"):
        return None
    workload, unreadable = await cluster.read_workload(job.namespace, workload_name(job.owner))
    return None if unreadable else read_left_queue_state(workload, job.uid)


async def _with_gang(cluster: ClusterApi, job: JobRef, old: Any, out: Outcome, now: datetime) -> Outcome:  # fmt: skip
    """The gang scheduler's word on the job's PodGroup (one GET), while its workers are placed."""
    target = pod_group_to_read(out)
    if target is None:
        released = released_gang(out)
        return with_gang(out, old, released, now) if released is not None else out
    group, unreadable = await cluster.read_pod_group(job.namespace, *target)
    return with_gang(out, old, read_gang(group, target[1], unreadable), now)


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
            timeout = _settings(memo).scrape_timeout_seconds
            pages = await _scrape(old, pods, state.deleted_uids, timeout) if scrape else {}
            health = _health_input(pages, state.records) if scrape else None
            cluster: ClusterApi = memo["cluster"]
            queue = await _queue_state(cluster, job, body)
            now = datetime.now(UTC)
            out = reconcile_job(
                job, body.get("spec", {}), old, pods, now,
                planner=memo["planner"],
                deleted_uids=state.deleted_uids,
                ensured_generation=state.ensured_generation,
                policy=memo.get("policy"),
                health=health,
                queue=queue,
            )  # fmt: skip
            if health is not None:
                state.records = out.buffer
            result = await cluster.apply(job.namespace, out.actions)
            out = await _with_gang(cluster, job, old, out, now)
            state.deleted_uids = {u for u in state.deleted_uids if u in {p.uid for p in pods}}
            state.deleted_uids |= {d.uid for d in result.deleted}
            if out.actions.ensure and not result.errors:
                state.ensured_generation = job.generation
            new = note_apply_errors(out.status, result.errors, now, job.generation)
            if scrape and out.evaluation.ok and out.evaluation.spec and out.evaluation.plan:
                new = _with_progress(new, out, pods, pages)
            _publish(body, patch, job, old, new, out, progress_events(old, new), scraped=scrape)
            if result.errors:
                logger.warning("apply failed: %s", "; ".join(result.errors))
                delay = _settings(memo).reconcile_interval_seconds
                raise kopf.TemporaryError("; ".join(result.errors), delay=delay)


async def _scrape(
    status: Any, pods: list[PodView], deleted_uids: set[str], timeout: float
) -> dict[ScrapeTarget, str]:
    """Every running worker rank's metrics page (the plan in status says how many per pod)."""
    if status.plan is None or status.phase in (PHASE_SUCCEEDED, PHASE_FAILED):
        return {}
    live = [p for p in pods if p.uid not in deleted_uids]
    targets = scrape_targets(live, status.plan.gpus_per_node)
    return await scrape_all(targets, timeout) if targets else {}


def _health_input(pages: dict[ScrapeTarget, str], records: RecordBuffer | None) -> HealthInput:
    samples = [s for t, text in pages.items() for s in parse_rank_samples(text, t.pod, t.node)]
    return HealthInput(samples=tuple(samples), buffer=records)


def _with_progress(status: Any, out: Outcome, pods: list[PodView], pages: dict[ScrapeTarget, str]) -> Any:  # fmt: skip
    """Merge what the trainers report: live metrics of running workers, and the final
    report (termination message) of workers that have exited."""
    assert out.evaluation.spec is not None
    finals = [parse_termination_message(p.termination_message) for p in pods if p.is_worker]
    progress = combine_progress([*(parse_trainer_metrics(p) for p in pages.values()), *finals])
    merged = merge_progress(status, progress, out.evaluation.spec.checkpoint.uri)
    return note_checkpoint_health(
        merged, progress, datetime.now(UTC), out.evaluation.job.generation
    )


def _publish(body: kopf.Body, patch: kopf.Patch, job: JobRef, old: Any, new: Any, out: Outcome,
             extra_events: list[EventSpec], *, scraped: bool) -> None:  # fmt: skip
    """Status (only what changed, to the status subresource), Events, operator metrics."""
    for key, value in status_patch(body.get("status"), new).items():
        patch.status[key] = value
    for event in (*out.events, *extra_events):
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)
    ns, name = job.namespace, job.name
    metrics.set_job_phase(f"{ns}/{name}", new.phase)
    metrics.record_restarts(ns, name, new.restarts - old.restarts)
    metrics.record_preemptions(ns, name, new.preemptions - old.preemptions)
    metrics.record_evictions(ns, name, len(new.evictions) - len(old.evictions))
    metrics.record_hangs(ns, name, new.hangs - old.hangs)
    if scraped:
        metrics.set_straggler_ratios(ns, name, out.ratios)
    if new.phase in (PHASE_SUCCEEDED, PHASE_FAILED) and old.phase != new.phase:
        metrics.forget_job_series(ns, name)


async def operate(
    settings: OperatorSettings | None = None,
    *,
    kubeconfig: str | None = None,
    planner: Any = None,
    policy: JobPolicy | None = None,
    ready_flag: asyncio.Event | threading.Event | None = None,
    stop_flag: asyncio.Event | threading.Event | None = None,
) -> None:
    """Run the operator in the current event loop until `stop_flag` is set.

    settings.namespaces None watches all namespaces. settings.peering None runs standalone
    (no leader election); a name joins the KopfPeering/ClusterKopfPeering of that name, so only
    one replica acts. `policy` (tests, embedding) overrides settings.policy.
    """
    settings = settings or OperatorSettings()
    memo = kopf.Memo(
        kubeconfig=kubeconfig,
        planner=planner,
        settings=settings,
        policy=policy if policy is not None else settings.policy,
    )
    if kubeconfig is not None:
        memo["cluster"] = ClusterApi(load_api_client(kubeconfig))
    peering = settings.peering
    await kopf.operator(
        # kopf freezes every peer whose priority is not higher than another's ("pausing all
        # operators, including self"): a distinct random priority per replica lets exactly one
        # replica act, and a rolling upgrade's overlap pause only the lower one.
        priority=secrets.randbelow(2**31 - 1) + 1 if peering else 0,
        clusterwide=settings.namespaces is None,
        namespaces=list(settings.namespaces or ()),
        liveness_endpoint=settings.liveness,
        peering_name=peering,
        standalone=peering is None,
        memo=memo,
        ready_flag=ready_flag,
        stop_flag=stop_flag,
    )


class NoClusterError(RuntimeError):
    """No credentials to reach a cluster: neither in-cluster nor a kubeconfig."""


def run_operator(settings: OperatorSettings, *, kubeconfig: str | None = None) -> None:
    """Blocking entry point (`ftjob operator`)."""
    # Checked before kopf starts: its startup activity would retry a traceback every minute.
    try:
        load_api_client(kubeconfig)
    except k8s_config.ConfigException as err:
        raise NoClusterError(
            f"no Kubernetes cluster to run against: {err} (in a pod the operator uses its "
            "ServiceAccount; elsewhere set KUBECONFIG or write ~/.kube/config)"
        ) from None
    asyncio.run(operate(settings, kubeconfig=kubeconfig))
