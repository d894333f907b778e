"""Running the operator: in-process (`await operate(settings, ...)`) or blocking
(`run_operator(settings)`, `ftjob operator`). The handlers are registered with kopf's default
registry when finetune_operator.handlers is imported."""

from __future__ import annotations

import asyncio
import secrets
import threading
from typing import Any

import kopf
from kubernetes import config as k8s_config

from finetune_operator.api.policy import JobPolicy
from finetune_operator.reconcile.apply import ClusterApi, load_api_client
from finetune_operator.settings import OperatorSettings


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
