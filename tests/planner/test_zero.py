"""DeepSpeed ZeRO model states as DeepSpeed's engine allocates them (planner/zero.py).

Pure: the per-structure figures below are what bench/deepspeed_memory.py measured on a live
DeepSpeed 0.19 engine (tests/bench/test_deepspeed_memory.py re-measures one of them)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from planner_specs import make_spec

from finetune_operator.planner import Candidate, TrainingShape, estimate_memory, shape_of
from finetune_operator.planner.catalog import lookup
from finetune_operator.planner.lora import adapter_parameters
from finetune_operator.planner.planning import build_problem
from finetune_operator.planner.zero import ZeroStates, zero_states

P = 8_000_000  # divisible by every world size below
E = 2  # bf16


def states(stage: int, n: int, *, offload: bool = False, ga: int = 1) -> ZeroStates:
    return zero_states(
        stage, n, P, 0, E, 12, fp32_master=True, offload=offload, grad_accumulation=ga
    )


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("stage", [1, 2])
def test_stage_1_2_full_bf16_copy_fp32_gradient_partition_at_the_step(stage: int, n: int) -> None:
    z = states(stage, n)
    # bit16_groups_flat (whole), single_partition_of_fp32_groups[i].grad (fp32, 1/N),
    # fp32 master + exp_avg + exp_avg_sq (1/N).
    assert (z.params, z.grads, z.optim, z.host) == (2 * P, 4 * P // n, 12 * P // n, 0)
    # Forward: gradients freed at the previous step; backward: the bf16 partition.
    assert (z.grads_forward, z.grads_backward) == (0, 2 * P // n)
    # The cast: bf16 partition + its flattened copy beside the fp32 one.
    assert z.step_transient == 4 * P // n


@pytest.mark.parametrize("n", [1, 2, 8])
def test_stage_3_persistent_bf16_gradient_partition_plus_fp32_at_the_step(n: int) -> None:
    z = states(3, n)
    assert (z.params, z.grads, z.optim, z.host) == (2 * P // n, 6 * P // n, 12 * P // n, 0)
    # grad_partitions_flat_buffer is allocated at init and kept through every phase.
    assert (z.grads_forward, z.grads_backward, z.step_transient) == (2 * P // n,) * 3


@pytest.mark.parametrize(
    ("stage", "device_params", "host_per_n"),
    [
        # fp32 master, m, v + fp32 gradient partition + bf16 copy-back buffer.
        (1, 2 * P, 12 + 4 + 2),
        (2, 2 * P, 12 + 4 + 2),
        # + the bf16 parameter partition and bf16 gradient partition, all on the host.
        (3, 0, 2 + 12 + 2 + 4),
    ],
    ids=["zero1", "zero2", "zero3"],
)
def test_offload_puts_optimizer_gradients_on_the_host(
    stage: int, device_params: int, host_per_n: int
) -> None:
    z = states(stage, 4, offload=True)
    assert (z.params, z.grads, z.optim, z.step_transient) == (device_params, 0, 0, 0)
    assert z.host == host_per_n * P // 4


def test_accumulation_keeps_the_partition_through_forward() -> None:
    assert states(2, 4, ga=4).grads_forward == 2 * P // 4
    assert states(2, 4, offload=True, ga=4).host == states(2, 4, offload=True).host + 2 * P // 4


def test_pure_bf16_hands_the_optimizer_a_bf16_partition() -> None:
    z = zero_states(2, 4, P, 0, E, 4, fp32_master=False, offload=False)
    assert z.grads == 2 * P // 4


def test_stage_3_shards_frozen_weights_stage_1_2_do_not() -> None:
    frozen = 1_000_000
    assert zero_states(3, 4, P, frozen, E, 12, fp32_master=True, offload=False).params == (
        2 * P // 4 + frozen // 4
    )
    assert zero_states(2, 4, P, frozen, E, 12, fp32_master=True, offload=False).params == (
        2 * P + frozen
    )


def test_estimate_memory_walks_the_zero_phases() -> None:
    """The optimizer phase holds the fp32 partition and the cast's copies; forward none
    (ZeRO-2, no accumulation), backward the bf16 partition."""
    m = shape_of(lookup("Llama-2-7b-hf").architecture)  # type: ignore[union-attr]
    n, trainable = 4, m.total
    shape = TrainingShape(micro_batch_size=1, seq_len=512, checkpointing=True)
    est = estimate_memory(m, shape, Candidate("zero2", n, 8))
    b = est.breakdown
    part = -(-trainable // n)
    assert (b.parameters, b.gradients, b.optimizer) == (2 * trainable, 4 * part, 12 * part)
    states_only = b.parameters + b.optimizer
    assert est.phases["optimizer"] >= states_only + 4 * part + 2 * 2 * part
    assert est.phases["forward"] - states_only < est.phases["backward"] - states_only


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_lora_adapters_are_bf16_with_fp32_masters_under_deepspeed(strategy: str) -> None:
    """The trainer casts the adapters to the precision's dtype on every ZeRO stage
    (deepspeed_engine.cast_whole_parameters) and DeepSpeed keeps fp32 masters of them; the torch
    backend keeps PEFT's fp32 adapters (their own masters). Counting DeepSpeed's adapters as
    fp32 without masters (the old model) gives 4 bytes of parameters and 8 of optimizer."""
    m = shape_of(lookup("Llama-2-7b-hf").architecture)  # type: ignore[union-attr]
    n = 4
    shape = TrainingShape(micro_batch_size=1, seq_len=512, method="lora", checkpointing=True)
    b = estimate_memory(m, shape, Candidate(strategy, n, 8)).breakdown
    adapters = adapter_parameters(m, shape.lora_rank, shape.lora_targets)
    part, frozen = -(-adapters // n), m.total * 2
    if strategy == "zero3":
        assert b.parameters == 2 * part + -(-frozen // n)
    else:
        assert b.parameters == 2 * adapters + frozen
    assert b.optimizer == 12 * part  # fp32 master + exp_avg + exp_avg_sq
    ddp = estimate_memory(m, shape, Candidate("ddp", n, 8)).breakdown
    assert (ddp.parameters, ddp.optimizer) == (4 * adapters + frozen, 8 * adapters)


@pytest.mark.parametrize(("n", "hpz"), [(4, 2), (8, 8), (16, 8), (2, 8)])
def test_stage_3_hpz_keeps_a_secondary_partition_over_its_group(n: int, hpz: int) -> None:
    """hpZ: beside the primary partition over the N ranks, every parameter (frozen ones
    too) keeps a secondary e-byte partition over its group of min(H, N) ranks (in forward and
    backward, to the step). On DeepSpeed 0.19's engine on CPU (fp32, world 4, H 2, the
    quickstart's 124,096 parameters) each rank held 248,192 bytes of `ds_secondary_tensor`:
    4 bytes x 124,096 / 2, this formula."""
    plain = zero_states(3, n, P, 1000 * n, E, 12, fp32_master=True, offload=False)
    z = zero_states(3, n, P, 1000 * n, E, 12, fp32_master=True, offload=False, hpz=hpz)
    group = min(hpz, n)
    assert z.params - plain.params == (E * P + 1000 * n) // group
    assert (z.grads, z.optim, z.host) == (plain.grads, plain.optim, 0)

    def quickstart(hpz: int) -> int:
        return zero_states(3, 4, 124_096, 0, 4, 12, fp32_master=False, offload=False,
                           hpz=hpz).params  # fmt: skip

    assert quickstart(2) - quickstart(1) == 248_192


def test_hpz_secondary_goes_to_the_host_with_parameter_offload_and_is_nothing_elsewhere() -> None:
    plain = zero_states(3, 4, P, 0, E, 12, fp32_master=True, offload=True)
    z = zero_states(3, 4, P, 0, E, 12, fp32_master=True, offload=True, hpz=2)
    assert z.host - plain.host == E * P // 2 and z.params == 0
    # ZeRO-1/2 hold the parameters whole (no hpZ); a group that does not divide the world is
    # not formed (api.deepspeed_config.hpz_group).
    for stage in (1, 2):
        assert states(stage, 4) == zero_states(stage, 4, P, 0, E, 12, fp32_master=True,
                                               offload=False, hpz=2)  # fmt: skip
    assert zero_states(3, 6, P, 0, E, 12, fp32_master=True, offload=False, hpz=4) == states(3, 6)


def test_the_plan_counts_the_users_hpz() -> None:
    """The group size comes from spec.strategy.deepspeedConfig into every candidate's
    TrainingShape, and a ZeRO-3 plan's parameter bytes hold the secondary partition."""
    hpz = {"zero_optimization": {"zero_hpz_partition_size": 8}}
    strategy = {"type": "zero3", "backend": "deepspeed"}
    plain = build_problem(make_spec(strategy=strategy))
    grouped = build_problem(make_spec(strategy={**strategy, "deepspeedConfig": hpz}))
    assert (plain.base.hpz_partition_size, grouped.base.hpz_partition_size) == (1, 8)
    m = grouped.model
    shape = TrainingShape(micro_batch_size=1, seq_len=2048, checkpointing=True)
    with_hpz = replace(shape, hpz_partition_size=8)
    params = [estimate_memory(m, s, Candidate("zero3", 16, 8)).breakdown.parameters
              for s in (shape, with_hpz)]  # fmt: skip
    assert params[1] - params[0] == -(-2 * m.total // 8)  # bf16, over a node of 8
