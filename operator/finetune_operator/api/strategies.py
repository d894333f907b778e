"""The one table of sharding strategies: what each (strategy, backend) shards and whether this
version's trainer runs it.

Read by the planner (which rows it searches and in what order, how each shards model states),
the capability check (api.capabilities: refuse at plan time what is not implemented) and the
trainer (finetune_trainer.parallelize dispatches on the row). A new strategy is one row here;
the planner's memory and step-time models derive what they need from its fields.

Backends use the spec's own names (`strategy.backend`): `fsdp` is the torch backend (DDP and
FSDP2 `fully_shard`), `deepspeed` is DeepSpeed's ZeRO engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Literal

from finetune_operator.api.spec import Backend, OptimizerName, StrategyName

# A concrete backend: what a plan says, never "auto".
BackendName = Literal["fsdp", "deepspeed"]
ShardedState = Literal["params", "grads", "optimizer"]
OffloadedState = Literal["params", "optimizer"]

_ALL: frozenset[ShardedState] = frozenset({"params", "grads", "optimizer"})
_OFFLOAD_ALL: frozenset[OffloadedState] = frozenset({"params", "optimizer"})
# bitsandbytes' 8-bit AdamW steps plain tensors only: FSDP2's DTensor parameters make it fail
# ("got mixed torch.Tensor and DTensor", bitsandbytes 0.50), so on torch it runs under DDP.
_TORCH_OPTIMIZERS: frozenset[OptimizerName] = frozenset({"adamw", "adamw8bit", "sgd"})
_FSDP2_OPTIMIZERS: frozenset[OptimizerName] = frozenset({"adamw", "sgd"})
# The trainer's torch optimizer handed to DeepSpeed's engine (finetune_trainer.deepspeed_engine);
# bitsandbytes' 8-bit AdamW is not wired into the engine.
_DEEPSPEED_OPTIMIZERS: frozenset[OptimizerName] = frozenset({"adamw", "sgd"})


@dataclass(frozen=True)
class Strategy:
    """One row: a strategy name as a backend runs it."""

    name: StrategyName
    backend: BackendName
    # Model states split over the shard group (the rest is replicated on every rank).
    shards: frozenset[ShardedState]
    # Sharded parameters are freed after each unit's forward and gathered again in backward
    # (ZeRO-3, FSDP full shard); False keeps them gathered from forward to backward.
    reshard_after_forward: bool
    # States `strategy.offload: cpu` moves to the host; empty: offload is refused.
    offloadable: frozenset[OffloadedState]
    # Search order by per-step communication volume, cheapest first (DESIGN §4).
    comm_rank: int
    # Whether this version's trainer runs the row; the capability check refuses it otherwise.
    implemented: bool
    # training.optimizer values the row's trainer path can step.
    optimizers: frozenset[OptimizerName]
    # Shard within a node and replicate across nodes (HSDP).
    shard_within_node: bool = False
    # Another row this one is only a name for (same wrapper, same memory): never searched
    # separately, planned and run as that row.
    runs_as: StrategyName | None = None

    @property
    def shards_params(self) -> bool:
        return "params" in self.shards

    @property
    def shards_grads(self) -> bool:
        return "grads" in self.shards

    @property
    def shards_optimizer(self) -> bool:
        return "optimizer" in self.shards

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage that shards what this row shards (0: nothing, DDP): DeepSpeed's
        `zero_optimization.stage` for a DeepSpeed row."""
        if self.shards_params:
            return 3
        if self.shards_grads:
            return 2
        return 1 if self.shards_optimizer else 0

    @property
    def replicated(self) -> bool:
        """Plain data parallel: every rank holds every state (DDP)."""
        return not self.shards

    @property
    def torch_fsdp(self) -> bool:
        """FSDP2 `fully_shard` (its sharded fp32 parameters are the master weights)."""
        return self.backend == "fsdp" and self.shards_params


