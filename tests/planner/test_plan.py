"""plan_job: rules of thumb, pinning, elastic jobs, the CPU quickstart and specific errors.

Shapes (stated, since the rules of thumb depend on them): bf16 mixed precision, AdamW, SDPA,
Llama-2-7B / Llama-3.1-70B from the catalog, sequence 2048 unless a case says otherwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from planner_specs import make_spec

from finetune_operator.api.capabilities import trainer_refusals
from finetune_operator.api.plan import Plan
from finetune_operator.api.spec import FineTuneJobSpec
from finetune_operator.api.strategies import STRATEGIES, StrategyTable
from finetune_operator.planner import PlanningError, plan_job, render_plan
from finetune_operator.planner.hardware import runtime_host_bytes

SHARDED = {"zero2", "zero3", "fsdp-full-shard", "fsdp-shard-grad-op"}
REPO = Path(__file__).resolve().parents[2]
# The strategy table as it is before and after the DeepSpeed backend lands: which rows the
# trainer implements decides what `strategy.backend: auto` searches (api/strategies.py).
TORCH_ONLY = STRATEGIES.without("deepspeed")
WITH_DEEPSPEED = STRATEGIES.implementing(
    [("zero1", "deepspeed"), ("zero2", "deepspeed"), ("zero3", "deepspeed")]
)
TABLES = [pytest.param(TORCH_ONLY, id="torch-only"), pytest.param(WITH_DEEPSPEED, id="deepspeed")]


def test_7b_full_ft_needs_four_80gb_gpus_on_the_torch_backend() -> None:
    """Two ranks hold the states (54 GiB) but the caching allocator reserves more than that
    (measured on an H100, bench/results/gpu-h100.md): the compute stream's pool at 1.105x its
    peak plus FSDP's reduce-scatter pool of sharded fp32 gradients, 72 GiB, over the 10%
    headroom limit (71.6 GiB). Same with DeepSpeed implemented when the job pins fsdp."""
    for spec, table in (
        (make_spec(), TORCH_ONLY),
        (make_spec(strategy={"backend": "fsdp"}), WITH_DEEPSPEED),
    ):
        plan = plan_job(spec, table)
        assert plan.fits and plan.world_size == 4 and plan.strategy in SHARDED
        assert plan.backend == "fsdp" and plan.headroom >= 0.10
        assert "Fewer ranks do not fit" in plan.reason and "2 (72." in plan.reason
        assert trainer_refusals(spec, plan, table) == []


@pytest.mark.parametrize("table", TABLES)
def test_7b_full_ft_with_deepspeed_backend_is_a_zero_stage(table: StrategyTable) -> None:
    """An explicit backend plans its rows whether the trainer runs them or not: the plan is
    the same with either table, on no more GPUs than FSDP2 needs (4), and the capability check
    refuses it until DeepSpeed lands and accepts it after."""
    spec = make_spec(
        strategy={"backend": "deepspeed"}, training={"activationCheckpointing": "full"}
    )
    plan = plan_job(spec, table)
    assert plan == plan_job(spec, WITH_DEEPSPEED if table is TORCH_ONLY else TORCH_ONLY)
    assert plan.fits and plan.backend == "deepspeed" and plan.world_size <= 4
    assert plan.strategy in {"zero1", "zero2", "zero3"} and plan.headroom >= 0.10
    refusals = trainer_refusals(spec, plan, table)
    if table is TORCH_ONLY:
        assert refusals == [
            f"spec.strategy: {plan.strategy} on deepspeed is not implemented by the trainer yet; "
            "use one of ddp, fsdp-full-shard, fsdp-hybrid, fsdp-shard-grad-op, zero3"
        ]
    else:
        assert refusals == []


def _cost(plan: Plan) -> tuple[float, float]:
    """What the plan's objective minimises first, then second."""
    if plan.objective == "fastest":
        return plan.estimated_step_seconds, plan.world_size
    return plan.world_size, plan.estimated_step_seconds


