"""The export at the end of training (`spec.output`) gathers the model on rank 0's host
(planner/export_memory.py): a plan with an output counts it as one more host phase, and a
memory request that holds training but not the export is refused naming it."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml
from planner_specs import make_spec

from finetune_operator.api.spec import FineTuneJobSpec
from finetune_operator.planner import plan_job
from finetune_operator.planner.architecture import ModelShape
from finetune_operator.planner.configuration import TrainingShape
from finetune_operator.planner.export_memory import export_host_bytes, gathered_state_bytes
from finetune_operator.planner.hardware import MIB
from finetune_operator.planner.lora import adapter_parameters
from finetune_operator.planner.planning import build_problem
from finetune_operator.planner.search import Evaluated, evaluate, strategies_for

REPO = Path(__file__).resolve().parents[2]
OUT = {"uri": "/data/out"}
MOUNT = {"claims": [{"claimName": "shared", "mountPath": "/data"}]}


def _spec(**sections: dict[str, Any]) -> FineTuneJobSpec:
    # Pinned to the torch path's FSDP2 (auto may pick DeepSpeed, whose gather is per rank).
    # Saves off: a 7B's async staging (2 x 20 GiB) would outweigh the export's share.
    sections = {
        "strategy": {"type": "fsdp-full-shard"},
        "checkpoint": {"enabled": False},
        **sections,
    }
    return make_spec(storage=MOUNT, **sections)


def _planned(spec: FineTuneJobSpec) -> Evaluated:
    """The plan's configuration, evaluated (its memory figures)."""
    plan = plan_job(spec)
    assert plan.fits, plan.reason
    p = build_problem(spec)
    row = next(r for r in strategies_for(p, plan.world_size) if r.name == plan.strategy)
    return evaluate(p, plan.world_size, row, plan.micro_batch_size, plan.activation_checkpointing)


def _shapes(spec: FineTuneJobSpec) -> tuple[ModelShape, TrainingShape]:
    ev = _planned(spec)
    return build_problem(spec).model, ev.shape


def test_the_gathered_state_dict_by_method_and_backend() -> None:
    """A mixed-precision full fine-tune gathers its fp32 masters; LoRA the frozen base in
    its dtype beside the fp32 adapters, even when only the adapter is written."""
    m, full = _shapes(_spec(output=OUT))
    assert not m.lm_head or m.lm_head == m.embedding  # Llama-2-7b: an untied head
    assert gathered_state_bytes(m, full, deepspeed=False) == m.total * 4
    lora_spec = _spec(method={"type": "lora"}, output=OUT)
    _, lora = _shapes(lora_spec)
    adapters = adapter_parameters(m, lora.lora_rank, lora.lora_targets)
    assert gathered_state_bytes(m, lora, deepspeed=False) == m.total * 2 + adapters * 4
    # Nothing without an output; a merge adds one fp32 delta of the largest weight.
    off = export_host_bytes(m, lora, enabled=False, deepspeed=False, merge=False, copied=True)
    assert off == 0
    kept = export_host_bytes(m, lora, enabled=True, deepspeed=False, merge=False, copied=True)
    merged = export_host_bytes(m, lora, enabled=True, deepspeed=False, merge=True, copied=True)
    assert merged > kept == m.total * 2 + adapters * 4


def test_a_plan_with_an_output_needs_the_export_phase() -> None:
    """The torch path: rank 0's gather spread over its pod's 8 processes (one cgroup)."""
    without = _planned(_spec())
    ev = _planned(_spec(output=OUT))
    assert without.export_bytes == 0
    assert ev.export_bytes == build_problem(_spec()).model.total * 4
    assert ev.export_ranks == 8 and ev.export_share == math.ceil(ev.export_bytes / 8)
    assert ev.host_need == without.host_need - max(
        without.load_host_bytes, without.resume_host_bytes, without.save_host_bytes
    ) + max(ev.load_host_bytes, ev.resume_host_bytes, ev.save_host_bytes, ev.export_share)
    assert ev.host_need > without.host_need


def test_a_request_that_fits_only_without_the_export_is_refused_naming_it() -> None:
    without = _planned(_spec())
    memory = f"{math.ceil(8 * without.host_need / MIB) + 8}Mi"
    assert plan_job(_spec(resources={"memory": memory})).fits
    plan = plan_job(_spec(resources={"memory": memory}, output=OUT))
    assert not plan.fits
    assert "the export's gathered model (25.1 GiB on rank 0, 3.1 GiB per process" in plan.reason
    per_pod = float(plan.reason.split("resources.memory >= ")[1].split(" GiB per pod")[0])
    assert plan_job(_spec(resources={"memory": f"{per_pod}Gi"}, output=OUT)).fits


def _cpu(strategy: str, output: dict[str, Any] | None = None, method: str = "full") -> Evaluated:
    """The quickstart (CPU, inline tiny Llama) on 2 processes, saves off."""
    doc: dict[str, Any] = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
    spec = doc["spec"]
    spec["resources"].update(gpusPerNode=2, maxNodes=1, memory="8Gi")
    # Wide and short: the gathered weights outweigh one micro-batch's activations.
    spec["model"]["architecture"].update(hiddenSize=512, intermediateSize=1376, numHiddenLayers=8)
    spec["training"].update(sequenceLength=16, globalBatchSize=2, microBatchSize=1)
    spec.update(strategy={"type": strategy}, checkpoint={"enabled": False}, method={"type": method})
    spec["output"] = output or {}
    return _planned(FineTuneJobSpec.model_validate(spec))


def test_on_a_cpu_device_only_a_copying_gather_adds_to_the_one_budget() -> None:
    """A replicated model on CPU is gathered as its own parameters (nothing copied), FSDP2's
    shards into new tensors; a merge clones even the former. In the device's need, beside
    the resident states, where it outweighs the step's transients (a LoRA's frozen base
    sharded over 2 processes: the gather is twice a process's shard)."""
    out = {"uri": "output/quickstart"}
    ddp, ddp_out = _cpu("ddp"), _cpu("ddp", out)
    assert ddp_out.export_bytes == 0 and ddp_out.device_need == ddp.device_need
    fsdp, fsdp_out = _cpu("fsdp-full-shard", method="lora"), _cpu("fsdp-full-shard", out, "lora")
    assert fsdp_out.export_bytes > 0 and fsdp_out.export_ranks == 2
    b = fsdp_out.est.breakdown
    resident = b.parameters + b.gradients + b.optimizer + b.total - b.reserved
    assert fsdp_out.device_need == resident + fsdp_out.export_share > fsdp.device_need
    assert fsdp_out.host_need == fsdp.host_need  # counted once, in the device's need
    merged = _cpu("ddp", {**out, "mergeLora": True}, method="lora")
    assert merged.export_bytes > 0
