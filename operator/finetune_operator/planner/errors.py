"""The planner's one error type: every refusal names the spec field to change."""

from __future__ import annotations


class PlanningError(ValueError):
    """An input the planner cannot plan, with the camelCase spec path to fix.

    `field` is a path such as `spec.method.lora.rank`; the operator copies it into the
    InvalidSpec condition so the user knows which line of the manifest is wrong.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
