"""A job stored before a release began refusing a spec form stays writable and keeps its old
meaning; a new job with that form is still refused, and an edit cannot introduce it
(api/spec_compat.py, crd_rules.kept_when_stored)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from finetune_operator.api.crd import build_crd
from finetune_operator.api.jobconfig import JobConfig
from finetune_operator.api.manifest import ManifestError, parse_manifest
from finetune_operator.api.schema_validation import CustomResourceSchema
from finetune_operator.api.spec_compat import accept_stored_spec
from tests.operator.factories import make_plan

REPO = Path(__file__).resolve().parents[2]

# The two forms the release refused (the quickstart is a full fine-tune).
STALE = {
    "empty-output-uri": lambda s: s.update(output={"uri": ""}),
    "merge-lora-of-a-full-fine-tune": lambda s: s.update(output={"mergeLora": True}),
}


@pytest.fixture(scope="module")
def schema() -> CustomResourceSchema:
    return CustomResourceSchema(build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"])


def _stored(schema: CustomResourceSchema, edit: Any) -> dict[str, Any]:
    """What an older API server stored (its CRD had no such rule): pruned and defaulted."""
    doc = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
    edit(doc["spec"])
    return schema.normalise(doc)


@pytest.mark.parametrize("form", list(STALE))
def test_a_new_job_with_the_form_is_refused_by_the_operators_check(form: str) -> None:
    """The API server takes it (a transition rule is not evaluated on create); `ftjob plan`
    and the operator (InvalidSpec) refuse it, naming the field."""
    doc = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
    STALE[form](doc["spec"])
    with pytest.raises(ManifestError, match=r"output\.(uri is empty|mergeLora is true)"):
        parse_manifest(doc, "job.yaml")


@pytest.mark.parametrize("form", list(STALE))
def test_a_stored_job_takes_status_patches_and_suspend(
    schema: CustomResourceSchema, form: str
) -> None:
    old = _stored(schema, STALE[form])
    # The status subresource: the server keeps the stored spec and validates the whole object.
    with_status = {**copy.deepcopy(old), "status": {"phase": "Running", "step": 3}}
    assert schema.validate(schema.normalise(with_status), old) == []
    suspended = copy.deepcopy(old)
    suspended["spec"]["suspend"] = True
    assert schema.validate(schema.normalise(suspended), old) == []


@pytest.mark.parametrize(
    ("output", "path", "message"),
    [
        ({"mergeLora": True}, "spec.output.mergeLora", "output.mergeLora needs method lora"),
        ({"uri": ""}, "spec.output.uri", "output.uri is empty"),
    ],
)
def test_a_valid_stored_job_cannot_gain_the_form(
    schema: CustomResourceSchema, output: dict[str, Any], path: str, message: str
) -> None:
    old = _stored(schema, lambda s: s.update(output={"uri": "/out"}))
    new = copy.deepcopy(old)
    new["spec"]["output"].update(output)
    errors = schema.validate(schema.normalise(new), old)
    assert any(p == path and message in m for p, m in errors), errors


@pytest.mark.parametrize(
    ("form", "field", "expected_output"),
    [
        ("empty-output-uri", "spec.output.uri", {}),
        ("merge-lora-of-a-full-fine-tune", "spec.output.mergeLora", {"mergeLora": False}),
    ],
)
def test_the_operator_reads_the_old_meaning(
    form: str, field: str, expected_output: dict[str, Any]
) -> None:
    raw: dict[str, Any] = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
    STALE[form](raw["spec"])
    before = copy.deepcopy(raw["spec"])
    spec, found = accept_stored_spec(raw["spec"])
    assert raw["spec"] == before  # the input is not edited
    assert spec["output"] == expected_output
    assert [d.field for d in found] == [field]
    assert "a new job with it is refused" in found[0].message
    assert accept_stored_spec(spec)[1] == ()  # a valid spec is left as it is


@pytest.mark.parametrize("form", list(STALE))
def test_the_trainer_reads_job_json_written_by_an_older_operator(form: str) -> None:
    raw: dict[str, Any] = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
    STALE[form](raw["spec"])
    doc = {"name": "qs", "spec": raw["spec"], "plan": make_plan(2).model_dump(by_alias=True)}
    config = JobConfig.model_validate_json(json.dumps(doc))
    assert config.spec.output.uri is None and config.spec.output.merge_lora is False
