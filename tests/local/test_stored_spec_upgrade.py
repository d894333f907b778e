"""An upgrade of the CRD through the local API server, as `helm upgrade` reaches a real one: a
job stored under the older CRD with a spec form the new one refuses still takes status patches
(the server evaluates the CEL rules on every write) and a suspend toggle; an edit that
brings the form into a valid job is refused with 422 naming the field."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml
from kubernetes import client

from finetune_local.cluster import LocalCluster
from finetune_operator.api.constants import CRD_NAME, GROUP, PLURAL, VERSION
from tests.conftest import CRD_PATH, EXAMPLES

NEW_RULES = ("output.mergeLora needs method", "output.uri is empty")


def _older_crd(crd: dict[str, Any]) -> dict[str, Any]:
    """The CRD before the release that refused the forms: without their rules (output.uri
    had no minLength then either)."""
    older = copy.deepcopy(crd)

    def strip(node: Any) -> None:
        if isinstance(node, dict):
            rules = node.get("x-kubernetes-validations")
            if rules is not None:
                kept = [r for r in rules if not r["message"].startswith(NEW_RULES)]
                node["x-kubernetes-validations"] = kept
                if not kept:
                    del node["x-kubernetes-validations"]
            for value in node.values():
                strip(value)
        elif isinstance(node, list):
            for value in node:
                strip(value)

    strip(older)
    return older


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, new_api_client: Callable[[LocalCluster], Any]
) -> Iterator[client.ApiClient]:
    crds = tmp_path_factory.mktemp("ftj-crds-old")
    current = yaml.safe_load(CRD_PATH.read_text())
    (crds / CRD_PATH.name).write_text(yaml.safe_dump(_older_crd(current)))
    with LocalCluster(tmp_path_factory.mktemp("api"), crds_dir=crds, kubelet=False) as local:
        yield new_api_client(local)


def _job(name: str, output: dict[str, Any]) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((EXAMPLES / "quickstart.yaml").read_text())
    doc["metadata"]["name"] = name
    doc["spec"]["output"] = output  # the quickstart is a full fine-tune
    return doc


def test_a_job_stored_before_the_upgrade_stays_writable(cluster: client.ApiClient) -> None:
    custom = client.CustomObjectsApi(cluster)
    stale = {"empty-uri": {"uri": ""}, "merge-full": {"mergeLora": True}}
    for name, output in stale.items():
        custom.create_namespaced_custom_object(
            GROUP, VERSION, "default", PLURAL, _job(name, output)
        )

    # The upgrade: the current CRD replaces the older one.
    ext = client.ApiextensionsV1Api(cluster)
    crd = ext.read_custom_resource_definition(CRD_NAME).to_dict()
    current = yaml.safe_load(CRD_PATH.read_text())
    body = {
        **current,
        "metadata": {**current["metadata"], "resourceVersion": crd["metadata"]["resource_version"]},
    }
    ext.replace_custom_resource_definition(CRD_NAME, body)

    for name in stale:
        status = {"status": {"phase": "Running", "observedGeneration": 1}}
        patched = custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, "default", PLURAL, name, status
        )
        assert patched["status"]["phase"] == "Running"
        suspended = custom.patch_namespaced_custom_object(
            GROUP, VERSION, "default", PLURAL, name, {"spec": {"suspend": True}}
        )
        assert suspended["spec"]["suspend"] is True

    # A valid job cannot be edited into the form: 422 naming the field (and the immutable spec).
    custom.create_namespaced_custom_object(
        GROUP, VERSION, "default", PLURAL, _job("valid", {"uri": "/out"})
    )
    with pytest.raises(client.ApiException) as refused:
        custom.patch_namespaced_custom_object(
            GROUP, VERSION, "default", PLURAL, "valid", {"spec": {"output": {"uri": ""}}}
        )
    assert refused.value.status == 422
    causes = json.loads(refused.value.body)["details"]["causes"]
    assert any(c["field"] == "spec.output.uri" for c in causes), causes