@pytest.mark.parametrize(
    "sections",
    [
        {},
        {"training": {"globalBatchSize": 64}},
        {"model": {"name": "Llama-3.1-8B"}},
        {"strategy": {"offload": "cpu"}, "resources": {"maxGPUs": 2}},
    ],
    ids=["7b", "7b-batch64", "8b", "7b-offload-2gpus"],
)
def test_7b_rules_of_thumb_pick_deepspeed_where_it_is_cheapest(sections: dict[str, Any]) -> None:
    """Full fine-tuning of 7B-8B models on 80 GB GPUs: once the trainer runs DeepSpeed,
    `backend: auto` picks a ZeRO plan here, because the planner finds it cheaper by the job's
    objective (fewer GPUs, or faster on as many) than the best torch plan, which is what it
    picks without DeepSpeed; the capability check accepts it."""
    spec = make_spec(**sections)
    torch_plan = plan_job(spec, TORCH_ONLY)
    plan = plan_job(spec, WITH_DEEPSPEED)
    assert torch_plan.fits and torch_plan.backend == "fsdp"
    assert plan.fits and plan.backend == "deepspeed" and plan.headroom >= 0.10
    assert plan.strategy in {"zero1", "zero2", "zero3"}
    assert plan.objective == torch_plan.objective
    assert _cost(plan) < _cost(torch_plan), (plan.reason, torch_plan.reason)
    assert trainer_refusals(spec, plan, WITH_DEEPSPEED) == []
    assert trainer_refusals(spec, torch_plan, TORCH_ONLY) == []


@pytest.mark.parametrize("table", [*TABLES, pytest.param(STRATEGIES, id="live")])
@pytest.mark.parametrize(
    "sections",
    [
        {},
        {"resources": {"maxGPUs": 2}, "training": {"globalBatchSize": 8}},
        {"strategy": {"offload": "cpu"}},
        {"strategy": {"type": "zero3"}, "resources": {"minNodes": 1, "maxNodes": 1}},
        {"method": {"type": "lora"}, "training": {"optimizer": "adamw8bit"}},
        {"model": {"name": "Llama-3.1-70B"}, "strategy": {"offload": "cpu"}},
    ],
    ids=["7b", "7b-2gpus", "7b-offload", "zero3-pinned", "lora-adamw8bit", "70b-offload"],
)
def test_backend_auto_never_plans_what_the_trainer_refuses(
    table: StrategyTable, sections: dict[str, Any]
) -> None:
    """Whether it fits or not (7b-2gpus does not on torch alone), the plan names a strategy
    the trainer runs: the refusal of a job that does not fit is about memory, never about a
    row the planner chose itself."""
    spec = make_spec(**sections)
    plan = plan_job(spec, table)
    assert trainer_refusals(spec, plan, table) == [], plan.reason


def test_7b_qlora_fits_one_24gb_gpu() -> None:
    plan = plan_job(
        make_spec(
            method={"type": "qlora"}, resources={"gpu": {"product": "RTX-4090"}, "gpusPerNode": 1}
        )
    )
    assert plan.fits and plan.world_size == 1


def test_70b_qlora_fits_one_80gb_gpu() -> None:
    plan = plan_job(make_spec(model={"name": "meta-llama/Llama-3.1-70B"}, method={"type": "qlora"}))
    assert plan.fits and plan.world_size == 1


SEQ4K = {"sequenceLength": 4096, "globalBatchSize": 64, "maxSteps": 100}


def test_70b_full_ft_on_8x80gb_is_zero3_with_offload() -> None:
    # 16 B/param x 70.6B / 8 = 141 GB of states per GPU: 8 x 80 GB holds 70B full FT only
    # with ZeRO-3 (FSDP full shard) and CPU offload of the states, and sync saves: an async
    # save's staging and write copies (2 x 98.6 GiB a rank) do not fit beside 131 GiB of
    # offloaded states in the default host budget (a sync save writes those in place).
    plan = plan_job(
        make_spec(
            model={"name": "Llama-3.1-70B"},
            training=SEQ4K,
            strategy={"offload": "cpu"},
            checkpoint={"async": False},
        )
    )
    assert plan.fits and plan.world_size == 8 and plan.nodes == 1
    assert plan.strategy in {"zero3", "fsdp-full-shard"} and plan.offload == "cpu"


def test_70b_full_ft_without_offload_needs_more_nodes() -> None:
    plan = plan_job(make_spec(model={"name": "Llama-3.1-70B"}, training=SEQ4K))
    assert plan.fits and plan.world_size > 8
    assert plan.strategy in {"zero3", "fsdp-full-shard"}


def test_70b_full_ft_on_two_24gb_gpus_does_not_fit() -> None:
    plan = plan_job(
        make_spec(
            model={"name": "Llama-3.1-70B"},
            resources={"gpu": {"memoryGiB": 24}, "gpusPerNode": 2, "maxGPUs": 2},
        )
    )
    assert not plan.fits
    for part in (
        "Tried world sizes 1, 2",
        "smallest need",
        # The FSDP root unit (embedding + head, 4.2 GB in bf16) stays unsharded and the fp32
        # loss tensors take 12 b*s*V: no GPU count fits 24 GB without offload.
        "strategy.offload: cpu would fit",
        # No LoRA hint: QLoRA runs replicated (FSDP cannot shard 4-bit weights) and needs
        # more than one 24 GB GPU; LoRA over the 16 ranks the batch allows needs more than
        # 21.6 GiB once the allocator's measured fragmentation (1.105x) is counted.
        "A GPU with >=",
    ):
        assert part in plan.reason
    assert "DOES NOT FIT" in render_plan(plan)


