"""Straggler detection (DESIGN.md §7): a pure detector over per-rank step records.

`find_stragglers(records, policy)` is the one entry point the operator (live scrapes) and
`ftjob stragglers` (recorded traces) share. No I/O, no clocks, no randomness in here.
"""

from finetune_operator.stragglers.detector import find_stragglers
from finetune_operator.stragglers.types import (
    Detection,
    Policy,
    StepRecord,
    Verdict,
    policy_from_spec,
)

__all__ = ["Detection", "Policy", "StepRecord", "Verdict", "find_stragglers", "policy_from_spec"]
