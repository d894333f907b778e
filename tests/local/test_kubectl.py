"""Real ``kubectl --kubeconfig`` against the emulator: discovery, Tables, CRUD."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess

import pytest
import yaml

from finetune_local.cluster import LocalCluster

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")


def kubectl(
    cluster: LocalCluster, *args: str, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    cache = cluster.data_dir / "kubectl-cache"
    return subprocess.run(
        ["kubectl", "--kubeconfig", str(cluster.kubeconfig_path), "--cache-dir", str(cache), *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_kubectl_create_and_get_shows_printer_columns(
    api_cluster: LocalCluster, tmp_path: pathlib.Path
) -> None:
    manifest = {
        "apiVersion": "test.dev/v1",
        "kind": "Widget",
        "metadata": {"name": "shown"},
        "spec": {"size": 7},
    }
    created = kubectl(api_cluster, "create", "-f", "-", stdin=yaml.safe_dump(manifest))
    assert created.returncode == 0, created.stderr
    result = kubectl(api_cluster, "get", "wdg")
    assert result.returncode == 0, result.stderr
    header, row = result.stdout.splitlines()[:2]
    assert header.split() == ["NAME", "PHASE", "SIZE", "AGE"]
    assert row.split()[0] == "shown" and "7" in row.split()


def test_kubectl_refusal_names_the_field(api_cluster: LocalCluster) -> None:
    manifest = {
        "apiVersion": "test.dev/v1",
        "kind": "Widget",
        "metadata": {"name": "bad"},
        "spec": {"size": 99},
    }
    result = kubectl(api_cluster, "create", "-f", "-", stdin=yaml.safe_dump(manifest))
    assert result.returncode != 0 and "spec.size" in result.stderr and "is invalid" in result.stderr


def test_kubectl_json_get_delete_and_namespaces(api_cluster: LocalCluster) -> None:
    # Generator subcommands (`kubectl create configmap ...`) send protobuf, which the emulator
    # refuses (415); manifests go as JSON.
    manifest = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "kc"},
        "data": {"a": "b"},
    }
    created = kubectl(api_cluster, "apply", "-f", "-", stdin=yaml.safe_dump(manifest))
    assert created.returncode == 0, created.stderr
    got = kubectl(api_cluster, "get", "cm", "kc", "-o", "json")
    assert json.loads(got.stdout)["data"] == {"a": "b"}
    assert "default" in kubectl(api_cluster, "get", "ns").stdout
    assert kubectl(api_cluster, "delete", "cm", "kc").returncode == 0
    assert kubectl(api_cluster, "get", "cm", "kc").returncode != 0


def test_kubectl_explain_shows_a_custom_resource_fields_description(
    api_cluster: LocalCluster,
) -> None:
    # README's `kubectl explain finetunejob.spec.training`: the API server publishes a CRD's
    # schema in OpenAPI v3 (it was "GVK ... not found in OpenAPI schema" here).
    result = kubectl(api_cluster, "explain", "widgets.spec.size")
    assert result.returncode == 0, result.stderr
    assert "How many widgets." in result.stdout and "integer" in result.stdout
    fields = kubectl(api_cluster, "explain", "widgets.spec")
    assert fields.returncode == 0, fields.stderr
    assert "size" in fields.stdout and "mode" in fields.stdout


def test_kubectl_get_events_shows_what_happened_to_which_object(
    api_cluster: LocalCluster,
) -> None:
    # The operator's Events (PlanFits, Restarting, ...) showed as NAME and AGE alone.
    event = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": "job.1"},
        "involvedObject": {"kind": "FineTuneJob", "name": "job", "namespace": "default"},
        "reason": "PlanFits",
        "message": "2 x CPU process: ddp",
        "type": "Normal",
        "source": {"component": "kopf"},
        "firstTimestamp": "2026-01-01T00:00:00Z",
        "lastTimestamp": "2026-01-01T00:00:05Z",
        "count": 2,
    }
    created = kubectl(api_cluster, "apply", "-f", "-", stdin=yaml.safe_dump(event))
    assert created.returncode == 0, created.stderr
    result = kubectl(api_cluster, "get", "events")
    assert result.returncode == 0, result.stderr
    header, row = result.stdout.splitlines()[:2]
    assert header.split() == ["LAST", "SEEN", "TYPE", "REASON", "OBJECT", "MESSAGE"]
    assert row.split()[1:5] == ["Normal", "PlanFits", "finetunejob/job", "2"]
    wide = kubectl(api_cluster, "get", "events", "-o", "wide").stdout.splitlines()
    assert "COUNT" in wide[0] and "kopf" in wide[1]
