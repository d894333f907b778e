"""What the trainer does not implement yet, decided before any pod starts.

A valid FineTuneJob may still ask for something this version's trainer refuses (a strategy
row not implemented, 8-bit Adam on CPU, ...). Refusing it at plan time gives the user a condition naming the field, instead
of worker pods that exit with an error until the restart budget is spent."""

from __future__ import annotations

from finetune_operator.api.plan import Plan
from finetune_operator.api.spec import FineTuneJobSpec
from finetune_operator.api.strategies import STRATEGIES, StrategyTable


def trainer_refusals(
    spec: FineTuneJobSpec, plan: Plan, strategies: StrategyTable = STRATEGIES
) -> list[str]:
    """Each problem as '<field>: <reason>'; empty when the trainer can run the plan.
    `strategies` says which (strategy, backend) rows the trainer implements."""
    problems: list[str] = []
    row = strategies.resolve(plan.strategy, plan.backend)
    if not row.implemented:
        runnable = sorted({r.name for r in strategies if r.implemented})
        problems.append(
            f"spec.strategy: {plan.strategy} on {row.backend} is not implemented by the trainer "
            f"yet; use one of {', '.join(runnable)}"
        )
    if "nvme" in (plan.offload, spec.strategy.offload):  # the plan's is none on CPU FSDP2
        problems.append("spec.strategy.offload: nvme is not implemented yet; use cpu")
    if plan.offload != "none" and not row.offloadable:
        can = sorted({r.name for r in strategies if r.offloadable and r.implemented})
        problems.append(
            f"spec.strategy.offload: {plan.strategy} cannot offload; use one of {', '.join(can)}"
        )
    training = spec.training
    cpu = spec.resources.device == "cpu"
    if cpu and training.optimizer == "adamw8bit":
        problems.append(
            "spec.training.optimizer: adamw8bit (bitsandbytes) needs a CUDA GPU; use adamw on CPU"
        )
    elif training.optimizer not in row.optimizers:
        able = sorted({r.name for r in strategies if training.optimizer in r.optimizers})
        problems.append(
            f"spec.training.optimizer: {training.optimizer} cannot step {plan.strategy} on "
            f"{row.backend}; use adamw, or strategy.type {' or '.join(able) or 'none'}"
        )
    deepspeed = row.backend == "deepspeed"
    if deepspeed and cpu and training.precision == "fp16":
        # DeepSpeed's CPU accelerator refuses fp16 unless the CPU computes it natively.
        problems.append("spec.training.precision: fp16 with DeepSpeed needs a GPU; use bf16")
    if cpu and spec.method.type == "qlora":
        problems.append("spec.method.type: qlora needs a CUDA GPU; use lora on CPU")
    elif spec.method.type == "qlora" and deepspeed:
        problems.append("spec.method.type: qlora is not implemented with DeepSpeed; use lora")
    elif spec.method.type == "qlora" and row.shards_params:
        # FSDP2 cannot shard bitsandbytes 4-bit weights (it crashes or drops their
        # quantisation state); QLoRA runs replicated.
        problems.append(f"spec.method.type: qlora cannot run under {plan.strategy}; use ddp")
    if cpu and spec.model.attention == "flash":
        problems.append("spec.model.attention: flash needs a CUDA GPU; use sdpa")
    if spec.model.source == "inline" and spec.model.architecture is plan.architecture is None:
        # The planner resolves catalog names and config.json paths into plan.architecture.
        problems.append("spec.model.architecture: source inline builds the model from it")
    # Object-store URIs themselves are checked at plan time by api/storage.py; every loading
    # path reads pretrained weights from one (FSDP/DDP and DeepSpeed ZeRO-1/2/3 by ranges,
    # QLoRA quantising as it reads), so the model's location refuses nothing here.
    return problems
