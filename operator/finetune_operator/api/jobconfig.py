"""The job config the operator writes to the ConfigMap and the trainer reads
(`/etc/finetune/job.json`): identity + spec + plan, camelCase JSON."""

from __future__ import annotations

from pydantic import Field

from finetune_operator.api.base import ApiModel
from finetune_operator.api.plan import Plan
from finetune_operator.api.spec import FineTuneJobSpec


class JobConfig(ApiModel):
    name: str = Field(..., description="FineTuneJob name.")
    namespace: str = Field("default")
    uid: str = Field("", description="FineTuneJob uid; the rendezvous id.")
    spec: FineTuneJobSpec
    plan: Plan
