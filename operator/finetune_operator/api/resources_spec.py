"""Where and how the job runs: `spec.resources` (GPUs, nodes, pod scheduling) and `spec.strategy`."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, WithJsonSchema, model_validator

from finetune_operator.api import limits as lim
from finetune_operator.api.base import SpecModel
from finetune_operator.api.spec_types import (
    Backend,
    Objective,
    Offload,
    StrategyType,
)


def _quantity_text(value: Any) -> Any:
    """`cpu: 8` is as valid as `cpu: "8"` in a pod (a quantity is int-or-string): kept as text."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return str(value)
    return value


# A Kubernetes quantity: what the pod's resources take, an integer or a string ("8", 64Gi).
Quantity = Annotated[
    str,
    BeforeValidator(_quantity_text),
    Field(max_length=lim.MAX_SHORT_STRING),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "integer", "minimum": 0},
                {"type": "string", "maxLength": lim.MAX_SHORT_STRING},
            ]
        }
    ),
]


class GpuSpec(SpecModel):
    resource_name: str = Field(
        "nvidia.com/gpu",
        max_length=lim.MAX_NAME_LENGTH,
        description="Extended resource to request.",
    )
    product: str | None = Field(
        None,
        max_length=lim.MAX_SHORT_STRING,
        description="GPU product, e.g. H100-80GB, A100-40GB, L4.",
    )
    memory_gib: float | None = Field(
        None,
        gt=0,
        le=lim.MAX_GPU_MEMORY_GIB,
        alias="memoryGiB",
        description="GPU memory; from product if unset.",
    )


class LocalObjectReference(SpecModel):
    name: str = Field(..., min_length=1, max_length=lim.MAX_NAME_LENGTH)


# The gang schedulers a job's PodGroup can be for (resources/podgroup.py builds it).
GangScheduler = Literal["none", "coscheduling", "volcano"]


class GangSchedulingSpec(SpecModel):
    """All-or-nothing placement of the worker pods: no worker pod is bound before the elastic
    minimum of them (resources.minNodes) fit at once, so two multi-node jobs never each hold
    part of their GPUs while waiting for the rest."""

    scheduler: GangScheduler = Field(
        ...,
        description=(
            "coscheduling: a scheduler-plugins PodGroup (scheduling.x-k8s.io/v1alpha1) and the "
            "pod label scheduling.x-k8s.io/pod-group; volcano: a Volcano PodGroup "
            "(scheduling.volcano.sh/v1beta1) and the pod annotation "
            "scheduling.k8s.io/group-name; none: off (overrides the operator's default)."
        ),
    )
    scheduler_name: str | None = Field(
        None,
        min_length=1,
        max_length=lim.MAX_NAME_LENGTH,
        description=(
            "spec.schedulerName of the worker pods: the scheduler (profile) that runs the "
            "plugin. Default: the operator's (chart value gangScheduling.schedulerName), else "
            "scheduler-plugins-scheduler for coscheduling and volcano for volcano."
        ),
    )
    schedule_timeout_seconds: int | None = Field(
        None,
        ge=1,
        le=lim.MAX_GANG_TIMEOUT_SECONDS,
        description=(
            "coscheduling only: how long pods that fit wait in the scheduler for the rest of "
            "the group before the whole group is rejected and retried (the PodGroup's "
            "scheduleTimeoutSeconds; the plugin's default when unset)."
        ),
    )
    queue: str | None = Field(
        None,
        min_length=1,
        max_length=lim.MAX_NAME_LENGTH,
        description="volcano only: the Volcano Queue of the PodGroup (Volcano's default queue when unset).",
    )

    @model_validator(mode="after")
    def _check_scheduler_fields(self) -> GangSchedulingSpec:
        if self.schedule_timeout_seconds is not None and self.scheduler != "coscheduling":
            raise ValueError(
                "resources.gangScheduling.scheduleTimeoutSeconds applies to scheduler "
                f"coscheduling only (scheduler is {self.scheduler})"
            )
        if self.queue is not None and self.scheduler != "volcano":
            raise ValueError(
                "resources.gangScheduling.queue applies to scheduler volcano only "
                f"(scheduler is {self.scheduler})"
            )
        if self.scheduler_name is not None and self.scheduler == "none":
            raise ValueError("resources.gangScheduling.schedulerName needs a scheduler, not none")
        return self

    @property
    def enabled(self) -> bool:
        return self.scheduler != "none"


