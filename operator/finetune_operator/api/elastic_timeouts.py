"""The elastic re-form's waits, derived per job (pure): the torchrun rendezvous last call and
the collective timeouts of the trainer's process groups.

Both the operator (the worker command's `--rdzv-conf`) and the trainer (its process groups)
derive them here from the same job.json (spec + plan), so they can never disagree. Inputs: the
plan's modelled step time, its checkpoint size, the weights a node loads, whether the blocks
are compiled, the final-save grace period and the checkpoint settings. Each has a floor and a
ceiling, and the user may set any of them under `spec.faultTolerance`.

- **Last call** (`rendezvousLastCallSeconds`): once `minNodes` agents joined a round, how long
  more may join. Where `minNodes < maxNodes`, surviving agents rejoin only after their workers
  stopped: a stopping worker finishes its step and saves a final checkpoint (at most the grace
  period; torchrun SIGKILLs it 30 s after SIGTERM). A last call shorter than that closes the
  round with the first arrivals and the survivors force a second re-form: a second cold start.
  Longer costs the same seconds once per real shrink (a node lost for good).
- **Steady collective timeout** (`collectiveTimeoutSeconds`): how long a training collective
  waits for a peer once the run is warm. It is what a *silent* peer loss (power loss, network
  partition: sockets stay open) costs before the survivors fail and re-form. A few step times:
  the step model's error, a straggler and (NCCL) the host running ahead of the GPU's queue stay
  inside it; at least a minute, so that a GC pause or a data-loading hiccup is not a lost node.
- **Startup collective timeout** (`startupCollectiveTimeoutSeconds`): process-group creation,
  loading weights and checkpoints, the first steps (torch.compile of the blocks, lazy
  initialisation), the steps around a checkpoint save (rank 0 commits and purges) and the
  export. It only matters on a peer lost in those phases, so it is generous.
- **Checkpoint group timeout**: the dedicated group DCP saves and loads on; its collectives
  wait for the slowest rank's write (or read) of its share, so it grows with the checkpoint.

What a node reads to resume (`node_resume_read_bytes`) depends on how the backend saved and
loads the state, not just on the checkpoint's size over the nodes: DCP reads a saved chunk
whole, so a rank reads every chunk overlapping what it holds.
- DDP (replicated): every rank loads the whole state: `checkpointBytes` per rank.
- FSDP2 and DeepSpeed ZeRO-3 (each rank holds 1/world of every tensor, saved as a chunk per
  rank: finetune_trainer.deepspeed_layout): at the world it saved at, a rank reads its own
  chunks, `T/M`; an elastic job re-formed at another world reads the chunks overlapping its
  share, at most `T/M + T/N`, N the smallest other world within `minNodes..maxNodes`.
- FSDP hybrid: sharded within a node, so each node reads the whole state once.
- DeepSpeed ZeRO-1/2: a rank reads whole the tensors of the parameters in its fp32 partition:
  `T/M` plus those across its partition's boundaries, allowed for as one more share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

from finetune_operator.api.constants import FINAL_SAVE_GRACE_SECONDS, TORCHRUN_STOP_SECONDS
from finetune_operator.api.plan import Plan
from finetune_operator.api.spec import FineTuneJobSpec
from finetune_operator.api.strategies import STRATEGIES

# torch 2.13's c10d rendezvous default is 30 s; we had 5 s for every job.
LAST_CALL_FLOOR_S: Final = 5.0
# Agent side of a rejoin: its monitor notices the waiting node (0.1 s polls), the worker reaches
# its stop point (the step's sync), the process exits, the agent rejoins the store.
WORKER_STOP_SLACK_S: Final = 5.0
LAST_CALL_CEILING_S: Final = TORCHRUN_STOP_SECONDS + WORKER_STOP_SLACK_S
# Steady: a few modelled (or measured) step times, never below a minute, never above the old
# fixed value (torch's NCCL default), and at most half the operator's hang timeout (unless that
# is below the floor), so that survivors fail and re-form by themselves before the operator
# restarts everything.
STEADY_STEP_MULTIPLE: Final = 5.0
STEADY_FLOOR_S: Final = 60.0
STEADY_CEILING_S: Final = 600.0
HANG_SHARE: Final = 0.5
# Startup: the old fixed 600 s (which covered everything) plus what the job makes longer.
STARTUP_BASE_S: Final = 600.0
STARTUP_CEILING_S: Final = 3600.0
# torch.compile of the decoder blocks on the first step (one graph shared by all blocks,
# forward and backward): minutes on an 8B model.
COMPILE_ALLOWANCE_S: Final = 300.0
# What one node reads or writes per second from the job's storage (a network volume or an
# object store), deliberately low: an underestimate only makes a timeout longer.
NODE_STORAGE_BYTES_PER_S: Final = 1e9
CHECKPOINT_SAVE_MULTIPLE: Final = 3.0
CHECKPOINT_CEILING_S: Final = 7200.0


@dataclass(frozen=True)
class CollectiveTimeouts:
    """Seconds a collective may wait, per phase of a run (see the module docstring)."""

    startup: float
    steady: float
    checkpoint: float
    steady_fixed: bool  # the user set it: the trainer's measured step time does not change it


def _clamp(value: float, low: float, high: float) -> float:
    return min(high, max(low, value))


def node_checkpoint_seconds(plan: Plan) -> float:
    """Modelled time for one node to write (or read) its share of a checkpoint."""
    per_node = plan.checkpoint_bytes / max(1, plan.nodes)
    return per_node / NODE_STORAGE_BYTES_PER_S


def rank_resume_read_bytes(spec: FineTuneJobSpec, plan: Plan) -> float:
    """What one rank reads from storage to resume (see the module docstring), at most the
    whole checkpoint."""
    total = float(plan.checkpoint_bytes)
    row = STRATEGIES.effective(STRATEGIES.resolve(plan.strategy, plan.backend))
    world = plan.world_size
    if row.replicated:
        return total
    if row.shard_within_node:
        return total / plan.gpus_per_node
    if row.shards_params:
        # At the world it was saved at, a rank reads its own chunks; an elastic job re-formed
        # at another world also reads the parts of the saved chunks around its share: at most
        # one more chunk, as large as the smallest other world the job may have saved at.
        r = spec.resources
        low, high = r.min_nodes or plan.nodes, max(r.max_nodes or plan.nodes, plan.nodes)
        others = [n * plan.gpus_per_node for n in range(low, high + 1) if n != plan.nodes]
        return min(total, total / world + (total / min(others) if others else 0.0))
    return min(total, 2 * total / world)  # ZeRO-1/2: its share and the boundary tensors


def node_resume_read_bytes(spec: FineTuneJobSpec, plan: Plan) -> float:
    """What one node's ranks together read from storage to resume."""
    return rank_resume_read_bytes(spec, plan) * plan.gpus_per_node


