"""The planner reads resources.memory and cpu by Kubernetes' resource.Quantity grammar: what
the API server refuses on a worker pod is refused at plan time, what it accepts is planned."""

from __future__ import annotations

import pytest

from finetune_operator.planner.errors import PlanningError
from finetune_operator.planner.hardware import check_cpu_quantity, parse_quantity


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2Gi", 2 << 30),
        ("1.5Gi", 3 << 29),
        ("512M", 512 * 10**6),
        ("1e9", 10**9),
        ("1E3", 1000),  # "E" with digits is an exponent ...
        ("1E", 10**18),  # ... without, the exa suffix
        ("1Ei", 1 << 60),
        ("+2Gi", 2 << 30),  # ParseQuantity takes a sign
        ("2000m", 2),  # milli-bytes: Kubernetes accepts them
        ("1.", 1),
        (".5k", 500),
    ],
)
def test_memory_quantities_the_api_server_accepts_are_read(text: str, expected: int) -> None:
    assert parse_quantity(text, "spec.resources.memory") == expected


@pytest.mark.parametrize(
    "text",
    [
        "1K",  # Kubernetes' decimal kilo is "k" only: "unable to parse quantity's suffix"
        "1 Gi",
        " 2Gi",
        "1e3Gi",  # an exponent or a suffix, not both
        "1e1.5",
        "1e",
        "-2Gi",
        "2GB",
        "",
    ],
)
def test_memory_quantities_the_api_server_refuses_are_refused(text: str) -> None:
    with pytest.raises(PlanningError, match="is not a Kubernetes quantity"):
        parse_quantity(text, "spec.resources.memory")


@pytest.mark.parametrize(
    ("text", "hint"),
    [
        ("16GB", "did you mean '16Gi' (16 x 2^30 bytes) or '16G' (16 x 10^9)?"),
        ("16gb", "did you mean '16Gi'"),
        ("16GiB", "did you mean '16Gi'"),
        ("1 Gi", "did you mean '1Gi'"),
        ("512mb", "did you mean '512Mi' (512 x 2^20 bytes) or '512M' (512 x 10^6)?"),
        ("1K", "did you mean '1Ki' (1 x 2^10 bytes) or '1k' (1 x 10^3)?"),
    ],
)
def test_memory_in_another_notation_is_refused_saying_what_to_write(text: str, hint: str) -> None:
    with pytest.raises(PlanningError, match="is not a Kubernetes quantity") as caught:
        parse_quantity(text, "spec.resources.memory")
    assert hint in str(caught.value)


@pytest.mark.parametrize("text", ["thirty", "1.2.3Gi", "1e3Gi", "-2Gi"])
def test_memory_that_is_no_size_gets_no_guess(text: str) -> None:
    with pytest.raises(PlanningError) as caught:
        parse_quantity(text, "spec.resources.memory")
    assert "did you mean" not in str(caught.value)


@pytest.mark.parametrize("text", ["8", "500m", "1.5", "2e3", "+1", "1E", "100n"])
def test_cpu_quantities_the_api_server_accepts_pass(text: str) -> None:
    check_cpu_quantity(text, "spec.resources.cpu")


@pytest.mark.parametrize("text", ["8 ", "1K", "1e3m", "0.5 cpu", "-1"])
def test_cpu_quantities_the_api_server_refuses_are_refused(text: str) -> None:
    with pytest.raises(PlanningError, match="is not a Kubernetes quantity"):
        check_cpu_quantity(text, "spec.resources.cpu")


@pytest.mark.parametrize("text", ["1e999", "10E", "8Ei"])
def test_memory_past_int64_is_refused_as_too_large(text: str) -> None:
    with pytest.raises(PlanningError, match="too large"):
        parse_quantity(text, "spec.resources.memory")
