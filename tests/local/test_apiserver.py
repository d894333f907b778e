"""The API emulator through the real ``kubernetes`` client: the rules clients rely on."""

from __future__ import annotations

import json
import threading
import urllib.request
import uuid
from typing import Any

import pytest
from kubernetes import client, watch

from finetune_local.cluster import LocalCluster

GROUP, VERSION, PLURAL = "test.dev", "v1", "widgets"


@pytest.fixture
def core(api_cluster: LocalCluster, new_api_client: Any) -> client.CoreV1Api:
    return client.CoreV1Api(new_api_client(api_cluster))


@pytest.fixture
def custom(api_cluster: LocalCluster, new_api_client: Any) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(new_api_client(api_cluster))


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def _widget(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "test.dev/v1",
        "kind": "Widget",
        "metadata": {"name": name},
        "spec": {"size": 3, **spec},
    }


def _status_of(exc: client.ApiException) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(exc.body)
    return body


def test_create_assigns_metadata_and_increasing_resource_versions(core: client.CoreV1Api) -> None:
    name = _name("cm")
    first = core.create_namespaced_config_map(
        "default", {"metadata": {"name": name}, "data": {"a": "1"}}
    )
    assert (
        first.metadata.uid and first.metadata.creation_timestamp and first.metadata.generation == 1
    )
    second = core.patch_namespaced_config_map(name, "default", {"data": {"a": "2"}})
    assert int(second.metadata.resource_version) > int(first.metadata.resource_version)
    listing = core.list_namespaced_config_map("default")
    assert int(listing.metadata.resource_version) >= int(second.metadata.resource_version)


def test_duplicate_create_is_409_and_missing_is_404(core: client.CoreV1Api) -> None:
    name = _name("dup")
    core.create_namespaced_config_map("default", {"metadata": {"name": name}})
    with pytest.raises(client.ApiException) as conflict:
        core.create_namespaced_config_map("default", {"metadata": {"name": name}})
    assert conflict.value.status == 409 and _status_of(conflict.value)["reason"] == "AlreadyExists"
    with pytest.raises(client.ApiException) as missing:
        core.read_namespaced_config_map("absent", "default")
    assert missing.value.status == 404 and _status_of(missing.value)["kind"] == "Status"
    with pytest.raises(client.ApiException) as no_ns:
        core.create_namespaced_config_map("nowhere", {"metadata": {"name": "x"}})
    assert no_ns.value.status == 404


def test_generate_name(core: client.CoreV1Api) -> None:
    created = core.create_namespaced_config_map("default", {"metadata": {"generateName": "gen-"}})
    assert created.metadata.name.startswith("gen-") and len(created.metadata.name) == 9


@pytest.mark.parametrize(
    "selector, expected",
    [
        ("app=a", {"a1"}),
        ("app==a", {"a1"}),
        ("app!=a", {"b1", "none"}),
        ("app in (a,b)", {"a1", "b1"}),
        ("app notin (a)", {"b1", "none"}),
        ("app", {"a1", "b1"}),
        ("!app", {"none"}),
        ("app=a,tier=x", {"a1"}),
    ],
    ids=["eq", "eqeq", "neq", "in", "notin", "exists", "not-exists", "and"],
)
def test_label_selectors_on_list(core: client.CoreV1Api, selector: str, expected: set[str]) -> None:
    ns = _name("sel")
    core.create_namespace({"metadata": {"name": ns}})
    for name, labels in (("a1", {"app": "a", "tier": "x"}), ("b1", {"app": "b"}), ("none", {})):
        core.create_namespaced_config_map(ns, {"metadata": {"name": name, "labels": labels}})
    found = {
        c.metadata.name for c in core.list_namespaced_config_map(ns, label_selector=selector).items
    }
    assert found == expected
    by_field = core.list_namespaced_config_map(ns, field_selector="metadata.name=b1").items
    assert [c.metadata.name for c in by_field] == ["b1"]


def test_watch_with_label_selector_from_resource_version(core: client.CoreV1Api) -> None:
    ns = _name("watch")
    core.create_namespace({"metadata": {"name": ns}})
    start = core.list_namespaced_config_map(ns).metadata.resource_version
    core.create_namespaced_config_map(ns, {"metadata": {"name": "in", "labels": {"w": "yes"}}})
    core.create_namespaced_config_map(ns, {"metadata": {"name": "out", "labels": {"w": "no"}}})
    core.patch_namespaced_config_map("in", ns, {"data": {"k": "v"}})
    core.patch_namespaced_config_map(
        "in", ns, {"metadata": {"labels": {"w": "no"}}}
    )  # leaves selection
    events = []
    stream = watch.Watch().stream(
        core.list_namespaced_config_map,
        ns,
        label_selector="w=yes",
        resource_version=start,
        timeout_seconds=1,
    )
    for event in stream:
        events.append(
            (
                event["type"],
                event["object"].metadata.name,
                int(event["object"].metadata.resource_version),
            )
        )
    assert [e[:2] for e in events] == [("ADDED", "in"), ("MODIFIED", "in"), ("DELETED", "in")]
    assert [e[2] for e in events] == sorted(e[2] for e in events)


