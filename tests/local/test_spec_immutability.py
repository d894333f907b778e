"""Through the local API server and the real client, as `kubectl apply` of an edited manifest
reaches a real one: the FineTuneJob's transition rule refuses a changed spec with 422 naming
`spec`, keeps the stored job unchanged, and lets `suspend` through."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml
from kubernetes import client

from finetune_local.cluster import LocalCluster
from finetune_operator.api.constants import GROUP, PLURAL, VERSION
from finetune_operator.api.crd_rules import IMMUTABLE_SPEC_MESSAGE
from tests.conftest import CRD_PATH, EXAMPLES


@pytest.fixture(scope="module")
def custom(
    tmp_path_factory: pytest.TempPathFactory, new_api_client: Callable[[LocalCluster], Any]
) -> Iterator[client.CustomObjectsApi]:
    crds = tmp_path_factory.mktemp("ftj-crds")
    shutil.copy(CRD_PATH, crds / CRD_PATH.name)
    with LocalCluster(tmp_path_factory.mktemp("api"), crds_dir=crds, kubelet=False) as cluster:
        yield client.CustomObjectsApi(new_api_client(cluster))


def _quickstart() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((EXAMPLES / "quickstart.yaml").read_text())
    return doc


def test_an_edited_spec_is_refused_and_suspend_is_not(custom: client.CustomObjectsApi) -> None:
    created = custom.create_namespaced_custom_object(
        GROUP, VERSION, "default", PLURAL, _quickstart()
    )
    name, steps = created["metadata"]["name"], created["spec"]["training"]["maxSteps"]

    with pytest.raises(client.ApiException) as refused:
        custom.patch_namespaced_custom_object(
            GROUP, VERSION, "default", PLURAL, name, {"spec": {"training": {"maxSteps": steps * 2}}}
        )
    assert refused.value.status == 422
    body = json.loads(refused.value.body)
    assert body["reason"] == "Invalid" and IMMUTABLE_SPEC_MESSAGE in body["message"]
    assert [c["field"] for c in body["details"]["causes"]] == ["spec"]
    stored = custom.get_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, name)
    assert stored["spec"]["training"]["maxSteps"] == steps and stored["metadata"]["generation"] == 1

    suspended = custom.patch_namespaced_custom_object(
        GROUP, VERSION, "default", PLURAL, name, {"spec": {"suspend": True}}
    )
    assert suspended["spec"]["suspend"] is True and suspended["metadata"]["generation"] == 2
