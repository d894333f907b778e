"""One reconcile pass of a FineTuneJob, shared by all its kopf handlers: read what is
observed, call the pure pass (reconcile.reconcile_job), apply its actions, patch status,
post Events and set the operator's metrics."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import kopf

from finetune_operator import metrics
from finetune_operator.api.constants import (
    PHASE_FAILED,
    PHASE_SUCCEEDED,
    REASON_NODE_LOST,
    REASON_NODES_UNREADABLE,
)
from finetune_operator.handlers.workloads import await_pods_gone, queue_state
from finetune_operator.reconcile import (
    EventSpec,
    HealthInput,
    JobRef,
    Outcome,
    PodView,
    RecordBuffer,
    ScrapeTarget,
    combine_progress,
    merge_progress,
    note_apply_errors,
    note_checkpoint_health,
    own_rounds_by_pod,
    parse_rank_samples,
    parse_termination_message,
    parse_trainer_metrics,
    progress_events,
    read_status,
    reconcile_job,
    rounds_by_pod,
    scrape_targets,
    status_patch,
)
from finetune_operator.reconcile.apply import ClusterApi
from finetune_operator.reconcile.forgiveness import taken_back
from finetune_operator.reconcile.gang import (
    pod_group_to_read,
    read_gang,
    released_gang,
    with_gang,
)
from finetune_operator.reconcile.nodeloss import NodeReading, NodeView, suspect_nodes
from finetune_operator.reconcile.observed import mark_terminating
from finetune_operator.resources.workload import queue_name_of
from finetune_operator.scrape import scrape_all
from finetune_operator.settings import OperatorSettings


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
    # Pods judged lost with their node and counted, while the index may still hold them (so
    # a lost pod is counted once; a refused force delete is retried). Losing it is safe: a
    # restarted operator lists pods afresh (a pod still listed then is counted once more).
    lost_uids: set[str] = field(default_factory=set)
    # The round each worker pod was last seen training in (its trainers' metrics): the round
    # its peers fail in if it is lost with its node. Losing it only means that round counts.
    rounds: dict[str, str] = field(default_factory=dict)
    seen_at: dict[str, datetime] = field(default_factory=dict)  # when `rounds` last said it
    # When this operator first counted each round of status.restartLedger: a round counted
    # after a lost pod was last seen in it, or after its node went down, is the node's
    # (reconcile/forgiveness.py). Losing it only means such a round stays counted.
    counted_at: dict[str, datetime] = field(default_factory=dict)
    nodes_warned: bool = False  # the NodesUnreadable Event posted (once per operator run)


def job_state(memo: kopf.Memo) -> JobState:
    if "job_state" not in memo:
        memo["job_state"] = JobState()
    state: JobState = memo["job_state"]
    return state


def settings_of(memo: kopf.Memo) -> OperatorSettings:
    settings: OperatorSettings = memo.get("settings") or OperatorSettings()
    return settings


def job_ref(body: kopf.Body) -> JobRef:
    meta = body.get("metadata", {})
    return JobRef(
        name=meta.get("name", ""),
        namespace=meta.get("namespace", ""),
        uid=meta.get("uid", ""),
        generation=int(meta.get("generation") or 0),
        queue_name=queue_name_of(meta.get("labels")),
    )


async def reconcile_pass(
    body: kopf.Body,
    memo: kopf.Memo,
    patch: kopf.Patch,
    index: kopf.Index[tuple[str, str], PodView],
    logger: kopf.Logger,
    *,
    scrape: bool = False,
) -> None:
    """One level-based pass; serialised per job so two triggers never count a failure twice."""
    job, state = job_ref(body), job_state(memo)
    async with state.lock:
        with metrics.timed_reconcile():
            old = read_status(body.get("status"))
            pods = list(index.get((job.namespace, job.name), []))
            timeout = settings_of(memo).scrape_timeout_seconds
            pages = await _scrape(old, pods, state.deleted_uids, timeout) if scrape else {}
            health = _health_input(pages, state.records) if scrape else None
            live = {p.uid for p in pods}
            _remember_rounds(state, pages, live, datetime.now(UTC))
            cluster: ClusterApi = memo["cluster"]
            queue = await queue_state(cluster, job, body)
            nodes = await _read_nodes(cluster, pods, state, body, logger)
            now = datetime.now(UTC)
            out = reconcile_job(
                job, body.get("spec", {}), old, pods, now,
                planner=memo["planner"],
                deleted_uids=state.deleted_uids,
                ensured_generation=state.ensured_generation,
                policy=memo.get("policy"),
                health=health,
                queue=queue,
                nodes=nodes,
            )  # fmt: skip
            if health is not None:
                state.records = out.buffer
            # Before the deletions it may ask for: the last pod's event must find it set.
            await_pods_gone(memo, (job.namespace, job.name), out.actions.await_pods_gone)
            result = await cluster.apply(job.namespace, out.actions)
            out = await _with_gang(cluster, job, old, out, now)
            state.deleted_uids = (state.deleted_uids & live) | {d.uid for d in result.deleted}
            # Counted once decided, whether or not the delete went through: a refused one is
            # sent again on the next pass (nodeloss.lost_again), never counted again.
            state.lost_uids = (state.lost_uids & live) | {
                d.uid for d in out.actions.delete if d.reason == REASON_NODE_LOST
            }
            _remember_counted(state, old.restart_ledger, out.status.restart_ledger, now)
            if out.actions.ensure and not result.errors:
                state.ensured_generation = job.generation
            new = note_apply_errors(out.status, result.errors, now, job.generation)
            if scrape and out.evaluation.ok and out.evaluation.spec and out.evaluation.plan:
                new = _with_progress(new, out, pods, pages)
            _publish(body, patch, job, old, new, out, progress_events(old, new), scraped=scrape)
            if result.errors:
                logger.warning("apply failed: %s", "; ".join(result.errors))
                delay = settings_of(memo).reconcile_interval_seconds
                raise kopf.TemporaryError("; ".join(result.errors), delay=delay)


def _remember_rounds(state: JobState, pages: dict[ScrapeTarget, str], live: set[str], now: datetime) -> None:  # fmt: skip
    """The round each live worker pod was last seen training in, and when."""
    found = rounds_by_pod(pages)
    state.rounds = {u: r for u, r in {**state.rounds, **found}.items() if u in live}
    state.seen_at = {
        u: t for u, t in {**state.seen_at, **dict.fromkeys(found, now)}.items() if u in live
    }


def _remember_counted(state: JobState, before: list[str], after: list[str], now: datetime) -> None:  # fmt: skip
    """When the rounds this pass added to the ledger were counted; only rounds still in it
    are kept (the ledger holds at most maxRestarts + 1). A round already in the ledger
    before this operator's first pass is left without a time: not known when it failed."""
    old = set(before)
    state.counted_at = {
        r: state.counted_at.get(r, now) for r in after if r in state.counted_at or r not in old
    }


