"""Pretrained safetensors on object storage, read by byte ranges straight into each rank's
shards: a DCP `StorageReader` over fsspec.

torch's `HuggingFaceStorageReader` opens every file with `safe_open`, which memory-maps a
local file: it cannot read `s3://`. Downloading the model first would put a whole copy on
every node's disk (and, without care, in every rank's memory). A safetensors file needs no
library to read by ranges: 8 bytes of header length, a JSON header giving each tensor's dtype,
shape and byte span, then the raw little-endian data in row-major order. So a rank reads the
headers (kilobytes), and for each slice DCP's load plan asks of it, only the rows of dim 0
the slice covers: with FSDP2's dim-0 shards that is exactly its shard's bytes. The requests
of a batch go out concurrently (`cat_ranges`), a batch bounded in bytes so the raw buffers
never exceed `batch_bytes` next to the shards (plus the tensor being assembled); a range
larger than `part_bytes` goes out as parallel parts, and each part that fails transiently is
asked again with backoff (finetune_trainer.ranged_reads)."""

from __future__ import annotations

import json
import logging
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from finetune_trainer.location import Location
from finetune_trainer.ranged_reads import (
    DEFAULT_RETRY,
    PART_BYTES,
    RetryPolicy,
    ShortReadError,
    cat_ranges_retrying,
    split_range,
)

log = logging.getLogger(__name__)

SUFFIX = ".safetensors"
HEADER_LEN_BYTES = 8
# Bounds one header read: real headers are a few hundred KB at most.
MAX_HEADER_BYTES = 100 << 20
BATCH_BYTES = 256 << 20

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


# Bytes that did not arrive as the header promised (a short read): may pass on a restart.
WeightsReadError = ShortReadError


@dataclass(frozen=True)
class Span:
    """Where one tensor's bytes lie in its file (absolute offsets)."""

    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def parse_header(
    file: str, raw: bytes, data_start: int, size: int | None = None
) -> dict[str, Span]:
    """Pure: the tensors of a safetensors header (the JSON after the 8-byte length), by
    name; `data_start` = 8 + header length. A dtype this reader does not know, a span that
    does not match its shape, or one past the file's listed `size` (a truncated upload: no
    restart reads bytes the object does not have) is an error naming the file and tensor."""
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file}: not a safetensors file (header is not JSON: {e})") from None
    spans: dict[str, Span] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = DTYPES.get(entry.get("dtype"))
        if dtype is None:
            raise ValueError(f"{file}: tensor {name} has dtype {entry.get('dtype')!r}, not read")
        shape = tuple(int(n) for n in entry["shape"])
        begin, end = (int(x) for x in entry["data_offsets"])
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"{file}: tensor {name} spans {end - begin} bytes, not {shape}")
        if size is not None and data_start + end > size:
            raise ValueError(
                f"{file}: tensor {name} ends at byte {data_start + end}, but the object has "
                f"{size} (truncated: upload it again)"
            )
        spans[name] = Span(file, dtype, shape, data_start + begin, data_start + end)
    return spans


def row_range(span: Span, offsets: Sequence[int], lengths: Sequence[int]) -> tuple[int, int]:
    """Pure: the byte range [start, end) holding the rows of dim 0 that a slice (offsets,
    lengths per dim) covers; the slice of the other dims is cut from them in memory."""
    if not span.shape:
        return span.begin, span.end
    row_bytes = math.prod(span.shape[1:]) * span.dtype.itemsize
    start = span.begin + offsets[0] * row_bytes
    return start, start + lengths[0] * row_bytes


def batches(sizes: Sequence[int], limit: int) -> list[list[int]]:
    """Pure: indices grouped in order, each group's sizes summing to at most `limit` (a
    single larger item gets a group of its own)."""
    out: list[list[int]] = []
    total = 0
    for i, size in enumerate(sizes):
        if out and total + size <= limit:
            out[-1].append(i)
            total += size
        else:
            out.append([i])
            total = size
    return out


