"""One read item's bytes, as stored in a safetensors file, written into the tensor DCP resolves
for it as they arrive: in order, in pieces of any size and alignment (the parts of a ranged
request, a slice of a mapped file).

The reader (finetune_trainer.safetensors_ranges) holds the raw bytes of a batch of requests,
at most READ_BATCH_BYTES, and the planner counts exactly that (planner.loading). Assembling
a request in a buffer of its own (a copy of its one part, or of its parts, up to a whole
tensor read by a DDP rank) or copying a piece to align it for its dtype held up to one
request more, on every rank. Here nothing is held beside the raw bytes but a few bytes of
an element split between two parts and, for a dtype conversion, STAGE_BYTES at a time (a
fixed staging tensor for a misaligned piece):
- the same dtype (the common case: shards and replicas in the file's dtype): the bytes are
  copied into the target's own bytes (a uint8 view: no alignment to respect);
- another dtype (bf16 files into an fp32 master): whole elements are converted straight
  from the piece if it is aligned for the stored dtype, through the staging tensor if not,
  STAGE_BYTES of the piece per copy (a copy to a GPU converts on the host first: its
  temporary stays that size).
A target that is not the slice's contiguous rows (a slice of dims past 0, a non-contiguous
target) gets its bytes assembled first (one copy of the slice, as before): no loader here
asks for one (FSDP2 shards dim 0; DDP and ZeRO read whole rows)."""

from __future__ import annotations

import warnings

import torch
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from finetune_trainer.safetensors_header import Span

# A conversion goes this much of a piece at a time (a multiple of every dtype's size).
STAGE_BYTES = 1 << 20


def from_bytes(data: memoryview, dtype: torch.dtype) -> torch.Tensor:
    """A tensor over `data` (non-empty), not a copy. The bytes of a GET are an immutable
    `bytes`: torch warns that writing through such a tensor is undefined; nothing does (it is
    only ever a copy's source)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(data, dtype=dtype)


def full_rows(item: ReadItem, span: Span) -> bool:
    """Pure: whether the slice is whole rows of dim 0 (every later dim whole), so that its
    bytes as stored are its elements in row-major order."""
    return all(
        o == 0 and n == d
        for o, n, d in zip(item.storage_offsets[1:], item.lengths[1:], span.shape[1:], strict=True)
    )


class SliceSink:
    """Receives the `nbytes` bytes of `item` (a slice of `span`'s tensor) through `write`,
    in order, and commits the target to `planner` once the last byte is in (at once if the
    slice has none)."""

    def __init__(self, item: ReadItem, span: Span, nbytes: int, planner: LoadPlanner) -> None:
        self.item, self.span, self.nbytes, self.planner = item, span, nbytes, planner
        self.target = planner.resolve_tensor(item).detach()
        want = tuple(item.lengths) if span.shape else ()
        if tuple(self.target.size()) != want:
            raise ValueError(
                f"{span.file}: {item.storage_index.fqn} slice {want} does not fit "
                f"{tuple(self.target.size())}"
            )
        self.pos = 0  # bytes received
        self.done = False
        self._buffer: bytearray | None = None
        self._carry = bytearray()  # the start of an element split between two pieces
        self._stage: torch.Tensor | None = None
        streamed = self.target.is_contiguous() and full_rows(item, span)
        if not streamed:
            self._buffer = bytearray(nbytes)
        else:
            self._flat = self.target.view(-1)
            self._elements = 0  # elements written
            if self.target.dtype == span.dtype:
                self._bytes: torch.Tensor | None = self._flat.view(torch.uint8)
            else:
                self._bytes = None
        self._finish_if_complete()

    def write(self, piece: memoryview) -> None:
        n = len(piece)
        if self.pos + n > self.nbytes:
            raise ValueError(f"{self.span.file}: more bytes than {self.item.storage_index.fqn}")
        if n:
            if self._buffer is not None:
                self._buffer[self.pos : self.pos + n] = piece
            elif self._bytes is not None:
                self._bytes[self.pos : self.pos + n].copy_(from_bytes(piece, torch.uint8))
            else:
                self._convert(piece)
            self.pos += n
        self._finish_if_complete()

    def _convert(self, piece: memoryview) -> None:
        size = self.span.dtype.itemsize
        if self._carry:
            take = min(size - len(self._carry), len(piece))
            self._carry += piece[:take]
            piece = piece[take:]
            if len(self._carry) == size:
                self._write_elements(memoryview(self._carry))
                self._carry = bytearray()
        whole = len(piece) // size * size
        if whole:
            self._write_elements(piece[:whole])
        if whole < len(piece):
            self._carry += piece[whole:]

    def _write_elements(self, data: memoryview) -> None:
        dtype, size = self.span.dtype, self.span.dtype.itemsize
        raw = from_bytes(data, torch.uint8)
        count = len(data) // size
        dst = self._flat[self._elements : self._elements + count]
        if raw.data_ptr() % size == 0:
            stage = None
        else:  # misaligned for its dtype: each chunk through the staging tensor
            if self._stage is None:
                self._stage = torch.empty(STAGE_BYTES, dtype=torch.uint8)
            stage = self._stage
        # STAGE_BYTES at a time, aligned or not: a converting copy into a CUDA target first
        # converts the whole source on the host (torch's copy_requires_temporaries), which
        # would be a temporary of a whole part in the target's dtype (128 MiB for a 64 MiB
        # bf16 part into fp32) beside the batch the planner counts.
        for k in range(0, len(data), STAGE_BYTES):
            chunk = raw[k : k + STAGE_BYTES]
            if stage is not None:
                chunk = stage[: len(chunk)].copy_(chunk)
            dst[k // size : (k + len(chunk)) // size].copy_(chunk.view(dtype))
        self._elements += count

    def _finish_if_complete(self) -> None:
        if self.done or self.pos < self.nbytes:
            return
        if self._buffer is not None:
            copy_rows(self.item, self.span, memoryview(self._buffer), self.target)
            self._buffer = None
        self.done = True
        self._stage = None
        self.planner.commit_tensor(self.item, self.target)


def copy_rows(item: ReadItem, span: Span, data: memoryview, target: torch.Tensor) -> None:
    """`data` (the slice's rows of dim 0 as stored, aligned for its dtype) into `target`,
    taking the slice's part of each later dim."""
    # frombuffer refuses an empty buffer
    rows = from_bytes(data, span.dtype) if len(data) else torch.empty(0, dtype=span.dtype)
    if span.shape:
        # The slice's row count, not -1: a (N, 0) tensor's rows hold no bytes to count.
        rows = rows.view(item.lengths[0], *span.shape[1:])
        rest = tuple(
            slice(o, o + n) for o, n in zip(item.storage_offsets[1:], item.lengths[1:], strict=True)
        )
        rows = rows[(slice(None), *rest)]
    else:
        rows = rows.view(())
    target.copy_(rows)
