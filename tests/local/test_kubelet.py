"""The local kubelet: scheduling, pod processes, namespaces, volumes, exit codes, deletion."""

from __future__ import annotations

import pathlib
import time
import uuid
from typing import Any

import pytest
from kubernetes import client

from finetune_local.cluster import LocalCluster
from tests.conftest import wait_until

pytestmark = pytest.mark.slow


@pytest.fixture
def core(cluster: LocalCluster, new_api_client: Any) -> client.CoreV1Api:
    return client.CoreV1Api(new_api_client(cluster))


def _pod(name: str, script: str, **spec: Any) -> dict[str, Any]:
    container = {
        "name": "main",
        "image": "ignored",
        "command": ["sh", "-c", script],
        **spec.pop("container", {}),
    }
    return {
        "metadata": {"name": name, "labels": spec.pop("labels", {"app": name})},
        "spec": {"restartPolicy": "Never", "containers": [container], **spec},
    }


def _wait_pod(core: client.CoreV1Api, name: str, predicate: Any, timeout: float = 15.0) -> Any:
    def read() -> Any:
        return core.read_namespaced_pod(name, "default")

    def matching() -> Any:
        pod = read()
        return pod if predicate(pod) else None

    return wait_until(matching, f"pod {name}", timeout, detail=lambda: str(read().status))


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:5]}"


def test_pod_gets_hostname_ip_hosts_and_config_volume(
    cluster: LocalCluster, core: client.CoreV1Api
) -> None:
    name = _name("hello")
    core.create_namespaced_config_map(
        "default", {"metadata": {"name": f"{name}-cfg"}, "data": {"job.json": "{}"}}
    )
    core.create_namespaced_service(
        "default",
        {
            "metadata": {"name": f"{name}-svc"},
            "spec": {"clusterIP": "None", "selector": {"app": name}},
        },
    )
    script = (
        "hostname; cat /etc/hosts; echo IP=$POD_IP; echo X=$(cat /etc/cfg/job.json); echo N=$NODE"
    )
    env = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
    ]
    core.create_namespaced_pod(
        "default",
        _pod(
            name,
            f"sleep 1; {script}",
            volumes=[{"name": "cfg", "configMap": {"name": f"{name}-cfg"}}],
            container={"env": env, "volumeMounts": [{"name": "cfg", "mountPath": "/etc/cfg"}]},
        ),
    )
    pod = _wait_pod(core, name, lambda p: p.status.phase == "Succeeded")
    log = cluster.pod_log_path("default", name)
    assert log is not None
    lines = log.read_text().splitlines()
    ip = pod.status.pod_ip
    assert ip.startswith("127.") and not ip.startswith("127.0.")  # the cluster's own /16
    assert lines[0] == name
    assert f"{ip}\t{name}" in lines
    assert any(
        line.startswith(ip) and f"{name}-svc.default.svc.cluster.local" in line for line in lines
    )
    assert f"IP={ip}" in lines and "X={}" in lines and f"N={pod.spec.node_name}" in lines
    assert pod.status.container_statuses[0].state.terminated.exit_code == 0


def test_exit_code_becomes_failed_status(core: client.CoreV1Api) -> None:
    name = _name("three")
    core.create_namespaced_pod("default", _pod(name, "exit 3"))
    pod = _wait_pod(core, name, lambda p: p.status.phase == "Failed")
    assert pod.status.container_statuses[0].state.terminated.exit_code == 3


def test_delete_sends_sigterm_then_removes(cluster: LocalCluster, core: client.CoreV1Api) -> None:
    name = _name("term")
    script = "trap 'echo got-term; exit 0' TERM; echo started; while true; do sleep 0.1; done"
    core.create_namespaced_pod("default", _pod(name, script))
    _wait_pod(core, name, lambda p: p.status.phase == "Running")
    log = cluster.pod_log_path("default", name)
    assert log is not None
    time.sleep(0.5)
    core.delete_namespaced_pod(name, "default")
    assert core.read_namespaced_pod(name, "default").metadata.deletion_timestamp  # graceful first

    def removed() -> bool:
        try:
            core.read_namespaced_pod(name, "default")
        except client.ApiException as exc:
            assert exc.status == 404
            return True
        return False

    wait_until(removed, "the pod to be removed", 15)
    assert "got-term" in log.read_text()