def test_pinned_configuration_is_evaluated_exactly() -> None:
    spec = make_spec(
        strategy={"type": "fsdp-full-shard"},
        resources={"minNodes": 2, "maxNodes": 2},
        training={"globalBatchSize": 64, "microBatchSize": 2, "activationCheckpointing": "full"},
    )
    plan = plan_job(spec)
    assert plan.candidates_evaluated == 1
    assert (plan.world_size, plan.nodes, plan.strategy) == (16, 2, "fsdp-full-shard")
    assert (plan.micro_batch_size, plan.activation_checkpointing) == (2, True)
    assert plan.gradient_accumulation_steps == 2


def test_pinned_configuration_that_does_not_fit_is_reported() -> None:
    spec = make_spec(
        strategy={"type": "ddp"},
        resources={"minNodes": 1, "maxNodes": 1},
        training={"microBatchSize": 2, "activationCheckpointing": "none"},
    )
    plan = plan_job(spec)
    assert not plan.fits and plan.strategy == "ddp" and plan.world_size == 8
    assert plan.candidates_evaluated == 1


def test_elastic_fits_at_min_nodes_and_launches_max_nodes() -> None:
    # 70B, fsdp: 16 GPUs would fit, but the job may shrink to minNodes=1 (8 GPUs): refuse
    # without offload, fit with it; either way launch maxNodes pods.
    elastic = {"minNodes": 1, "maxNodes": 4}
    shrinking = plan_job(
        make_spec(model={"name": "Llama-3.1-70B"}, training=SEQ4K, resources=elastic)
    )
    assert not shrinking.fits and shrinking.nodes == 4
    plan = plan_job(
        make_spec(
            model={"name": "Llama-3.1-70B"},
            training=SEQ4K,
            resources=elastic,
            strategy={"offload": "cpu"},
            checkpoint={"async": False},  # as above: no room for an async save's copies
        )
    )
    assert plan.fits and (plan.nodes, plan.world_size) == (4, 32)
    assert "minNodes" in plan.reason


def test_cpu_quickstart_fits_ddp_two_nodes() -> None:
    doc: dict[str, Any] = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
    plan = plan_job(FineTuneJobSpec.model_validate(doc["spec"]))
    assert plan.fits and plan.strategy == "ddp" and plan.nodes == 2
    assert plan.gpu_memory_bytes == 2 * 1024**3  # resources.memory 2Gi / 1 process
    # No CUDA context on CPU; the process's runtime shares the pod's memory with its tensors.
    assert plan.memory.total == plan.memory.reserved + runtime_host_bytes(1)


def test_plan_reports_throughput_and_gpu_hours() -> None:
    plan = plan_job(make_spec())
    assert plan.tokens_per_second == pytest.approx(
        16 * 2048 / plan.estimated_step_seconds, rel=1e-3
    )
    assert plan.gpu_hours == pytest.approx(
        100 * plan.estimated_step_seconds * plan.world_size / 3600, rel=1e-3
    )


