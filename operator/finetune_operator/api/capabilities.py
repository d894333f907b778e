"""What the trainer does not implement yet, decided before any pod starts.

A valid FineTuneJob may still ask for something this version's trainer refuses (DeepSpeed,
8-bit Adam, ...). Refusing it at plan time gives the user a condition naming the field, instead
of worker pods that exit with an error until the restart budget is spent."""

from __future__ import annotations

from finetune_operator.api.deepspeed_config import uses_deepspeed
from finetune_operator.api.plan import Plan
from finetune_operator.api.spec import FineTuneJobSpec

_OBJECT_STORES = ("s3://", "gs://", "az://", "abfs://")


def trainer_refusals(spec: FineTuneJobSpec, plan: Plan) -> list[str]:
    """Each problem as '<field>: <reason>'; empty when the trainer can run the plan."""
    problems: list[str] = []
    deepspeed = uses_deepspeed(plan)  # ZeRO-1/2/3 on DeepSpeed: finetune_trainer.deepspeed_engine
    if plan.backend == "deepspeed" and not deepspeed:
        problems.append(f"spec.strategy: {plan.strategy} does not run on backend deepspeed")
    if plan.offload == "nvme":
        problems.append("spec.strategy.offload: nvme is not implemented yet; use cpu")
    if plan.offload != "none" and plan.strategy == "ddp":
        problems.append("spec.strategy.offload: offload needs an fsdp strategy, not ddp")
    training = spec.training
    if training.optimizer == "adamw8bit":
        problems.append("spec.training.optimizer: adamw8bit is not implemented yet; use adamw")
    cpu = spec.resources.device == "cpu"
    if training.precision == "fp16" and not deepspeed:
        problems.append("spec.training.precision: fp16 is not implemented; use bf16")
    elif training.precision == "fp16" and cpu:
        # DeepSpeed's CPU accelerator refuses fp16 unless the CPU has native fp16 (oneDNN).
        problems.append("spec.training.precision: fp16 with DeepSpeed needs a GPU; use bf16")
    if deepspeed and spec.method.type == "qlora":
        problems.append("spec.method.type: qlora is not implemented with DeepSpeed; use lora")
    if cpu and spec.method.type == "qlora":
        problems.append("spec.method.type: qlora needs a CUDA GPU; use lora on CPU")
    elif spec.method.type == "qlora" and plan.strategy.startswith(("fsdp", "zero3")):
        # FSDP2 cannot shard bitsandbytes 4-bit weights (it crashes or drops their
        # quantisation state); QLoRA runs replicated.
        problems.append(f"spec.method.type: qlora cannot run under {plan.strategy}; use ddp")
    if cpu and spec.model.attention == "flash":
        problems.append("spec.model.attention: flash needs a CUDA GPU; use sdpa")
    if spec.model.source == "inline" and spec.model.architecture is plan.architecture is None:
        # The planner resolves catalog names and config.json paths into plan.architecture.
        problems.append("spec.model.architecture: source inline builds the model from it")
    for field, uri in (
        ("spec.checkpoint.uri", spec.checkpoint.uri),
        ("spec.dataset.uri", spec.dataset.uri),
        ("spec.output.uri", spec.output.uri or ""),
    ):
        if uri.startswith(_OBJECT_STORES):
            problems.append(f"{field}: object storage is not implemented yet; use a shared path")
    return problems
