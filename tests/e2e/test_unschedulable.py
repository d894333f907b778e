"""A FineTuneJob whose worker pods fit no node of the local cluster (its scheduler models
kube-scheduler's NodeResourcesFit): the job stays Pending, runs nothing, and its status names
the requests no node had room for and the spec fields that set them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from finetune_local.session import LocalSession, phase_of
from tests.conftest import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def test_a_job_whose_workers_fit_no_node_is_reported_not_run(
    quickstart_doc: dict[str, Any], tmp_path: Path
) -> None:
    # Worker pods request what the operator would ask of a real cluster: the quickstart's
    # 2Gi of memory and the data cache's default 32Gi of ephemeral-storage. Both nodes have
    # too little disk; local-node-1 too little memory as well.
    with LocalSession(
        tmp_path / "cluster",
        nodes=2,
        node_capacity={"ephemeral-storage": "20Gi"},
        node_resources={"local-node-1": {"memory": "1Gi"}},
    ) as session:
        core = session.core
        assert core is not None
        session.submit(quickstart_doc)

        def reported() -> str | None:
            job = session.get("quickstart")
            for c in job.get("status", {}).get("conditions", []):
                if "no node has room" in (c.get("message") or ""):
                    return str(c["message"])
            return None

        message = wait_until(
            reported,
            "the job to report its unschedulable workers",
            60,
            detail=lambda: str(session.get("quickstart").get("status")),
        )
        assert (
            "cannot start: Unschedulable: no node has room for the worker's "
            "ephemeral-storage 32Gi (spec.dataset.cacheSizeLimit), "
            "memory 2Gi (spec.resources.memory)"
        ) in message
        assert (
            "scheduler: 0/2 nodes are available: 2 Insufficient ephemeral-storage, "
            "1 Insufficient memory."
        ) in message
        assert phase_of(session.get("quickstart")) == "Pending"
        workers = core.list_namespaced_pod(
            "default", label_selector="finetune.dev/job=quickstart,finetune.dev/role=worker"
        ).items
        assert workers and all(p.spec.node_name is None for p in workers)
        assert all(p.status.phase == "Pending" for p in workers)
        events = core.list_namespaced_event("default").items
        assert {e.involved_object.name for e in events if e.reason == "FailedScheduling"} >= {
            p.metadata.name for p in workers
        }
