"""DESIGN §4 search: the configurations that fit with headroom, chosen by the job's objective
(fewest GPUs then fastest, as DESIGN §4 says; fastest within maxGPUs; or fewest GPU-hours).

Order of enumeration: world sizes ascending (1..gpusPerNode, then whole nodes up to maxGPUs),
strategies by communication cost, micro-batches ascending (memory grows with it, so the first
that does not fit ends that row), checkpointing off before on. Pure: no clocks, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from finetune_operator.api.limits import MAX_NODES
from finetune_operator.api.spec import FineTuneJobSpec, Objective
from finetune_operator.api.storage import is_object_store_uri
from finetune_operator.api.strategies import STRATEGIES, Strategy, StrategyTable
from finetune_operator.planner.architecture import ModelShape
from finetune_operator.planner.checkpoint_memory import SaveMemory, save_memory
from finetune_operator.planner.configuration import PRECISION_BYTES, Candidate, TrainingShape
from finetune_operator.planner.export_memory import export_host_bytes
from finetune_operator.planner.hardware import Accelerator, runtime_host_bytes
from finetune_operator.planner.loading import weights_read_host_bytes, zero_resume_host_bytes
from finetune_operator.planner.memory import MemoryEstimate, estimate_memory
from finetune_operator.planner.model_states import (
    checkpoint_largest_tensor_bytes,
    checkpoint_state_bytes,
)
from finetune_operator.planner.steptime import step_seconds

# DESIGN §4: a plan must leave at least this share of GPU memory free.
MIN_HEADROOM = 0.10
# Without resources.maxGPUs the search stops at this many nodes.
DEFAULT_MAX_NODES = 64


@dataclass(frozen=True)
class Problem:
    """Everything the search needs, validated and resolved from the spec."""

    spec: FineTuneJobSpec
    model: ModelShape
    acc: Accelerator
    base: TrainingShape  # micro_batch_size/checkpointing/accumulation filled per candidate
    host_budget: int
    # False only for the refusal's "how many GPUs would it take" hint: world sizes need not
    # divide the global batch (the hint then says to change it).
    strict_batch: bool = True
    # Which strategies exist, how they shard, which the trainer runs (api.strategies).
    strategies: StrategyTable = STRATEGIES


@dataclass(frozen=True)
class Evaluated:
    row: Strategy  # the strategy as planned (name, backend)
    cand: Candidate
    shape: TrainingShape
    est: MemoryEstimate
    fits: bool
    step_s: float
    # Host RAM a resume adds beside the offloaded states (DeepSpeed on a GPU: one read group).
    resume_host_bytes: int = 0
    # The process's runtime on the host (GPU jobs; on CPU it is in the device total).
    runtime_host_bytes: int = 0
    device_fits: bool = True  # the device holds it (fits also needs the host to)
    # What the device must hold: the breakdown's total on a GPU; on CPU, where the device is
    # the host, with the offloaded states and a resume's read group (0: the breakdown's total).
    device_bytes: int = 0
    # What a checkpoint save holds (checkpoint_memory); on CPU counted in device_bytes.
    save: SaveMemory = field(default_factory=SaveMemory)
    # Host RAM a GPU job's load of object-store weights holds: the ranged reads in flight
    # (loading.ranged_read_bytes; on CPU in the load peak, which is the same memory).
    load_host_bytes: int = 0
    # Host RAM rank 0's export holds at the end (export_memory; on CPU in device_bytes),
    # and the processes of its pod whose budgets it is spread over (export_share).
    export_bytes: int = 0
    export_ranks: int = 1

    @property
    def export_share(self) -> int:
        return -(-self.export_bytes // max(1, self.export_ranks))

    @property
    def device_need(self) -> int:
        return self.device_bytes or self.est.breakdown.total

    @property
    def save_host_bytes(self) -> int:
        return self.save.host_peak if self.cand.cuda else 0

    @property
    def host_need(self) -> int:
        # On CPU the offloaded states are in the device's need (evaluate): counted once.
        offloaded = self.est.host_bytes if self.cand.cuda else 0
        # Phases, one after the other, never together: the weights are read, then a resume's
        # read group is read and freed, all before the first step; the staging buffer is
        # allocated after it (dcp_checkpointer.prepare) and freed before the export gathers
        # the model (trainer.py). The largest counts, not the sum. The export is rank 0's
        # (export_share: spread over its pod's processes, whose budgets are one cgroup's).
        export = self.export_share if self.cand.cuda else 0
        phases = max(self.load_host_bytes, self.resume_host_bytes, self.save_host_bytes, export)
        return offloaded + phases + self.runtime_host_bytes


def memory_limit(acc: Accelerator) -> float:
    return acc.memory_bytes * (1 - MIN_HEADROOM)


def strategies_for(p: Problem, n: int) -> list[Strategy]:
    """Candidate strategies at world size n, honouring pins, backend and offload
    (StrategyTable.searched says which rows each backend searches)."""
    st = p.spec.strategy
    if st.type != "auto":
        return [p.strategies.resolve(st.type, st.backend)]
    out: list[Strategy] = []
    for row in p.strategies.searched(st.backend):
        if p.spec.method.type == "qlora" and not row.replicated:
            continue  # FSDP cannot shard bitsandbytes 4-bit weights: QLoRA runs replicated.
        if p.spec.training.optimizer not in row.optimizers:
            continue
        if row.shard_within_node and n <= p.spec.resources.gpus_per_node:
            continue  # one node: hybrid is full shard.
        if st.offload != "none" and not row.offloadable:
            continue
        if st.offload != "none" and row.shards_params and not row.reshard_after_forward:
            # Parameters kept gathered from forward to backward stay on the GPU all step:
            # offloading their shards saves little and costs the transfers (pin it to get it).
            continue
        if n == 1 and not row.replicated and st.offload == "none":
            continue  # one rank: nothing to shard.
        out.append(row)
    return out


def divisors(n: int) -> list[int]:
    """Divisors of n, ascending, in O(sqrt n): batches are bounded (api.limits) but large."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _replicas(row: Strategy, cand: Candidate) -> int:
    """Ranks holding the same checkpoint state, whose writing DCP spreads over them: DDP's
    replicas, hybrid sharding's copies of a shard; DeepSpeed's chunks are all distinct."""
    if row.backend == "deepspeed":
        return 1
    if row.replicated:
        return cand.world_size
    return cand.world_size // cand.shard_size if row.shards_params else 1


