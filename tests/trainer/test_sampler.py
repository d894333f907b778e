"""The step sampler: same global batches at any world size, position survives resharding."""

from __future__ import annotations

import pytest

from finetune_trainer.sampler import StepSampler


def sampler(
    world: int, rank: int, *, n: int = 37, gb: int = 8, micro_batch_size: int = 2
) -> StepSampler:
    return StepSampler(
        num_samples=n,
        global_batch=gb,
        micro_batch_size=micro_batch_size,
        rank=rank,
        world_size=world,
        seed=7,
    )


def global_step(world: int, samplers: list[StepSampler]) -> list[int]:
    return [i for s in samplers for mb in s.next_step() for i in mb]


@pytest.mark.parametrize("world", [1, 2, 4], ids=["w1", "w2", "w4"])
def test_global_batches_do_not_depend_on_world_size(world: int) -> None:
    ref = [sampler(1, 0)]
    ranks = [sampler(world, r) for r in range(world)]
    for _ in range(12):  # crosses two epoch boundaries (37 samples, 8 per step)
        assert global_step(world, ranks) == global_step(1, ref)


def test_micro_batches_split_the_rank_share() -> None:
    s = sampler(2, 1)
    steps = s.next_step()
    assert [len(mb) for mb in steps] == [2, 2]  # 8 / 2 ranks = 4 = 2 micro-batches of 2


def test_position_resumes_at_another_world_size() -> None:
    two = [sampler(2, r) for r in range(2)]
    for _ in range(5):
        global_step(2, two)
    state = two[0].state_dict()
    assert state["consumed"] == 40
    one = sampler(1, 0)
    one.load_state_dict(state)
    expected = global_step(2, two)
    assert global_step(1, [one]) == expected


def test_every_epoch_is_a_permutation_and_epochs_differ() -> None:
    s = StepSampler(
        num_samples=16, global_batch=16, micro_batch_size=16, rank=0, world_size=1, seed=3
    )
    e0, e1 = s.next_step()[0], s.next_step()[0]
    assert sorted(e0) == sorted(e1) == list(range(16))
    assert e0 != e1
    assert s.epoch == 2


def test_refuses_indivisible_batch() -> None:
    with pytest.raises(ValueError, match="not divisible"):
        sampler(3, 0)


def test_refuses_state_of_another_dataset() -> None:
    s = sampler(1, 0)
    with pytest.raises(ValueError, match="dataset changed"):
        s.load_state_dict({"consumed": 8, "seed": 7, "num_samples": 99})