@pytest.mark.parametrize(
    ("sections", "field"),
    [
        ({"model": {"name": "acme/unknown-13b"}}, "spec.model.architecture"),
        ({"method": {"type": "lora", "lora": {"rank": 4096 + 8}}}, None),  # API refuses >4096
        (
            {
                "model": {"name": "Llama-3.2-1B-Instruct"},
                "method": {"type": "lora", "lora": {"rank": 4096}},
            },
            "spec.method.lora.rank",
        ),
        ({"training": {"sequenceLength": 8192}}, "spec.training.sequenceLength"),
        ({"training": {"globalBatchSize": 6, "microBatchSize": 4}}, "spec.training.microBatchSize"),
        (
            {"training": {"microBatchSize": 4}, "resources": {"minNodes": 1, "maxNodes": 1}},
            "spec.training.microBatchSize",
        ),
        (
            {"resources": {"minNodes": 2, "maxNodes": 3}, "training": {"globalBatchSize": 16}},
            "spec.training.globalBatchSize",
        ),
        ({"resources": {"gpu": {"product": "H9000"}}}, "spec.resources.gpu.product"),
        ({"resources": {"gpu": {}}}, "spec.resources.gpu"),
        (
            {"method": {"type": "lora", "lora": {"targetModules": ["qkv"]}}},
            "spec.method.lora.targetModules",
        ),
        ({"strategy": {"type": "ddp", "offload": "cpu"}}, "spec.strategy.offload"),
        ({"resources": {"device": "cpu", "gpu": {}}}, "spec.resources.memory"),
        ({"resources": {"device": "cpu", "memory": "0.5"}}, "spec.resources.memory"),
        ({"resources": {"device": "cpu", "memory": "0Gi"}}, "spec.resources.memory"),
        ({"resources": {"gpu": {"memoryGiB": 1e-12}}}, "spec.resources.gpu.memoryGiB"),
        (
            {
                "model": {
                    "name": "tiny",
                    "source": "inline",
                    "architecture": {
                        "hiddenSize": 64,
                        "numHiddenLayers": 2,
                        "numAttentionHeads": 4,
                        "intermediateSize": 172,
                        "vocabSize": 100,
                    },
                }
            },
            "spec.model.architecture.vocabSize",
        ),
    ],
    ids=[
        "unknown-model",
        "rank-over-api-limit",
        "rank-over-hidden",
        "seq-over-max-pos",
        "micro-batch-not-dividing",
        "micro-batch-over-per-rank",
        "elastic-batch-not-divisible",
        "unknown-product",
        "no-gpu-memory",
        "unknown-target",
        "ddp-offload",
        "cpu-without-memory",
        "cpu-memory-under-a-byte",
        "cpu-memory-zero",
        "gpu-memory-under-a-byte",
        "inline-vocab-below-byte-tokenizer",
    ],
)
def test_specific_errors(sections: dict[str, Any], field: str | None) -> None:
    if field is None:
        with pytest.raises(ValueError):
            plan_job(make_spec(**sections))
        return
    with pytest.raises(PlanningError) as err:
        plan_job(make_spec(**sections))
    assert err.value.field == field


def test_report_is_aligned_table_in_gib() -> None:
    text = render_plan(plan_job(make_spec()))
    assert "GiB" in text and "Reason:" in text
    table = text.partition("Reason:")[0]
    rows = [line for line in table.splitlines() if line.startswith(("parameters", "peak"))]
    assert len(rows) == 2 and len({len(r) for r in rows}) == 1  # right-aligned numbers


@pytest.mark.parametrize(
    ("device", "hours", "shown"),
    [
        ("cpu", 0.0035, "none (CPU job: 0.0035 process-hours)"),
        ("gpu", 0.0035, "0.0035"),  # a short job is not "0.0"
        ("gpu", 1234.56, "1,234.6"),
    ],
)
def test_report_says_what_the_job_costs_on_its_device(
    device: str, hours: float, shown: str
) -> None:
    """A CPU plan printed "GPU-hours 0.0": no GPU was ever involved."""
    plan = plan_job(make_spec()).model_copy(update={"device": device, "gpu_hours": hours})
    line = next(x for x in render_plan(plan).splitlines() if x.startswith("GPU-hours"))
    assert line.split(None, 1)[1] == shown


def test_report_names_the_backend_as_such() -> None:
    """ "ddp (fsdp)" read as DDP inside FSDP; the backend is labelled."""
    plan = plan_job(make_spec(strategy={"type": "ddp"}))
    line = next(x for x in render_plan(plan).splitlines() if x.startswith("Strategy"))
    assert line.split(None, 1)[1] == f"ddp, backend {plan.backend}, offload {plan.offload}"


def test_report_counts_configurations_in_words() -> None:
    """One configuration is "1 configuration", several are plural."""
    import re

    for plan in (
        plan_job(make_spec()),
        plan_job(make_spec()).model_copy(update={"candidates_evaluated": 1}),
    ):
        n = plan.candidates_evaluated
        line = next(x for x in render_plan(plan).splitlines() if x.startswith("Evaluated"))
        assert re.search(rf"\b{n} configurations?$", line)
        assert line.endswith("configuration" if n == 1 else "configurations"), line


def test_plan_carries_the_resolved_architecture_for_the_trainer() -> None:
    """One resolution: the catalog entry the planner sized is what an inline job builds."""
    from finetune_operator.api.capabilities import trainer_refusals
    from finetune_operator.planner.catalog import lookup

    spec = make_spec(model={"name": "meta-llama/Llama-2-7b-hf", "source": "inline"})
    plan = plan_job(spec)
    entry = lookup("meta-llama/Llama-2-7b-hf")
    assert entry is not None and plan.architecture == entry.architecture
    assert not [r for r in trainer_refusals(spec, plan) if r.startswith("spec.model")]


