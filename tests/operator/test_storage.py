"""Storage in the API (api/storage.py): claims and core volumes mounted into every worker,
and absolute paths confined to them, refused at plan time naming the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from pydantic import ValidationError

from finetune_operator.api.capabilities import trainer_refusals
from finetune_operator.api.manifest import load_manifest
from finetune_operator.api.spec import FineTuneJobSpec
from finetune_operator.api.storage import StorageSpec, object_store_problems, unmounted_paths
from finetune_operator.planner import PlanningError, plan_job
from finetune_operator.resources import Owner, build_worker_pod, desired_objects
from tests.operator.factories import REPO, make_plan, quickstart_raw

EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
SHARED = {"claims": [{"claimName": "shared", "mountPath": "/shared"}]}


def spec_with(**sections: Any) -> FineTuneJobSpec:
    raw = quickstart_raw()
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    return FineTuneJobSpec.model_validate(raw)


@pytest.mark.parametrize(
    ("storage", "message"),
    [
        ({"claims": [{"claimName": "c", "mountPath": "data"}]}, "must be an absolute path"),
        ({"claims": [{"claimName": "c", "mountPath": "/tmp/x"}]}, "overlaps /tmp"),
        ({"claims": [{"claimName": "c", "mountPath": "/etc"}]}, "overlaps /etc/finetune"),
        ({"claims": [{"claimName": "c", "mountPath": "/a/../b"}]}, "must not contain '..'"),
        ({"claims": [{"claimName": "c", "mountPath": "/a"}, {"claimName": "d", "mountPath": "/a/"}]},
         r"is also storage.claims\[0\].mountPath"),
        ({"volumes": [{"emptyDir": {}}]}, r"storage.volumes\[0\] needs a name"),
        ({"volumes": [{"name": "v", "emptyDir": {}}, {"name": "v", "emptyDir": {}}]},
         "duplicate names"),
        ({"volumes": [{"name": "claim-0", "emptyDir": {}}]}, "reserved for storage.claims"),
        ({"volumeMounts": [{"name": "nope", "mountPath": "/x"}]}, "is not in storage.volumes"),
    ],
    ids=["relative", "tmp", "etc", "dotdot", "same-path", "unnamed", "duplicate", "prefix",
         "unknown-volume"],
)  # fmt: skip
def test_invalid_storage_is_refused_naming_the_field(storage: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        StorageSpec.model_validate(storage)


@pytest.mark.parametrize(
    ("sections", "fields"),
    [
        ({}, []),  # relative paths: the working directory
        ({"checkpoint": {"uri": "/shared/ckpt"}, "storage": SHARED}, []),
        ({"checkpoint": {"uri": "s3://bucket/ckpt"}}, []),
        ({"checkpoint": {"uri": "/ckpt"}}, ["spec.checkpoint.uri"]),
        ({"checkpoint": {"uri": "/sharedx/ckpt"}, "storage": SHARED}, ["spec.checkpoint.uri"]),
        ({"output": {"uri": "file:///out"}, "dataset": {"uri": "/d.jsonl"}},
         ["spec.output.uri", "spec.dataset.uri"]),
        ({"model": {"source": "pvc", "path": "/models/m"}}, ["spec.model.path"]),
        ({"model": {"source": "pvc", "name": "/shared/m", "architecture": None},
          "storage": SHARED}, []),
        ({"checkpoint": {"uri": "/ro/ckpt"}, "dataset": {"uri": "/ro/d.jsonl"},
          "storage": {"claims": [{"claimName": "c", "mountPath": "/ro", "readOnly": True}]}},
         ["spec.checkpoint.uri"]),
    ],
    ids=["relative", "under-claim", "object-store", "unmounted", "prefix-is-not-parent",
         "output-and-dataset", "model-path", "model-name-path", "read-only-written"],
)  # fmt: skip
def test_absolute_paths_must_lie_on_a_declared_mount(
    sections: dict[str, Any], fields: list[str]
) -> None:
    assert [field for field, _ in unmounted_paths(spec_with(**sections))] == fields


def test_plan_refuses_an_unmounted_path_naming_the_field() -> None:
    with pytest.raises(PlanningError) as err:
        plan_job(spec_with(checkpoint={"uri": "/checkpoints/q"}))
    assert err.value.field == "spec.checkpoint.uri" and "not under a mounted volume" in str(
        err.value
    )


STORE = {
    "objectStore": {
        "secretName": "s3-credentials",
        "endpointUrl": "http://minio:9000",
        "pathStyle": True,
    }
}


@pytest.mark.parametrize(
    ("sections", "problem"),
    [
        ({"checkpoint": {"uri": "s3://b/ckpt"}, "output": {"uri": "s3://b/out"}, "storage": STORE},
         None),
        ({"checkpoint": {"uri": "s3://b/ckpt"}}, ("spec.checkpoint.uri", "needs spec.storage.objectStore")),
        ({"output": {"uri": "s3://b/out"}}, ("spec.output.uri", "needs spec.storage.objectStore")),
        ({"output": {"uri": "s3:///out"}, "storage": STORE}, ("spec.output.uri", "names no bucket")),
        ({"checkpoint": {"uri": "gs://b/ckpt"}, "storage": STORE},
         ("spec.checkpoint.uri", "https://storage.googleapis.com")),
        ({"checkpoint": {"uri": "az://b/ckpt"}}, ("spec.checkpoint.uri", "az:// is not supported")),
        ({"checkpoint": {"uri": "file:///shared/ckpt"}, "storage": SHARED}, None),
        ({"dataset": {"uri": "s3://b/data/train-*.jsonl", "format": "jsonl"}, "storage": STORE},
         None),
        ({"dataset": {"uri": "s3://b/data/train.parquet", "format": "parquet"}}, (
            "spec.dataset.uri", "needs spec.storage.objectStore")),
        ({"dataset": {"uri": "s3://b/data/", "format": "jsonl"}, "storage": STORE},
         ("spec.dataset.uri", "names no object")),
        ({"dataset": {"uri": "s3://b/*/train.jsonl", "format": "jsonl"}, "storage": STORE},
         ("spec.dataset.uri", "only in the last part")),
        ({"dataset": {"uri": "s3://b/ds", "format": "hf"}, "storage": STORE},
         ("spec.dataset.uri", "read as jsonl or parquet")),
        ({"dataset": {"uri": "gs://b/train.jsonl", "format": "jsonl"}, "storage": STORE},
         ("spec.dataset.uri", "gs:// is not supported")),
        ({"dataset": {"uri": "builtin://quickstart"}}, None),
        ({"model": {"name": "Llama-3.1-8B", "source": "uri", "path": "s3://b/llama"},
          "storage": STORE}, None),
        ({"model": {"name": "Llama-3.1-8B", "source": "uri", "path": "s3://b/llama"}},
         ("spec.model.path", "needs spec.storage.objectStore")),
        ({"model": {"name": "Llama-3.1-8B", "source": "pvc", "path": "s3://b/llama"},
          "storage": STORE}, ("spec.model.path", "need spec.model.source uri")),
        ({"model": {"name": "s3://b/llama", "source": "hub"}, "storage": STORE},
         ("spec.model.name", "source hub does not read object storage")),
        ({"model": {"name": "s3:///llama", "source": "uri"}, "storage": STORE},
         ("spec.model.name", "names no bucket")),
        ({"model": {"name": "Llama-3.1-8B", "source": "uri", "path": "az://b/llama"}},
         ("spec.model.path", "az:// is not supported")),
    ],
    ids=["s3-with-store", "s3-checkpoint-no-store", "s3-output-no-store", "no-bucket", "gs",
         "az", "file", "dataset-s3-glob", "dataset-no-store", "dataset-no-key",
         "dataset-glob-in-prefix", "dataset-hf-format", "dataset-gs", "dataset-builtin",
         "model-s3", "model-no-store", "model-pvc-source", "model-hub-source", "model-no-bucket", "model-az"],
)  # fmt: skip
def test_object_store_uris_are_checked_at_plan_time(
    sections: dict[str, Any], problem: tuple[str, str] | None
) -> None:
    problems = object_store_problems(spec_with(**sections))
    if problem is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problems[0][0] == problem[0], problems
        assert problem[1] in problems[0][1]


@pytest.mark.parametrize(
    ("store", "message"),
    [({"secretName": "Not_A_Name"}, "secretName"), ({"endpointUrl": "minio:9000"}, "endpointUrl"),
     ({"secretName": "s", "accessKey": "AKIA..."}, "accessKey")],
    ids=["secret-name", "endpoint-scheme", "no-keys-in-the-spec"],
)  # fmt: skip
def test_object_store_fields_are_validated(store: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        StorageSpec.model_validate({"objectStore": store})


def test_plan_refuses_s3_without_an_object_store_naming_the_field() -> None:
    with pytest.raises(PlanningError) as err:
        plan_job(spec_with(output={"uri": "s3://bucket/model"}))
    assert err.value.field == "spec.output.uri"


def test_worker_gets_the_credentials_from_the_secret_and_stays_valid(owner: Owner) -> None:
    spec = spec_with(checkpoint={"uri": "s3://b/ckpt"}, storage=STORE)
    pod = build_worker_pod(owner, spec, make_plan(), 0)
    kubernetes_validate.validate(pod, "1.32", strict=True)
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert env[key] == {"name": key, "valueFrom": {"secretKeyRef": {
            "name": "s3-credentials", "key": key}}}  # fmt: skip
    assert env["AWS_SESSION_TOKEN"]["valueFrom"]["secretKeyRef"]["optional"] is True
    assert not any("value" in e and "test" in str(e["value"]) for e in env.values())
    # Without a Secret (the pod's own identity), no env refers to one.
    keyless = spec_with(checkpoint={"uri": "s3://b/ckpt"}, storage={"objectStore": {}})
    keyless_env = build_worker_pod(owner, keyless, make_plan(), 0)["spec"]["containers"][0]["env"]
    assert not any("secretKeyRef" in e.get("valueFrom", {}) for e in keyless_env)


def test_worker_mounts_claims_and_volumes_and_stays_valid(owner: Owner) -> None:
    spec = spec_with(storage={
        **SHARED,
        "volumes": [{"name": "weights", "nfs": {"server": "nfs.local", "path": "/exports/m"}}],
        "volumeMounts": [{"name": "weights", "mountPath": "/weights", "readOnly": True}],
    })  # fmt: skip
    pod = build_worker_pod(owner, spec, make_plan(), 0)
    kubernetes_validate.validate(pod, "1.32", strict=True)
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["claim-0"]["persistentVolumeClaim"] == {"claimName": "shared", "readOnly": False}
    assert volumes["weights"]["nfs"]["server"] == "nfs.local"
    mounts = {m["mountPath"]: m for m in pod["spec"]["containers"][0]["volumeMounts"]}
    assert mounts["/shared"]["name"] == "claim-0" and mounts["/weights"]["readOnly"] is True
    assert pod["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_plans_and_its_pods_validate_with_their_volumes(
    path: Path, owner: Owner
) -> None:
    spec = load_manifest(path).spec
    assert unmounted_paths(spec) == []
    plan = plan_job(spec)
    objects = desired_objects(owner, spec, plan, [])
    for obj in objects:
        kubernetes_validate.validate(obj, "1.32", strict=True)
    worker = next(o for o in objects if o["metadata"]["name"].endswith("-worker-0"))
    declared = {p for p, _ in spec.storage.mounts()}
    mounted = {m["mountPath"] for m in worker["spec"]["containers"][0]["volumeMounts"]}
    assert declared <= mounted


@pytest.mark.parametrize(
    ("strategy", "method", "device", "refusal"),
    [("fsdp-full-shard", "full", "cpu", None), ("ddp", "lora", "cpu", None),
     ("zero1", "full", "cpu", None), ("zero2", "lora", "cpu", None),
     ("zero3", "full", "cpu", None), ("ddp", "qlora", "gpu", None),
     # Not the weights' location: QLoRA under DeepSpeed is refused wherever they are.
     ("zero3", "qlora", "gpu", "spec.method.type: qlora is not implemented with DeepSpeed")],
    ids=["fsdp", "ddp-lora", "zero1", "zero2-lora", "zero3", "qlora", "qlora-deepspeed"],
)  # fmt: skip
def test_s3_weights_are_read_by_every_loading_path(
    strategy: str, method: str, device: str, refusal: str | None
) -> None:
    """The torch backends read s3:// weights by ranges, DeepSpeed's loaders too (ZeRO-3:
    rank 0 per module; ZeRO-1/2: a stripe per rank), QLoRA quantises as it reads them: no
    refusal names the model's location (a refusal that remains names its own field)."""
    spec = spec_with(model={"source": "uri", "path": "s3://b/tiny"}, storage=STORE,
                     method={"type": method}, resources={"device": device})  # fmt: skip
    backend = "deepspeed" if strategy.startswith("zero") else "fsdp"
    plan = make_plan().model_copy(update={"strategy": strategy, "backend": backend})
    refusals = trainer_refusals(spec, plan)
    assert [r for r in refusals if r.startswith("spec.model")] == []
    if refusal is None:
        assert refusals == []
    else:
        assert len(refusals) == 1 and refusals[0].startswith(refusal), refusals


def test_an_s3_model_the_catalog_does_not_know_needs_its_architecture_in_the_spec() -> None:
    spec = spec_with(model={"name": "my-model", "source": "uri", "path": "s3://b/my-model",
                            "architecture": None}, storage=STORE)  # fmt: skip
    with pytest.raises(PlanningError) as err:
        plan_job(spec)
    assert err.value.field == "spec.model.architecture"
    assert "does not read s3://b/my-model" in str(err.value)
