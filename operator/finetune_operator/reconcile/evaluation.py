"""Turning the raw spec into a validated spec and a plan, or into a refusal with a reason."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from finetune_operator.api.capabilities import trainer_refusals
from finetune_operator.api.constants import (
    COND_FAILED,
    COND_PLANNED,
    REASON_INVALID_SPEC,
    REASON_NOT_ALLOWED,
    REASON_PLAN_INFEASIBLE,
    REASON_UNSUPPORTED,
)
from finetune_operator.api.limits import job_name_problem
from finetune_operator.api.manifest import format_validation_error
from finetune_operator.api.plan import Plan
from finetune_operator.api.policy import JobPolicy, policy_refusals, with_policy_defaults
from finetune_operator.api.spec import FineTuneJobSpec
from finetune_operator.api.spec_compat import Deprecation, accept_stored_spec
from finetune_operator.api.status import FineTuneJobStatus
from finetune_operator.planner.errors import PlanningError
from finetune_operator.reconcile.admission import QueueState
from finetune_operator.reconcile.conditions import find
from finetune_operator.resources import Owner

PlanFn = Callable[[FineTuneJobSpec], Plan]
PLANNER_MODULE = "finetune_operator.planner"


@dataclass(frozen=True)
class JobRef:
    """Identity of the FineTuneJob being reconciled."""

    name: str
    namespace: str
    uid: str
    generation: int
    queue_name: str | None = None  # the LocalQueue of its Kueue queue-name label, if any

    @property
    def owner(self) -> Owner:
        return Owner(name=self.name, namespace=self.namespace, uid=self.uid)


@dataclass(frozen=True)
class Evaluation:
    """A valid spec with a plan that fits, or the reason (InvalidSpec/PlanInfeasible) it is not."""

    job: JobRef
    spec: FineTuneJobSpec | None = None
    plan: Plan | None = None
    failure_reason: str | None = None
    failure_message: str = ""
    # Namespaces that may scrape trainer metrics when the policy builds a NetworkPolicy;
    # None: no NetworkPolicy.
    network_policy: tuple[str, ...] | None = None
    # Kueue: the job's Workload as read this pass; None when the job is not queued in Kueue.
    queue: QueueState | None = None
    # Spec forms refused for new jobs, kept with their old meaning for this accepted one.
    deprecations: tuple[Deprecation, ...] = ()

    @property
    def ok(self) -> bool:
        return self.failure_reason is None and self.spec is not None and self.plan is not None


def default_planner() -> PlanFn:
    """The real planner, imported late so the reconcile layer imports without it."""
    # By name: the planner package is written concurrently and may not export it yet.
    module = importlib.import_module(PLANNER_MODULE)
    planner: PlanFn = vars(module)["plan_job"]
    return planner


def describe_validation_error(err: ValidationError) -> str:
    """The spec's errors as `ftjob plan` words them ('spec.output.uri: why'; a rule across
    fields, whose message names them, at 'spec'): on create, the only refusal a kubectl user
    sees (the CRD's transition rules skip creates)."""
    return "; ".join(f"{where}: {why}" for where, why in format_validation_error(err))


def _check_name(job: JobRef) -> str | None:
    problem = job_name_problem(job.name)
    return None if problem is None else f"metadata.name: {problem}"


def _sticky_failure(job: JobRef, status: FineTuneJobStatus) -> Evaluation | None:
    """A spec refused at this generation stays refused without re-running the planner."""
    failed = find(status.conditions, COND_FAILED)
    if (
        failed is not None
        and failed.status == "True"
        and failed.reason
        in (REASON_INVALID_SPEC, REASON_PLAN_INFEASIBLE, REASON_UNSUPPORTED, REASON_NOT_ALLOWED)
        and status.observed_generation == job.generation
    ):
        return Evaluation(job, failure_reason=failed.reason, failure_message=failed.message)
    return None


def _cached_plan(job: JobRef, status: FineTuneJobStatus) -> Plan | None:
    planned = find(status.conditions, COND_PLANNED)
    if (
        status.plan is not None
        and status.plan.fits
        and planned is not None
        and planned.status == "True"
        and status.observed_generation == job.generation
    ):
        return status.plan
    return None


def _accepted_before(status: FineTuneJobStatus) -> bool:
    """Whether an operator planned this job before (at any generation: a suspend toggle
    bumps it). Its spec was valid then (it is immutable), and it may be running:
    spec_compat applies. The plan stays in the status when a later release refuses the
    spec, so a job that release failed runs again once its generation moves (suspend)."""
    return status.plan is not None


def _network_policy(policy: JobPolicy) -> tuple[str, ...] | None:
    if not policy.network_policy:
        return None
    scrapers = [policy.operator_namespace, *policy.monitoring_namespaces]
    return tuple(sorted({ns for ns in scrapers if ns}))


def evaluate_job(
    job: JobRef,
    raw_spec: Mapping[str, Any],
    status: FineTuneJobStatus,
    planner: PlanFn,
    policy: JobPolicy | None = None,
) -> Evaluation:
    """Validate the spec, check it against the job policy and plan it; the plan is reused
    while the generation is unchanged."""
    policy = policy or JobPolicy()
    sticky = _sticky_failure(job, status)
    if sticky is not None:
        return sticky
    name_problem = _check_name(job)
    if name_problem:
        return Evaluation(job, failure_reason=REASON_INVALID_SPEC, failure_message=name_problem)
    deprecations: tuple[Deprecation, ...] = ()
    if _accepted_before(status):
        raw_spec, deprecations = accept_stored_spec(raw_spec)
    try:
        spec = FineTuneJobSpec.model_validate(dict(raw_spec))
    except ValidationError as err:
        message = describe_validation_error(err)
        return Evaluation(job, failure_reason=REASON_INVALID_SPEC, failure_message=message)
    forbidden = policy_refusals(spec, policy)
    if forbidden:
        message = "the operator's job policy refuses " + "; ".join(forbidden)
        return Evaluation(job, failure_reason=REASON_NOT_ALLOWED, failure_message=message)
    spec = with_policy_defaults(spec, policy)
    plan = _cached_plan(job, status)
    if plan is None:
        try:
            plan = planner(spec)
        except PlanningError as err:
            # Any other exception is a planner bug: the handler retries it rather than blame
            # the user's spec for it.
            message = f"{err.field}: {err.message}"
            return Evaluation(
                job, spec, failure_reason=REASON_INVALID_SPEC, failure_message=message
            )
    if not plan.fits:
        message = f"no configuration fits: {plan.reason}"
        return Evaluation(job, spec, plan, REASON_PLAN_INFEASIBLE, message)
    refusals = trainer_refusals(spec, plan)
    if refusals:
        message = "the trainer cannot run this job: " + "; ".join(refusals)
        return Evaluation(job, spec, plan, REASON_UNSUPPORTED, message)
    return Evaluation(
        job, spec, plan, network_policy=_network_policy(policy), deprecations=deprecations
    )
