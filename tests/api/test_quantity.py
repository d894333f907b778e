"""Byte quantities of the spec (`dataset.cacheSizeLimit`): parsed exactly, refused naming the
field, and kept out of the data cache's key (resizing the volume must not rebuild the data)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from finetune_operator.api.quantity import quantity_bytes
from finetune_operator.api.spec import DatasetSpec


@pytest.mark.parametrize(
    ("text", "expected"),
    [("32Gi", 32 << 30), ("1.5Gi", 3 << 29), ("20G", 20 * 10**9), ("500Mi", 500 << 20),
     ("1073741824", 1 << 30), ("0.5Ti", 1 << 39), ("2k", 2000), (" 1Ei ", 1 << 60)],
)  # fmt: skip
def test_quantity_bytes(text: str, expected: int) -> None:
    assert quantity_bytes(text, "f") == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [("32GB", "is not a byte quantity"), ("1e9", "is not a byte quantity"),
     ("500m", "is not a byte quantity"), ("-1Gi", "is not a byte quantity"),
     ("1Mi", "is below 64Mi"), (0, "is below 64Mi")],
)  # fmt: skip
def test_bad_cache_size_limit_is_refused_naming_the_field(value: object, message: str) -> None:
    with pytest.raises(ValidationError, match=rf"dataset\.cacheSizeLimit .*{message}"):
        DatasetSpec.model_validate({"uri": "d.jsonl", "cacheSizeLimit": value})


def test_cache_size_limit_defaults_and_integers_become_text() -> None:
    assert DatasetSpec(uri="d").cache_size_limit == "32Gi"
    spec = DatasetSpec.model_validate({"uri": "d", "cacheSizeLimit": 1 << 30})
    assert (spec.cache_size_limit, spec.cache_size_limit_bytes) == ("1073741824", 1 << 30)
