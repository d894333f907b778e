"""DeepSpeed jobs end to end on the local cluster: the real operator plans them, the kubelet
runs elastic torchrun, the trainer runs ZeRO on DeepSpeed's CPU accelerator (gloo). Three jobs
share one cluster and run side by side, to pay the cluster's and the imports' start-up once:

- `ds-zero2`: pinned zero2 on 2 worker pods;
- `ds-zero3`: pinned zero3 with CPU offload (parameters and optimizer) on 1 pod;
- `ds-auto`: `strategy: auto` with `backend: deepspeed` and offload: whatever the planner chose
  (a ZeRO strategy: offload rules DDP out) is what the trainer ran.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest

from finetune_local.session import LocalSession, is_finished, phase_of
from tests.e2e.conftest import committed_steps, step_records

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

STEPS = 6


def _job(doc: dict[str, Any], name: str, strategy: dict[str, Any], nodes: int) -> dict[str, Any]:
    job = copy.deepcopy(doc)
    job["metadata"]["name"] = name
    job["spec"]["strategy"] = strategy
    job["spec"]["training"].update({"maxSteps": STEPS, "warmupSteps": 2})
    job["spec"]["resources"].update({"minNodes": nodes, "maxNodes": nodes})
    job["spec"]["checkpoint"].update({"uri": f"checkpoints/{name}", "intervalSteps": 3})
    job["spec"]["output"] = {"uri": f"output/{name}"}
    return job


def _ran_stage(data: Path, name: str) -> int:
    logs = sorted((data / "pods" / "default").glob(f"{name}-worker-*/*.log"))
    text = "\n".join(log.read_text(errors="replace") for log in logs)
    found = re.search(r"DeepSpeed config: (\{.*\})$", text, re.M)
    assert found, f"{name}: no DeepSpeed config in the worker logs"
    records = [r for log in logs for r in step_records(log)]
    assert records and records[-1]["loss"] < records[0]["loss"], records
    return int(json.loads(found.group(1))["zero_optimization"]["stage"])


def test_zero2_zero3_offload_and_auto_run_to_succeeded(
    tmp_path: Path, quickstart_doc: dict[str, Any]
) -> None:
    data = tmp_path / "cluster"
    jobs = {
        "ds-zero2": _job(quickstart_doc, "ds-zero2", {"type": "zero2", "backend": "deepspeed"}, 2),
        "ds-zero3": _job(quickstart_doc, "ds-zero3",
                         {"type": "zero3", "backend": "deepspeed", "offload": "cpu"}, 1),
        "ds-auto": _job(quickstart_doc, "ds-auto",
                        {"type": "auto", "backend": "deepspeed", "offload": "cpu"}, 1),
    }  # fmt: skip
    with LocalSession(data, nodes=4) as session:
        for manifest in jobs.values():
            session.submit(manifest)
        done = {name: session.wait_for(name, is_finished, timeout=300) for name in jobs}
    for name, job in done.items():
        assert phase_of(job) == "Succeeded", (name, job.get("status"))
        assert job["status"]["step"] == STEPS
        assert committed_steps(data / "shared" / "checkpoints" / name)[-1] == STEPS
        assert (data / "shared" / "output" / name / "model.safetensors").is_file()

    plans = {name: job["status"]["plan"] for name, job in done.items()}
    assert (plans["ds-zero2"]["strategy"], plans["ds-zero2"]["worldSize"]) == ("zero2", 2)
    assert (plans["ds-zero3"]["strategy"], plans["ds-zero3"]["offload"]) == ("zero3", "cpu")
    chosen = plans["ds-auto"]["strategy"]
    assert chosen in ("zero1", "zero2", "zero3") and plans["ds-auto"]["backend"] == "deepspeed"
    assert _ran_stage(data, "ds-zero2") == 2
    assert _ran_stage(data, "ds-zero3") == 3
    assert _ran_stage(data, "ds-auto") == int(chosen[-1])  # what the planner chose ran
    # The planned config lies beside job.json in the pods' config volume, for people to read.
    beside = [p for p in data.rglob("deepspeed.json") if (p.parent / "job.json").is_file()]
    assert beside, "no deepspeed.json beside job.json"
