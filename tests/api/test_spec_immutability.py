"""Once created, a FineTuneJob's spec changes only in `suspend`: the API server refuses the
rest (the CRD's transition rule, as a real API server evaluates it), so running workers and
their restarts never see another generation's model, data or plan."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from finetune_operator.api.crd import build_crd
from finetune_operator.api.crd_rules import IMMUTABLE_SPEC_MESSAGE, MUTABLE_SPEC_FIELDS
from finetune_operator.api.schema_validation import CustomResourceSchema
from finetune_operator.api.spec import FineTuneJobSpec

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def schema() -> CustomResourceSchema:
    return CustomResourceSchema(build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"])


@pytest.fixture
def job(schema: CustomResourceSchema) -> dict[str, Any]:
    doc = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
    stored = schema.normalise(doc)  # what the API server stored: pruned and defaulted
    assert schema.validate(stored) == []
    return stored


def _update(schema: CustomResourceSchema, old: dict[str, Any], edit: Any) -> list[tuple[str, str]]:
    new = copy.deepcopy(old)
    edit(new["spec"])
    return schema.validate(schema.normalise(new), old)


def _refused(errors: list[tuple[str, str]]) -> bool:
    return any(path == "spec" and IMMUTABLE_SPEC_MESSAGE in message for path, message in errors)


def test_suspend_and_resume_are_accepted(schema: CustomResourceSchema, job: dict[str, Any]) -> None:
    assert _update(schema, job, lambda s: s.update(suspend=True)) == []
    suspended = schema.normalise({**job, "spec": {**job["spec"], "suspend": True}})
    assert _update(schema, suspended, lambda s: s.update(suspend=False)) == []
    assert _update(schema, job, lambda s: None) == []  # a no-op apply


@pytest.mark.parametrize(
    "edit",
    [
        lambda s: s["training"].update(maxSteps=s["training"]["maxSteps"] + 1),
        lambda s: s["model"]["architecture"].update(numHiddenLayers=3),
        lambda s: s["dataset"].update(uri="other.jsonl"),
        lambda s: s.update(output={"uri": "/tmp/out"}),  # an optional field appearing
        lambda s: s.pop("checkpoint"),  # ... or going away
        lambda s: s.setdefault("resources", {}).update(affinity={"nodeAffinity": {}}),  # free-form
        lambda s: s.setdefault("strategy", {}).update(type="fsdp-full-shard"),
    ],
    ids=[
        "maxSteps",
        "architecture",
        "dataset",
        "add output",
        "drop checkpoint",
        "affinity",
        "strategy",
    ],
)
def test_any_other_change_is_refused_naming_the_rule(
    schema: CustomResourceSchema, job: dict[str, Any], edit: Any
) -> None:
    assert _refused(_update(schema, job, edit))


def test_a_change_with_suspend_is_refused_too(
    schema: CustomResourceSchema, job: dict[str, Any]
) -> None:
    """Suspending does not open the spec: a resumed job must be the one its checkpoints hold."""

    def edit(s: dict[str, Any]) -> None:
        s.update(suspend=True)
        s["training"].update(learningRate=1e-3)

    assert _refused(_update(schema, job, edit))


def test_creation_is_not_judged_by_the_rule(
    schema: CustomResourceSchema, job: dict[str, Any]
) -> None:
    assert schema.validate(job) == []  # no old object: transition rules do not apply


def test_the_rule_covers_every_spec_field_but_suspend() -> None:
    rule = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    text = next(
        r["rule"]
        for r in rule["x-kubernetes-validations"]
        if r["message"] == IMMUTABLE_SPEC_MESSAGE
    )
    fields = {f.alias or name for name, f in FineTuneJobSpec.model_fields.items()}
    assert "suspend" in fields and {"suspend"} == MUTABLE_SPEC_FIELDS
    for name in fields - MUTABLE_SPEC_FIELDS:
        assert f"self.{name} == oldSelf.{name}" in text, name
    assert "suspend" not in text
