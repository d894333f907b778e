"""Host RAM per process has a runtime baseline (planner/hardware.runtime_host_bytes): a
resources.memory the Python/torch runtime alone exceeds is refused by the plan, with the
per-pod figure that would fit, instead of the pod being OOM-killed at start."""

from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml
from planner_specs import make_spec

from finetune_operator.api.spec import FineTuneJobSpec
from finetune_operator.planner import plan_job
from finetune_operator.planner.hardware import MIB, runtime_host_bytes
from finetune_operator.planner.planning import build_problem
from finetune_operator.planner.search import evaluate, strategies_for

REPO = Path(__file__).resolve().parents[2]


def _quickstart(memory: str) -> FineTuneJobSpec:
    doc: dict[str, Any] = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
    doc["spec"]["resources"]["memory"] = memory
    return FineTuneJobSpec.model_validate(doc["spec"])


def _per_pod_mib(reason: str) -> float:
    match = re.search(r"resources\.memory >= ([0-9.]+) (MiB|GiB) per pod", reason)
    assert match, reason
    return float(match.group(1)) * (1024 if match.group(2) == "GiB" else 1)


def test_a_cpu_pod_smaller_than_its_runtime_is_refused_with_what_would_fit() -> None:
    """64Mi holds the quickstart's 6 MiB of tensors but not the process that holds them."""
    plan = plan_job(_quickstart("64Mi"))
    assert not plan.fits
    assert "Tried world sizes" in plan.reason
    per_pod = _per_pod_mib(plan.reason)
    assert per_pod * MIB > runtime_host_bytes(1)
    # The figure the refusal names is enough: a pod given it plans.
    assert plan_job(_quickstart(f"{math.ceil(per_pod) + 1}Mi")).fits


def test_a_gpu_pod_smaller_than_its_processes_runtimes_is_refused_on_the_host() -> None:
    """Eight GPU processes in 1Gi: 128 MiB each, under a trainer's runtime; the GPU is fine,
    so the reason names the host, not a bigger GPU."""
    plan = plan_job(make_spec(resources={"memory": "1Gi"}))
    assert not plan.fits
    assert plan.reason.startswith("Nothing fits in 128.0 MiB of host RAM per process (the H100")
    assert "Host RAM per process: the runtime" in plan.reason
    assert "A GPU with >=" not in plan.reason
    per_pod = _per_pod_mib(plan.reason)
    assert per_pod * MIB >= 8 * runtime_host_bytes(8)
    assert plan_job(make_spec(resources={"memory": f"{math.ceil(per_pod)}Mi"})).fits


def test_offloaded_states_and_the_runtime_share_the_host_budget() -> None:
    """A DeepSpeed offload whose states (and resume group) alone fit the host budget, but not
    with the runtime beside them: refused; a runtime's more budget: fits."""
    p = build_problem(make_spec(strategy={"type": "zero2", "offload": "cpu"}))
    row = strategies_for(p, 8)[0]
    ev = evaluate(p, 8, row, 1, True)
    states = ev.est.host_bytes + max(ev.resume_host_bytes, ev.save.host_peak)
    assert ev.est.host_bytes > 0 and ev.host_need == states + runtime_host_bytes(8)
    tight = evaluate(replace(p, host_budget=states + MIB), 8, row, 1, True)
    assert not tight.fits
    assert evaluate(replace(p, host_budget=tight.host_need), 8, row, 1, True).fits


def test_an_offload_refusal_names_the_least_host_ram_a_configuration_needs() -> None:
    """The refusal's host figure is the least any configuration the GPUs hold needs (offloaded
    states shrink with the ranks), not that of the configuration smallest on the GPU (1 rank
    holding all the states), and a pod given it plans."""
    offload = {"type": "zero2", "offload": "cpu"}
    refused = plan_job(make_spec(strategy=offload, resources={"memory": "8Gi"}))
    assert not refused.fits
    assert refused.reason.startswith("Nothing fits in 1.0 GiB of host RAM per process")
    host = re.search(r"Host RAM per process: .* need ([0-9.]+) GiB at (\d+) ranks", refused.reason)
    assert host is not None, refused.reason
    assert int(host[2]) > 1  # sharded over ranks, not the 1-rank smallest-on-GPU one
    assert "the runtime (" in refused.reason and "offloaded states (" in refused.reason
    per_pod = _per_pod_mib(refused.reason)
    plan = plan_job(make_spec(strategy=offload, resources={"memory": f"{math.ceil(per_pod)}Mi"}))
    assert plan.fits and plan.world_size == int(host[2])