def test_required_node_anti_affinity_excludes_nodes(
    cluster: LocalCluster, core: client.CoreV1Api
) -> None:
    excluded = cluster.node_names[:-1]
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {
                        "matchExpressions": [
                            {
                                "key": "kubernetes.io/hostname",
                                "operator": "NotIn",
                                "values": excluded,
                            }
                        ]
                    }
                ]
            }
        }
    }
    name = _name("avoid")
    core.create_namespaced_pod("default", _pod(name, "true", affinity=affinity))
    pod = _wait_pod(core, name, lambda p: p.spec.node_name is not None)
    assert pod.spec.node_name == cluster.node_names[-1]
    nowhere = _name("nowhere")
    affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][
        0
    ]["matchExpressions"][0]["values"] = cluster.node_names
    core.create_namespaced_pod("default", _pod(nowhere, "true", affinity=affinity))
    pending = _wait_pod(
        core,
        nowhere,
        lambda p: any(
            c.type == "PodScheduled" and c.status == "False" for c in p.status.conditions or []
        ),
    )
    assert pending.status.phase == "Pending" and pending.spec.node_name is None


def test_a_pod_no_node_has_room_for_stays_pending_with_kubes_reason_and_event(
    cluster: LocalCluster, core: client.CoreV1Api
) -> None:
    """Each node advertises 8 cpu and 32Gi (less 100Mi) allocatable: a limit of 40Gi is a
    request of 40Gi (defaulted), which no node fits; a FailedScheduling event says so."""
    node = core.read_node(cluster.node_names[0])
    assert node.status.capacity["ephemeral-storage"] == "200Gi"
    assert int(node.status.allocatable["memory"]) == 32 * 2**30 - 100 * 2**20
    name = _name("huge")
    limits = {"cpu": "2", "memory": "40Gi"}
    core.create_namespaced_pod(
        "default", _pod(name, "true", container={"resources": {"limits": limits}})
    )
    pending = _wait_pod(
        core,
        name,
        lambda p: any(
            c.type == "PodScheduled" and c.status == "False" for c in p.status.conditions or []
        ),
    )
    assert pending.spec.containers[0].resources.requests == limits
    assert pending.status.qos_class == "Guaranteed"
    condition = next(c for c in pending.status.conditions if c.type == "PodScheduled")
    assert condition.reason == "Unschedulable"
    assert condition.message == "0/3 nodes are available: 3 Insufficient memory."

    # Each retry is one more FailedScheduling; the recorder makes them one Event whose
    # series counts from the second attempt (about a second later), as on a real cluster.
    def failed() -> list[Any]:
        events = core.list_namespaced_event("default").items
        return [e for e in events if e.involved_object.name == name]

    repeated = wait_until(
        lambda: [e for e in failed() if e.series is not None] or None, "an event series", 10
    )
    assert [(e.type, e.reason, e.message, e.source.component) for e in failed()] == [
        ("Warning", "FailedScheduling", condition.message, "default-scheduler")
    ]
    assert repeated[0].series.count == 2 and repeated[0].series.last_observed_time
    assert pending.status.phase == "Pending" and pending.spec.node_name is None


def test_kill_pod_processes_gives_exit_137(cluster: LocalCluster, core: client.CoreV1Api) -> None:
    name = _name("kill")
    core.create_namespaced_pod("default", _pod(name, "sleep 60"))
    _wait_pod(core, name, lambda p: p.status.phase == "Running")
    assert cluster.kill_pod_processes("default", name)
    pod = _wait_pod(core, name, lambda p: p.status.phase == "Failed")
    assert pod.status.container_statuses[0].state.terminated.exit_code == 137


