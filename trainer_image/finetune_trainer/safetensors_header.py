"""A safetensors file's header, judged before a byte of tensor data is read or mapped.

The format: 8 bytes of little-endian header length, a JSON header giving each tensor's
dtype, shape and byte span (`data_offsets`, relative to the end of the header), then the raw
data. Every reader of pretrained weights (finetune_trainer.safetensors_ranges for DCP's load
plan, finetune_trainer.remote_tensors for the whole-tensor loaders) parses headers here, so
one set of refusals holds for a directory and a bucket alike:

- a file shorter than its header's data region (a truncated copy on a volume, a download
  that stopped part way, a broken upload) is refused naming the file, the size the header
  promises and the size it has, before the file is mapped: a mapped page past the end of a
  file is a SIGBUS, and a restart would read the same file;
- a header that is not a JSON object, an entry without a dtype/shape/offsets, offsets
  reversed, a span that does not match its shape, or two spans overlapping (a corrupt or
  hand-made file: one tensor's bytes would be read as another's) is refused naming the file
  and tensor.

Pure functions: the readers do the I/O. Every error is a ValueError (a refusal: see
finetune_trainer.pretrained.weights_error)."""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

HEADER_LEN_BYTES = 8
# Bounds one header read: real headers are a few hundred KB at most.
MAX_HEADER_BYTES = 100 << 20

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class Span:
    """Where one tensor's bytes lie in its file (absolute offsets)."""

    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def check_header_length(file: str, length: int, size: int) -> None:
    """The 8-byte header length against the file's `size`: a file too short for its own
    header is refused before the header is read."""
    if size < HEADER_LEN_BYTES:
        raise ValueError(f"{file}: not a safetensors file ({size} bytes)")
    if length > min(MAX_HEADER_BYTES, size - HEADER_LEN_BYTES):
        raise ValueError(
            f"{file}: not a safetensors file, or truncated (header length {length}, {size} bytes)"
        )


def _entry(file: str, name: str, entry: Any) -> tuple[torch.dtype, tuple[int, ...], int, int]:
    if not isinstance(entry, dict):
        raise ValueError(f"{file}: tensor {name}'s header entry is {entry!r}, not an object")
    dtype = DTYPES.get(entry.get("dtype"))  # type: ignore[arg-type]
    if dtype is None:
        raise ValueError(f"{file}: tensor {name} has dtype {entry.get('dtype')!r}, not read")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    ints = (list, tuple)
    if (
        not isinstance(shape, ints)
        or not all(isinstance(n, int) and n >= 0 for n in shape)
        or not isinstance(offsets, ints)
        or len(offsets) != 2
        or not all(isinstance(n, int) and n >= 0 for n in offsets)
    ):
        raise ValueError(
            f"{file}: tensor {name} has shape {shape!r} and data_offsets {offsets!r}, not "
            "lists of non-negative integers (a damaged header)"
        )
    begin, end = offsets
    if end < begin:
        raise ValueError(f"{file}: tensor {name} has data_offsets [{begin}, {end}], reversed")
    if end - begin != math.prod(shape) * dtype.itemsize:
        raise ValueError(f"{file}: tensor {name} spans {end - begin} bytes, not {tuple(shape)}")
    return dtype, tuple(shape), begin, end


def parse_header(
    file: str, raw: bytes, data_start: int, size: int | None = None
) -> dict[str, Span]:
    """Pure: the tensors of a safetensors header (the JSON after the 8-byte length), by
    name; `data_start` = 8 + header length; `size`: the file's (or object's) size as listed,
    checked against the end of the data the header describes (see the module docstring)."""
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file}: not a safetensors file (header is not JSON: {e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{file}: not a safetensors file (header is not a JSON object)")
    spans: dict[str, Span] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, begin, end = _entry(file, name, entry)
        spans[name] = Span(file, dtype, shape, data_start + begin, data_start + end)
    # Overlap: sorted by start, each span must begin at or after the end of the one before
    # (empty tensors hold no bytes and overlap nothing).
    filled = sorted((s for s in spans.items() if s[1].end > s[1].begin), key=lambda s: s[1].begin)
    for (before, a), (name, b) in itertools.pairwise(filled):
        if b.begin < a.end:
            raise ValueError(
                f"{file}: tensors {before} and {name} overlap (bytes {b.begin}-{a.end}): "
                "a damaged header"
            )
    data_end = max((s.end for s in spans.values()), default=data_start)
    if size is not None and data_end > size:
        raise ValueError(
            f"{file}: {size} bytes, but its header's tensor data ends at byte {data_end} "
            f"(the file is truncated, {data_end - size} bytes short: copy or upload it again)"
        )
    return spans


def row_range(span: Span, offsets: Sequence[int], lengths: Sequence[int]) -> tuple[int, int]:
    """Pure: the byte range [start, end) holding the rows of dim 0 that a slice (offsets,
    lengths per dim) covers; the slice of the other dims is cut from them in memory."""
    if not span.shape:
        return span.begin, span.end
    row_bytes = math.prod(span.shape[1:]) * span.dtype.itemsize
    start = span.begin + offsets[0] * row_bytes
    return start, start + lengths[0] * row_bytes