def node_resume_seconds(spec: FineTuneJobSpec, plan: Plan) -> float:
    """Modelled time for one node to read what its ranks resume from."""
    return node_resume_read_bytes(spec, plan) / NODE_STORAGE_BYTES_PER_S


def worker_stop_seconds(spec: FineTuneJobSpec, plan: Plan) -> float:
    """How long a worker told to stop takes to exit: the step in flight, then its final
    checkpoint; the grace period (counted from the signal) cuts the save, torchrun's SIGKILL
    everything."""
    step = plan.estimated_step_seconds
    if not spec.checkpoint.enabled:
        return min(TORCHRUN_STOP_SECONDS, step)
    stop = max(step, min(step + node_checkpoint_seconds(plan), FINAL_SAVE_GRACE_SECONDS))
    return min(TORCHRUN_STOP_SECONDS, stop)


def rendezvous_last_call_seconds(spec: FineTuneJobSpec, plan: Plan) -> int:
    """The c10d rendezvous `last_call_timeout` (whole seconds, as torchrun parses it)."""
    fixed = spec.fault_tolerance.rendezvous_last_call_seconds
    if fixed is not None:
        return fixed
    derived = worker_stop_seconds(spec, plan) + WORKER_STOP_SLACK_S
    return math.ceil(_clamp(derived, LAST_CALL_FLOOR_S, LAST_CALL_CEILING_S))


def steady_collective_seconds(
    spec: FineTuneJobSpec, plan: Plan, measured_step_seconds: float | None = None
) -> float:
    """The training group's timeout once warm: `STEADY_STEP_MULTIPLE` times the slower of the
    modelled and the measured step (the model can be off on other hardware or interconnects)."""
    fixed = spec.fault_tolerance.collective_timeout_seconds
    if fixed is not None:
        return float(fixed)
    step = max(plan.estimated_step_seconds, measured_step_seconds or 0.0)
    hang_share = HANG_SHARE * spec.fault_tolerance.hang_timeout_seconds
    # The floor wins over the hang share: a hang timeout set below two minutes asks the
    # operator to act first, not for collectives that fail at a GC pause.
    ceiling = min(STEADY_CEILING_S, max(STEADY_FLOOR_S, hang_share))
    return _clamp(STEADY_STEP_MULTIPLE * step, STEADY_FLOOR_S, ceiling)


def startup_collective_seconds(spec: FineTuneJobSpec, plan: Plan) -> float:
    """Process-group creation, loading and the first steps (whole seconds)."""
    fixed = spec.fault_tolerance.startup_collective_timeout_seconds
    if fixed is not None:
        return float(fixed)
    # What a node loads before its first collective can complete: the weights (each local
    # rank's load peak holds its shard plus a whole module: an overestimate) or a checkpoint.
    load_bytes = max(plan.load_peak_bytes * plan.gpus_per_node, node_resume_read_bytes(spec, plan))
    derived = STARTUP_BASE_S + load_bytes / NODE_STORAGE_BYTES_PER_S
    if plan.compiled_blocks:
        derived += COMPILE_ALLOWANCE_S
    return round(_clamp(derived, STARTUP_BASE_S, STARTUP_CEILING_S))


def collective_timeouts(
    spec: FineTuneJobSpec, plan: Plan, measured_step_seconds: float | None = None
) -> CollectiveTimeouts:
    steady = steady_collective_seconds(spec, plan, measured_step_seconds)
    # Never shorter than steady: a user's long steady timeout holds in every phase.
    startup = max(startup_collective_seconds(spec, plan), steady)
    # Its collectives wait for the slowest node's write of its share, or read at a resume.
    transfer = max(node_checkpoint_seconds(plan), node_resume_seconds(spec, plan))
    checkpoint = round(_clamp(CHECKPOINT_SAVE_MULTIPLE * transfer, startup, CHECKPOINT_CEILING_S))
    return CollectiveTimeouts(
        startup=startup,
        steady=steady,
        checkpoint=max(checkpoint, startup),
        steady_fixed=spec.fault_tolerance.collective_timeout_seconds is not None,
    )
