"""The elastic re-form's waits derived per job (api/elastic_timeouts.py), and their overrides."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from finetune_operator.api.elastic_timeouts import (
    collective_timeouts,
    node_resume_read_bytes,
    rank_resume_read_bytes,
    rendezvous_last_call_seconds,
    steady_collective_seconds,
    worker_stop_seconds,
)
from finetune_operator.api.plan import MemoryBreakdown, Plan
from finetune_operator.api.spec import FaultToleranceSpec, FineTuneJobSpec
from tests.operator.factories import quickstart_raw

GB = 10**9


def plan(
    *,
    step: float = 1.0,
    checkpoint_gb: float = 0.0,
    nodes: int = 2,
    gpus_per_node: int = 8,
    load_peak_gb: float = 0.0,
    compiled: bool = False,
) -> Plan:
    zero = MemoryBreakdown(parameters=0, gradients=0, optimizer=0, activations=0, buffers=0,
                           peak=0, reserved=0, total=0)  # fmt: skip
    return Plan(
        fits=True, world_size=nodes * gpus_per_node, nodes=nodes, gpus_per_node=gpus_per_node,
        strategy="fsdp-full-shard", micro_batch_size=1, gradient_accumulation_steps=1,
        activation_checkpointing=False, gpu_memory_bytes=80 * GB, headroom=0.2,
        estimated_step_seconds=step, reason="test", memory=zero, compiled_blocks=compiled,
        checkpoint_bytes=int(checkpoint_gb * GB), load_peak_bytes=int(load_peak_gb * GB),
    )  # fmt: skip


def spec(*, checkpoint: dict[str, Any] | None = None, **fault_tolerance: Any) -> FineTuneJobSpec:
    raw = quickstart_raw()
    raw["checkpoint"] = {**raw.get("checkpoint", {}), **(checkpoint or {})}
    raw["faultTolerance"] = fault_tolerance
    return FineTuneJobSpec.model_validate(raw)


@pytest.mark.parametrize(
    ("job", "p", "expected"),
    [
        # A tiny model: a step and a fast save fit well inside the old 5 s + slack.
        (spec(), plan(step=0.1), 6),
        # 8B full fine-tune on 2 nodes: ~96 GB per checkpoint, 48 GB a node: the 25 s grace
        # (from the signal) cuts the save: 25 + 5.
        (spec(), plan(step=3.0, checkpoint_gb=96), 30),
        # A step longer than the grace: the step, then the save is already out of time.
        (spec(), plan(step=28.0, checkpoint_gb=96), 33),
        # A 6 GB-per-node save after a 2 s step: 2 + 6 + 5.
        (spec(), plan(step=2.0, checkpoint_gb=12), 13),
        # Checkpointing off: no final save, only the step in flight.
        (spec(checkpoint={"enabled": False}), plan(step=3.0, checkpoint_gb=96), 8),
        (spec(rendezvousLastCallSeconds=90), plan(step=0.1), 90),
    ],
    ids=["tiny", "8b-full-grace", "long-step", "mid", "no-checkpoints", "override"],
)
def test_last_call(job: FineTuneJobSpec, p: Plan, expected: int) -> None:
    assert rendezvous_last_call_seconds(job, p) == expected


def test_worker_stop_never_beyond_torchrun_sigkill() -> None:
    assert worker_stop_seconds(spec(), plan(step=100.0, checkpoint_gb=1000)) == 30.0
    assert rendezvous_last_call_seconds(spec(), plan(step=100.0)) == 35


@pytest.mark.parametrize(
    ("job", "p", "measured", "expected"),
    [
        (spec(), plan(step=0.1), None, 60.0),  # floor
        (spec(), plan(step=20.0), None, 100.0),  # 5 step times
        (spec(), plan(step=20.0), 30.0, 150.0),  # a slower real step widens it
        (spec(), plan(step=20.0), 5.0, 100.0),  # a faster one never narrows the model's
        (spec(), plan(step=200.0), None, 300.0),  # half the 600 s hang timeout
        (spec(hangTimeoutSeconds=3600), plan(step=200.0), None, 600.0),  # the old value caps
        (spec(hangTimeoutSeconds=150), plan(step=20.0), None, 75.0),  # half the hang timeout
        (spec(hangTimeoutSeconds=15), plan(step=20.0), None, 60.0),  # the floor beats hang/2
        (spec(collectiveTimeoutSeconds=15), plan(step=20.0), 30.0, 15.0),  # the user's wins
    ],
    ids=[
        "floor",
        "steps",
        "measured-slower",
        "measured-faster",
        "hang-share",
        "ceiling",
        "mid-hang",
        "short-hang",
        "override",
    ],
)
def test_steady(job: FineTuneJobSpec, p: Plan, measured: float | None, expected: float) -> None:
    assert steady_collective_seconds(job, p, measured) == pytest.approx(expected)


def test_startup_and_checkpoint_grow_with_the_job() -> None:
    small = collective_timeouts(spec(), plan(step=0.1))
    assert (small.startup, small.steady, small.checkpoint) == (600, 60, 600)
    # 16 GB of weights a node reads, compiled blocks: 600 + 16 + 300.
    big = collective_timeouts(spec(), plan(step=3.0, load_peak_gb=2, compiled=True))
    assert big.startup == pytest.approx(916)
    # 70B full: 850 GB of checkpoint over 1 node is 850 s to write: three of them.
    huge = collective_timeouts(fixed_nodes(1), plan(step=57, checkpoint_gb=850, nodes=1))
    assert huge.checkpoint == pytest.approx(2550) and huge.startup == pytest.approx(1450)
    assert collective_timeouts(spec(), plan(checkpoint_gb=10**5, nodes=1)).checkpoint == 7200


def fixed_nodes(nodes: int) -> FineTuneJobSpec:
    raw = quickstart_raw()
    raw["resources"] = {**raw["resources"], "minNodes": nodes, "maxNodes": nodes}
    return FineTuneJobSpec.model_validate(raw)


@pytest.mark.parametrize(
    ("job", "strategy", "backend", "nodes", "per_rank"),
    [
        # Every rank loads the whole replicated state.
        pytest.param(fixed_nodes(2), "ddp", "fsdp", 2, 160.0, id="ddp"),
        # Sharded 1/world, saved and resumed at the same world: its own chunks.
        pytest.param(fixed_nodes(2), "fsdp-full-shard", "fsdp", 2, 10.0, id="fsdp-same-world"),
        pytest.param(fixed_nodes(2), "zero3", "deepspeed", 2, 10.0, id="zero3-same-world"),
        # Elastic 1..2 nodes at 2: the chunks saved at 1 node (8 ranks, 20 GB) around its share.
        pytest.param(spec(), "zero3", "deepspeed", 2, 10.0 + 20.0, id="zero3-elastic"),
        # Sharded within a node: each node reads the whole state once.
        pytest.param(fixed_nodes(2), "fsdp-hybrid", "fsdp", 2, 20.0, id="hybrid"),
        # ZeRO-1/2: its partition's parameters whole, boundaries allowed as one more share.
        pytest.param(fixed_nodes(2), "zero2", "deepspeed", 2, 20.0, id="zero2"),
    ],
)
def test_what_a_resume_reads_per_backend(
    job: FineTuneJobSpec, strategy: str, backend: str, nodes: int, per_rank: float
) -> None:
    p = plan(checkpoint_gb=160, nodes=nodes).model_copy(
        update={"strategy": strategy, "backend": backend}
    )
    assert rank_resume_read_bytes(job, p) == pytest.approx(per_rank * GB)
    assert node_resume_read_bytes(job, p) == pytest.approx(8 * per_rank * GB)


def test_a_replicated_resume_lengthens_the_checkpoint_timeout() -> None:
    """DDP's ranks each read the whole checkpoint: a node reads 8 times what FSDP's does."""
    sharded = plan(checkpoint_gb=100, nodes=2)
    replicated = sharded.model_copy(update={"strategy": "ddp"})
    job = fixed_nodes(2)
    # FSDP: 50 GB a node: startup 600 + 50 s, the checkpoint group never below it.
    assert collective_timeouts(job, sharded).checkpoint == 650
    # DDP: 800 GB a node: startup 600 + 800 s, three reads of 800 s for the checkpoint group.
    ddp = collective_timeouts(job, replicated)
    assert (ddp.startup, ddp.checkpoint) == (1400, 2400)


def test_startup_override_and_never_below_steady() -> None:
    t = collective_timeouts(spec(startupCollectiveTimeoutSeconds=120), plan(compiled=True))
    assert t.startup == 120 and t.checkpoint == 120 and not t.steady_fixed
    # Only steady set, above the derived startup: every phase waits at least that long.
    t = collective_timeouts(spec(collectiveTimeoutSeconds=900, hangTimeoutSeconds=3600), plan())
    assert t.startup == 900 and t.steady == 900 and t.steady_fixed


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"collectiveTimeoutSeconds": 600}, "faultTolerance.collectiveTimeoutSeconds (600) must be below faultTolerance.hangTimeoutSeconds (600)"),
        ({"collectiveTimeoutSeconds": 120, "startupCollectiveTimeoutSeconds": 60}, "faultTolerance.startupCollectiveTimeoutSeconds (60) must be >= faultTolerance.collectiveTimeoutSeconds (120)"),
        ({"collectiveTimeoutSeconds": 5}, "greater than or equal to 10"),
        ({"rendezvousLastCallSeconds": 0}, "greater than or equal to 1"),
    ],
    ids=["above-hang", "startup-below-steady", "too-short", "no-last-call"],
)  # fmt: skip
def test_bad_overrides_name_the_field(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError) as err:
        FaultToleranceSpec.model_validate(fields)
    assert message in str(err.value)
