"""The FineTuneJob spec's enums and the field rules its models share (api/spec.py)."""

from __future__ import annotations

from typing import Literal

StrategyType = Literal[
    "auto", "ddp", "zero1", "zero2", "zero3", "fsdp-full-shard", "fsdp-shard-grad-op", "fsdp-hybrid"
]
# A concrete strategy: what a plan says, never "auto".
StrategyName = Literal[
    "ddp", "zero1", "zero2", "zero3", "fsdp-full-shard", "fsdp-shard-grad-op", "fsdp-hybrid"
]
Offload = Literal["none", "cpu", "nvme"]
Backend = Literal["auto", "fsdp", "deepspeed"]
MethodType = Literal["full", "lora", "qlora"]
Precision = Literal["bf16", "fp16", "fp32"]
OptimizerName = Literal["adamw", "adamw8bit", "sgd"]
# Structural CRD schemas cannot say "boolean or string", so checkpointing is an enum.
ActivationCheckpointingMode = Literal["auto", "none", "full"]
AttentionImpl = Literal["sdpa", "flash", "eager"]
# What the planner optimises among the configurations that fit (DESIGN §4 picks fewest GPUs).
Objective = Literal["auto", "fewest-gpus", "fastest", "lowest-cost"]
# Without checkpoint fields a job still saves this often, so it resumes and can make a final
# save on SIGTERM: a default that loses work is worse than the cost of a save per half hour.
DEFAULT_CHECKPOINT_INTERVAL_MINUTES = 30.0


def refuse_parent_segments(uri: str | None, field: str) -> str | None:
    """A storage URI must not climb out of where it points with `..` segments (checkpoint,
    output and dataset directories of one job must not reach another's). Absolute paths stay
    legal: confining them to the job's declared volumes is the volumes feature's job."""
    if uri is not None and ".." in uri.split("://", 1)[-1].split("/"):
        raise ValueError(f"{field} {uri!r} must not contain '..' path segments")
    return uri


# The CRD's CEL twin of refuse_parent_segments (api/crd_rules.py), so the API server refuses too.
NO_PARENT_SEGMENTS_RULE = "!self.matches('(^|/)[.][.](/|$)')"
