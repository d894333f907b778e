"""Running the operator: in-process (`await operate(settings, ...)`) or blocking
(`run_operator(settings)`, `ftjob operator`). The handlers are registered with kopf's default
registry when finetune_operator.handlers is imported."""

from __future__ import annotations

import asyncio
import copy
import secrets
import threading
from typing import Any

import kopf
import kubernetes.client as k8s
import urllib3
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
    """No cluster to run against: no credentials (in-cluster or a kubeconfig), or its API
    server cannot be reached."""


def run_operator(settings: OperatorSettings, *, kubeconfig: str | None = None) -> None:
    """Blocking entry point (`ftjob operator`)."""
    # Checked before kopf starts: its startup activity would retry a traceback every minute.
    try:
        client = load_api_client(kubeconfig)
    except k8s_config.ConfigException as err:
        raise NoClusterError(
            f"no Kubernetes cluster to run against: {err} (in a pod the operator uses its "
            "ServiceAccount; elsewhere set KUBECONFIG or write ~/.kube/config)"
        ) from None
    _probe_api_server(client)
    asyncio.run(operate(settings, kubeconfig=kubeconfig))


def _probe_api_server(client: k8s.ApiClient, timeout_seconds: float = 10.0) -> None:
    """One GET /version before kopf starts: a server that cannot be reached (a closed port, a
    wrong host, TLS refused) is one line naming it, where kopf would retry for two minutes,
    print three tracebacks and exit 1. An HTTP answer, even a refusal, means it is there (the
    operator's own requests then say what is denied). In a pod, a server not up yet makes the
    container restart, as kopf's giving up would, only sooner."""
    host = client.configuration.host
    # One try: urllib3 retries a failed GET three times by default, so a host that drops the
    # packets (a wrong address, a VPN down) would take four timeouts to be named, not one.
    config = copy.copy(client.configuration)
    config.retries = 0
    try:
        with k8s.ApiClient(config) as probe:
            k8s.VersionApi(probe).get_code(_request_timeout=timeout_seconds)
    except k8s.ApiException:
        return
    except (urllib3.exceptions.HTTPError, OSError) as err:
        reason = getattr(err, "reason", None) or err  # urllib3's MaxRetryError wraps it
        # urllib3 puts its connection object first: the message is the last argument.
        args = getattr(reason, "args", ())
        detail = args[-1] if args and isinstance(args[-1], str) else str(reason)
        raise NoClusterError(
            f"cannot reach the Kubernetes API server at {host}: {detail} (check KUBECONFIG, "
            "the context's server address, and that the cluster is up)"
        ) from None
