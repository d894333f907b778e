"""Losing a node of the local cluster (`LocalCluster.lose_node`) and getting it back, with the
kubelet, its heartbeats and the controllers running (timings of seconds): what the lost
node's processes and the API show, what the kubelet does when the node is back, and that
frozen processes never outlive the cluster, even one killed with SIGKILL."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from finetune_local.cluster import LocalCluster
from finetune_local.controllermanager import NodeHealthTimings
from finetune_local.podrunner import pod_processes
from tests.conftest import REPO, wait_until
from tests.e2e.processes import cluster_processes

pytestmark = pytest.mark.slow

FAST = NodeHealthTimings(
    heartbeat_seconds=0.5,
    monitor_period_seconds=0.5,
    monitor_grace_seconds=3,
    eviction_period_seconds=0.5,
    pod_gc_period_seconds=1,
    pod_gc_quarantine_seconds=2,
)
NODE = "local-node-1"
# A child in a session of its own, as torchrun starts its workers: not in the pod's group.
SCRIPT = "setsid sleep 300 & sleep 300"


@pytest.fixture(scope="module")
def cluster(crds_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    data = tmp_path_factory.mktemp("nodeloss")
    with LocalCluster(data, crds_dir=crds_dir, nodes=2, node_health=FAST) as local:
        yield local


@pytest.fixture
def core(cluster: LocalCluster, new_api_client: Any) -> Iterator[client.CoreV1Api]:
    yield client.CoreV1Api(new_api_client(cluster))
    cluster.restore_node(NODE)  # whatever a test left lost


def _start(
    core: client.CoreV1Api, tolerations: list[dict[str, Any]] | None = None, script: str = SCRIPT
) -> tuple[str, list[int]]:
    name = f"lost-{uuid.uuid4().hex[:5]}"
    spec = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 1,
        "nodeSelector": {"kubernetes.io/hostname": NODE},
        "containers": [{"name": "m", "image": "x", "command": ["sh", "-c", script]}],
        "tolerations": tolerations,
    }
    core.create_namespaced_pod("default", {"metadata": {"name": name}, "spec": spec})

    def started() -> list[int] | None:
        pod = core.read_namespaced_pod(name, "default")
        if pod.status.phase != "Running":
            return None
        pid = int(pod.status.container_statuses[0].container_id.removeprefix("local://"))
        procs = pod_processes(pid)
        return procs if len(procs) >= 3 else None  # sh and its two sleeps

    return name, wait_until(started, f"pod {name} and its processes", 30, 0.1)


def _states(pids: list[int]) -> set[str]:
    states = set()
    for pid in pids:
        try:
            states.add(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0])
        except OSError:
            states.add("gone")
    if "Z" in states:  # dead, not yet reaped by its parent
        states = (states - {"Z"}) | {"gone"}
    return states


def _ready(obj: Any) -> str:
    return next((c.status for c in obj.status.conditions or [] if c.type == "Ready"), "")


def _renew_time(cluster: LocalCluster, new_api_client: Any) -> Any:
    leases = client.CoordinationV1Api(new_api_client(cluster))
    return leases.read_namespaced_lease(NODE, "kube-node-lease").spec.renew_time


def test_partition_freezes_stops_heartbeats_and_status_then_kills_what_was_deleted(
    cluster: LocalCluster, core: client.CoreV1Api, new_api_client: Any
) -> None:
    name, pids = _start(core, [{"key": "node.kubernetes.io/unreachable", "operator": "Exists",
                                "effect": "NoExecute", "tolerationSeconds": 1}])  # fmt: skip
    cluster.lose_node(NODE, "partition")
    assert _states(pids) == {"T"}  # stopped, every process of the tree
    renewed = _renew_time(cluster, new_api_client)
    wait_until(lambda: _ready(core.read_node(NODE)) == "Unknown", "the node to go Unknown", 20)
    assert _renew_time(cluster, new_api_client) == renewed
    assert _ready(core.read_namespaced_pod(name, "default")) == "False"
    # Evicted 1 s after the taint: Terminating, and stays so (no kubelet finishes it).
    wait_until(lambda: core.read_namespaced_pod(name, "default").metadata.deletion_timestamp,
               "the taint eviction", 20)  # fmt: skip
    time.sleep(3)  # past its 1 s grace
    pod = core.read_namespaced_pod(name, "default")
    assert pod.status.phase == "Running" and _states(pids) == {"T"}
    core.delete_namespaced_pod(name, "default", grace_period_seconds=0)  # force

    cluster.restore_node(NODE)
    wait_until(lambda: _states(pids) == {"gone"}, "the deleted pod's processes killed", 20,
               detail=lambda: str(_states(pids)))  # fmt: skip
    wait_until(lambda: _ready(core.read_node(NODE)) == "True", "the node Ready again", 20)
    wait_until(lambda: not core.read_node(NODE).spec.taints, "the taints removed", 20)
    assert _renew_time(cluster, new_api_client) != renewed


def test_a_replacement_of_the_same_name_runs_beside_the_frozen_pod_and_survives_its_end(
    cluster: LocalCluster, core: client.CoreV1Api
) -> None:
    name, pids = _start(core)
    cluster.lose_node(NODE, "partition")
    core.delete_namespaced_pod(name, "default", grace_period_seconds=0)  # what the operator does
    spec = {
        "restartPolicy": "Never",
        "nodeSelector": {"kubernetes.io/hostname": "local-node-0"},
        "containers": [{"name": "m", "image": "x", "command": ["sh", "-c", "sleep 300"]}],
    }
    core.create_namespaced_pod("default", {"metadata": {"name": name}, "spec": spec})
    replacement = wait_until(
        lambda: (p := core.read_namespaced_pod(name, "default")).status.phase == "Running" and p,
        "the replacement to run", 30,
    )  # fmt: skip
    assert _states(pids) == {"T"}  # the old one, frozen all along
    cluster.restore_node(NODE)
    wait_until(lambda: _states(pids) == {"gone"}, "the old pod's processes killed", 20)
    time.sleep(1)
    pod = core.read_namespaced_pod(name, "default")
    assert pod.metadata.uid == replacement.metadata.uid and pod.status.phase == "Running"
    assert cluster.pod_main_pid("default", name) == int(
        pod.status.container_statuses[0].container_id.removeprefix("local://")
    )
    core.delete_namespaced_pod(name, "default", grace_period_seconds=0)


def test_a_stale_pod_runs_again_when_its_node_is_back_and_is_stopped_gracefully(
    cluster: LocalCluster, core: client.CoreV1Api, tmp_path: Path
) -> None:
    """Force-deleted while its node was cut off: its processes ran on all along on a real node,
    and its kubelet, back, stops it as it last saw it (running): SIGTERM and the spec's grace
    period, not a SIGKILL before it can run another instruction."""
    marks = tmp_path / "marks"
    # Counts its own seconds of life after the partition, and says when it is asked to stop.
    script = (f"trap 'echo term >> {marks}; exit 0' TERM; "
              f"while true; do echo beat >> {marks}; sleep 0.2; done")  # fmt: skip
    name, pids = _start(core, script=f"setsid sleep 300 & {script}")
    cluster.lose_node(NODE, "partition")
    core.delete_namespaced_pod(name, "default", grace_period_seconds=0)  # what the operator does
    frozen_at = marks.read_text().count("beat")
    time.sleep(1)
    assert marks.read_text().count("beat") == frozen_at  # frozen
    cluster.restore_node(NODE)
    wait_until(lambda: _states(pids) == {"gone"}, "the stale pod's processes gone", 20,
               detail=lambda: str(_states(pids)))  # fmt: skip
    lines = marks.read_text().split()
    assert lines[-1] == "term", lines[-5:]  # stopped by SIGTERM, and it exited on it


def test_a_pod_that_outlived_the_partition_runs_on_ready_again(
    cluster: LocalCluster, core: client.CoreV1Api
) -> None:
    # Tolerates the lost node for ever (no tolerationSeconds): never evicted.
    forever = [{"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute"}]  # fmt: skip
    # Its processes in the pod's group: a graceful delete stops them all (the kubelet signals
    # the group; a child in a session of its own outlives it, as a trainer until it notices).
    name, pids = _start(core, forever, "sleep 300 & sleep 300 & wait")
    cluster.lose_node(NODE, "partition")
    wait_until(lambda: _ready(core.read_namespaced_pod(name, "default")) == "False",
               "the pod marked not Ready", 20)  # fmt: skip
    cluster.restore_node(NODE)
    assert _states(pids) <= {"S", "R"}, _states(pids)  # thawed
    wait_until(lambda: _ready(core.read_namespaced_pod(name, "default")) == "True",
               "the pod Ready again", 20)  # fmt: skip
    assert core.read_namespaced_pod(name, "default").metadata.deletion_timestamp is None
    core.delete_namespaced_pod(name, "default")  # a live kubelet finishes it
    wait_until(lambda: _states(pids) == {"gone"}, "the pod stopped", 20)


def test_poweroff_kills_and_reports_nothing_until_the_node_is_back(
    cluster: LocalCluster, core: client.CoreV1Api
) -> None:
    forever = [{"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute"}]  # fmt: skip
    name, pids = _start(core, forever)
    cluster.lose_node(NODE, "poweroff")
    assert _states(pids) == {"gone"}
    time.sleep(2)
    assert core.read_namespaced_pod(name, "default").status.phase == "Running"  # nobody said
    cluster.restore_node(NODE)
    pod = wait_until(
        lambda: (p := core.read_namespaced_pod(name, "default")).status.phase == "Failed" and p,
        "the pod reported Failed", 20,
    )  # fmt: skip
    assert pod.status.container_statuses[0].state.terminated.exit_code == 137


def test_lose_node_refuses_what_it_cannot_do(cluster: LocalCluster) -> None:
    with pytest.raises(ValueError, match="no node"):
        cluster.lose_node("local-node-9")
    with pytest.raises(ValueError, match="how must be one of"):
        cluster.lose_node(NODE, "unplugged")  # type: ignore[arg-type]


_KILLED_CLUSTER = textwrap.dedent(
    """
    import sys, time
    from kubernetes import client, config
    from finetune_local.cluster import LocalCluster
    with LocalCluster(sys.argv[1], crds_dir=None, nodes=1) as local:
        core = client.CoreV1Api(config.new_client_from_config(str(local.kubeconfig_path)))
        spec = {"restartPolicy": "Never", "containers": [{"name": "m", "image": "x",
                "command": ["sh", "-c", sys.argv[2]]}]}
        core.create_namespaced_pod("default", {"metadata": {"name": "p"}, "spec": spec})
        while core.read_namespaced_pod("p", "default").status.phase != "Running":
            time.sleep(0.1)
        time.sleep(1)  # the setsid'd child is forked
        local.lose_node("local-node-0")
        print("lost", flush=True)
        time.sleep(600)
    """
)


def test_frozen_processes_die_with_a_killed_cluster(tmp_path: Path) -> None:
    data = tmp_path / "cluster"
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_CLUSTER, str(data), SCRIPT], cwd=REPO, stdout=subprocess.PIPE, text=True
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "lost"
        frozen = cluster_processes(data)
        assert len(frozen) >= 3 and _states(frozen) == {"T"}, _states(frozen)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        wait_until(lambda: not cluster_processes(data), "no process of the killed cluster", 30,
                   detail=lambda: str(cluster_processes(data)))  # fmt: skip
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
