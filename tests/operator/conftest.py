"""Fixtures for the operator tests."""

from __future__ import annotations

import copy

import pytest

from finetune_operator.api.spec import FineTuneJobSpec
from finetune_operator.resources import Owner
from tests.operator.factories import EIGHT_GPU_SPEC, UID, quickstart_raw


@pytest.fixture
def owner() -> Owner:
    return Owner(name="quickstart", namespace="team-a", uid=UID)


@pytest.fixture
def quickstart_spec() -> FineTuneJobSpec:
    return FineTuneJobSpec.model_validate(quickstart_raw())


@pytest.fixture
def gpu8_spec() -> FineTuneJobSpec:
    return FineTuneJobSpec.model_validate(copy.deepcopy(EIGHT_GPU_SPEC))
