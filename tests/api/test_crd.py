"""The committed CRD is the generated one, valid, structural, and its CEL rules refuse what
the pydantic validators refuse."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import celpy
import kubernetes_validate
import pytest
import yaml

from finetune_operator.api.crd import build_crd, render_crd_yaml
from finetune_operator.api.crd_rules import CEL_RULES, INT_OR_AUTO_RULE, SPEC_CEL_RULES
from tests.conftest import CRD_PATH


def test_committed_crd_matches_generation() -> None:
    assert CRD_PATH.read_text() == render_crd_yaml(), (
        "crds/ is stale: regenerate with `ftjob crd > crds/finetunejobs.finetune.dev.yaml`"
    )


def test_crd_validates_against_official_schema() -> None:
    kubernetes_validate.validate(yaml.safe_load(CRD_PATH.read_text()), "1.32", strict=True)


def _walk(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    found = [(path, node)]
    for name, sub in node.get("properties", {}).items():
        found += _walk(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        found += _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        found += _walk(node["additionalProperties"], f"{path}{{}}")
    return found


def test_schema_is_structural() -> None:
    root = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(root):
        assert "$ref" not in node and "anyOf" not in node, path
        typed = "type" in node or node.get("x-kubernetes-int-or-string")
        assert typed, f"{path} has no type"
        if isinstance(node.get("exclusiveMinimum"), (int, float)) and not isinstance(
            node.get("exclusiveMinimum"), bool
        ):
            pytest.fail(f"{path}: OpenAPI v3.0 wants a boolean exclusiveMinimum")


def test_printer_columns_and_short_name() -> None:
    spec = build_crd()["spec"]
    assert spec["names"]["shortNames"] == ["ftj"]
    cols = [c["name"] for c in spec["versions"][0]["additionalPrinterColumns"]]
    assert cols == ["Phase", "GPUs", "Strategy", "Step", "Restarts", "Age"]
    assert spec["versions"][0]["subresources"] == {"status": {}}


def _cel(rule: str, obj: Any) -> bool:
    env = celpy.Environment()
    return bool(env.program(env.compile(rule)).evaluate({"self": celpy.json_to_cel(obj)}))


def _rules_pass(model: str, obj: dict[str, Any]) -> bool:
    return all(_cel(r["rule"], obj) for r in CEL_RULES[model])


@pytest.mark.parametrize(
    ("model", "obj", "ok"),
    [
        ("ResourcesSpec", {"minNodes": 1, "maxNodes": 2}, True),
        ("ResourcesSpec", {"minNodes": 3, "maxNodes": 2}, False),
        ("ResourcesSpec", {"maxNodes": 2}, True),
        ("TrainingSpec", {"maxSteps": 10, "warmupSteps": 2}, True),
        ("TrainingSpec", {"warmupSteps": 0}, False),
        ("TrainingSpec", {"maxSteps": 10, "warmupSteps": 20}, False),
        ("MethodSpec", {"type": "full", "lora": {"rank": 8}}, False),
        ("MethodSpec", {"type": "lora", "lora": {"rank": 8}}, True),
        ("StrategySpec", {"type": "zero2", "backend": "fsdp"}, False),
        ("StrategySpec", {"type": "zero2", "backend": "deepspeed"}, True),
        ("StrategySpec", {"type": "fsdp-hybrid", "backend": "deepspeed"}, False),
        ("FaultToleranceSpec", {"hangTimeoutSeconds": 600}, True),
        ("FaultToleranceSpec", {"hangTimeoutSeconds": 600, "collectiveTimeoutSeconds": 60}, True),
        ("FaultToleranceSpec", {"hangTimeoutSeconds": 600, "collectiveTimeoutSeconds": 600}, False),
        (
            "FaultToleranceSpec",
            {
                "hangTimeoutSeconds": 900,
                "collectiveTimeoutSeconds": 300,
                "startupCollectiveTimeoutSeconds": 120,
            },
            False,
        ),
        ("GangSchedulingSpec", {"scheduler": "coscheduling", "scheduleTimeoutSeconds": 60}, True),
        ("GangSchedulingSpec", {"scheduler": "volcano", "scheduleTimeoutSeconds": 60}, False),
        ("GangSchedulingSpec", {"scheduler": "volcano", "queue": "q"}, True),
        ("GangSchedulingSpec", {"scheduler": "coscheduling", "queue": "q"}, False),
        ("GangSchedulingSpec", {"scheduler": "none", "schedulerName": "x"}, False),
        ("ModelArchitecture", {"numAttentionHeads": 32, "numKeyValueHeads": 8}, True),
        ("ModelArchitecture", {"numAttentionHeads": 32, "numKeyValueHeads": 5}, False),
        ("ModelArchitecture", {"numAttentionHeads": 4, "numLocalExperts": 8}, False),
        ("DatasetSpec", {"uri": "d", "cacheSizeLimit": "64Gi"}, True),
        ("DatasetSpec", {"uri": "d", "cacheSizeLimit": "1.5T"}, True),
        ("DatasetSpec", {"uri": "d", "cacheSizeLimit": 1 << 30}, True),
        ("DatasetSpec", {"uri": "d", "cacheSizeLimit": "32GB"}, False),
        ("DatasetSpec", {"uri": "d", "cacheSizeLimit": "-1Gi"}, False),
        ("DatasetSpec", {"uri": "d", "cacheSizeLimit": 0}, False),
    ],
    ids=lambda v: str(v) if not isinstance(v, dict) else "",
)
def test_cel_rules(model: str, obj: dict[str, Any], ok: bool) -> None:
    assert _rules_pass(model, obj) is ok


FULL_MERGE = {"method": {"type": "full"}, "output": {"mergeLora": True}}
VALID = {"method": {"type": "full"}, "output": {}}


@pytest.mark.parametrize(
    ("old", "new", "ok"),
    [
        (VALID, FULL_MERGE, False),
        (VALID, {"method": {"type": "lora"}, "output": {"mergeLora": True}}, True),
        (VALID, {"method": {"type": "full"}, "output": {"mergeLora": False}}, True),
        (VALID, VALID, True),
        (FULL_MERGE, FULL_MERGE, True),  # stored before the rule: stays writable
        (FULL_MERGE, {**FULL_MERGE, "suspend": True}, True),
    ],
    ids=["gains-it", "lora", "false", "valid", "stored-with-it", "stored-with-it-suspended"],
)
def test_spec_transition_rules(old: dict[str, Any], new: dict[str, Any], ok: bool) -> None:
    """Transition rules (crd_rules.kept_when_stored): refused where an update brings the form in."""
    env = celpy.Environment()
    for rule in SPEC_CEL_RULES:
        activation = {"self": celpy.json_to_cel(new), "oldSelf": celpy.json_to_cel(old)}
        assert env.program(env.compile(rule["rule"])).evaluate(activation) == ok


@pytest.mark.parametrize(
    ("value", "ok"), [(1, True), (4, True), ("auto", True), (0, False), ("x", False)]
)
def test_int_or_auto_rule(value: Any, ok: bool) -> None:
    assert _cel(INT_OR_AUTO_RULE["rule"], value) is ok


def test_committed_reference_matches_generation(repo_root: Path) -> None:
    from finetune_operator.api.reference import render_reference

    committed = (repo_root / "docs" / "reference.md").read_text()
    assert committed == render_reference(), (
        "docs/reference.md is stale: python -m finetune_operator.api.reference > docs/reference.md"
    )
