"""Manifests: examples parse; invalid ones are refused with the field and the reason."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import yaml

from finetune_operator.api.manifest import (
    ManifestError,
    load_manifest,
    parse_manifest,
    parse_spec,
)
from finetune_operator.api.manifest_reader import parse_yaml_document
from tests.conftest import EXAMPLES


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_examples_parse(path: Path) -> None:
    manifest = load_manifest(path)
    assert manifest.name


def _quickstart() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((EXAMPLES / "quickstart.yaml").read_text())
    return doc


def _set(doc: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    node = doc
    *parents, leaf = dotted.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    return doc


@pytest.mark.parametrize(
    ("field", "value", "expected_path", "expected_reason"),
    [
        # Worded as the API server words them (kubectl apply shows the same).
        ("spec.method.type", "dpo", "spec.method.type", '"full", "lora", "qlora"'),
        ("spec.resources.minNodes", 5, "spec.resources.minNodes", "must be <= maxNodes"),
        (
            "spec.training.sequenceLength",
            4,
            "spec.training.sequenceLength",
            "greater than or equal",
        ),
        ("spec.training.microBatchSize", "big", "spec.training.microBatchSize", "auto"),
        ("spec.strategy.type", "zero4", "spec.strategy.type", "zero3"),
        ("spec.training.learningRate", -1, "spec.training.learningRate", "greater than 0"),
        ("spec.resources.gpuz", 1, "spec.resources.gpuz", "unknown field"),
        ("spec.training.sequence_length", 64, "spec.training.sequence_length", "unknown field"),
        ("spec.training.learningRate", float("inf"), "spec.training.learningRate", "NaN or inf"),
        ("spec.training.maxSteps", 10**9, "spec.training.maxSteps", "less than or equal"),
        ("spec.checkpoint.uri", "../other-job", "spec.checkpoint.uri", "'..' path segments"),
        ("spec.output.uri", "out/../../etc", "spec.output.uri", "'..' path segments"),
        # Taken as "unset" before: the trained model went nowhere without a word.
        ("spec.output.uri", "", "spec.output.uri", "output.uri is empty"),
        # Accepted and ignored before (the quickstart is a full fine-tune). Refused by the
        # operator's check of the whole spec (the CRD's rule for it is a transition rule).
        ("spec.output.mergeLora", True, "spec", "output.mergeLora is true but method.type is"),
        ("spec.dataset.uri", "s3://bucket/../x", "spec.dataset.uri", "'..' path segments"),
        ("metadata", "job", "metadata", "must be an object"),
        ("metadata", ["job"], "metadata", "must be an object"),
        ("metadata.name", "job\n", "metadata.name", "RFC 1123"),
        ("metadata.name", "Job", "metadata.name", "RFC 1123"),
        ("metadata.name", "j" * 53, "metadata.name", "at most 52"),
        # Subdomains the API server takes, but no Service may be named after (DNS-1035):
        # accepted before, the job then waited on a rendezvous Service that could not exist.
        ("metadata.name", "my.job", "metadata.name", "DNS-1035 label"),
        ("metadata.name", "1job", "metadata.name", "starting with a letter"),
        ("metadata.namespace", "a.b", "metadata.namespace", "RFC 1123"),
        (
            "spec.model.architecture.numKeyValueHeads",
            3,
            "spec.model.architecture.numKeyValueHeads",
            "must divide",
        ),
    ],
)
def test_invalid_manifest_names_field(
    field: str, value: Any, expected_path: str, expected_reason: str
) -> None:
    doc = _set(_quickstart(), field, value)
    with pytest.raises(ManifestError) as err:
        parse_manifest(doc, "job.yaml")
    paths = dict(err.value.problems)
    assert expected_path in paths, err.value.problems
    assert expected_reason in paths[expected_path]
    assert expected_path in str(err.value)


@pytest.mark.parametrize(
    ("field", "reason"),
    [
        ("spec.training.sequenceLenght", "unknown field (did you mean sequenceLength?)"),
        ("spec.training.sequence_length", "unknown field (did you mean sequenceLength?)"),
        ("spec.training.MaxSteps", "unknown field (did you mean maxSteps?)"),
        ("spec.modle", "unknown field (did you mean model?)"),
        ("spec.resources.gpu.memoryGib", "unknown field (did you mean memoryGiB?)"),
        ("spec.training.banana", "unknown field"),  # nothing close: no guess
        # PEFT's and transformers' names for the same settings
        ("spec.method.lora.r", "unknown field (did you mean rank?)"),
        ("spec.method.lora.lora_alpha", "unknown field (did you mean alpha?)"),
        (
            "spec.training.per_device_train_batch_size",
            "unknown field (did you mean microBatchSize?)",
        ),
        ("spec.training.max_seq_length", "unknown field (did you mean sequenceLength?)"),
        ("spec.training.lr", "unknown field (did you mean learningRate?)"),
        ("spec.resources.r", "unknown field"),  # an alias only where its field is
    ],
)
def test_an_unknown_field_names_the_one_it_resembles(field: str, reason: str) -> None:
    with pytest.raises(ManifestError) as err:
        parse_manifest(_set(_quickstart(), field, 1), "job.yaml")
    assert err.value.problems == [(field, reason)]


def test_an_unknown_field_in_a_list_item_names_the_one_it_resembles() -> None:
    doc = _quickstart()
    doc["spec"]["storage"] = {"claims": [{"claim_name": "data", "mountPath": "/data"}]}
    with pytest.raises(ManifestError) as err:
        parse_manifest(doc, "job.yaml")
    assert err.value.problems == [
        ("spec.storage.claims[0].claim_name", "unknown field (did you mean claimName?)")
    ]


@pytest.mark.parametrize(
    ("cpu", "memory"),
    [(8, 2147483648), ("500m", "64Gi"), (0, "1G")],
    ids=["ints", "strings", "zero"],
)
def test_resource_quantities_are_int_or_string_as_in_a_pod(cpu: Any, memory: Any) -> None:
    """`cpu: 8` is what most Kubernetes users write; the pod gets the same quantity as text."""
    doc = _set(_set(_quickstart(), "spec.resources.cpu", cpu), "spec.resources.memory", memory)
    resources = parse_manifest(doc).spec.resources
    assert (resources.cpu, resources.memory) == (str(cpu), str(memory))


@pytest.mark.parametrize(
    ("value", "reason"),
    [(-1, "non-negative integer"), ("9" * 300, "at most 256 characters"), (1.5, "integer or string"),
     (True, "integer or string")],
    ids=["negative", "too-long", "float", "bool"],
)  # fmt: skip
def test_bad_resource_quantities_name_the_field(value: Any, reason: str) -> None:
    with pytest.raises(ManifestError) as err:
        parse_manifest(_set(_quickstart(), "spec.resources.cpu", value))
    assert reason in dict(err.value.problems)["spec.resources.cpu"]


def test_wrong_kind_and_missing_name() -> None:
    doc = _quickstart()
    doc["kind"] = "Job"
    del doc["metadata"]["name"]
    with pytest.raises(ManifestError) as err:
        parse_manifest(doc)
    assert {p for p, _ in err.value.problems} == {"kind", "metadata.name"}


def test_lora_defaults_filled_for_adapter_methods() -> None:
    doc = _set(_quickstart(), "spec.method.type", "lora")
    spec = parse_manifest(doc).spec
    assert spec.method.lora is not None and spec.method.lora.rank == 16


@pytest.mark.parametrize(
    ("field", "uri"),
    [("checkpoint", "../x"), ("checkpoint", "a/.."), ("output", "s3://b/../c"), ("dataset", "..")],
)
def test_parent_segments_refused_by_pydantic_too(field: str, uri: str) -> None:
    # The operator's own validation (the API server's CEL twin is tested through parse_manifest).
    spec = _quickstart()["spec"]
    spec[field]["uri"] = uri
    with pytest.raises(ManifestError) as err:
        parse_spec(spec)
    assert f"{field}.uri" in str(err.value) and "'..'" in str(err.value)


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("spec.output.uri", "", "output.uri is empty"),
        ("spec.output.mergeLora", True, "output.mergeLora is true but method.type is 'full'"),
    ],
)
def test_refused_by_pydantic_too(field: str, value: Any, reason: str) -> None:
    """The operator's own validation (its InvalidSpec condition), the CRD's twin aside."""
    with pytest.raises(ManifestError, match=reason):
        parse_spec(_set(_quickstart(), field, value)["spec"])
    lora = _set(_set(_quickstart(), "spec.method.type", "lora"), "spec.output.mergeLora", True)
    assert parse_spec(lora["spec"]).output.merge_lora


@pytest.mark.parametrize("uri", ["/abs/path", "a..b/c", "s3://bucket/x..y", "checkpoints/job"])
def test_uris_without_parent_segments_are_accepted(uri: str) -> None:
    doc = _set(_quickstart(), "spec.checkpoint.uri", uri)
    assert parse_manifest(doc).spec.checkpoint.uri == uri


@pytest.mark.parametrize(
    ("new", "old", "want"),
    [
        pytest.param(None, "none", "none", id="old-name-only"),
        pytest.param("auto", "full", "full", id="old-name-beside-the-servers-default"),
        pytest.param("full", "full", "full", id="both-agree"),
    ],
)
def test_old_activation_checkpointing_name_is_moved_with_a_warning(
    new: str | None, old: str, want: str
) -> None:
    doc = _quickstart()
    training = doc["spec"]["training"]
    training.pop("activationCheckpointing", None)
    if new is not None:
        training["activationCheckpointing"] = new
    training["gradientCheckpointing"] = old
    with pytest.warns(FutureWarning, match="activationCheckpointing"):
        spec = parse_manifest(doc).spec
    assert spec.training.activation_checkpointing == want
    assert "gradientCheckpointing" not in spec.to_json_dict()["training"]  # written once


def test_old_and_new_activation_checkpointing_names_disagreeing_are_refused() -> None:
    doc = _quickstart()
    doc["spec"]["training"].update(activationCheckpointing="none", gradientCheckpointing="full")
    with pytest.raises(ManifestError, match="gradientCheckpointing"):
        parse_manifest(doc)


@pytest.mark.parametrize(
    ("field", "text", "value"),
    [
        ("learningRate", "3e-3", 0.003),  # no dot: a string to YAML 1.1, a float to kubectl
        ("learningRate", "2E-5", 2e-5),
        ("learningRate", "1.5e-4", 1.5e-4),
        ("maxSteps", "60.0", 60),  # kubectl's JSON writes the float 60.0 as 60: an integer
        ("maxSteps", "1e2", 100),
        ("maxSteps", "60", 60),
    ],
)
def test_numbers_read_as_kubectl_reads_them(field: str, text: str, value: Any) -> None:
    """kubectl parses YAML with go-yaml v2 (sigs.k8s.io/yaml), whose floats need no dot,
    then sends JSON, where an integral float is an integer: `ftjob plan` (and the local API
    server, which gets the same document) must accept what `kubectl apply` accepts."""
    text_doc = (EXAMPLES / "quickstart.yaml").read_text()
    line = {"learningRate": "    learningRate: 3.0e-3", "maxSteps": "    maxSteps: 60"}[field]
    assert line in text_doc
    doc, problems = parse_yaml_document(text_doc.replace(line, f"    {field}: {text}"))
    assert problems == []
    got = doc["spec"]["training"][field]
    assert got == pytest.approx(value) and type(got) is type(value)
    spec = parse_manifest(doc, "job.yaml").spec.training
    assert getattr(spec, {"learningRate": "learning_rate", "maxSteps": "max_steps"}[field]) == (
        pytest.approx(value)
    )


def test_a_number_where_a_string_belongs_is_refused_as_kubectl_would() -> None:
    """`revision: 1e3` is the number 1000 to kubectl, and the API server refuses a number for
    a string field: not the string '1e3' it is to a YAML 1.1 reader."""
    text = (
        (EXAMPLES / "quickstart.yaml")
        .read_text()
        .replace("source: inline", "source: inline\n    revision: 1e3")
    )
    doc, problems = parse_yaml_document(text)
    assert problems == [] and doc["spec"]["model"]["revision"] == 1000
    with pytest.raises(ManifestError, match=r"spec\.model\.revision"):
        parse_manifest(doc, "job.yaml")


@pytest.mark.parametrize(
    ("text", "value"), [("y", True), ("N", False), ("yes", True), ("off", False)]
)
def test_yaml_1_1_booleans_as_kubectl_reads_them(text: str, value: bool) -> None:
    """go-yaml v2 (kubectl) also reads y/Y/n/N as booleans, which a YAML 1.1 reader leaves
    as strings: `mergeLora: y` is true to kubectl."""
    doc, problems = parse_yaml_document(
        (EXAMPLES / "quickstart.yaml")
        .read_text()
        .replace("output:\n", f"output:\n    mergeLora: {text}\n")
    )
    assert problems == [] and doc["spec"]["output"]["mergeLora"] is value


@pytest.mark.parametrize(
    ("written", "key", "warns"),
    [("y", "true", True), ("N", "false", True), ("on", "true", True), ("off", "false", True),
     ("yes", "true", True), ("true", "true", False), ("'on'", "on", False), ("8", "8", False),
     ("1.5", "1.5", False), ("1e2", "100", False), ("0.1234567891", "0.12345679", False),
     # Go's shortest %g: an exponent from 1e6 on, none below, whatever the digits' count.
     ("10.0", "10", False), ("1e6", "1e+06", False), ("1234567.0", "1.234567e+06", False),
     ("1234567.5", "1.2345675e+06", False), ("0.00001", "1e-05", False)],
)  # fmt: skip
def test_keys_are_named_as_kubectl_names_them(written: str, key: str, warns: bool) -> None:
    """sigs.k8s.io/yaml turns a boolean or number key into its JSON string ("true", "8"; a
    float as Go's float32 text): a YAML 1.1 reader kept the boolean True, which then read as
    'key True is not a string' (and merged `y:` with `1:`, True == 1 in Python)."""
    text = (
        (EXAMPLES / "quickstart.yaml")
        .read_text()
        .replace("output:\n", f"output:\n    {written}: x\n    1: z\n")
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        doc, problems = parse_yaml_document(text)
    assert (
        problems == [] and doc["spec"]["output"][key] == "x" and doc["spec"]["output"]["1"] == "z"
    )
    said = [str(w.message) for w in caught]
    assert bool(said) == warns
    if warns:
        assert (
            f"key {written} is the boolean {key} to kubectl" in said[0]
            and f"'{written}'" in said[0]
        )
    # The API server then refuses the field by the name kubectl sent.
    with pytest.raises(ManifestError, match=rf"spec\.output\.{re.escape(key)}"):
        parse_manifest(doc, "job.yaml")


def test_two_keys_kubectl_names_alike_are_refused() -> None:
    """`true:` and `on:` are one key to kubectl, which would keep one value: nothing lost."""
    doc, problems = parse_yaml_document("a:\n  true: 1\n  on: 2\n")
    assert doc is None
    assert (
        'mapping key "on" already defined at line 2 (as "true": both are the key "true"'
        in (problems[0][1])
    )


@pytest.mark.parametrize("key", ["training.sequenceLength", ""])
def test_an_odd_unknown_key_gets_no_misleading_guess(key: str) -> None:
    """A key with a point in it reads back as a path ending in a real field, and a key "" as
    one ending in "spec": suggesting either would name what the user already wrote."""
    doc = _quickstart()
    doc["spec"][key] = 512
    with pytest.raises(ManifestError) as err:
        parse_manifest(doc, "job.yaml")
    assert err.value.problems == [(f"spec.{key}", "unknown field")]
