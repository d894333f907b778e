"""Stragglers and hangs end to end: the real operator scrapes real trainers (torchrun, gloo) on
the local cluster, where one virtual node is slow (its pods sleep in every step, as on a slow
GPU) or one rank hangs.

- action evict: the slow node's worker is found (Event, condition), evicted, its node excluded,
  the replacement scheduled elsewhere; the job resumes from its checkpoint and succeeds.
- action alert: the same job is flagged (condition, Event) and never evicted.
- no slow node: never evicted over the whole run; a rank that hangs is detected and the job
  restarts from its checkpoint and succeeds.
The operator's own /metrics is scraped: the straggler ratio and eviction series the dashboard
and the alert read carry the values of these runs.
"""

from __future__ import annotations

import socket
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from finetune_local.session import LocalSession, is_finished, phase_of
from finetune_operator.api import metricnames as mn
from tests.e2e.conftest import committed_steps, resumed_steps

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

SLOW_NODE = "local-node-2"
# Every rank's step sleeps 0.1 s (compute the tiny model on a shared CPU would otherwise make
# all noise); the slow node's 0.4 s.
BASE_ENV = {"FT_STEP_DELAY_SECONDS": "0.1"}
SLOW_ENV = {"FT_STEP_DELAY_SECONDS": "0.4"}
HANG_NODE = "local-node-2"
MAX_STEPS = 80  # the eviction must come well before the end on a loaded CI machine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def slow_node_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSession]:
    # local-node-0 takes the rendezvous pod (the first one created, on the emptiest node), the
    # workers are pinned to nodes 1-4: worker-1 lands on the slow node 2, node 4 stays free.
    data = tmp_path_factory.mktemp("stragglers") / "cluster"
    port = _free_port()
    with LocalSession(
        data, nodes=5, extra_env=BASE_ENV, node_env={SLOW_NODE: SLOW_ENV}, metrics_port=port
    ) as s:
        s.metrics_port = port  # type: ignore[attr-defined]
        yield s


def _job(
    doc: dict[str, Any], name: str, nodes: list[str], steps: int = MAX_STEPS, **stragglers: Any
) -> dict[str, Any]:
    doc["metadata"]["name"] = name
    spec = doc["spec"]
    spec["training"].update(globalBatchSize=12, maxSteps=steps)
    spec["resources"].update(
        minNodes=3,
        maxNodes=3,
        affinity={
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [
                            {"key": "kubernetes.io/hostname", "operator": "In", "values": nodes}
                        ]}
                    ]
                }
            }
        },
    )  # fmt: skip
    # Every 10 steps: the detector skips records that include a save, so not too often.
    spec["checkpoint"].update(uri=f"checkpoints/{name}", intervalSteps=10)
    spec["output"]["uri"] = f"output/{name}"
    spec["faultTolerance"].update(
        # The default cooldown (600 s). The false eviction of a survivor right after the
        # re-form that cooldown 0 once showed here is fixed and reproduced without a cluster in
        # tests/operator/test_straggler_reform.py (with 0 this run passed once since); on a
        # loaded 2-core machine these 5-step windows are noisy, so 0 waits for more runs.
        stragglers={"windowSteps": 5, "consecutiveWindows": 2, "cooldownSeconds": 600, **stragglers}
    )
    return doc


def _conditions(job: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in job.get("status", {}).get("conditions", [])}


def _events(session: LocalSession, name: str) -> list[Any]:
    assert session.core is not None
    events = session.core.list_namespaced_event("default").items
    return [e for e in events if e.involved_object.name == name]


def _operator_series(session: LocalSession, metric: mn.Metric, job: str) -> dict[str, float]:
    port = session.metrics_port  # type: ignore[attr-defined]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == metric.name and s.labels.get("finetunejob") == job:
                assert s.labels["namespace"] == "default"
                out[s.labels.get("rank", "")] = s.value
    return out


def _why(job: dict[str, Any]) -> list[tuple[str, str, str]]:
    return [(c["type"], c["reason"], c.get("message", "")) for c in _conditions(job).values()]


def _pod_node(session: LocalSession, name: str) -> str | None:
    assert session.core is not None
    return session.core.read_namespaced_pod(name, "default").spec.node_name  # type: ignore[no-any-return]