class RangedSafetensorsReader(StorageReader):
    """Hugging Face safetensors under `location` (any fsspec filesystem), read by ranges.
    `bytes_read` counts what this rank fetched (headers included); `bytes_total` is the size
    of the safetensors files."""

    def __init__(
        self,
        location: Location,
        *,
        batch_bytes: int = BATCH_BYTES,
        part_bytes: int = PART_BYTES,
        retry: RetryPolicy | None = None,
    ) -> None:
        super().__init__()
        self.location = location
        self.batch_bytes = batch_bytes
        self.part_bytes = part_bytes
        # Looked up when reading, so that a test may replace the module's default.
        self._retry = retry
        self.storage_data: dict[MetadataIndex, Span] = {}
        self.bytes_read = 0
        self.bytes_total = 0
        # The first error of a read, as raised: DCP flattens a metadata read's error into
        # an AssertionError's text, which the caller cannot classify.
        self.failure: BaseException | None = None

    def reset(self, checkpoint_id: Any = None) -> None:
        self.storage_data = {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False  # never chosen by DCP itself: only passed explicitly

    @property
    def retry(self) -> RetryPolicy:
        return self._retry or DEFAULT_RETRY

    def _fetch(self, paths: list[str], starts: list[int], ends: list[int]) -> list[bytes]:
        fs = self.location.fs
        urls = [str(fs.unstrip_protocol(p)) for p in paths]
        got = cat_ranges_retrying(fs, paths, starts, ends, urls, self.retry)
        self.bytes_read += sum(len(b) for b in got)
        return got

    def _cat(self, path: str, start: int, end: int) -> bytes:
        return self._fetch([path], [start], [end])[0]

    def _header(self, path: str, size: int) -> dict[str, Span]:
        # Against the listed size, what the object lacks is the object's fault (a refusal);
        # a read that returns less than the object has is the network's (WeightsReadError).
        url = self.location.fs.unstrip_protocol(path)
        if size < HEADER_LEN_BYTES:
            raise ValueError(f"{url}: not a safetensors file ({size} bytes)")
        (length,) = struct.unpack("<Q", self._cat(path, 0, HEADER_LEN_BYTES))
        if length > min(MAX_HEADER_BYTES, size - HEADER_LEN_BYTES):
            raise ValueError(
                f"{url}: not a safetensors file, or truncated (header length {length}, "
                f"{size} bytes)"
            )
        raw = self._cat(path, HEADER_LEN_BYTES, HEADER_LEN_BYTES + length)
        return parse_header(url, raw, HEADER_LEN_BYTES + length, size)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        try:
            return self._read_metadata()
        except Exception as e:
            self.failure = self.failure or e
            raise

    def _read_metadata(self) -> Metadata:
        files = sorted(
            (e for e in self.location.children() if e.name.endswith(SUFFIX) and not e.is_dir),
            key=lambda e: e.name,
        )
        self.bytes_total = sum(e.size for e in files)
        tensors: dict[str, TensorStorageMetadata] = {}
        storage: dict[MetadataIndex, Span] = {}
        files_of: dict[str, str] = {}
        for entry in files:
            path = (self.location / entry.name).path
            for name, span in self._header(path, entry.size).items():
                if name in files_of:
                    # Two files holding one tensor: two models (or a consolidated copy beside
                    # the shards) under one prefix; which one is read would be an accident.
                    raise ValueError(
                        f"{span.file}: tensor {name} is also in {files_of[name]}: one model's "
                        "safetensors per prefix"
                    )
                files_of[name] = span.file
                zero = torch.Size([0] * len(span.shape))
                tensors[name] = TensorStorageMetadata(
                    properties=TensorProperties(dtype=span.dtype),
                    size=torch.Size(span.shape),
                    chunks=[ChunkStorageMetadata(offsets=zero, sizes=torch.Size(span.shape))],
                )
                storage[MetadataIndex(fqn=name, offset=zero)] = span
        return Metadata(state_dict_metadata=dict(tensors), storage_data=storage)

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        try:
            self._read_data(plan, planner)
        except Exception as e:
            self.failure = self.failure or e
            raise
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_data(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        items = list(plan.items)
        # Each item's range as parts (item index, start, end, offset in the item's bytes).
        parts: list[tuple[int, int, int, int]] = []
        buffers: dict[int, bytearray] = {}
        left: dict[int, int] = {}
        spans = [self._range(item) for item in items]
        for i, (_, start, end) in enumerate(spans):
            pieces = split_range(start, end, self.part_bytes)
            left[i] = len(pieces)
            parts.extend((i, s, e, s - start) for s, e in pieces)
        strip = self.location.fs._strip_protocol
        for group in batches([e - s for _, s, e, _ in parts], self.batch_bytes):
            chosen = [parts[k] for k in group]
            raw = self._fetch(
                [strip(spans[i][0].file) for i, _, _, _ in chosen],
                [s for _, s, _, _ in chosen],
                [e for _, _, e, _ in chosen],
            )
            for (i, s, e, at), data in zip(chosen, raw, strict=True):
                _, start, end = spans[i]
                if (s, e) == (start, end):
                    whole = bytearray(data)  # the item in one part
                else:
                    whole = buffers.setdefault(i, bytearray(end - start))
                    whole[at : at + (e - s)] = data
                left[i] -= 1
                if left[i] == 0:
                    buffers.pop(i, None)
                    self._copy(items[i], spans[i][0], whole, planner)

    def _range(self, item: ReadItem) -> tuple[Span, int, int]:
        span = self.storage_data[item.storage_index]
        start, end = row_range(span, item.storage_offsets, item.lengths)
        return span, start, end

    @staticmethod
    def _copy(item: ReadItem, span: Span, data: bytearray, planner: LoadPlanner) -> None:
        rows = torch.frombuffer(data, dtype=span.dtype)
        if span.shape:
            rows = rows.view(-1, *span.shape[1:])
            rest = tuple(
                slice(o, o + n)
                for o, n in zip(item.storage_offsets[1:], item.lengths[1:], strict=True)
            )
            rows = rows[(slice(None), *rest)]
        else:
            rows = rows.view(())
        target = planner.resolve_tensor(item).detach()
        if target.size() != rows.size():
            raise ValueError(
                f"{span.file}: {item.storage_index.fqn} slice {tuple(rows.size())} does not fit "
                f"{tuple(target.size())}"
            )
        target.copy_(rows)
        planner.commit_tensor(item, target)
