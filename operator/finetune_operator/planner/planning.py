"""`plan_job(spec) -> Plan`: validate the spec, run the search, assemble the Plan."""

from __future__ import annotations

from dataclasses import replace

from finetune_operator.api.constants import BYTE_TOKENIZER_VOCAB
from finetune_operator.api.deepspeed_config import hpz_partition_size
from finetune_operator.api.plan import Plan
from finetune_operator.api.spec import FineTuneJobSpec
from finetune_operator.api.storage import (
    is_object_store_uri,
    object_store_problems,
    unmounted_paths,
)
from finetune_operator.api.strategies import STRATEGIES, StrategyTable
from finetune_operator.planner.architecture import ModelShape, resolve_model
from finetune_operator.planner.configuration import PRECISION_BYTES, TrainingShape
from finetune_operator.planner.errors import PlanningError
from finetune_operator.planner.explain import explain_choice, explain_refusal
from finetune_operator.planner.hardware import (
    accelerator_for,
    check_cpu_quantity,
    host_bytes_per_process,
)
from finetune_operator.planner.loading import (
    checkpoint_bytes,
    load_peak_bytes,
    replicated_load_peak_bytes,
    zero_load_peak_bytes,
)
from finetune_operator.planner.lora import expand_targets
from finetune_operator.planner.memory import compiles_blocks
from finetune_operator.planner.search import (
    Evaluated,
    Problem,
    SearchResult,
    checkpoint_modes,
    fastest,
    resolve_objective,
    run_search,
    search_at,
    world_sizes,
)


def build_problem(
    spec: FineTuneJobSpec, strategies: StrategyTable = STRATEGIES, *, compile_blocks: bool = True
) -> Problem:
    """Resolve model and device and refuse inputs no configuration could train.
    `compile_blocks`: the trainer compiles its decoder blocks where it can (its default,
    memory.compiles_blocks); False plans for eager blocks (FT_COMPILE=0)."""
    for field, message in [*unmounted_paths(spec), *object_store_problems(spec)]:
        raise PlanningError(field, message)
    model = resolve_model(spec.model)
    acc = accelerator_for(spec.resources)
    if spec.resources.cpu is not None:
        check_cpu_quantity(spec.resources.cpu, "spec.resources.cpu")
    tr, arch = spec.training, model.arch
    if arch.max_position_embeddings and tr.sequence_length > arch.max_position_embeddings:
        raise PlanningError(
            "spec.training.sequenceLength",
            f"{tr.sequence_length} exceeds the model's maxPositionEmbeddings "
            f"({arch.max_position_embeddings})",
        )
    if spec.model.source == "inline" and arch.vocab_size < BYTE_TOKENIZER_VOCAB:
        raise PlanningError(
            "spec.model.architecture.vocabSize",
            f"{arch.vocab_size} is below the {BYTE_TOKENIZER_VOCAB} token ids of the byte-level "
            "tokenizer inline models train with (256 bytes, bos, eos, pad)",
        )
    lora = spec.method.lora
    targets: tuple[str, ...] = ()
    if spec.method.type != "full" and lora is not None:
        if lora.rank > arch.hidden_size:
            raise PlanningError(
                "spec.method.lora.rank", f"rank {lora.rank} exceeds hiddenSize {arch.hidden_size}"
            )
        targets = expand_targets(lora.target_modules)
    if spec.method.type == "qlora" and not acc.cuda:
        raise PlanningError("spec.method.type", "qlora needs bitsandbytes on a GPU, not CPU")
    if isinstance(tr.micro_batch_size, int) and tr.global_batch_size % tr.micro_batch_size:
        raise PlanningError(
            "spec.training.microBatchSize",
            f"{tr.micro_batch_size} does not divide globalBatchSize {tr.global_batch_size}",
        )
    st = spec.strategy
    if st.type != "auto" and st.offload != "none":
        row = strategies.resolve(st.type, st.backend)
        if not row.offloadable:
            can = sorted({r.name for r in strategies if r.offloadable})
            raise PlanningError(
                "spec.strategy.offload", f"{st.type} cannot offload; use one of {', '.join(can)}"
            )
    base = TrainingShape(
        micro_batch_size=1,
        seq_len=tr.sequence_length,
        precision=tr.precision,
        optimizer=tr.optimizer,
        method=spec.method.type,
        lora_rank=lora.rank if lora else 16,
        lora_targets=targets or ("q_proj",),
        lora_dropout=lora.dropout if lora else 0.0,
        attention=spec.model.attention,
        compile_blocks=compile_blocks,
        hpz_partition_size=hpz_partition_size(st.deepspeed_config),
    )
    return Problem(
        spec, model, acc, base, host_bytes_per_process(spec.resources), strategies=strategies
    )