async def _with_gang(cluster: ClusterApi, job: JobRef, old: Any, out: Outcome, now: datetime) -> Outcome:  # fmt: skip
    """The gang scheduler's word on the job's PodGroup (one GET), while its workers are placed."""
    target = pod_group_to_read(out, now)
    if target is None:
        released = released_gang(out)
        return with_gang(out, old, released, now) if released is not None else out
    group, unreadable = await cluster.read_pod_group(job.namespace, *target)
    return with_gang(out, old, read_gang(group, target[1], unreadable), now)


async def _read_nodes(cluster: ClusterApi, pods: list[PodView], state: JobState, body: kopf.Body,
                      logger: kopf.Logger) -> NodeReading:  # fmt: skip
    """The Nodes of the job's terminating pods (rarely any: nodeloss.suspect_nodes), one GET
    each: a cluster-wide watch of every Node would cost far more than these few reads. One
    the operator may not read is a warning (logged, an Event once, the WorkersReady
    condition), never a failed pass."""
    views: dict[str, NodeView] = {}
    unreadable: dict[str, str] = {}
    for name in sorted(suspect_nodes(mark_terminating(pods, state.deleted_uids))):
        view, why = await cluster.read_node(name)
        if view is not None:
            views[name] = view
        else:
            unreadable[name] = why
    if unreadable and not state.nodes_warned:  # the condition keeps saying it afterwards
        state.nodes_warned = True
        why = next(iter(unreadable.values()))
        logger.warning("cannot tell whether the job's terminating pods are lost: %s", why)
        kopf.event(body, type="Warning", reason=REASON_NODES_UNREADABLE, message=why)
    return NodeReading(
        views, unreadable, frozenset(state.lost_uids), dict(state.rounds),
        seen_at=dict(state.seen_at), counted_at=dict(state.counted_at),
    )  # fmt: skip


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
    own = own_rounds_by_pod(pages)
    return HealthInput(samples=tuple(samples), buffer=records, own_rounds=own)


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
    metrics.record_restarts(ns, name, new.restarts - old.restarts, taken_back(old, new))
    metrics.record_preemptions(ns, name, new.preemptions - old.preemptions)
    metrics.record_evictions(ns, name, len(new.evictions) - len(old.evictions))
    metrics.record_hangs(ns, name, new.hangs - old.hangs)
    if scraped:
        metrics.set_straggler_ratios(ns, name, out.ratios)
    if new.phase in (PHASE_SUCCEEDED, PHASE_FAILED) and old.phase != new.phase:
        metrics.forget_job_series(ns, name)