@pytest.mark.parametrize(
    "sections",
    [
        {},
        {"method": {"type": "lora"}},
        {"model": {"name": "meta-llama/Llama-3.1-70B"}, "resources": {"gpusPerNode": 8, "maxGPUs": 16}},
        {"model": {"name": "Qwen/Qwen3-30B-A3B"}, "resources": {"gpusPerNode": 8}},
    ],
    ids=["7b-full", "7b-lora", "70b-full", "moe"],
)  # fmt: skip
def test_load_peak_is_the_shards_plus_one_module_and_below_the_step(
    sections: dict[str, Any],
) -> None:
    from finetune_operator.planner.loading import largest_module_parameters

    # The torch backend's rows (DeepSpeed's: the test below).
    spec = make_spec(**{"strategy": {"backend": "fsdp"}, **sections})
    plan = plan_job(spec)
    assert plan.architecture is not None and plan.backend == "fsdp"
    from finetune_operator.planner import shape_of

    module = largest_module_parameters(shape_of(plan.architecture)) * 4
    assert plan.load_peak_bytes == plan.memory.parameters + module
    assert plan.load_peak_bytes < plan.memory.peak


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_load_peak_zero3_partitions_zero12_full_replica(stage: int) -> None:
    """ZeRO-3 builds partitioned (zero.Init): its partitions plus one module gathered in the
    partition dtype and its fp32 init, well under the whole model; ZeRO-1/2 keep a full
    replica, built in the training dtype (as DDP), plus one module's fp32 init."""
    from finetune_operator.planner import shape_of
    from finetune_operator.planner.loading import largest_module_parameters

    spec = make_spec(strategy={"type": f"zero{stage}", "backend": "deepspeed"},
                     resources={"gpusPerNode": 8, "maxGPUs": 8})  # fmt: skip
    plan = plan_job(spec)
    assert plan.fits and plan.backend == "deepspeed"
    assert plan.architecture is not None
    m = shape_of(plan.architecture)
    module = largest_module_parameters(m)
    e = {"bf16": 2, "fp16": 2, "fp32": 4}[spec.training.precision]
    if stage == 3:
        assert plan.load_peak_bytes == plan.memory.parameters + module * (e + 4)
        assert plan.load_peak_bytes < m.total * e / 2  # nowhere near a whole model
        assert plan.load_peak_bytes < plan.memory.peak
    else:
        assert plan.memory.parameters == m.total * e  # a whole replica per rank
        assert plan.load_peak_bytes == plan.memory.parameters + module * 4
        assert plan.load_peak_bytes < m.total * 4  # never an fp32 replica


@pytest.mark.parametrize("example", ["quickstart.yaml", "llama-3.1-8b-lora.yaml"])
def test_report_memory_rows_add_up_to_the_need_shown(example: str) -> None:
    """The breakdown's total reads as reserved plus a named runtime row, and on CPU a last row
    gives the header's need: the quickstart showed "reserved 6.40", then "total 614.40"
    (608 MiB of runtime unnamed) under "Memory per process 617.27 MiB"."""
    doc: dict[str, Any] = yaml.safe_load((REPO / "examples" / example).read_text())
    plan = plan_job(FineTuneJobSpec.model_validate(doc["spec"]))
    text = render_plan(plan)
    rows = {
        line[:14].strip(): float(line[14:])
        for line in text.partition("Reason:")[0].splitlines()
        if line[:1].isalpha() and line[14:].strip().replace(".", "").isdigit()
    }
    runtime = rows.get("runtime", rows.get("cuda context"))
    assert runtime is not None and runtime > 0, text
    assert abs(rows["reserved"] + runtime - rows["total"]) < 0.02, text
    header = next(line for line in text.splitlines() if "headroom)" in line)
    need = float(header.split()[3])
    assert rows.get("needed", rows["total"]) == need, text
    assert ("needed" in rows) == (plan.device == "cpu"), text


@pytest.mark.parametrize(("nodes", "shown"), [(1, "8 (1 node x 8)"), (2, "16 (2 nodes x 8)")])
def test_report_counts_nodes_in_words(nodes: int, shown: str) -> None:
    """The 70B example printed "World size 8 (1 nodes x 8)"."""
    update = {"nodes": nodes, "gpus_per_node": 8, "world_size": nodes * 8}
    plan = plan_job(make_spec()).model_copy(update=update)
    line = next(x for x in render_plan(plan).splitlines() if x.startswith("World size"))
    assert line.split(None, 2)[2] == shown
