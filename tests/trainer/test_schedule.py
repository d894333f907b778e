"""LR schedule, gradient accumulation, precision and runtime-env parsing."""

from __future__ import annotations

import math

import pytest

from finetune_trainer.config import RuntimeEnv
from finetune_trainer.errors import UnsupportedConfigError
from finetune_trainer.optim import lr_factor
from finetune_trainer.trainer import gradient_accumulation, precision_context


@pytest.mark.parametrize(
    ("step", "schedule", "expected"),
    [
        (0, "cosine", 0.2),  # warm-up: (0+1)/5
        (4, "cosine", 1.0),  # last warm-up step reaches the peak
        (5, "cosine", 1.0),  # decay starts at the peak
        (30, "cosine", 0.5 * (1 + math.cos(math.pi * 25 / 50))),
        (55, "cosine", 0.0),
        (30, "linear", 0.5),
        (55, "linear", 0.0),
        (30, "constant", 1.0),
        (99, "cosine", 0.0),  # past the end stays at 0
    ],
)
def test_lr_factor(step: int, schedule: str, expected: float) -> None:
    assert lr_factor(step, warmup=5, total=55, schedule=schedule) == pytest.approx(expected)


def test_lr_factor_without_warmup_starts_at_peak() -> None:
    assert lr_factor(0, warmup=0, total=10, schedule="cosine") == 1.0


@pytest.mark.parametrize(("world", "expected"), [(1, 4), (2, 2), (4, 1)])
def test_gradient_accumulation_follows_actual_world(world: int, expected: int) -> None:
    assert gradient_accumulation(8, world, 2) == expected


def test_gradient_accumulation_refuses_indivisible() -> None:
    with pytest.raises(UnsupportedConfigError, match="globalBatchSize 8 is not divisible"):
        gradient_accumulation(8, 3, 2)


def test_precision_context_autocasts_half_precisions_only() -> None:
    import torch

    cpu = torch.device("cpu")
    for precision, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        with precision_context(precision, cpu):
            assert torch.get_autocast_dtype("cpu") == dtype and torch.is_autocast_enabled("cpu")
        with precision_context(precision, cpu, autocast=False):
            assert not torch.is_autocast_enabled("cpu")
    with precision_context("fp32", cpu):
        assert not torch.is_autocast_enabled("cpu")
    with pytest.raises(UnsupportedConfigError, match="fp8"):
        precision_context("fp8", cpu)


def test_runtime_env_from_environ() -> None:
    env = RuntimeEnv.from_environ(
        {
            "RANK": "3",
            "LOCAL_RANK": "1",
            "WORLD_SIZE": "4",
            "LOCAL_WORLD_SIZE": "2",
            "TORCHELASTIC_RESTART_COUNT": "2",
            "POD_IP": "10.0.0.5",
            "FT_STEP_DELAY_SECONDS": "0.5",
        }
    )
    assert (env.rank, env.local_rank, env.world_size, env.restart_count) == (3, 1, 4, 2)
    assert env.metrics_port == 9401 and env.pod_ip == "10.0.0.5"
    assert env.faults.step_delay_seconds == 0.5 and env.rank != 0


@pytest.mark.parametrize("raw", ["abc", "-1"])
def test_runtime_env_rejects_bad_delay(raw: str) -> None:
    with pytest.raises(ValueError, match="FT_STEP_DELAY_SECONDS"):
        RuntimeEnv.from_environ({"FT_STEP_DELAY_SECONDS": raw})
