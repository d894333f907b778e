"""The operator's job policy (issue 11.7): which trainer images and ServiceAccounts a job may
use, the defaults for jobs that name neither, and the NetworkPolicy the operator builds.

A FineTuneJob author must not run an arbitrary image, or run as a privileged ServiceAccount of
the namespace, just because the operator creates pods on their behalf. The chart sets the
policy (values `trainer.*`, `policy.*`, `networkPolicy.*` → `ftjob operator` flags); the
check is pure and runs in the reconcile pass, refusing a job with a condition that names the
field. `JobPolicy()` itself allows everything (the library default, for tests and embedding);
`ftjob operator` builds a restrictive one from its flags.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase

from finetune_operator.api.constants import DEFAULT_TRAINER_IMAGE
from finetune_operator.api.resources_spec import GangScheduler, GangSchedulingSpec
from finetune_operator.api.spec import FineTuneJobSpec

ANY = "*"


@dataclass(frozen=True)
class JobPolicy:
    """What the operator lets jobs do. Patterns are shell globs (`*` any, `?` one char)."""

    trainer_image: str = DEFAULT_TRAINER_IMAGE  # for jobs that set no spec.image
    allowed_images: tuple[str, ...] = (ANY,)  # the trainer image is always allowed too
    trainer_service_account: str | None = None  # for jobs that set no serviceAccountName
    allowed_service_accounts: tuple[str, ...] = (ANY,)  # the trainer SA is always allowed too
    network_policy: bool = False  # build a NetworkPolicy per job
    operator_namespace: str | None = None  # may scrape trainer metrics
    monitoring_namespaces: tuple[str, ...] = ()  # may scrape trainer metrics
    # Gang scheduling of jobs that set no resources.gangScheduling: None (off), coscheduling
    # or volcano; and the schedulerName of jobs gang-scheduled by that scheduler that name none.
    gang_scheduler: GangScheduler | None = None
    gang_scheduler_name: str | None = None


def _allowed(value: str, patterns: tuple[str, ...], always: str | None) -> bool:
    return value == always or any(fnmatchcase(value, p) for p in patterns)


def policy_refusals(spec: FineTuneJobSpec, policy: JobPolicy) -> list[str]:
    """Why the policy refuses the job, one entry per field (empty: allowed)."""
    refusals = []
    if spec.image is not None and not _allowed(
        spec.image, policy.allowed_images, policy.trainer_image
    ):
        allowed = ", ".join(sorted({policy.trainer_image, *policy.allowed_images}))
        refusals.append(f"spec.image {spec.image!r} is not an allowed trainer image ({allowed})")
    account = spec.resources.service_account_name
    if account is not None and not _allowed(
        account, policy.allowed_service_accounts, policy.trainer_service_account
    ):
        names = {*policy.allowed_service_accounts}
        if policy.trainer_service_account:
            names.add(policy.trainer_service_account)
        allowed = ", ".join(sorted(names)) or "none: leave it unset"
        refusals.append(
            f"spec.resources.serviceAccountName {account!r} is not an allowed trainer "
            f"ServiceAccount ({allowed})"
        )
    return refusals


def _gang_default(gang: GangSchedulingSpec | None, policy: JobPolicy) -> GangSchedulingSpec | None:
    if gang is None and policy.gang_scheduler not in (None, "none"):
        gang = GangSchedulingSpec(scheduler=policy.gang_scheduler)
    if (
        gang is not None
        and gang.scheduler == policy.gang_scheduler
        and gang.scheduler_name is None
        and policy.gang_scheduler_name
    ):
        gang = gang.model_copy(update={"scheduler_name": policy.gang_scheduler_name})
    return gang


def with_policy_defaults(spec: FineTuneJobSpec, policy: JobPolicy) -> FineTuneJobSpec:
    """The spec the pods are built from: the policy's image, ServiceAccount and gang
    scheduling where the job names none."""
    resources = spec.resources
    if resources.service_account_name is None and policy.trainer_service_account:
        resources = resources.model_copy(
            update={"service_account_name": policy.trainer_service_account}
        )
    gang = _gang_default(resources.gang_scheduling, policy)
    if gang is not resources.gang_scheduling:
        resources = resources.model_copy(update={"gang_scheduling": gang})
    return spec.model_copy(
        update={"image": spec.image or policy.trainer_image, "resources": resources}
    )