class ResourcesSpec(SpecModel):
    device: Literal["gpu", "cpu"] = Field(
        "gpu", description="gpu, or cpu for CPU-only (gloo) runs such as the local quickstart."
    )
    gpu: GpuSpec = Field(default_factory=GpuSpec, description="Accelerator per process.")
    gpus_per_node: int = Field(
        1, ge=1, le=lim.MAX_GPUS_PER_NODE, description="Processes (GPUs) per worker pod."
    )
    max_gpus: int | None = Field(
        None, ge=1, le=lim.MAX_GPUS, alias="maxGPUs", description="Upper bound on the world size."
    )
    min_nodes: int | None = Field(
        None, ge=1, le=lim.MAX_NODES, description="Elastic minimum of worker pods."
    )
    max_nodes: int | None = Field(
        None, ge=1, le=lim.MAX_NODES, description="Elastic maximum of worker pods."
    )
    cpu: Quantity | None = Field(
        None, description="CPU request/limit per worker pod, e.g. 8 or 500m."
    )
    memory: Quantity | None = Field(
        None, description="Memory request/limit per worker pod, e.g. 64Gi."
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict, max_length=lim.MAX_LIST_ITEMS, description="Worker nodeSelector."
    )
    tolerations: list[dict[str, Any]] = Field(
        default_factory=list, max_length=lim.MAX_LIST_ITEMS, description="Tolerations."
    )
    objective: Objective = Field(
        "auto",
        description=(
            "What the planner optimises among plans that fit: fewest-gpus, fastest (shortest "
            "step time within maxGPUs), lowest-cost (fewest GPU-hours). auto: fastest when "
            "maxGPUs is set (you said what you will spend), else fewest-gpus."
        ),
    )
    affinity: dict[str, Any] | None = Field(None, description="Extra pod affinity.")
    priority_class_name: str | None = Field(
        None, max_length=lim.MAX_NAME_LENGTH, description="PriorityClass of worker pods."
    )
    image_pull_secrets: list[LocalObjectReference] = Field(
        default_factory=list, max_length=lim.MAX_LIST_ITEMS
    )
    service_account_name: str | None = Field(
        None,
        max_length=lim.MAX_NAME_LENGTH,
        description="ServiceAccount of the pods; default: the operator's trainer ServiceAccount. "
        "Must be one the operator allows (chart value policy.allowedServiceAccounts).",
    )
    gang_scheduling: GangSchedulingSpec | None = Field(
        None,
        description=(
            "Gang scheduling of the worker pods through a PodGroup the operator owns. Unset: "
            "the operator's default (chart value gangScheduling.default; off unless set)."
        ),
    )
    automount_service_account_token: bool = Field(
        False,
        description="Mount the ServiceAccount's API token into the pods. Off: trainers never "
        "talk to the Kubernetes API, so a compromised trainer gets no credentials.",
    )

    @model_validator(mode="after")
    def _check_nodes(self) -> ResourcesSpec:
        if self.min_nodes and self.max_nodes and self.min_nodes > self.max_nodes:
            raise ValueError(
                f"resources.minNodes ({self.min_nodes}) must be <= "
                f"resources.maxNodes ({self.max_nodes})"
            )
        return self


def _zero_keys_problem(config: dict[str, Any]) -> str | None:
    """What is wrong with the user's ZeRO keys the trainer's DeepSpeed would stop at, or
    None: hpZ's group size must be a positive integer; MiCS is gone from DeepSpeed 0.19."""
    zero = config.get("zero_optimization")
    if not isinstance(zero, dict):
        return None
    hpz = zero.get("zero_hpz_partition_size")
    if hpz is not None and (not isinstance(hpz, int) or isinstance(hpz, bool) or hpz < 1):
        return f"zero_hpz_partition_size is {hpz!r}: a positive integer (ranks a node) expected"
    for key in ("mics_shard_size", "mics_hierarchical_params_gather"):
        if key in zero:
            return f"{key}: MiCS was removed from DeepSpeed 0.19 (the trainer's); remove it"
    return None


class StrategySpec(SpecModel):
    type: StrategyType = Field("auto", description="auto (planner decides) or a pinned strategy.")
    offload: Offload = Field("none", description="Offload of optimizer states/parameters.")
    backend: Backend = Field("auto", description="auto | fsdp | deepspeed.")
    deepspeed_config: dict[str, Any] | None = Field(
        None,
        description=(
            "Your own DeepSpeed config keys (a JSON object, as in a ds_config.json), merged into "
            "the config the trainer generates from the plan. The plan wins where they disagree "
            "(batch sizes, zero_optimization.stage, offload devices, bf16/fp16, "
            "gradient_clipping, bucket sizes); optimizer, scheduler, amp, torch_autocast, "
            "checkpoint and elasticity come from the spec and are dropped. The trainer logs "
            "every key it overrode. Needs backend deepspeed (or type zero1/zero2)."
        ),
    )

    @model_validator(mode="after")
    def _check_backend(self) -> StrategySpec:
        if self.type in ("zero1", "zero2") and self.backend == "fsdp":
            raise ValueError(f"strategy.type {self.type} needs backend deepspeed, not fsdp")
        if self.type.startswith("fsdp") and self.backend == "deepspeed":
            raise ValueError(f"strategy.type {self.type} needs backend fsdp, not deepspeed")
        if self.deepspeed_config is not None:
            if self.backend != "deepspeed" and self.type not in ("zero1", "zero2"):
                raise ValueError(
                    "strategy.deepspeedConfig needs strategy.backend deepspeed "
                    f"(backend is {self.backend}, type {self.type})"
                )
            problem = _zero_keys_problem(self.deepspeed_config)
            if problem:
                raise ValueError(f"strategy.deepspeedConfig.zero_optimization.{problem}")
            size = len(json.dumps(self.deepspeed_config))
            if size > lim.MAX_DEEPSPEED_CONFIG_BYTES:
                raise ValueError(
                    f"strategy.deepspeedConfig is {size} bytes as JSON; at most "
                    f"{lim.MAX_DEEPSPEED_CONFIG_BYTES}"
                )
        return self
