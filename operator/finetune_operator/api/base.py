"""Base model: camelCase in YAML/JSON, snake_case in Python, unknown fields refused."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class ApiModel(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_default=True,
    )

    def to_json_dict(self) -> dict[str, Any]:
        """The object as the API server stores it: camelCase, no unset optionals."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class SpecModel(ApiModel):
    """A part of the spec: infinities and NaN are refused (JSON, hence kubectl and the API
    server, cannot carry them, and a bound such as ``le`` lets NaN through)."""

    model_config = ConfigDict(allow_inf_nan=False)
