"""The job config the operator writes to the ConfigMap and the trainer reads
(`/etc/finetune/job.json`): identity + spec + plan, camelCase JSON."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from finetune_operator.api.base import ApiModel
from finetune_operator.api.plan import Plan
from finetune_operator.api.spec import FineTuneJobSpec
from finetune_operator.api.spec_compat import accept_stored_spec


class JobConfig(ApiModel):
    name: str = Field(..., description="FineTuneJob name.")
    namespace: str = Field("default")
    uid: str = Field("", description="FineTuneJob uid; the rendezvous id.")
    spec: FineTuneJobSpec
    plan: Plan

    @model_validator(mode="before")
    @classmethod
    def _accept_stored_spec(cls, data: Any) -> Any:
        # job.json is written only for a job the operator accepted: one written by an older
        # operator keeps its meaning on a restart (the operator reports the deprecation).
        if isinstance(data, dict) and isinstance(data.get("spec"), dict):
            return {**data, "spec": accept_stored_spec(data["spec"])[0]}
        return data
