"""`ftjob`: the plan JSON contract of DESIGN.md §4, exit codes, refusals naming the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from finetune_operator.cli import main
from tests.conftest import CRD_PATH, EXAMPLES

PLAN_KEYS = {
    "fits", "worldSize", "nodes", "gpusPerNode", "strategy", "offload", "microBatchSize",
    "gradientAccumulationSteps", "activationCheckpointing", "gpuMemoryBytes", "headroom",
    "estimatedStepSeconds", "reason", "memory",
}  # fmt: skip
MEMORY_KEYS = {
    "parameters", "gradients", "optimizer", "activations", "buffers", "peak", "reserved", "total"
}


def _write(tmp_path: Path, doc: dict[str, Any]) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def _quickstart() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((EXAMPLES / "quickstart.yaml").read_text())
    return doc


def test_plan_json_has_the_documented_fields(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(EXAMPLES / "quickstart.yaml"), "-o", "json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan.keys() >= PLAN_KEYS and plan["memory"].keys() >= MEMORY_KEYS
    assert plan["fits"] is True and plan["nodes"] == 2 and plan["strategy"] == "ddp"
    memory = plan["memory"]
    assert memory["peak"] <= memory["reserved"] <= memory["total"] <= plan["gpuMemoryBytes"]


def test_plan_table_and_infeasible_exit_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = _quickstart()
    doc["spec"]["model"] = {"name": "meta-llama/Llama-3.1-70B"}
    doc["spec"]["training"]["precision"] = "bf16"
    doc["spec"]["resources"] = {"gpu": {"memoryGiB": 24}, "gpusPerNode": 2, "maxGPUs": 2}
    doc["spec"]["strategy"] = {"type": "auto"}
    assert main(["plan", _write(tmp_path, doc)]) == 1
    out = capsys.readouterr().out
    assert "fits" in out.lower() and "GiB" in out


@pytest.mark.parametrize("command", ["plan", "run"])
def test_invalid_manifest_exit_2_naming_the_field(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = _quickstart()
    doc["spec"]["resources"]["minNodes"] = 5
    argv = [command, _write(tmp_path, doc)] + (["--local"] if command == "run" else [])
    assert main(argv) == 2  # refused before any cluster is started
    err = capsys.readouterr().err
    assert "spec.resources" in err and "minNodes (5) must be <= " in err


def test_planning_error_names_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = _quickstart()
    doc["spec"]["model"] = {"name": "no-such-model"}
    assert main(["plan", _write(tmp_path, doc)]) == 2
    assert "spec.model" in capsys.readouterr().err


def test_crd_command_prints_the_committed_crd(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["crd"]) == 0
    assert capsys.readouterr().out == CRD_PATH.read_text()


def test_run_local_is_a_plugin_and_says_what_to_install_without_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The operator image has no local cluster: `ftjob run --local` then explains itself."""
    from importlib.metadata import entry_points

    import finetune_operator.cli as cli

    registered = entry_points(group="finetune_operator.run", name="local")
    assert [ep.value for ep in registered] == ["finetune_local.runner:run_local"]
    monkeypatch.setattr(cli, "entry_points", lambda **_: [])
    assert main(["run", "--local", str(EXAMPLES / "quickstart.yaml")]) == 2
    assert "finetune-operator[local]" in capsys.readouterr().err
