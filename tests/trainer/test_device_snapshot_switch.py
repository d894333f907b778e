"""spec.checkpoint.deviceSnapshot reaches the trainer through job.json; the env var overrides."""

from __future__ import annotations

import pytest

from finetune_operator.api.spec import CheckpointSpec
from finetune_trainer.dcp_checkpointer import DEVICE_SNAPSHOT_ENV, device_snapshot


def test_the_spec_decides_unless_the_env_var_says_0_or_1() -> None:
    on, off = CheckpointSpec(deviceSnapshot=True), CheckpointSpec()
    assert device_snapshot(on, {}) and not device_snapshot(off, {})
    assert device_snapshot(off, {DEVICE_SNAPSHOT_ENV: "1"})
    assert not device_snapshot(on, {DEVICE_SNAPSHOT_ENV: "0"})
    assert device_snapshot(on, {DEVICE_SNAPSHOT_ENV: ""})


def test_a_misspelt_override_is_refused() -> None:
    with pytest.raises(ValueError, match="must be 0 or 1, not 'yes'"):
        device_snapshot(CheckpointSpec(), {DEVICE_SNAPSHOT_ENV: "yes"})