def _weights_reads(p: Problem, row: Strategy, shape: TrainingShape, cand: Candidate) -> int:
    """Host bytes of the ranged reads of pretrained weights on an object store, for the loads
    that read them through DCP (finetune_trainer.pretrained, replica_loading); QLoRA's and
    ZeRO-3's loaders read one tensor or module at a time (remote_tensors): not counted."""
    uri = p.spec.model.weights_location()
    remote = p.spec.model.source == "uri" and uri is not None and is_object_store_uri(uri)
    if (
        not remote
        or shape.method == "qlora"
        or (row.backend == "deepspeed" and row.zero_stage == 3)
    ):
        return 0
    # The replica's dtype, as planning._load_peak reads it: DDP's fp32 masters for a full
    # fine-tune (else the frozen base's dtype); DeepSpeed's partitions in the precision's.
    e = PRECISION_BYTES[shape.precision]
    if row.backend != "deepspeed" and (shape.method == "full" or shape.precision == "fp32"):
        e = 4
    return weights_read_host_bytes(
        p.model,
        shard_size=cand.shard_size if row.shards_params else 1,
        striped_world=1 if row.shards_params else cand.world_size,
        element_bytes=e,
    )


def evaluate(
    p: Problem,
    n: int,
    row: Strategy,
    micro_batch_size: int,
    ckpt: bool,
    mem_world: int | None = None,
) -> Evaluated:
    """One configuration: memory at `mem_world` ranks (elastic minimum), time at `n`."""
    gpn = p.spec.resources.gpus_per_node
    global_batch = p.spec.training.global_batch_size
    # zero3 on the fsdp backend allocates (and runs) as FSDP full shard does.
    ms = p.strategies.effective(row).name
    mem_n = mem_world or n
    shape = replace(
        p.base,
        micro_batch_size=micro_batch_size,
        checkpointing=ckpt,
        grad_accumulation=max(1, global_batch // (mem_n * micro_batch_size)),
    )
    cand = Candidate(ms, mem_n, gpn, p.spec.strategy.offload, p.acc.cuda)
    est = estimate_memory(p.model, shape, cand)
    resume = (
        zero_resume_host_bytes(p.model, shape)
        if row.backend == "deepspeed" and p.spec.checkpoint.enabled
        else 0
    )
    ck = p.spec.checkpoint
    state = checkpoint_state_bytes(p.model, shape, cand)
    save = save_memory(
        state,
        on_host=min(state, est.host_bytes) if p.acc.cuda else 0,
        replicas=_replicas(row, cand),
        largest_tensor=checkpoint_largest_tensor_bytes(p.model, shape, cand),
        enabled=ck.enabled,
        async_=ck.async_,
        cuda=p.acc.cuda,
        deepspeed=row.backend == "deepspeed",
        object_store=is_object_store_uri(ck.uri),
        device_snapshot=ck.device_snapshot,
    )
    out = p.spec.output
    export = export_host_bytes(
        p.model,
        shape,
        enabled=out is not None and out.uri is not None,
        deepspeed=row.backend == "deepspeed",
        merge=out is not None and out.merge_lora and shape.method != "full",
        # On a CPU device a replicated torch model's gathered entries are its parameters.
        copied=p.acc.cuda or row.backend == "deepspeed" or not row.replicated,
    )
    # The plan budgets every process alike (resources.memory / gpusPerNode), but the pod's
    # memory limit is one cgroup for all of its processes. On the torch path only rank 0
    # gathers (the others get an empty dict and hold their resident states, no save phase
    # left), so rank 0's pod holds gpn x (its states) + the export: a 1/gpn share of it per
    # process is exact for that pod, conservative for the others. DeepSpeed's gather
    # (deepspeed_checkpoint.gather_module_state_dict) keeps its copies on every rank: whole.
    export_ranks = 1 if row.backend == "deepspeed" else gpn
    export_share = -(-export // export_ranks)
    b = est.breakdown
    if p.acc.cuda:
        device_need = b.total + save.device_snapshot
    else:
        # On CPU the device memory is the host's (one budget per process: resources.memory
        # over its processes), so each byte is counted once, in it: the states DeepSpeed
        # offloads to its host buffers (FSDP2 offloads nothing on CPU: Candidate.offloads)
        # beside everything else, and the resume's group beside the resident model states (it
        # is freed before the first step, whose transients it never meets). Checked apart, the
        # two halves each fit the budget while their sum did not. A save's memory joins the
        # step's peak when its write overlaps the steps (async), else the resident states
        # between steps. The export comes after the last save, its staging freed (trainer.py),
        # beside the resident states.
        # The runtime (total less reserved: the process's Python/torch) is there between
        # steps too.
        resident = b.parameters + b.gradients + b.optimizer + b.total - b.reserved
        step_save = save.host_peak if save.during_step else 0
        between = max(resume, export_share, 0 if save.during_step else save.host_peak)
        device_need = est.host_bytes + max(b.total + step_save, resident + between)
        resume = 0  # counted in the device's need (Evaluated.host_need: once)
    runtime = runtime_host_bytes(gpn) if p.acc.cuda else 0
    device_fits = device_need <= memory_limit(p.acc)
    load_host = _weights_reads(p, row, shape, cand) if p.acc.cuda else 0
    run_shape = replace(shape, grad_accumulation=max(1, global_batch // (n * micro_batch_size)))
    step = step_seconds(p.model, run_shape, replace(cand, world_size=n), p.acc, global_batch)
    placed = replace(cand, strategy=row.name)
    ev = Evaluated(
        row, placed, shape, est, False, step, resume, runtime, device_fits, device_need, save,
        load_host, export, export_ranks,
    )  # fmt: skip
    # The host's need is Evaluated.host_need's one formula (its phases' max), not a copy.
    return replace(ev, fits=device_fits and ev.host_need <= p.host_budget)


def micro_batch_sizes(p: Problem, per_rank: int) -> list[int]:
    micro_batch_size = p.spec.training.micro_batch_size
    if isinstance(micro_batch_size, int):
        return [micro_batch_size] if per_rank % micro_batch_size == 0 else []
    return divisors(per_rank)


def checkpoint_modes(p: Problem) -> list[bool]:
    mode = p.spec.training.activation_checkpointing
    return {"none": [False], "full": [True]}.get(mode, [False, True])


@dataclass
class SearchResult:
    best: Evaluated | None
    smallest: Evaluated | None  # lowest total among everything tried (for refusals)
    tried: dict[int, float]  # world size -> smallest total there
    evaluated: int = 0
    # The least host RAM per process among configurations the device holds (for refusals).
    least_host: Evaluated | None = None


def search_at(
    p: Problem,
    n: int,
    result: SearchResult,
    mem_world: int | None = None,
    launch: int | None = None,
) -> list[Evaluated]:
    """Every fitting configuration at world size n (memory at mem_world when elastic)."""
    fitting: list[Evaluated] = []
    run_n = launch or n
    per_rank = max(1, p.spec.training.global_batch_size // (mem_world or n))
    for row in strategies_for(p, n):
        for ckpt in checkpoint_modes(p):
            for micro_batch_size in micro_batch_sizes(p, per_rank):
                ev = evaluate(p, run_n, row, micro_batch_size, ckpt, mem_world or n)
                result.evaluated += 1
                total = ev.device_need
                if result.smallest is None or total < result.smallest.device_need:
                    result.smallest = ev
                result.tried[n] = min(result.tried.get(n, total), total)
                least = result.least_host
                if ev.device_fits and (least is None or ev.host_need < least.host_need):
                    result.least_host = ev
                if not ev.fits:
                    break  # larger micro-batches only need more memory
                fitting.append(ev)
    return fitting


def world_sizes(p: Problem) -> list[int]:
    """1..gpusPerNode, then whole nodes, up to maxGPUs/maxNodes; each must divide the batch.

    The candidates are the divisors of the global batch, not a range up to maxGPUs: the cost
    of a plan depends on the batch's divisor count (at most 240 within api.limits), never on
    how many GPUs the spec allows, so no manifest can make the operator's reconcile loop
    build a list of 10^8 world sizes. Only the refusal hint (strict_batch False) ignores the
    batch, and it is bounded by DEFAULT_MAX_NODES whole nodes.
    """
    res = p.spec.resources
    gpn = res.gpus_per_node
    # A plan never launches more worker pods than the API allows (the CRD bounds maxNodes).
    max_gpus = min(res.max_gpus or DEFAULT_MAX_NODES * gpn, (res.max_nodes or MAX_NODES) * gpn)
    if p.strict_batch:
        candidates = divisors(p.spec.training.global_batch_size)
    else:
        top = min(max_gpus, DEFAULT_MAX_NODES * gpn)
        candidates = list(range(1, gpn + 1)) + list(range(2 * gpn, top + 1, gpn))
    return [n for n in candidates if n <= max_gpus and (n <= gpn or n % gpn == 0)]


def fastest(fitting: list[Evaluated]) -> Evaluated:
    return min(fitting, key=lambda ev: ev.step_s)


def resolve_objective(spec: FineTuneJobSpec) -> Objective:
    """`auto`: fastest when the user bounded the GPUs (maxGPUs says what they will spend),
    else fewest GPUs (without a bound, "fastest" would mean as many GPUs as exist)."""
    obj = spec.resources.objective
    if obj != "auto":
        return obj
    return "fastest" if spec.resources.max_gpus is not None else "fewest-gpus"


def _gpu_seconds(ev: Evaluated) -> float:
    return ev.step_s * ev.cand.world_size


def choose(fitting: list[Evaluated], objective: Objective) -> Evaluated:
    """The best of `fitting` for `objective`; ties go to fewer GPUs, then the faster one."""
    if objective == "lowest-cost":
        return min(fitting, key=lambda ev: (_gpu_seconds(ev), ev.cand.world_size, ev.step_s))
    if objective == "fastest":
        return min(fitting, key=lambda ev: (ev.step_s, ev.cand.world_size))
    return min(fitting, key=lambda ev: (ev.cand.world_size, ev.step_s))


def run_search(p: Problem, sizes: list[int], objective: Objective = "fewest-gpus") -> SearchResult:
    """fewest-gpus stops at the first size with a fitting configuration and takes its fastest;
    fastest and lowest-cost compare every size up to the bound."""
    result = SearchResult(best=None, smallest=None, tried={})
    fitting: list[Evaluated] = []
    for n in sizes:
        fitting.extend(search_at(p, n, result))
        if fitting and objective == "fewest-gpus":
            break
    if fitting:
        result.best = choose(fitting, objective)
    return result