def _check_divides(spec: FineTuneJobSpec, n: int, what: str) -> None:
    if spec.training.global_batch_size % n:
        raise PlanningError(
            "spec.training.globalBatchSize",
            f"{spec.training.global_batch_size} is not divisible by the {what} world size {n}",
        )


def _fixed_size(p: Problem) -> tuple[int, int] | None:
    """(memory world size, launched world size) when the spec fixes them, else None.

    Elastic jobs (minNodes set) launch maxNodes pods but must fit at minNodes: sharded states
    grow per rank when ranks leave. A pinned strategy with minNodes == maxNodes fixes both.
    """
    res = p.spec.resources
    gpn = res.gpus_per_node
    if res.min_nodes is None:
        if p.spec.strategy.type != "auto" and res.max_nodes is not None:
            return res.max_nodes * gpn, res.max_nodes * gpn
        return None
    launch_nodes = res.max_nodes or res.min_nodes
    mem_n, launch_n = res.min_nodes * gpn, launch_nodes * gpn
    _check_divides(p.spec, mem_n, "minNodes")
    _check_divides(p.spec, launch_n, "launched")
    return mem_n, launch_n


def _search(p: Problem) -> tuple[SearchResult, int | None]:
    fixed = _fixed_size(p)
    if fixed is None:
        sizes = world_sizes(p)
        if not sizes:
            raise PlanningError(
                "spec.training.globalBatchSize",
                f"no world size up to the GPU limit divides {p.spec.training.global_batch_size}",
            )
        return run_search(p, sizes, resolve_objective(p.spec)), None
    mem_n, launch_n = fixed
    micro_batch_size = p.spec.training.micro_batch_size
    per_rank = p.spec.training.global_batch_size // mem_n
    if isinstance(micro_batch_size, int) and per_rank % micro_batch_size:
        raise PlanningError(
            "spec.training.microBatchSize",
            f"{micro_batch_size} does not divide the per-rank batch {per_rank} at world size {mem_n}",
        )
    result = SearchResult(best=None, smallest=None, tried={})
    fitting = search_at(p, mem_n, result, mem_world=mem_n, launch=launch_n)
    if fitting:
        result.best = fastest(fitting)
    return result, launch_n


def _striped_world(spec: FineTuneJobSpec, ev: Evaluated, world: int) -> int:
    """The ranks that read the weights in stripes (replica_loading): a replicated row (DDP,
    ZeRO-1/2) loading pretrained weights from an object store (QLoRA reads its own way); 1
    where nothing is striped."""
    model = spec.model
    uri = model.weights_location()
    remote = model.source == "uri" and uri is not None and is_object_store_uri(uri)
    replicated = not ev.row.shards_params and ev.shape.method != "qlora"
    return world if remote and replicated else 1


def _load_peak(m: ModelShape, ev: Evaluated, striped_world: int) -> int:
    # On a GPU the ranged reads are host memory (Evaluated.load_host_bytes): the device's
    # load peak keeps the stripes only.
    on_host = ev.cand.cuda
    parameters = ev.est.breakdown.parameters
    if ev.row.backend != "deepspeed":
        if ev.row.shards_params:
            return load_peak_bytes(m, parameters)
        # DDP's replica: fp32 masters for full fine-tuning, else the frozen base's dtype.
        full = ev.shape.method == "full" or ev.shape.precision == "fp32"
        e = 4 if full else PRECISION_BYTES[ev.shape.precision]
        return replicated_load_peak_bytes(
            m, parameters, element_bytes=e, striped_world=striped_world, reads_on_host=on_host
        )
    return zero_load_peak_bytes(
        m,
        ev.row.zero_stage,
        parameters,
        partition_dtype_bytes=PRECISION_BYTES[ev.shape.precision],
        striped_world=striped_world,
        reads_on_host=on_host,
    )


