"""`strategy.offload: cpu` counts each byte once, where it lives. On a GPU the device and the
host are two memories: the offloaded states are host RAM only. On a CPU job they are one: the
device is the process's share of resources.memory, which is also its host budget, so what
DeepSpeed offloads to its host buffers adds to the device's need (checked apart, each half fit
the budget while their sum did not), and FSDP2, which offloads nothing on CPU
(finetune_trainer.parallelize), is planned with its states where the trainer keeps them."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from planner_specs import make_spec

from finetune_operator.api.capabilities import trainer_refusals
from finetune_operator.planner import plan_job
from finetune_operator.planner.configuration import Candidate
from finetune_operator.planner.hardware import runtime_host_bytes
from finetune_operator.planner.planning import build_problem
from finetune_operator.planner.report import render_plan
from finetune_operator.planner.search import MIN_HEADROOM, Problem, evaluate, strategies_for

TINY = {"name": "Qwen/Qwen2.5-0.5B"}
CPU = {"device": "cpu", "gpu": {}, "memory": "64Gi", "gpusPerNode": 1, "maxGPUs": 1}
SHORT = {"sequenceLength": 256, "globalBatchSize": 4, "maxSteps": 10}


def _cpu_problem(strategy: dict[str, str]) -> Problem:
    return build_problem(make_spec(model=TINY, training=SHORT, resources=CPU, strategy=strategy))


def deepspeed_offload_on_cpu() -> Any:
    """ZeRO-2 with its optimizer states offloaded, on a CPU device: the offloaded states share
    the process's memory with the rest."""
    return make_spec(model=TINY, training=SHORT, resources=CPU,
                     strategy={"type": "zero2", "backend": "deepspeed", "offload": "cpu"})  # fmt: skip


def evaluated(spec: Any, plan: Any) -> Any:
    """The search's evaluation of `plan`'s choice, at world 1."""
    p = build_problem(spec)
    return evaluate(p, 1, strategies_for(p, 1)[0], plan.micro_batch_size,
                    plan.activation_checkpointing)  # fmt: skip


def test_deepspeed_offload_on_cpu_adds_the_offloaded_states_to_the_device_need() -> None:
    p = _cpu_problem({"type": "zero2", "backend": "deepspeed", "offload": "cpu"})
    ev = evaluate(p, 1, strategies_for(p, 1)[0], 1, True)
    b, host = ev.est.breakdown, ev.est.host_bytes
    assert host > 0 and b.optimizer == 0  # DeepSpeed on CPU still moves them to host buffers
    # once, in the one memory both live in; with the async save's staging and write copy
    assert ev.device_need == b.total + host + ev.save.host_peak
    assert ev.host_need == 0  # not a second time against the same budget
    # A budget each half fits but their sum does not: refused (the halves were checked apart,
    # against the same RAM, so it planned).
    limit = ev.device_need - 1
    tight = replace(p, acc=replace(p.acc, memory_bytes=int(limit / (1 - MIN_HEADROOM))))
    tight = replace(tight, host_budget=tight.acc.memory_bytes)
    assert b.total <= limit and host <= tight.host_budget
    assert not evaluate(tight, 1, strategies_for(p, 1)[0], 1, True).fits
    enough = replace(tight, acc=replace(tight.acc, memory_bytes=tight.acc.memory_bytes + 2))
    assert evaluate(enough, 1, strategies_for(p, 1)[0], 1, True).fits


def test_deepspeed_offload_on_a_gpu_keeps_device_and_host_apart() -> None:
    p = build_problem(make_spec(strategy={"type": "zero2", "offload": "cpu"}))
    ev = evaluate(p, 8, strategies_for(p, 8)[0], 1, True)
    assert ev.est.host_bytes > 0
    assert ev.device_need == ev.est.breakdown.total
    # The resume's group (before the first step) or the async save's staging and write copies
    # (after it), whichever is larger: DeepSpeed's 1/8 of 12 B per parameter, twice.
    save = ev.save.host_peak
    assert save == 2 * ev.save.staging > ev.resume_host_bytes
    assert ev.host_need == ev.est.host_bytes + save + runtime_host_bytes(8)