@dataclass(frozen=True)
class StrategyTable:
    """The rows, with the lookups every reader shares."""

    rows: tuple[Strategy, ...]

    def __post_init__(self) -> None:
        keys = [(r.name, r.backend) for r in self.rows]
        if len(keys) != len(set(keys)):
            raise ValueError(f"duplicate (strategy, backend) rows: {keys}")
        for r in self.rows:
            if r.runs_as is not None and r.runs_as not in {x.name for x in self.rows}:
                raise ValueError(f"{r.name} on {r.backend} runs as unknown {r.runs_as}")

    def __iter__(self) -> Iterator[Strategy]:
        return iter(self.rows)

    def by_name(self, name: str) -> list[Strategy]:
        return [r for r in self.rows if r.name == name]

    def resolve(self, name: StrategyName, backend: Backend | str) -> Strategy:
        """The row that runs `name` when `backend` is asked for (the spec's `auto`, or a plan's
        backend). A backend that has no such row gives the name's own row (ddp is plain torch
        DDP whichever backend was asked; a zero1 pin under backend auto is DeepSpeed's). Among
        several, an implemented row first, then table order (zero3: fsdp before deepspeed)."""
        rows = self.by_name(name)
        if not rows:
            raise KeyError(f"unknown strategy {name!r}")
        matching = [r for r in rows if r.backend == backend]
        candidates = matching or rows
        return next((r for r in candidates if r.implemented), candidates[0])

    def effective(self, row: Strategy) -> Strategy:
        """The row whose wrapper and memory `row` has (itself, or its `runs_as` target on the
        same backend)."""
        if row.runs_as is None:
            return row
        return next(r for r in self.rows if r.name == row.runs_as and r.backend == row.backend)

    def canonical(self, name: StrategyName) -> Strategy:
        """The row a bare strategy name means to the memory model: the one that is not a name
        for another (zero3 is DeepSpeed's ZeRO-3; fsdp-full-shard is FSDP2's)."""
        return next(r for r in self.by_name(name) if r.runs_as is None)

    def searched(self, backend: Backend) -> list[Strategy]:
        """Rows `strategy.type: auto` searches, cheapest communication first.

        `backend: auto` searches every implemented row of every backend: the planner picks
        the cheapest plan this trainer runs, never one the capability check would refuse.
        An explicit backend searches that backend's rows whether implemented or not (the
        plan shows what it would take; the capability check then says it is not there yet),
        plus replicated data parallel, which is torch DDP under any backend; there the asked
        backend's rows come first, so they win ties of the step-time model (DDP and ZeRO-1
        move the same bytes)."""
        rows = [r for r in self.rows if r.runs_as is None]
        if backend == "auto":
            return sorted((r for r in rows if r.implemented), key=lambda r: r.comm_rank)
        rows = [r for r in rows if r.backend == backend or r.replicated]
        return sorted(rows, key=lambda r: (r.backend != backend, r.comm_rank))

    def implementing(self, rows: Iterable[tuple[StrategyName, BackendName]]) -> StrategyTable:
        """A copy with `rows` marked implemented (tests of the planner as a backend lands)."""
        wanted = set(rows)
        unknown = wanted - {(r.name, r.backend) for r in self.rows}
        if unknown:
            raise KeyError(f"no such rows: {sorted(unknown)}")
        return StrategyTable(
            tuple(
                replace(r, implemented=r.implemented or (r.name, r.backend) in wanted)
                for r in self.rows
            )
        )

    def without(self, backend: BackendName) -> StrategyTable:
        """A copy with every row of `backend` marked not implemented."""
        return StrategyTable(
            tuple(replace(r, implemented=r.implemented and r.backend != backend) for r in self.rows)
        )


STRATEGIES = StrategyTable(
    (
        Strategy(
            "ddp", "fsdp", frozenset(), False, frozenset(), 0,
            implemented=True, optimizers=_TORCH_OPTIMIZERS,
        ),
        Strategy(
            "zero1", "deepspeed", frozenset({"optimizer"}), False, frozenset({"optimizer"}), 1,
            implemented=True, optimizers=_DEEPSPEED_OPTIMIZERS,
        ),
        Strategy(
            "zero2", "deepspeed", frozenset({"grads", "optimizer"}), False,
            frozenset({"optimizer"}), 2,
            implemented=True, optimizers=_DEEPSPEED_OPTIMIZERS,
        ),
        Strategy(
            "fsdp-shard-grad-op", "fsdp", _ALL, False, _OFFLOAD_ALL, 3,
            implemented=True, optimizers=_FSDP2_OPTIMIZERS,
        ),
        Strategy(
            "fsdp-hybrid", "fsdp", _ALL, True, _OFFLOAD_ALL, 4,
            implemented=True, optimizers=_FSDP2_OPTIMIZERS, shard_within_node=True,
        ),
        Strategy(
            "fsdp-full-shard", "fsdp", _ALL, True, _OFFLOAD_ALL, 5,
            implemented=True, optimizers=_FSDP2_OPTIMIZERS,
        ),
        # zero3 on the torch backend is FSDP2 full shard under another name. Before the
        # DeepSpeed row: a zero3 pin under backend auto stays FSDP2 (resolve: table order).
        Strategy(
            "zero3", "fsdp", _ALL, True, _OFFLOAD_ALL, 6,
            implemented=True, optimizers=_FSDP2_OPTIMIZERS, runs_as="fsdp-full-shard",
        ),
        Strategy(
            "zero3", "deepspeed", _ALL, True, _OFFLOAD_ALL, 6,
            implemented=True, optimizers=_DEEPSPEED_OPTIMIZERS,
        ),
    )
)  # fmt: skip