def test_watch_from_compacted_version_is_gone(
    api_cluster: LocalCluster, core: client.CoreV1Api
) -> None:
    api_cluster.call(lambda: api_cluster.api.store._log.clear())
    api_cluster.call(
        lambda: api_cluster.api.store._log.append(type("E", (), {"resource_version": 10**9})())
    )  # pretend history starts much later
    try:
        raw = core.list_namespaced_config_map(
            "default", watch=True, resource_version="1", timeout_seconds=1, _preload_content=False
        )
        first = json.loads(raw.readline() if hasattr(raw, "readline") else raw.data.splitlines()[0])
        assert first["type"] == "ERROR" and first["object"]["code"] == 410
    finally:
        api_cluster.call(lambda: api_cluster.api.store._log.clear())


def test_status_subresource_separates_spec_and_status(custom: client.CustomObjectsApi) -> None:
    name = _name("wdg")
    created = custom.create_namespaced_custom_object(
        GROUP, VERSION, "default", PLURAL, {**_widget(name), "status": {"phase": "Sneaky"}}
    )
    assert "status" not in created  # dropped on create
    after_main = custom.patch_namespaced_custom_object(
        GROUP, VERSION, "default", PLURAL, name, {"status": {"phase": "Ignored"}}
    )
    assert "status" not in after_main and after_main["metadata"]["generation"] == 1
    after_status = custom.patch_namespaced_custom_object_status(
        GROUP,
        VERSION,
        "default",
        PLURAL,
        name,
        {"status": {"phase": "Running"}, "spec": {"size": 9}},
    )
    assert after_status["status"] == {"phase": "Running"} and after_status["spec"]["size"] == 3
    assert after_status["metadata"]["generation"] == 1  # status writes never bump generation
    bumped = custom.patch_namespaced_custom_object(
        GROUP, VERSION, "default", PLURAL, name, {"spec": {"size": 4}}
    )
    assert bumped["metadata"]["generation"] == 2 and bumped["status"] == {"phase": "Running"}
    again = custom.patch_namespaced_custom_object(
        GROUP, VERSION, "default", PLURAL, name, {"spec": {"size": 4}}
    )
    assert again["metadata"]["resourceVersion"] == bumped["metadata"]["resourceVersion"]  # no-op


@pytest.mark.parametrize(
    "spec, field, words",
    [
        ({"size": 0}, "spec.size", "should be greater than or equal to 1"),
        ({"size": 11}, "spec.size", "should be less than or equal to 10"),
        ({"size": "big"}, "spec.size", "must be of type integer"),
        ({"size": 2, "mode": "warp"}, "spec.mode", 'Unsupported value: "warp"'),
        ({}, "spec.size", "Required value"),
        (
            {"size": 2, "minNodes": 3, "maxNodes": 2},
            "spec.minNodes",
            "minNodes must be <= maxNodes",
        ),
    ],
    ids=["minimum", "maximum", "type", "enum", "required", "cel"],
)
def test_schema_refusals_are_422_with_the_field(
    custom: client.CustomObjectsApi, spec: dict[str, Any], field: str, words: str
) -> None:
    body = {
        "apiVersion": "test.dev/v1",
        "kind": "Widget",
        "metadata": {"name": _name("bad")},
        "spec": spec,
    }
    with pytest.raises(client.ApiException) as refused:
        custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, body)
    status = _status_of(refused.value)
    assert refused.value.status == 422 and status["reason"] == "Invalid"
    assert f"{field}: " in status["message"] and words in status["message"]
    assert any(c["field"] == field for c in status["details"]["causes"])


def test_defaults_applied_and_unknown_fields_pruned(custom: client.CustomObjectsApi) -> None:
    created = custom.create_namespaced_custom_object(
        GROUP, VERSION, "default", PLURAL, _widget(_name("dflt"), colour="red")
    )
    assert created["spec"] == {"size": 3, "mode": "fast"}


def test_json_patch_test_failure_is_422(custom: client.CustomObjectsApi) -> None:
    name = _name("jp")
    custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, _widget(name))
    ops = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": "0"},
        {"op": "replace", "path": "/spec/size", "value": 5},
    ]
    with pytest.raises(client.ApiException) as refused:
        custom.patch_namespaced_custom_object(
            GROUP,
            VERSION,
            "default",
            PLURAL,
            name,
            ops,
            _content_type="application/json-patch+json",
        )
    assert refused.value.status == 422


