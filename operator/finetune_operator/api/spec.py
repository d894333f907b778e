"""FineTuneJob spec (DESIGN.md §3). The CRD schema is generated from these models.

The top-level spec and its checkpoint, fault-tolerance and output parts live here; the other
parts by responsibility beside it (spec_types, model_spec, training_spec, resources_spec), all
re-exported from here: `from finetune_operator.api.spec import X` is the import path."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from finetune_operator.api import limits as lim
from finetune_operator.api.base import SpecModel
from finetune_operator.api.model_spec import ModelArchitecture, ModelSpec
from finetune_operator.api.resources_spec import (
    GpuSpec,
    LocalObjectReference,
    ResourcesSpec,
    StrategySpec,
)
from finetune_operator.api.spec_types import (
    DEFAULT_CHECKPOINT_INTERVAL_MINUTES,
    NO_PARENT_SEGMENTS_RULE,
    ActivationCheckpointingMode,
    AttentionImpl,
    Backend,
    MethodType,
    Objective,
    Offload,
    OptimizerName,
    Precision,
    StrategyName,
    StrategyType,
    refuse_parent_segments,
)
from finetune_operator.api.storage import StorageSpec
from finetune_operator.api.training_spec import (
    DatasetSpec,
    LoraSpec,
    MethodSpec,
    TrainingSpec,
)

__all__ = [
    "DEFAULT_CHECKPOINT_INTERVAL_MINUTES",
    "NO_PARENT_SEGMENTS_RULE",
    "ActivationCheckpointingMode",
    "AttentionImpl",
    "Backend",
    "CheckpointSpec",
    "DatasetSpec",
    "FaultToleranceSpec",
    "FineTuneJobSpec",
    "GpuSpec",
    "LocalObjectReference",
    "LoraSpec",
    "MethodSpec",
    "MethodType",
    "ModelArchitecture",
    "ModelSpec",
    "Objective",
    "Offload",
    "OptimizerName",
    "OutputSpec",
    "Precision",
    "ResourcesSpec",
    "StorageSpec",
    "StragglerSpec",
    "StrategyName",
    "StrategySpec",
    "StrategyType",
    "TrainingSpec",
    "refuse_parent_segments",
]


class CheckpointSpec(SpecModel):
    uri: str = Field(
        "checkpoints",
        min_length=1,
        max_length=lim.MAX_URI_LENGTH,
        description="Directory (or s3:// URI) for checkpoints.",
    )
    interval_steps: int | None = Field(
        None, ge=1, le=lim.MAX_STEPS, description="Save every N steps."
    )
    interval_minutes: float | None = Field(
        DEFAULT_CHECKPOINT_INTERVAL_MINUTES,
        gt=0,
        le=lim.MAX_INTERVAL_MINUTES,
        description="Save every N minutes (also when intervalSteps is set: whichever comes first).",
    )
    keep: int = Field(
        3, ge=1, le=lim.MAX_CHECKPOINTS_KEPT, description="Committed checkpoints to keep."
    )
    enabled: bool = Field(
        True, description="false: never checkpoint (no resume, no final save on SIGTERM)."
    )
    async_: bool = Field(True, alias="async", description="Save in the background (DCP async).")
    device_snapshot: bool = Field(
        False,
        description="GPU, async saves: copy the state within GPU memory first, so the next "
        "optimizer step waits only for that copy and the copy to the host runs on beside the "
        "following steps. Costs one more copy of each rank's checkpoint state in GPU memory "
        "(the planner counts it). Not measured on a GPU yet.",
    )

    @field_validator("uri")
    @classmethod
    def _uri_stays_put(cls, uri: str) -> str:
        return refuse_parent_segments(uri, "checkpoint.uri") or uri


class StragglerSpec(SpecModel):
    enabled: bool = Field(True, description="Detect stragglers.")
    action: Literal["evict", "alert"] = Field("evict", description="evict or only alert.")
    threshold: float = Field(
        1.2,
        gt=1.0,
        le=lim.MAX_STRAGGLER_THRESHOLD,
        description="Compute-time ratio over the median.",
    )
    window_steps: int = Field(
        20, ge=1, le=lim.MAX_WINDOW_STEPS, description="Steps per detection window."
    )
    consecutive_windows: int = Field(
        3, ge=1, le=lim.MAX_CONSECUTIVE_WINDOWS, description="Windows in a row before acting."
    )
    cooldown_seconds: int = Field(
        600, ge=0, le=lim.MAX_COOLDOWN_SECONDS, description="Minimum time between evictions."
    )
    max_evictions_per_hour: int = Field(
        2, ge=0, le=lim.MAX_EVICTIONS_PER_HOUR, description="Eviction rate limit."
    )


class FaultToleranceSpec(SpecModel):
    max_restarts: int = Field(
        3,
        ge=0,
        le=lim.MAX_RESTARTS,
        description="Failure restarts of the job before Failed, whichever layer makes them: "
        "torchrun's restarts of a worker group inside its pod and the operator's replacements "
        "of failed pods (and hang restarts) alike, so a trainer that fails every time is "
        "attempted at most maxRestarts + 1 times. Preemptions, evictions, deleted pods and "
        "peers joining are not counted.",
    )
    backoff_seconds: float = Field(
        10, ge=0, le=lim.MAX_BACKOFF_SECONDS, description="Base delay before a replacement."
    )
    hang_timeout_seconds: int = Field(
        600,
        ge=10,
        le=86400,
        description=(
            "No step progress on any rank, or a rank whose heartbeat is older than this, for "
            "this long is a hang: the workers restart from the last committed checkpoint "
            "(counted against maxRestarts)."
        ),
    )
    collective_timeout_seconds: int | None = Field(
        None,
        ge=lim.MIN_COLLECTIVE_TIMEOUT_SECONDS,
        le=lim.MAX_COLLECTIVE_TIMEOUT_SECONDS,
        description=(
            "How long a training collective waits for a peer once the run is warm: what a "
            "silent node loss (power loss, network partition) costs before the survivors fail "
            "and re-form. Default: derived per job, 5 step times within [60, 600] s and at "
            "most half of hangTimeoutSeconds above 60 s (docs/architecture.md)."
        ),
    )
    startup_collective_timeout_seconds: int | None = Field(
        None,
        ge=lim.MIN_COLLECTIVE_TIMEOUT_SECONDS,
        le=lim.MAX_COLLECTIVE_TIMEOUT_SECONDS,
        description=(
            "How long a collective waits while the workers start (weights and checkpoint "
            "loading, the first steps with torch.compile), around checkpoint saves and during "
            "the export. Default: derived per job from the model and compilation, at least "
            "600 s."
        ),
    )
    rendezvous_last_call_seconds: int | None = Field(
        None,
        ge=1,
        le=lim.MAX_LAST_CALL_SECONDS,
        description=(
            "Once minNodes workers joined a re-form, how long more may join (torchrun's "
            "last_call_timeout). Default: derived per job, the time a worker takes to stop "
            "(a step and its final checkpoint save) plus 5 s, within [5, 35] s."
        ),
    )
    node_lost_seconds: int = Field(
        60,
        ge=lim.MIN_NODE_LOST_SECONDS,
        le=lim.MAX_NODE_LOST_SECONDS,
        description=(
            "How long the job's pods stay on a node that stopped answering (Ready Unknown or "
            "False: lost power, partitioned, kubelet dead) before Kubernetes evicts them: "
            "their tolerationSeconds of the node.kubernetes.io/unreachable and not-ready "
            "NoExecute taints (Kubernetes' default is 300). A pod evicted from a lost node "
            "stays Terminating (no kubelet confirms it): once its node has not been Ready "
            "for this long (Ready False: its kubelet still posts, so also the pod's grace "
            "period), the operator force-deletes it so that its replacement can start "
            "(a preemption, not counted against maxRestarts). A toleration of those taints "
            "in resources.tolerations wins over this."
        ),
    )
    stragglers: StragglerSpec = Field(default_factory=StragglerSpec)

    @model_validator(mode="after")
    def _check_timeouts(self) -> FaultToleranceSpec:
        steady, startup = self.collective_timeout_seconds, self.startup_collective_timeout_seconds
        if steady is not None and steady >= self.hang_timeout_seconds:
            raise ValueError(
                f"faultTolerance.collectiveTimeoutSeconds ({steady}) must be below "
                f"faultTolerance.hangTimeoutSeconds ({self.hang_timeout_seconds}): the ranks "
                "must give up on a lost peer before the operator declares a hang"
            )
        if steady is not None and startup is not None and startup < steady:
            raise ValueError(
                f"faultTolerance.startupCollectiveTimeoutSeconds ({startup}) must be >= "
                f"faultTolerance.collectiveTimeoutSeconds ({steady})"
            )
        return self


class OutputSpec(SpecModel):
    uri: str | None = Field(
        None,
        # No min_length (in the CRD it would wedge jobs stored with ""): _uri_not_empty
        # refuses it for new jobs, and a CEL transition rule an edit to it
        # (crd_rules.kept_when_stored).
        max_length=lim.MAX_URI_LENGTH,
        description="Where the final model is written (a directory or s3:// URI); omitted: "
        "no export, the model is only in the checkpoints.",
    )
    format: Literal["hf-safetensors"] = Field("hf-safetensors", description="Output format.")
    merge_lora: bool = Field(
        False,
        description="Merge adapters into the base weights (method lora or qlora only).",
    )

    @field_validator("uri", mode="before")
    @classmethod
    def _uri_not_empty(cls, uri: object) -> object:
        # "" is no place to write to; taken as "unset", the model would silently go nowhere.
        if uri == "":
            raise ValueError(
                "output.uri is empty: give a directory or s3:// URI, or omit it for no export"
            )
        return uri

    @field_validator("uri")
    @classmethod
    def _uri_stays_put(cls, uri: str | None) -> str | None:
        return refuse_parent_segments(uri, "output.uri")


class FineTuneJobSpec(SpecModel):
    model: ModelSpec = Field(..., description="The model to fine-tune.")
    dataset: DatasetSpec = Field(..., description="The training data.")
    method: MethodSpec = Field(default_factory=MethodSpec, description="full, lora or qlora.")
    training: TrainingSpec = Field(..., description="Sequence, batch, steps, optimizer, precision.")
    resources: ResourcesSpec = Field(
        default_factory=ResourcesSpec, description="GPUs, nodes and pod scheduling."
    )
    strategy: StrategySpec = Field(
        default_factory=StrategySpec, description="Sharding strategy (auto: the planner picks)."
    )
    checkpoint: CheckpointSpec = Field(
        default_factory=CheckpointSpec, description="Where and how often to checkpoint."
    )
    fault_tolerance: FaultToleranceSpec = Field(
        default_factory=FaultToleranceSpec, description="Restarts, backoff and stragglers."
    )
    output: OutputSpec = Field(default_factory=OutputSpec, description="The trained model.")
    storage: StorageSpec = Field(
        default_factory=StorageSpec,
        description="Volumes mounted into every worker: checkpoints, output, data, weights.",
    )
    image: str | None = Field(
        None,
        min_length=1,
        max_length=lim.MAX_IMAGE_LENGTH,
        description="Trainer image; default: the operator's (chart value trainer.image). "
        "Must match the operator's allowed images (chart value policy.allowedImages).",
    )
    suspend: bool = Field(False, description="Delete pods, keep checkpoints; false resumes.")

    @model_validator(mode="after")
    def _merge_lora_needs_adapters(self) -> FineTuneJobSpec:
        # Accepted and ignored before: a user asking for merged weights got no answer.
        if self.output.merge_lora and self.method.type == "full":
            raise ValueError(
                "output.mergeLora is true but method.type is 'full': there are no adapters to "
                "merge (a full fine-tune already exports whole weights); remove "
                "output.mergeLora or use method lora/qlora"
            )
        return self
