"""A deterministic distributed sampler whose position does not depend on the world size.

The data order is one stream of sample indices: epoch `e` is a permutation of the dataset
seeded by `seed + e`. A step takes the next `global_batch` positions of that stream; rank `r`
of `W` takes the `r`-th contiguous slice of them. The only state is `consumed` (stream
positions used), so a checkpoint written at one world size resumes at any other one: the
global batches stay the same samples, only their split over ranks changes.
"""

from __future__ import annotations

from typing import Any

import torch


class StepSampler:
    def __init__(
        self,
        *,
        num_samples: int,
        global_batch: int,
        micro_batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
    ) -> None:
        if num_samples < 1:
            raise ValueError("num_samples must be >= 1")
        if global_batch % (world_size * micro_batch_size):
            raise ValueError(
                f"global batch {global_batch} is not divisible by world size {world_size} "
                f"x micro-batch {micro_batch_size}"
            )
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.micro_batch_size = micro_batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.consumed = 0
        self._perm_epoch = -1
        self._perm: list[int] = []

    @property
    def epoch(self) -> int:
        return self.consumed // self.num_samples

    def _index(self, position: int) -> int:
        epoch, offset = divmod(position, self.num_samples)
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._perm = torch.randperm(self.num_samples, generator=g).tolist()
            self._perm_epoch = epoch
        return self._perm[offset]

    def next_step(self) -> list[list[int]]:
        """This rank's micro-batches (sample indices) for the next step; advances the stream."""
        per_rank = self.global_batch // self.world_size
        start = self.consumed + self.rank * per_rank
        mine = [self._index(start + i) for i in range(per_rank)]
        self.consumed += self.global_batch
        m = self.micro_batch_size
        return [mine[i : i + m] for i in range(0, per_rank, m)]

    def state_dict(self) -> dict[str, Any]:
        return {"consumed": self.consumed, "seed": self.seed, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["num_samples"]) != self.num_samples or int(state["seed"]) != self.seed:
            raise ValueError(
                f"sampler state is for {state['num_samples']} samples / seed {state['seed']}, "
                f"this run has {self.num_samples} / {self.seed}: the dataset changed"
            )
        self.consumed = int(state["consumed"])