def _to_plan(
    p: Problem, ev: Evaluated, fits: bool, reason: str, launch_n: int, evaluated: int
) -> Plan:
    gpn = min(p.spec.resources.gpus_per_node, launch_n)
    tr = p.spec.training
    step = ev.step_s
    tokens = tr.global_batch_size * tr.sequence_length
    b = ev.est.breakdown
    return Plan(
        device=p.spec.resources.device,
        fits=fits,
        world_size=launch_n,
        nodes=max(1, launch_n // gpn),
        gpus_per_node=gpn,
        strategy=ev.cand.strategy,
        # What the trainer does: FSDP2 on a CPU device offloads nothing (Candidate.offloads;
        # the reason says why the spec's offload is not run).
        offload=ev.cand.offload if ev.cand.offloads else "none",
        backend=ev.row.backend,
        micro_batch_size=ev.shape.micro_batch_size,
        gradient_accumulation_steps=max(
            1, tr.global_batch_size // (launch_n * ev.shape.micro_batch_size)
        ),
        activation_checkpointing=ev.shape.checkpointing,
        compiled_blocks=compiles_blocks(ev.shape, ev.cand),
        gpu_memory_bytes=p.acc.memory_bytes,
        headroom=round(1 - ev.device_need / p.acc.memory_bytes, 4),
        estimated_step_seconds=round(step, 6),
        tokens_per_second=round(tokens / step, 3) if step else 0.0,
        gpu_hours=round((tr.max_steps or 0) * step * launch_n / 3600, 6),
        reason=reason,
        memory=b,
        candidates_evaluated=evaluated,
        architecture=p.model.arch,
        load_peak_bytes=_load_peak(p.model, ev, _striped_world(p.spec, ev, launch_n)),
        checkpoint_bytes=checkpoint_bytes(p.model, ev.shape),
    )


def plan_job(
    spec: FineTuneJobSpec, strategies: StrategyTable = STRATEGIES, *, compile_blocks: bool = True
) -> Plan:
    """Plan a FineTuneJob: world size, strategy, micro-batch, checkpointing and memory.

    Raises PlanningError(field, message) for inputs no configuration can satisfy; returns a
    Plan with fits=False (and a reason saying what was tried and what would fit) when the
    inputs are valid but nothing fits. `strategies`: the table of strategies (which ones
    the trainer implements decides what `backend: auto` searches).
    """
    p = build_problem(spec, strategies, compile_blocks=compile_blocks)
    result, launch_n = _search(p)
    if result.best is not None:
        best = result.best
        n = launch_n or best.cand.world_size
        plan = _to_plan(p, best, True, "", n, result.evaluated)
        fixed = launch_n is not None
        objective = "fewest-gpus" if fixed else resolve_objective(spec)
        reason = explain_choice(p, result, best, plan, objective)
        return plan.model_copy(
            update={"reason": reason, "objective": "fixed" if fixed else objective}
        )
    if result.smallest is None:
        raise PlanningError(
            "spec.training.microBatchSize",
            "no micro-batch size divides the per-rank batch at any world size",
        )
    smallest = result.smallest
    n = launch_n or smallest.cand.world_size
    reason = explain_refusal(p, result, hint_problem=_hint_search)
    return _to_plan(p, smallest, False, reason, n, result.evaluated)


def _hint_search(p: Problem, **changes: object) -> Evaluated | None:
    """The first fitting configuration when the spec is changed as `changes` say
    (method, offload, sync checkpoint saves, unbounded GPU count), for the refusal's
    suggestions."""
    spec = p.spec
    # Resources first: the spec is re-validated below, and the hint drops the GPU bounds.
    res = spec.resources.model_copy(update={"min_nodes": None, "max_nodes": None})
    if changes.get("unbounded", True):
        res = res.model_copy(update={"max_gpus": None})
    spec = spec.model_copy(update={"resources": res})
    method = changes.get("method")
    if method is not None:
        spec = spec.model_copy(
            update={
                "method": spec.method.model_copy(
                    update={"type": method, "lora": spec.method.lora or None}
                )
            }
        )
        spec = FineTuneJobSpec.model_validate(spec.model_dump(by_alias=True))
    if changes.get("offload"):
        spec = spec.model_copy(
            update={"strategy": spec.strategy.model_copy(update={"offload": "cpu", "type": "auto"})}
        )
    if changes.get("sync_saves"):
        ck = spec.checkpoint.model_copy(update={"async_": False, "device_snapshot": False})
        spec = spec.model_copy(update={"checkpoint": ck})
    if spec.training.activation_checkpointing == "none":
        training = spec.training.model_copy(update={"activation_checkpointing": "auto"})
        spec = spec.model_copy(update={"training": training})
    q = replace(
        build_problem(spec, p.strategies, compile_blocks=p.base.compile_blocks),
        host_budget=p.host_budget,
        strict_batch=not changes.get("unbounded"),
    )
    if not checkpoint_modes(q):
        return None
    return run_search(q, world_sizes(q)).best