def test_owner_reference_cascade(core: client.CoreV1Api, custom: client.CustomObjectsApi) -> None:
    name = _name("owner")
    owner = custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, _widget(name))
    ref = {
        "apiVersion": "test.dev/v1",
        "kind": "Widget",
        "name": name,
        "uid": owner["metadata"]["uid"],
    }
    core.create_namespaced_config_map(
        "default", {"metadata": {"name": f"{name}-child", "ownerReferences": [ref]}}
    )
    core.create_namespaced_config_map("default", {"metadata": {"name": f"{name}-free"}})
    custom.delete_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, name)
    names = {c.metadata.name for c in core.list_namespaced_config_map("default").items}
    assert f"{name}-child" not in names and f"{name}-free" in names


def test_finalizers_hold_deletion_until_removed(custom: client.CustomObjectsApi) -> None:
    name = _name("fin")
    body = _widget(name)
    body["metadata"]["finalizers"] = ["test.dev/hold"]
    custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, body)
    custom.delete_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, name)
    held = custom.get_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, name)
    assert held["metadata"]["deletionTimestamp"]
    with pytest.raises(client.ApiException) as refused:
        custom.patch_namespaced_custom_object(
            GROUP,
            VERSION,
            "default",
            PLURAL,
            name,
            {"metadata": {"finalizers": ["test.dev/hold", "new"]}},
        )
    assert refused.value.status == 422
    custom.patch_namespaced_custom_object(
        GROUP, VERSION, "default", PLURAL, name, {"metadata": {"finalizers": None}}
    )
    with pytest.raises(client.ApiException) as gone:
        custom.get_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, name)
    assert gone.value.status == 404


def test_discovery_lists_crd_with_short_names(api_cluster: LocalCluster) -> None:
    with urllib.request.urlopen(f"{api_cluster.api_url}/apis/test.dev/v1") as response:
        resources = json.load(response)
    main = next(r for r in resources["resources"] if r["name"] == "widgets")
    assert main["shortNames"] == ["wdg"] and main["namespaced"] and "watch" in main["verbs"]
    assert any(r["name"] == "widgets/status" for r in resources["resources"])


def test_concurrent_writers_never_share_a_resource_version(core: client.CoreV1Api) -> None:
    versions: list[int] = []

    def write(i: int) -> None:
        cm = core.create_namespaced_config_map("default", {"metadata": {"name": _name(f"c{i}")}})
        versions.append(int(cm.metadata.resource_version))

    threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(versions)) == 8


def test_events_core_and_events_k8s_io(
    api_cluster: LocalCluster, core: client.CoreV1Api, new_api_client: Any
) -> None:
    involved = {
        "kind": "Widget",
        "name": "evented",
        "namespace": "default",
        "apiVersion": "test.dev/v1",
    }
    core.create_namespaced_event(
        "default",
        {
            "metadata": {"generateName": "ev-"},
            "involvedObject": involved,
            "reason": "Tested",
            "message": "hello",
            "type": "Normal",
        },
    )
    found = core.list_namespaced_event(
        "default", field_selector="involvedObject.name=evented"
    ).items
    assert [e.reason for e in found] == ["Tested"]
    events = client.EventsV1Api(new_api_client(api_cluster))
    events.create_namespaced_event(
        "default",
        {
            "metadata": {"name": "new-style"},
            "reason": "Tested",
            "action": "Test",
            "eventTime": "2025-01-01T00:00:00.000000Z",
            "reportingController": "t",
            "reportingInstance": "t",
        },
    )
    assert events.read_namespaced_event("new-style", "default").reason == "Tested"


def test_strict_field_validation_refuses_unknown_fields(custom: client.CustomObjectsApi) -> None:
    # kubectl's default (--validate=strict): refused with 400 naming the field, not pruned.
    name = _name("strict")
    body = _widget(name, colour="red")
    with pytest.raises(client.ApiException) as err:
        custom.create_namespaced_custom_object(
            GROUP, VERSION, "default", PLURAL, body, field_validation="Strict"
        )
    assert (
        err.value.status == 400
        and 'unknown field "spec.colour"' in _status_of(err.value)["message"]
    )
    created = custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, body)
    assert "colour" not in created["spec"]  # without Strict: pruned, as before


def test_a_pod_with_a_negative_or_over_limit_request_is_refused_naming_the_field(
    core: client.CoreV1Api,
) -> None:
    """As the real API server's pod validation: every fault is a cause, named by its field."""
    resources = {"requests": {"cpu": "-1", "memory": "2Gi"}, "limits": {"memory": "1Gi"}}
    pod = {
        "metadata": {"name": _name("neg")},
        "spec": {"containers": [{"name": "c", "image": "x", "resources": resources}]},
    }
    with pytest.raises(client.ApiException) as refused:
        core.create_namespaced_pod("default", pod)
    status = _status_of(refused.value)
    assert refused.value.status == 422 and status["reason"] == "Invalid"
    assert [c["field"] for c in status["details"]["causes"]] == [
        "spec.containers[0].resources.requests[cpu]",
        "spec.containers[0].resources.requests[memory]",
    ]
    assert "must be greater than or equal to 0" in status["message"]
    assert "must be less than or equal to memory limit of 1Gi" in status["message"]
