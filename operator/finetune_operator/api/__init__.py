"""The FineTuneJob API: pydantic models (no kopf, no torch) and the CRD generated from them."""

from finetune_operator.api.plan import MemoryBreakdown, Plan
from finetune_operator.api.spec import FineTuneJobSpec
from finetune_operator.api.status import Condition, FineTuneJobStatus

__all__ = ["Condition", "FineTuneJobSpec", "FineTuneJobStatus", "MemoryBreakdown", "Plan"]
