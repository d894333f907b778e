"""The operator's settings: one typed object, built once from `ftjob operator`'s flags (which
the Helm chart renders from its values) with environment variables as their defaults.

Nothing else reads the environment: handlers get the settings from kopf's memo. The local
cluster builds its operator's settings through the same flags (`parse_operator_args`), so the
end-to-end tests exercise the path a Deployment uses.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from finetune_operator.api.constants import DEFAULT_TRAINER_IMAGE
from finetune_operator.api.policy import JobPolicy

ENV_PREFIX = "FINETUNE_OPERATOR_"


@dataclass(frozen=True)
class OperatorSettings:
    # None: every namespace (cluster-wide RBAC); otherwise the namespaces watched.
    namespaces: tuple[str, ...] | None = ("default",)
    # Seconds between level-based passes over each job: observe pods, scrape every rank,
    # detect stragglers and hangs. Each pass scrapes every rank of every job: keep it coarse in
    # production (the straggler detector counts steps, not passes, so a longer interval only
    # delays a verdict by at most one interval).
    reconcile_interval_seconds: float = 10.0
    scrape_timeout_seconds: float = 2.0
    watch_timeout_seconds: float = 60.0
    peering: str | None = None  # kopf peering name: leader election among replicas
    liveness: str | None = None  # e.g. http://0.0.0.0:8080/healthz
    metrics_port: int | None = None
    # What jobs may ask for (images, ServiceAccounts) and the per-job NetworkPolicy. The
    # library default allows everything; `ftjob operator`'s flags build a restrictive one.
    policy: JobPolicy = field(default_factory=JobPolicy)


# Messages without the flag's name: argparse's own starts "argument --flag:".
def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (0 to 65535)")
    return value


def _env(env: Mapping[str, str], key: str, default: str | None) -> str | None:
    return env.get(ENV_PREFIX + key, default)


# The flags whose default FINETUNE_OPERATOR_<KEY> sets, as `ftjob operator --help` lists them
# (the names are not the flags' own: tests/operator/test_settings.py checks each one).
ENV_FLAGS: tuple[tuple[str, str], ...] = (
    ("--liveness", "LIVENESS"),
    ("--peering", "PEERING"),
    ("--metrics-port", "METRICS_PORT"),
    ("--reconcile-interval", "RECONCILE_INTERVAL_SECONDS"),
    ("--scrape-timeout", "SCRAPE_TIMEOUT_SECONDS"),
    ("--watch-timeout", "WATCH_TIMEOUT_SECONDS"),
    ("--trainer-image", "TRAINER_IMAGE"),
    ("--gang-scheduler", "GANG_SCHEDULER"),
    ("--gang-scheduler-name", "GANG_SCHEDULER_NAME"),
)


def env_epilog() -> str:
    flags = ", ".join(f"{ENV_PREFIX}{key} ({flag})" for flag, key in ENV_FLAGS)
    return f"environment variables set these flags' defaults (a flag given wins): {flags}"


def add_operator_arguments(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """The flags of `ftjob operator`; each defaults to FINETUNE_OPERATOR_<NAME> if set."""
    d = OperatorSettings()
    parser.add_argument("-n", "--namespace", action="append", help="namespace to watch (repeat)")
    parser.add_argument("-A", "--all-namespaces", action="store_true", help="watch all namespaces")
    parser.add_argument("--liveness", default=_env(env, "LIVENESS", None),
                        help="e.g. http://0.0.0.0:8080/healthz")  # fmt: skip
    parser.add_argument("--peering", default=_env(env, "PEERING", None),
                        help="kopf peering name (leader election)")  # fmt: skip
    parser.add_argument("--standalone", action="store_true", help="no peering, no leader election")
    parser.add_argument("--metrics-port", type=_port, default=_env(env, "METRICS_PORT", "9090"),
                        help="operator /metrics port (0: none; default: %(default)s)")  # fmt: skip
    parser.add_argument(
        "--reconcile-interval",
        type=_positive,
        default=_env(env, "RECONCILE_INTERVAL_SECONDS", str(d.reconcile_interval_seconds)),
        help="seconds between passes over each job (pods, scrape, stragglers, hangs; "
        "default: %(default)s)",
    )
    parser.add_argument(
        "--scrape-timeout",
        type=_positive,
        default=_env(env, "SCRAPE_TIMEOUT_SECONDS", str(d.scrape_timeout_seconds)),
        help="seconds to wait for a trainer's /metrics page (default: %(default)s)",
    )
    parser.add_argument(
        "--watch-timeout",
        type=_positive,
        default=_env(env, "WATCH_TIMEOUT_SECONDS", str(d.watch_timeout_seconds)),
        help="server-side timeout of kopf's watch requests (default: %(default)s)",
    )
    pol = parser.add_argument_group("job policy (what FineTuneJobs may ask for)")
    add_image_policy_arguments(pol, env)
    pol.add_argument(
        "--network-policy",
        action="store_true",
        help="create a NetworkPolicy per job: ingress only from its own pods, metrics only "
        "from the operator's namespace and --monitoring-namespace",
    )
    pol.add_argument("--monitoring-namespace", action="append", metavar="NS",
                     help="namespace whose pods may scrape trainer metrics (repeat)")  # fmt: skip
    pol.add_argument(
        "--gang-scheduler",
        choices=("none", "coscheduling", "volcano"),
        default=_env(env, "GANG_SCHEDULER", "none"),
        help="gang scheduling (a PodGroup per job) for jobs that set no "
        "spec.resources.gangScheduling",
    )
    pol.add_argument("--gang-scheduler-name", default=_env(env, "GANG_SCHEDULER_NAME", ""),
                     help="schedulerName of worker pods gang-scheduled by --gang-scheduler "
                     "(default: that scheduler's usual name)")  # fmt: skip
    parser.epilog = env_epilog()


def add_image_policy_arguments(group: argparse._ArgumentGroup, env: Mapping[str, str]) -> None:
    """The images and ServiceAccounts jobs may use: `ftjob operator`'s policy, which
    `ftjob plan` takes too to check a manifest against it."""
    group.add_argument("--trainer-image",
                       default=_env(env, "TRAINER_IMAGE", DEFAULT_TRAINER_IMAGE),
                       help="image of jobs with no spec.image")  # fmt: skip
    group.add_argument(
        "--allowed-image",
        action="append",
        metavar="GLOB",
        help="another image jobs may name (repeat; '*' allows any); the trainer image always",
    )
    group.add_argument("--trainer-service-account", default="",
                       help="ServiceAccount of jobs that name none")  # fmt: skip
    group.add_argument(
        "--allowed-service-account",
        action="append",
        metavar="GLOB",
        help="another ServiceAccount jobs may name (repeat; '*' allows any)",
    )


def image_policy_from_args(args: argparse.Namespace) -> JobPolicy:
    """The policy of `add_image_policy_arguments`' flags (the rest: JobPolicy's defaults). By
    default only the trainer image and the trainer ServiceAccount (or none: the namespace's
    default, without its token)."""
    return JobPolicy(
        trainer_image=args.trainer_image,
        allowed_images=tuple(args.allowed_image or ()),
        trainer_service_account=args.trainer_service_account or None,
        allowed_service_accounts=tuple(args.allowed_service_account or ()),
    )


def settings_from_args(
    args: argparse.Namespace, env: Mapping[str, str] | None = None
) -> OperatorSettings:
    """`env` gives the operator's own namespace (POD_NAMESPACE, from the downward API)."""
    namespaces = None if args.all_namespaces else tuple(args.namespace or ["default"])
    policy = replace(
        image_policy_from_args(args),
        network_policy=args.network_policy,
        operator_namespace=(env or {}).get("POD_NAMESPACE") or None,
        monitoring_namespaces=tuple(args.monitoring_namespace or ()),
        gang_scheduler=None if args.gang_scheduler == "none" else args.gang_scheduler,
        gang_scheduler_name=args.gang_scheduler_name or None,
    )
    return OperatorSettings(
        namespaces=namespaces,
        # argparse applies `type` to string defaults too, so these are floats here.
        reconcile_interval_seconds=float(args.reconcile_interval),
        scrape_timeout_seconds=float(args.scrape_timeout),
        watch_timeout_seconds=float(args.watch_timeout),
        peering=None if args.standalone else args.peering,
        liveness=args.liveness,
        metrics_port=int(args.metrics_port) if args.metrics_port else None,
        policy=policy,
    )


def parse_operator_args(
    argv: Sequence[str], env: Mapping[str, str] | None = None
) -> OperatorSettings:
    """Settings from `ftjob operator` flags, e.g. the args the chart's Deployment renders."""
    parser = argparse.ArgumentParser(prog="ftjob operator", exit_on_error=False)
    add_operator_arguments(parser, env or {})
    return settings_from_args(parser.parse_args(list(argv)), env)