def test_fsdp_offload_on_cpu_plans_the_states_where_the_trainer_keeps_them() -> None:
    """No CPUOffloadPolicy on a CPU run: the same memory as without offload, nothing on the
    host beside it."""
    off = _cpu_problem({"type": "fsdp-full-shard", "offload": "cpu"})
    ev = evaluate(off, 1, strategies_for(off, 1)[0], 1, True)
    none = _cpu_problem({"type": "fsdp-full-shard"})
    base = evaluate(none, 1, strategies_for(none, 1)[0], 1, True)
    assert ev.est.host_bytes == 0 and ev.est.breakdown.optimizer > 0
    assert ev.est.breakdown == base.est.breakdown and ev.device_need == base.device_need
    assert not Candidate("fsdp-full-shard", offload="cpu", cuda=False).offloads
    assert Candidate("fsdp-full-shard", offload="cpu", cuda=True).offloads
    assert Candidate("zero2", offload="cpu", cuda=False).offloads


def test_a_cpu_offload_plan_reports_the_headroom_of_everything_in_its_memory() -> None:
    spec = deepspeed_offload_on_cpu()
    plan = plan_job(spec)
    ev = evaluated(spec, plan)
    assert plan.fits and plan.memory == ev.est.breakdown
    assert plan.headroom == round(1 - ev.device_need / plan.gpu_memory_bytes, 4)
    assert plan.headroom < round(1 - plan.memory.total / plan.gpu_memory_bytes, 4)


def test_a_cpu_offload_plans_reason_states_the_need_its_headroom_is_of() -> None:
    """The reason's "Needs X of Y" and its headroom are one figure: the offloaded states in
    the process's memory (it said the breakdown alone, 3.3 of 32 GiB, beside a 61% headroom)."""
    spec = deepspeed_offload_on_cpu()
    plan = plan_job(spec)
    ev = evaluated(spec, plan)
    assert ev.device_need > plan.memory.total + 2**30  # the two figures differ here
    assert f"Needs {ev.device_need / 2**30:.1f} GiB of 64.0 GiB" in plan.reason, plan.reason


def test_the_plan_table_states_the_need_its_headroom_is_of() -> None:
    """`ftjob plan`'s memory row: the same need as the headroom beside it (it showed the
    breakdown alone, 3.30 GiB of 32.00 GiB beside a 60.9% headroom)."""
    spec = deepspeed_offload_on_cpu()
    plan = plan_job(spec)
    need = (1 - plan.headroom) * plan.gpu_memory_bytes / 2**30
    row = next(line for line in render_plan(plan).splitlines() if "headroom)" in line)
    shown = float(row.split()[3])
    assert abs(shown - need) < 0.01, row
    assert shown > plan.memory.total / 2**30 + 1  # the offloaded states are in it
    gpu = plan_job(make_spec(strategy={"type": "zero2", "offload": "cpu"}))
    row = next(line for line in render_plan(gpu).splitlines() if "headroom)" in line)
    assert f"{gpu.memory.total / 2**30:.2f} GiB of" in row  # a GPU's: its breakdown, unchanged


def test_an_fsdp_plan_on_cpu_says_it_offloads_nothing_and_why() -> None:
    """The plan says what the trainer runs (status.plan, `ftjob plan`): FSDP2 on a CPU device
    offloads nothing, whatever strategy.offload asks; DeepSpeed there, and FSDP2 on a GPU, do."""
    spec = make_spec(model=TINY, training=SHORT, resources=CPU,
                     strategy={"type": "fsdp-full-shard", "offload": "cpu"})  # fmt: skip
    plan = plan_job(spec)
    assert plan.fits and plan.offload == "none"
    assert "strategy.offload: cpu is not run (offload none)" in plan.reason
    assert "offload none" in render_plan(plan)
    assert "offload cpu" not in render_plan(plan)
    assert trainer_refusals(spec, plan) == []
    deepspeed = plan_job(
        make_spec(model=TINY, training=SHORT, resources=CPU,
                  strategy={"type": "zero2", "backend": "deepspeed", "offload": "cpu"})
    )  # fmt: skip
    assert deepspeed.offload == "cpu" and "is not run" not in deepspeed.reason
    gpu = plan_job(make_spec(strategy={"type": "fsdp-full-shard", "offload": "cpu"}))
    assert gpu.offload == "cpu" and "is not run" not in gpu.reason


def test_nvme_on_cpu_fsdp_is_still_refused_though_the_plan_offloads_nothing() -> None:
    spec = make_spec(model=TINY, training=SHORT, resources=CPU,
                     strategy={"type": "fsdp-full-shard", "offload": "nvme"})  # fmt: skip
    plan = plan_job(spec)
    assert plan.offload == "none"
    assert any("nvme is not implemented" in p for p in trainer_refusals(spec, plan))