def _live_members(pgid: int) -> list[int]:
    """Processes of a group that are not zombies (a sandbox init may not reap orphans)."""
    members = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def test_stop_leaves_no_processes(crds_dir: Any, tmp_path: Any, new_api_client: Any) -> None:
    with LocalCluster(tmp_path, crds_dir=crds_dir, nodes=1) as local:
        core = client.CoreV1Api(new_api_client(local))
        core.create_namespaced_pod("default", _pod("orphan", "sleep 300 & sleep 300"))
        pod = _wait_pod(core, "orphan", lambda p: p.status.phase == "Running")
        pid = int(pod.status.container_statuses[0].container_id.removeprefix("local://"))
        # The shell's background child shares its group (it may take a moment to fork).
        deadline = time.monotonic() + 10
        while len(_live_members(pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(_live_members(pid)) >= 2
    # SIGKILLed on stop; a loaded machine may take a moment to finish them off.
    deadline = time.monotonic() + 10
    while _live_members(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _live_members(pid) == []


def test_volume_over_tmp_keeps_image_paths_visible(
    cluster: LocalCluster, core: client.CoreV1Api
) -> None:
    # The cluster's data dir lives under /tmp here (pytest's tmp_path); a pod mounting an
    # emptyDir over /tmp (as worker pods do) must still see it, and the Python environment,
    # while its /tmp is otherwise the fresh, empty volume.
    assert str(cluster.data_dir).startswith("/tmp/")
    marker = cluster.data_dir / "shared" / "marker.txt"
    marker.write_text("visible")
    stray = pathlib.Path("/tmp") / f"stray-{uuid.uuid4().hex[:6]}"
    stray.write_text("host /tmp")
    name = _name("tmpvol")
    script = (
        f"cat {marker}; echo; test -e {stray} && echo STRAY || echo CLEAN; python -c 'print(1+1)'"
    )
    core.create_namespaced_pod(
        "default",
        _pod(
            name,
            script,
            volumes=[{"name": "tmp", "emptyDir": {}}],
            container={"volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}]},
        ),
    )
    try:
        _wait_pod(core, name, lambda p: p.status.phase in ("Succeeded", "Failed"))
        log = cluster.pod_log_path("default", name)
        assert log is not None
        assert log.read_text().split() == ["visible", "CLEAN", "2"], log.read_text()
    finally:
        stray.unlink()


@pytest.mark.parametrize(
    ("script", "policy", "phase", "expected"),
    [
        ("echo '{\"step\": 7}' > /dev/termination-log", None, "Succeeded", '{"step": 7}\n'),
        ("echo boom; exit 2", "FallbackToLogsOnError", "Failed", "boom\n"),
        ("echo boom; exit 2", None, "Failed", None),
    ],
    ids=["file", "fallback-to-logs", "file-policy-empty"],
)
def test_termination_message(
    core: client.CoreV1Api, script: str, policy: str | None, phase: str, expected: str | None
) -> None:
    name = _name("term")
    container = {"terminationMessagePolicy": policy} if policy else {}
    core.create_namespaced_pod("default", _pod(name, script, container=container))
    pod = _wait_pod(core, name, lambda p: p.status.phase == phase)
    message = pod.status.container_statuses[0].state.terminated.message
    assert (message or None) == expected


def test_claim_binds_on_first_consumer_and_outlives_pods(
    cluster: LocalCluster, core: client.CoreV1Api
) -> None:
    """A pod whose claim does not exist stays Pending; once the claim exists the kubelet binds
    it to a host directory (as a WaitForFirstConsumer provisioner would), and what one pod
    wrote there the next one reads."""
    name = _name("pvc")
    volume = {"name": "data", "persistentVolumeClaim": {"claimName": f"{name}-claim"}}
    mount = {"volumeMounts": [{"name": "data", "mountPath": "/data"}]}
    core.create_namespaced_pod(
        "default", _pod(f"{name}-w", "echo hello > /data/note", volumes=[volume], container=mount)
    )
    time.sleep(2)
    assert core.read_namespaced_pod(f"{name}-w", "default").status.phase == "Pending"
    core.create_namespaced_persistent_volume_claim(
        "default",
        {
            "metadata": {"name": f"{name}-claim"},
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
    )
    _wait_pod(core, f"{name}-w", lambda p: p.status.phase == "Succeeded")
    claim = core.read_namespaced_persistent_volume_claim(f"{name}-claim", "default")
    assert claim.status.phase == "Bound" and claim.status.access_modes == ["ReadWriteMany"]
    core.create_namespaced_pod(
        "default", _pod(f"{name}-r", "cat /data/note", volumes=[volume], container=mount)
    )
    _wait_pod(core, f"{name}-r", lambda p: p.status.phase == "Succeeded")
    log = cluster.pod_log_path("default", f"{name}-r")
    assert log is not None and log.read_text().strip() == "hello"


def test_secret_env_waits_for_the_secret_and_its_key(
    cluster: LocalCluster, core: client.CoreV1Api
) -> None:
    """Env from a Secret (secretKeyRef) as a real kubelet resolves it: while the Secret or a
    key is missing the container waits in CreateContainerConfigError (the pod stays Pending,
    nothing runs); once both exist the process starts with the values; an optional key may
    be absent."""
    name = _name("sec")
    env = [
        {"name": k, "valueFrom": {"secretKeyRef": {"name": f"{name}-s", "key": k}}}
        for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
    ]
    env.append(
        {
            "name": "AWS_SESSION_TOKEN",
            "valueFrom": {
                "secretKeyRef": {"name": f"{name}-s", "key": "AWS_SESSION_TOKEN", "optional": True}
            },
        }
    )
    core.create_namespaced_pod(
        "default",
        _pod(
            name,
            'echo "$AWS_ACCESS_KEY_ID/$AWS_SECRET_ACCESS_KEY/${AWS_SESSION_TOKEN-unset}"',
            container={"env": env},
        ),
    )

    def waiting(p: Any) -> Any:
        statuses = p.status.container_statuses or []
        return statuses and statuses[0].state.waiting

    pod = _wait_pod(
        core, name, lambda p: waiting(p) and waiting(p).reason == "CreateContainerConfigError"
    )
    assert pod.status.phase == "Pending" and waiting(pod).message == f'secret "{name}-s" not found'
    core.create_namespaced_secret(
        "default", {"metadata": {"name": f"{name}-s"}, "stringData": {"AWS_ACCESS_KEY_ID": "AKID"}}
    )
    pod = _wait_pod(core, name, lambda p: waiting(p) and "couldn't find key" in waiting(p).message)
    assert (
        waiting(pod).message
        == f"couldn't find key AWS_SECRET_ACCESS_KEY in Secret default/{name}-s"
    )
    assert pod.status.phase == "Pending" and cluster.pod_log_path("default", name) is None
    core.patch_namespaced_secret(
        f"{name}-s", "default", {"stringData": {"AWS_SECRET_ACCESS_KEY": "sk"}}
    )
    _wait_pod(core, name, lambda p: p.status.phase == "Succeeded")
    log = cluster.pod_log_path("default", name)
    assert log is not None and log.read_text().strip() == "AKID/sk/unset"


def test_empty_dir_outlives_restarts_is_evicted_over_its_size_limit_and_goes_with_the_pod(
    cluster: LocalCluster, core: client.CoreV1Api
) -> None:
    """An emptyDir as a node keeps it (the worker pods' data cache relies on all three): the
    container's restart finds what it wrote; outgrowing `sizeLimit` evicts the pod (Failed,
    reason Evicted, the kubelet's message), not a failed write; deleting the pod deletes it."""
    name = _name("cache")
    script = (
        "if [ -f /cache/mark ]; then echo again; head -c 3000000 /dev/zero > /cache/big; sleep 60; "
        "else echo first > /cache/mark; exit 1; fi"
    )
    core.create_namespaced_pod(
        "default",
        _pod(
            name,
            script,
            restartPolicy="OnFailure",
            volumes=[{"name": "cache", "emptyDir": {"sizeLimit": "1Mi"}}],
            container={"volumeMounts": [{"name": "cache", "mountPath": "/cache"}]},
        ),
    )
    pod = _wait_pod(core, name, lambda p: p.status.phase == "Failed", timeout=30)
    assert (pod.status.reason, pod.status.message) == (
        "Evicted",
        'Usage of EmptyDir volume "cache" exceeds the limit "1Mi". ',
    )
    assert pod.status.container_statuses[0].restart_count == 1
    log = cluster.pod_log_path("default", name)
    assert log is not None and "again" in log.read_text()  # the restart saw the first's mark
    volume = log.parent / "volumes" / "cache"
    assert (volume / "mark").exists()
    core.delete_namespaced_pod(name, "default")
    wait_until(lambda: not volume.exists(), "the emptyDir to go with the pod", 15)


def test_a_volume_source_under_another_volumes_mount_path_is_not_hidden(tmp_path: Any) -> None:
    """A hostPath under /tmp, in a worker pod whose emptyDir is mounted over /tmp first, failed
    every start with "mount /tmp/.../data on /data: No such file or directory" (the emptyDir
    hid the source): sources are opened before the first mount."""
    import json
    import subprocess
    import sys

    from finetune_local import podinit

    outer, empty, inner = tmp_path / "outer", tmp_path / "empty", tmp_path / "inner"
    for path in (outer / "data", empty, inner):
        path.mkdir(parents=True)
    (outer / "data" / "mine.jsonl").write_text("mine\n")
    spec = {
        "hostname": "p",
        "mounts": [
            {"source": str(empty), "target": str(outer), "readOnly": False},  # as /tmp's emptyDir
            {"source": str(outer / "data"), "target": str(inner), "readOnly": True},
        ],
        "workingDir": str(tmp_path),
        "argv": ["sh", "-c", f"cat {inner}/mine.jsonl; ls -A {outer} | wc -l"],
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    run = subprocess.run(
        [sys.executable, "-I", "-S", podinit.__file__, str(tmp_path / "spec.json")],  # as spawned
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert (run.returncode, run.stdout.split()) == (0, ["mine", "0"]), run.stderr


def test_a_mount_target_another_clusters_pod_mounts_on_is_not_removed(tmp_path: Any) -> None:
    """Two local clusters on one host: the one stopping first removed the mount targets it had
    created (/etc/finetune), which detached the other's pods' mounts there: their trainers
    failed on a missing /etc/finetune/job.json."""
    import subprocess

    from finetune_local.mountpoints import MountPoints

    source, target = tmp_path / "config", tmp_path / "etc" / "finetune"
    source.mkdir()
    (source / "job.json").write_text("{}")
    points = MountPoints(tmp_path / "registry")
    points.ensure(target, is_file=False)  # creates etc/ and etc/finetune
    other_pod = subprocess.Popen(  # another cluster's pod: its own mount namespace
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         f"mount --bind {source} {target} && echo up && sleep 60"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert other_pod.stdout is not None and other_pod.stdout.readline() == "up\n"
        points.remove_created()
        assert target.is_dir()  # still its mount point
        seen = subprocess.run(
            ["nsenter", "-t", str(other_pod.pid), "-m", "cat", str(target / "job.json")],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert seen.stdout == "{}", seen.stderr
    finally:
        other_pod.kill()
        other_pod.wait()
