"""The DeepSpeed config of a job: generated from its plan, merged with the user's own keys.

Pure functions (no deepspeed import, no I/O): the operator renders the config into the job's
ConfigMap beside job.json (`deepspeed.json`, at the planned world size) so a user can read
it, and the trainer builds the one it runs with at the world size it actually has (an elastic
re-form changes the accumulation), logging the keys of the user's config it overrode.

Three layers, later ones winning:
1. trainer defaults (`_defaults`): settings the plan does not decide (loss-scaling window,
   overlap_comm, ...). The user may change them.
2. the user's `spec.strategy.deepspeedConfig`, minus the sections the trainer owns
   (`TRAINER_OWNED`: the optimizer and schedule come from spec.training, checkpoints from
   spec.checkpoint).
3. the plan (`_plan_owned`): batch shape, ZeRO stage, offload, precision, clipping and the
   bucket sizes the planner's memory model assumed. A user value that differs is overridden
   and reported: the plan's memory estimate is only true for the plan's settings.
The user's hpZ group size (`HPZ_KEY`) is kept (the planner counts it) except at a world size
it cannot group (`hpz_group`): there it is set to 1 and reported as overridden.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from finetune_operator.api.plan import Plan
from finetune_operator.api.spec import FineTuneJobSpec, StrategyName
from finetune_operator.api.strategies import STRATEGIES

DEEPSPEED_CONFIG_FILE_NAME = "deepspeed.json"
# DeepSpeed's reduce_bucket_size / allgather_bucket_size default, in elements: the config sets
# it and finetune_operator.planner.memory counts it for ZeRO's gradient bucket (one constant).
ZERO_BUCKET_ELEMENTS = 500_000_000
# A DeepSpeed resume reads the checkpoint's fp32 tensors (master weights, optimizer states) in
# groups of at most this many bytes per rank, or of the largest one tensor when that is larger
# (finetune_trainer.deepspeed_resume); the planner counts the same figure on the host.
RESUME_CHUNK_BYTES = 1 << 30


def resume_chunk_budget(largest_tensor_bytes: int, cap: int = RESUME_CHUNK_BYTES) -> int:
    """Host bytes one group of a DeepSpeed resume may hold: `cap`, or one tensor if larger
    (a tensor is read whole: DCP reads a saved tensor as one item)."""
    return max(cap, largest_tensor_bytes)


# Sections of a user config that the trainer owns through the spec: dropped (and reported).
TRAINER_OWNED = (
    "optimizer",  # spec.training.optimizer / learningRate / weightDecay
    "scheduler",  # spec.training.schedule / warmupSteps
    "amp",  # spec.training.precision
    "torch_autocast",  # spec.training.precision
    "checkpoint",  # spec.checkpoint (the trainer's committed DCP checkpoints)
    "elasticity",  # spec.resources minNodes/maxNodes (torchrun elastic)
)
# ZeRO++'s hierarchical partitioning (hpZ): ZeRO-3 keeps, beside each rank's partition over
# the world, a secondary copy of the parameters partitioned over groups of this many ranks
# (a node), so that the forward's and backward's gathers stay within the group. Taken from the
# user's config; the planner counts the copy (planner/zero.py).
HPZ_KEY = "zero_hpz_partition_size"
# Printed every N steps by DeepSpeed itself: the trainer logs its own step lines.
_QUIET_STEPS = 10**9


def hpz_partition_size(user: dict[str, Any] | None) -> int:
    """The hpZ group size the user's config asks for (`zero_optimization.
    zero_hpz_partition_size`, validated by StrategySpec); 1 (none) when unset."""
    zero = (user or {}).get("zero_optimization")
    size = zero.get(HPZ_KEY, 1) if isinstance(zero, dict) else 1
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 1 else 1


def hpz_group(size: int, world: int) -> int:
    """The hpZ group DeepSpeed forms at `world` ranks: `min(size, world)`, which must divide
    the world (DeepSpeed asserts it); 1 (no hpZ) where it does not, e.g. after an elastic
    re-form to a world of another shape."""
    group = min(size, world)
    return group if group > 1 and world % group == 0 else 1


def uses_deepspeed(plan: Plan) -> bool:
    """Whether the plan runs on the DeepSpeed backend (its strategy table row)."""
    return STRATEGIES.resolve(plan.strategy, plan.backend).backend == "deepspeed"


def zero_stage(strategy: StrategyName) -> int:
    row = STRATEGIES.resolve(strategy, "deepspeed")
    if row.backend != "deepspeed":
        raise ValueError(f"strategy {strategy!r} is not a DeepSpeed ZeRO strategy")
    return row.zero_stage


def _defaults(spec: FineTuneJobSpec, plan: Plan) -> dict[str, Any]:
    stage = zero_stage(plan.strategy)
    # overlap_comm: ZeRO-3's default, on a GPU (side streams). On the CPU accelerator there are
    # no streams to overlap on, and it made a ZeRO-3 offload step ~8x slower (0.4 s -> 3.5 s).
    overlap = stage == 3 and plan.device == "gpu"
    zero: dict[str, Any] = {"contiguous_gradients": True, "overlap_comm": overlap}
    config: dict[str, Any] = {
        "steps_per_print": _QUIET_STEPS,
        "wall_clock_breakdown": False,
        # The trainer hands DeepSpeed a torch AdamW/SGD built from spec.training.
        "zero_allow_untested_optimizer": True,
        # Offload with torch's AdamW on the host: DeepSpeedCPUAdam needs a compiled op
        # (DS_BUILD_OPS=0 installs none).
        "zero_force_ds_cpu_optimizer": False,
        "zero_optimization": zero,
    }
    if spec.training.precision == "fp16":
        # Dynamic loss scaling: start at 2^16, halve on overflow (after `hysteresis` of them),
        # double after `loss_scale_window` clean steps.
        config["fp16"] = {
            "loss_scale": 0,
            "initial_scale_power": 16,
            "loss_scale_window": 1000,
            "hysteresis": 2,
            "min_loss_scale": 1,
        }
    return config


def _plan_owned(
    spec: FineTuneJobSpec, plan: Plan, world_size: int, grad_accum: int
) -> dict[str, Any]:
    stage = zero_stage(plan.strategy)
    precision = spec.training.precision
    zero: dict[str, Any] = {
        "stage": stage,
        "reduce_bucket_size": ZERO_BUCKET_ELEMENTS,
    }
    if stage < 3:
        zero["allgather_bucket_size"] = ZERO_BUCKET_ELEMENTS
    pin = plan.device == "gpu"  # pinned host memory only helps (and only exists) with a GPU
    if plan.offload == "cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    else:
        zero["offload_optimizer"] = {"device": "none"}
        if stage == 3:
            zero["offload_param"] = {"device": "none"}
    micro = plan.micro_batch_size
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": micro * grad_accum * world_size,
        "gradient_clipping": float(spec.training.max_grad_norm),
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16"},
        "zero_optimization": zero,
    }


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """`top` over `base`, recursively for nested objects."""
    out = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _contradictions(user: dict[str, Any], plan: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys the user set to something other than what the plan says."""
    found: list[str] = []
    for key, mine in plan.items():
        if key not in user:
            continue
        theirs, name = user[key], f"{prefix}{key}"
        if isinstance(mine, dict) and isinstance(theirs, dict):
            found += _contradictions(theirs, mine, f"{name}.")
        elif isinstance(mine, dict) or isinstance(theirs, dict) or not _same(theirs, mine):
            found.append(name)
    return found


def _same(a: Any, b: Any) -> bool:
    # DeepSpeed reads "5e8" (a float) and 500000000 alike; "auto" means "what the plan says".
    if a == "auto":
        return True
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return float(a) == float(b)
    return bool(a == b)


def merge_user_config(
    generated: dict[str, Any], plan_owned: dict[str, Any], user: dict[str, Any] | None
) -> tuple[dict[str, Any], list[str]]:
    """(effective config, the user's keys it overrode, dotted and sorted). `generated` is
    defaults + plan; the user's keys go between the two layers (module docstring)."""
    if not user:
        return copy.deepcopy(generated), []
    dropped = sorted(k for k in user if k in TRAINER_OWNED)
    kept = {k: v for k, v in user.items() if k not in TRAINER_OWNED}
    merged = _merge(_merge(generated, kept), plan_owned)
    return merged, sorted(dropped + _contradictions(kept, plan_owned))


def deepspeed_config(
    spec: FineTuneJobSpec, plan: Plan, *, world_size: int, grad_accum: int
) -> tuple[dict[str, Any], list[str]]:
    """The DeepSpeed config this plan runs with at `world_size` ranks and `grad_accum`
    micro-batches per step, with `spec.strategy.deepspeedConfig` merged in; and the user's
    keys that were overridden (or dropped as trainer-owned)."""
    plan_owned = _plan_owned(spec, plan, world_size, grad_accum)
    generated = _merge(_defaults(spec, plan), plan_owned)
    config, overridden = merge_user_config(generated, plan_owned, spec.strategy.deepspeed_config)
    hpz = hpz_partition_size(spec.strategy.deepspeed_config)
    if hpz > 1 and hpz_group(hpz, world_size) == 1:
        # DeepSpeed would stop at its divisibility assertion: run without hpZ at this world.
        config["zero_optimization"][HPZ_KEY] = 1
        overridden = sorted([*overridden, f"zero_optimization.{HPZ_KEY}"])
    return config, overridden


def planned_deepspeed_config(spec: FineTuneJobSpec, plan: Plan) -> str | None:
    """The config at the planned world size as JSON (the ConfigMap's `deepspeed.json`);
    None when the plan does not run on DeepSpeed."""
    if not uses_deepspeed(plan):
        return None
    config, _ = deepspeed_config(
        spec, plan, world_size=plan.world_size, grad_accum=plan.gradient_accumulation_steps
    )
    return json.dumps(config, indent=2, sort_keys=True)