def test_slow_node_is_evicted_and_avoided(
    slow_node_session: LocalSession, quickstart_doc: dict[str, Any]
) -> None:
    s = slow_node_session
    s.submit(
        _job(
            quickstart_doc,
            "strag-evict",
            ["local-node-1", SLOW_NODE, "local-node-3", "local-node-4"],
        )
    )
    ratios: dict[str, float] = {}
    flagged: list[dict[str, Any]] = []

    def watch(job: dict[str, Any]) -> None:
        cond = _conditions(job).get("StragglerDetected")
        if cond and cond["status"] == "True":
            flagged.append(cond)
        for rank, value in _operator_series(s, mn.OPERATOR_STRAGGLER_RATIO, "strag-evict").items():
            ratios[rank] = max(value, ratios.get(rank, 0.0))

    job = s.wait_for(
        "strag-evict",
        lambda j: bool(j.get("status", {}).get("evictions")),
        timeout=300,
        on_poll=watch,
    )
    (eviction,) = job["status"]["evictions"]
    assert eviction["node"] == SLOW_NODE and eviction["pod"] == "strag-evict-worker-1"
    assert eviction["ratio"] >= 1.2 and eviction["rank"] is not None
    assert job["status"]["excludedNodes"] == [SLOW_NODE]
    checkpoint_at_eviction = int((job["status"].get("lastCheckpoint") or {}).get("step") or 0)
    assert flagged and flagged[-1]["reason"] in ("StragglerFound", "StragglerEvicted")
    evicted = _operator_series(s, mn.OPERATOR_EVICTIONS, "strag-evict")
    assert evicted == {"": 1.0}
    assert ratios and max(ratios.values()) >= 1.2, ratios  # the dashboard's straggler panel

    job = s.wait_for("strag-evict", is_finished, timeout=400)
    assert phase_of(job) == "Succeeded", _why(job)
    status = job["status"]
    assert len(status["evictions"]) == 1 and status["restarts"] == 0  # no budget spent
    assert _pod_node(s, "strag-evict-worker-1") not in (SLOW_NODE, None)
    reasons = {e.reason: e.message for e in _events(s, "strag-evict")}
    assert "StragglerEvicted" in reasons and SLOW_NODE in reasons["StragglerEvicted"]
    assert "strag-evict-worker-1" in reasons["StragglerEvicted"]
    # The re-formed group resumed from the checkpoint committed at or after the eviction (the
    # evicted rank's stop saves one): no step lost beyond it; the run went on to the end.
    log = s.cluster.pod_log_path("default", "strag-evict-worker-0")
    assert log is not None
    resumed = resumed_steps(log)
    assert resumed and min(resumed) >= checkpoint_at_eviction, (resumed, checkpoint_at_eviction)
    committed = committed_steps(s.data_dir / "shared" / "checkpoints" / "strag-evict")
    assert committed[-1] == MAX_STEPS
    # A finished job's series are deleted.
    assert _operator_series(s, mn.OPERATOR_STRAGGLER_RATIO, "strag-evict") == {}


def test_alert_action_flags_but_never_evicts(
    slow_node_session: LocalSession, quickstart_doc: dict[str, Any]
) -> None:
    s = slow_node_session
    nodes = ["local-node-1", SLOW_NODE, "local-node-3"]
    s.submit(_job(quickstart_doc, "strag-alert", nodes, steps=60, action="alert"))
    seen: list[str] = []
    ratios: dict[str, float] = {}

    def watch(job: dict[str, Any]) -> None:
        cond = _conditions(job).get("StragglerDetected")
        if cond and cond["status"] == "True":
            seen.append(cond["reason"])
        for rank, value in _operator_series(s, mn.OPERATOR_STRAGGLER_RATIO, "strag-alert").items():
            ratios[rank] = max(value, ratios.get(rank, 0.0))

    job = s.wait_for("strag-alert", is_finished, timeout=400, on_poll=watch)
    assert phase_of(job) == "Succeeded", _why(job)
    assert "StragglerAlerted" in seen
    assert job["status"].get("evictions", []) == [] and job["status"].get("excludedNodes", []) == []
    slow = [x for x in job["status"].get("stragglers", []) if x.get("confirmed")]
    assert all(x["node"] == SLOW_NODE for x in slow)
    assert max(ratios.values()) >= 1.2, ratios
    found = [e for e in _events(s, "strag-alert") if e.reason == "StragglerFound"]
    assert found and SLOW_NODE in found[0].message and "strag-alert-worker-" in found[0].message


def test_hung_rank_recovers_and_a_healthy_job_is_never_evicted(
    tmp_path_factory: pytest.TempPathFactory, quickstart_doc: dict[str, Any]
) -> None:
    data = tmp_path_factory.mktemp("hang") / "cluster"
    # The hang is transient: the first rank to reach step 12 on this node leaves a marker in
    # the shared working directory and hangs; after the restart it trains normally.
    env = {HANG_NODE: {"FT_HANG_AT_STEP": "12"}}
    with LocalSession(data, nodes=4, extra_env=BASE_ENV, node_env=env) as s:
        # Threshold 1.5, not the default 1.2: three "nodes" share this machine's 2 cores with
        # the other tests, and over 5-step windows that contention alone once measured a
        # healthy rank at 1.21x (an eviction that is the CPU's, not a node's).
        doc = _job(quickstart_doc, "hang", ["local-node-1", HANG_NODE, "local-node-3"], steps=30,
                   threshold=1.5)  # fmt: skip
        doc["spec"]["faultTolerance"]["hangTimeoutSeconds"] = 15
        s.submit(doc)
        straggler_seen: list[dict[str, Any]] = []

        def watch(job: dict[str, Any]) -> None:
            cond = _conditions(job).get("StragglerDetected")
            if cond and cond["status"] == "True":
                straggler_seen.append(cond)

        job = s.wait_for("hang", lambda j: int(j.get("status", {}).get("hangs") or 0) >= 1,
                         timeout=300, on_poll=watch)  # fmt: skip
        hang = _conditions(job)["HangDetected"]
        assert hang["status"] == "True" and hang["reason"] in ("RankHung", "NoProgress")
        job = s.wait_for("hang", is_finished, timeout=400, on_poll=watch)
        assert phase_of(job) == "Succeeded", _why(job)
        status = job["status"]
        assert status["hangs"] == 1 and status["restarts"] == 1
        assert _conditions(job)["HangDetected"]["status"] == "False"
        assert status.get("evictions", []) == [] and not straggler_seen, straggler_seen
        events = [e for e in _events(s, "hang") if e.reason == "HangDetected"]
        assert events and events[0].type == "Warning"
        assert committed_steps(s.data_dir / "shared" / "checkpoints" / "hang")[-1] == 30
