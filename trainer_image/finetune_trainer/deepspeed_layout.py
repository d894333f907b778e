"""Where a DeepSpeed checkpoint's tensors lie in storage: each rank writes its own chunk.

A DeepSpeed checkpoint (deepspeed_checkpoint) holds one fp32 tensor per trainable parameter and
key (the master weight, each optimizer state). Two layouts, told apart by their keys:

- **chunked** (written since this module): `model.chunked.<name>` and
  `optim.chunked.<name>.<state>`, each the parameter's *flattened* tensor (`numel` elements)
  saved as a DTensor sharded `Shard(0)` over a 1-D mesh of the saving world: rank r of N
  writes elements [r*c, min(numel, (r+1)*c)) with c = ceil(numel/N) (torch.chunk's rule).
  That is exactly ZeRO-3's partition of the parameter (DeepSpeed pads each parameter to a
  multiple of the world and gives every rank `ceil(numel/N)` elements), so a ZeRO-3 rank
  saves its partition as it holds it (no gather), and a ZeRO-3 resume at M ranks asks DCP for
  its own partition only: DCP reads the saved chunks overlapping it (at most ceil(N/M)+1 of
  them, each read whole), not the whole tensor. Flat, because ZeRO's partitions are ranges of
  the flattened parameter, not rows: a row-sharded tensor would cut them across chunks.
- **whole** (written before): `model.<name>` and `optim.<name>.<state>`, one full-shaped tensor
  each, written by one rank. DCP reads a saved tensor whole, so a rank that needs any part of it
  reads all of it. Still loaded (deepspeed_resume), at any stage and world size.

What a rank reads at a resume (deepspeed_resume) follows from what DeepSpeed's fragment setters
need: ZeRO-3 its partition; ZeRO-1/2 its fragment of each parameter that overlaps its fp32
partition (`_hp_mapping`), an arbitrary range of the flattened parameter that no DTensor
placement states, asked of DCP through RangeLoadPlanner. Chunked, either reads only the saved
chunks overlapping what the rank holds: ~1/M of the checkpoint plus the chunks at partition
boundaries; whole, the tensors it needs any part of, whole.

A flattened tensor's DCP metadata has its element count only, so a model whose parameters
have the same names and counts but other shapes (hidden 64 / intermediate 128 against 128 /
64: the MLP's matrices transposed) would load into the wrong layout. So a chunked save records
each trainable parameter's full shape in the COMMITTED marker (`SHAPES_KEY`, written with the
manifest by rank 0; read back by every rank before the load), and the compatibility check
(checkpoint_compat) compares those full shapes (`comparable_shapes`). A chunked checkpoint
written before the record has none: it is compared on counts only, as it was.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from finetune_trainer.checkpoint_compat import Shape

CHUNKED = "chunked"  # the chunked layout's keys: model.chunked.<name>, optim.chunked.<name>.<k>
# The COMMITTED marker's record of a chunked save: trainable parameter name -> its full shape.
SHAPES_KEY = "parameterShapes"


def chunk_range(numel: int, world: int, rank: int) -> tuple[int, int]:
    """(start, length) of rank's chunk of a flattened tensor of `numel` elements at `world`
    ranks: torch.chunk's rule, as DTensor's Shard(0) and ZeRO-3's partitions cut it (the last
    ranks' chunks are short or empty)."""
    size = -(-numel // world)
    start = min(rank * size, numel)
    return start, max(0, min(size, numel - start))


def is_chunked(saved_keys: Iterable[str]) -> bool:
    prefixes = (f"model.{CHUNKED}.", f"optim.{CHUNKED}.")
    return any(k.startswith(prefixes) for k in saved_keys)


def saved_shapes(
    name: str, shape: torch.Size, state_keys: Iterable[str], *, chunked: bool
) -> dict[str, tuple[int, ...]]:
    """The keys one trainable parameter has in a checkpoint of the given layout, with their
    full (global) sizes, as DCP's metadata lists them."""
    if chunked:
        flat = (shape.numel(),)
        return {
            f"model.{CHUNKED}.{name}": flat,
            **{f"optim.{CHUNKED}.{name}.{k}": flat for k in state_keys},
        }
    full = tuple(int(n) for n in shape)
    return {f"model.{name}": full, **{f"optim.{name}.{k}": full for k in state_keys}}


def _param_of(key: str) -> str | None:
    """The parameter a chunked key belongs to (None: not a chunked key)."""
    for prefix in (f"model.{CHUNKED}.", f"optim.{CHUNKED}."):
        if key.startswith(prefix):
            rest = key[len(prefix) :]
            return rest if prefix.startswith("model") else rest.rsplit(".", 1)[0]
    return None


def _dims(value: Any) -> tuple[int, ...] | None:
    """A recorded shape, or None where the record does not hold one."""
    if isinstance(value, list) and all(isinstance(n, int) and n >= 0 for n in value):
        return tuple(value)
    return None


def _unflatten(
    shapes: Mapping[str, Shape], record: Mapping[str, Sequence[int]]
) -> dict[str, Shape]:
    """`shapes` with each chunked key of a parameter in `record` given its full shape, where
    the counts agree (else left flat: the difference is reported on the counts)."""
    out = dict(shapes)
    for key, shape in shapes.items():
        name = _param_of(key)
        full = record.get(name) if name is not None else None
        flat = shape[0] if shape is not None and len(shape) == 1 else None
        if full is not None and flat is not None and torch.Size(full).numel() == flat:
            out[key] = tuple(full)
    return out


def comparable_shapes(
    saved: Mapping[str, Shape],
    expected: Mapping[str, Shape],
    saved_record: Any,
    job_record: Mapping[str, Sequence[int]],
) -> tuple[dict[str, Shape], dict[str, Shape]]:
    """The checkpoint's shapes (`saved`, from DCP's metadata) and the job's (`expected`) to
    compare (checkpoint_compat.compare): for a chunked checkpoint whose marker recorded its
    parameters' full shapes (`saved_record`, the marker's `SHAPES_KEY`), each chunked key with
    its parameter's full shape on both sides (the job's from `job_record`), so that a model
    with the same counts but other shapes differs. Otherwise unchanged: a whole-layout
    checkpoint's tensors are full-shaped anyway; and a chunked checkpoint written before the
    record (no `saved_record`) can only be compared on element counts, which still refuses
    any parameter added, removed or resized, and still loads as before."""
    if not is_chunked(saved) or not isinstance(saved_record, Mapping):
        return dict(saved), dict(expected)
    recorded = {str(n): d for n, v in saved_record.items() if (d := _dims(v)) is not None}
    # Only the parameters the checkpoint recorded: one it did not is compared on counts on
    # both sides, never full against flat.
    mine = {n: tuple(s) for n, s in job_record.items() if n in recorded}
    return _unflatten(saved, recorded), _unflatten(expected, mine)


class ChunkedLayout:
    """The chunked layout at this world: wraps a rank's chunk as the DTensor DCP saves, and
    makes the templates a resume reads a rank's chunk into."""

    def __init__(self) -> None:
        # The training group spans the world (DeepSpeed's data-parallel group); the mesh only
        # gives DCP each rank's coordinate (no collective runs on it: the DTensors are built
        # with run_check=False and DCP uses its own checkpoint group).
        world = dist.group.WORLD
        if world is None:
            raise RuntimeError("the chunked layout needs the default process group")
        self.mesh = DeviceMesh.from_group(world, "cpu")
        self.world = dist.get_world_size()
        self.rank = dist.get_rank()

    def chunk(self, numel: int) -> tuple[int, int]:
        return chunk_range(numel, self.world, self.rank)

    def wrap(self, local: torch.Tensor, numel: int) -> DTensor:
        """This rank's chunk (a 1-D host tensor of `chunk(numel)`'s length) as a shard of the
        flattened tensor."""
        if local.numel() != self.chunk(numel)[1]:
            raise ValueError(
                f"rank {self.rank}'s chunk of a {numel}-element tensor has {local.numel()} "
                f"elements, expected {self.chunk(numel)[1]}"
            )
        return DTensor.from_local(
            local.reshape(-1), self.mesh, [Shard(0)], run_check=False,
            shape=torch.Size([numel]), stride=(1,),
        )  # fmt: skip

    def template(self, numel: int) -> DTensor:
        """Where DCP reads this rank's chunk of a chunked tensor into (fp32, on the host)."""
        return self.wrap(torch.empty(self.chunk(numel)[1], dtype=torch.float32), numel)


class RangeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but each 1-D tensor of the state dict it is given receives
    elements [start, start + its length) of the saved flattened tensor of its key (`starts`:
    flattened key -> start), not the whole: DCP then reads only the saved chunks that overlap
    that range (each whole) and copies the overlap in. What a ZeRO-1/2 rank holds of a
    parameter is such a range (`lp_fragment_address`), which no DTensor placement can state.
    Every key of the state dict must have a start (a chunked checkpoint's tensors only)."""

    def __init__(self, starts: Mapping[str, int]) -> None:
        super().__init__()
        self.starts = dict(starts)

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None  # given by DCP's load before planning
        items: list[ReadItem] = []
        for fqn, local in self.state_dict.items():
            saved = self.metadata.state_dict_metadata.get(fqn)
            start, length = self.starts[fqn], int(local.numel())
            if not isinstance(saved, TensorStorageMetadata) or len(saved.size) != 1:
                raise ValueError(f"checkpoint key {fqn}: not a flattened tensor ({saved!r})")
            if start < 0 or start + length > saved.size[0]:
                raise ValueError(
                    f"checkpoint key {fqn}: elements [{start}, {start + length}) asked of a "
                    f"{saved.size[0]}-element tensor"
                )
            if length == 0:
                continue  # DCP would still read the chunk at `start`, whole, for nothing
            wanted = ChunkStorageMetadata(torch.Size([start]), torch.Size([length]))
            items += create_read_items_for_chunk_list(fqn, saved, [wanted])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        # The plain tensor holds the range itself: the read items' destination offsets are
        # already relative to its start (create_read_items_for_chunk_list).
        tensor: torch.Tensor = self.state_dict[index.fqn]
        return tensor
