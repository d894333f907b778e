"""Pretrained safetensors on object storage, read by byte ranges straight into each rank's
shards: a DCP `StorageReader` over fsspec.

torch's `HuggingFaceStorageReader` opens every file with `safe_open`, which memory-maps a
local file: it cannot read `s3://`. Downloading the model first would put a whole copy on
every node's disk (and, without care, in every rank's memory). A safetensors file needs no
library to read by ranges: 8 bytes of header length, a JSON header giving each tensor's dtype,
shape and byte span, then the raw little-endian data in row-major order. So a rank reads the
headers (kilobytes), and for each slice DCP's load plan asks of it, only the rows of dim 0
the slice covers: with FSDP2's dim-0 shards that is exactly its shard's bytes. Ranges of one
file at most `gap_bytes` apart (the rows of many small tensors, a DDP rank's whole tensors
one after another) are coalesced into one request of at most `part_bytes`, the gap read and
dropped. The headers are judged before any data is read or mapped
(finetune_trainer.safetensors_header: a file shorter than its header says is refused, never
mapped past its end). The requests of a batch go out concurrently (`cat_ranges`), a batch bounded in
bytes so the raw buffers never exceed `batch_bytes` next to the shards: each slice's bytes are
written straight into its target as they arrive and each part is released once written
(finetune_trainer.slice_sink: no request copied or assembled beside its batch); a range
larger than `part_bytes` goes out as parallel parts, and each part that fails transiently is
asked again with backoff (finetune_trainer.ranged_reads). A
sharded checkpoint's `model.safetensors.index.json` decides which file each tensor is read
from (finetune_trainer.safetensors_index)."""

from __future__ import annotations

import logging
import mmap
import struct
from collections.abc import Sequence
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

from finetune_operator.api.weights_reads import READ_BATCH_BYTES
from finetune_trainer.location import Location
from finetune_trainer.ranged_reads import (
    DEFAULT_RETRY,
    GAP_BYTES,
    PART_BYTES,
    RetryPolicy,
    ShortReadError,
    cat_ranges_retrying,
    coalesce,
    dropped_bytes,
    split_range,
)
from finetune_trainer.rank_zero_read import read_on_rank0
from finetune_trainer.safetensors_header import (
    HEADER_LEN_BYTES,
    Span,
    check_header_length,
    parse_header,
    row_range,
)
from finetune_trainer.safetensors_index import (
    INDEX_NAME,
    MAX_INDEX_BYTES,
    absent,
    files_to_read,
    ignored_files,
    owned,
    parse_index,
)
from finetune_trainer.slice_sink import SliceSink

log = logging.getLogger(__name__)

BATCH_BYTES = READ_BATCH_BYTES  # counted by the planner (planner.loading)


# Bytes that did not arrive as the header promised (a short read): may pass on a restart.
WeightsReadError = ShortReadError


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


class MappedFiles:
    """Local files mapped once each, their byte ranges served from the page cache. The
    sizes were checked against the headers when the files were listed
    (safetensors_header.parse_header), so a range past a file's end means the file was
    replaced by a shorter one since: a short read. (A file cut short after it is mapped, while
    its pages are read, is still a SIGBUS: a mapping has no way to refuse.)"""

    def __init__(self) -> None:
        self._views: dict[str, memoryview] = {}

    def range(self, file: str, start: int, end: int) -> memoryview:
        view = self._views.get(file)
        if view is None:
            with open(file, "rb") as f:
                # ACCESS_COPY: a private mapping torch.frombuffer takes as writable
                # (nothing writes it; the pages stay the page cache's).
                view = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY))
            self._views[file] = view
        piece = view[start:end]
        if len(piece) != end - start:
            raise WeightsReadError(
                f"{file}: {len(piece)} bytes of {end - start} at {start} (the file was "
                "truncated or replaced since it was listed)"
            )
        return piece


class RangedSafetensorsReader(StorageReader):
    """Hugging Face safetensors under `location` (any fsspec filesystem), read by ranges.
    `bytes_read` counts the bytes of the safetensors this rank needed (the headers and the
    slices the load plan asked for) and `bytes_total` is the size of the safetensors files
    read; what it fetched besides: `bytes_gaps` (between ranges coalesced into one request,
    read and dropped) and `bytes_index` (model.safetensors.index.json); `requests` counts the
    ranges it fetched (a retry not counted again)."""

    def __init__(
        self,
        location: Location,
        *,
        batch_bytes: int = BATCH_BYTES,
        part_bytes: int = PART_BYTES,
        gap_bytes: int = GAP_BYTES,
        retry: RetryPolicy | None = None,
        shared: bool = False,
    ) -> None:
        super().__init__()
        # Rank 0 reads the listing, index and headers for every rank (rank_zero_read): only
        # for a reader every rank of the default group uses alike.
        self.shared = shared
        self._metadata: tuple[Metadata, int] | None = None
        self.location = location
        self.batch_bytes = batch_bytes
        self.part_bytes = part_bytes
        self.gap_bytes = gap_bytes
        # Looked up when reading, so that a test may replace the module's default.
        self._retry = retry
        self.storage_data: dict[MetadataIndex, Span] = {}
        self.bytes_read = 0
        self.bytes_total = 0
        self.bytes_gaps = 0
        self.bytes_index = 0
        self.requests = 0
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
        self.requests += len(got)
        return got

    def _cat(self, path: str, start: int, end: int) -> bytes:
        return self._fetch([path], [start], [end])[0]

    def _header(self, file: Location, size: int) -> dict[str, Span]:
        # Against the listed size, what the object lacks is the object's fault (a refusal);
        # a read that returns less than the object has is the network's (WeightsReadError).
        url, path = file.url, file.path
        check_header_length(url, 0, size)
        (length,) = struct.unpack("<Q", self._cat(path, 0, HEADER_LEN_BYTES))
        self.bytes_read += HEADER_LEN_BYTES
        check_header_length(url, length, size)
        raw = self._cat(path, HEADER_LEN_BYTES, HEADER_LEN_BYTES + length)
        self.bytes_read += len(raw)
        return parse_header(url, raw, HEADER_LEN_BYTES + length, size)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The tensors of every file, read once per reader (a striped load's DCP loads reuse
        them) and, `shared`, once per job (rank 0's, broadcast). A failed read is not read
        again by DCP's rank-local retry (`rank=`, which asks for a `__<rank>.metadata` no
        safetensors model has): that would repeat it, and, shared, its broadcast."""
        if kwargs.get("rank") is not None and self.failure is not None:
            raise self.failure
        try:
            if self._metadata is None:
                read = self._read_metadata
                self._metadata = read_on_rank0(read) if self.shared else read()
            metadata, self.bytes_total = self._metadata
            return metadata
        except Exception as e:
            self.failure = self.failure or e
            raise

    def _read_metadata(self) -> tuple[Metadata, int]:
        listed = {e.name: e.size for e in self.location.children() if not e.is_dir}
        index = self.location / INDEX_NAME
        weight_map = None
        if INDEX_NAME in listed:
            if listed[INDEX_NAME] > MAX_INDEX_BYTES:
                raise ValueError(f"{index.url}: {listed[INDEX_NAME]} bytes, not an index")
            raw = self._cat(index.path, 0, listed[INDEX_NAME])
            self.bytes_index += len(raw)
            weight_map = parse_index(index.url, raw)
        files = files_to_read(listed, weight_map, index.url)
        skipped = ignored_files(listed, weight_map)
        if skipped:
            log.warning("%s: not in %s, not read: %s", self.location.url, INDEX_NAME, skipped)
        self.bytes_total = sum(listed[name] for name in files)
        tensors: dict[str, TensorStorageMetadata] = {}
        storage: dict[MetadataIndex, Span] = {}
        files_of: dict[str, str] = {}
        for name in files:
            spans = self._header(self.location / name, listed[name])
            for tensor in owned(name, spans, weight_map):
                span = spans[tensor]
                if tensor in files_of:
                    # Two files holding one tensor, no index to choose: two models (or a
                    # consolidated copy beside the shards) under one prefix; which one is
                    # read would be an accident.
                    raise ValueError(
                        f"{span.file}: tensor {tensor} is also in {files_of[tensor]}: one "
                        f"model's safetensors per prefix (or a {INDEX_NAME} naming the files)"
                    )
                files_of[tensor] = span.file
                zero = torch.Size([0] * len(span.shape))
                tensors[tensor] = TensorStorageMetadata(
                    properties=TensorProperties(dtype=span.dtype),
                    size=torch.Size(span.shape),
                    chunks=[ChunkStorageMetadata(offsets=zero, sizes=torch.Size(span.shape))],
                )
                storage[MetadataIndex(fqn=tensor, offset=zero)] = span
        if weight_map is not None:
            found = {t: f.rsplit("/", 1)[-1] for t, f in files_of.items()}
            lost = absent(found, weight_map)
            if lost:
                shown = ", ".join(f"{t} (in {f})" for t, f in lost[:5])
                raise ValueError(
                    f"{index.url} maps {len(lost)} tensors to files that do not hold them: "
                    f"{shown} (an index from another save: upload the model again)"
                )
        return Metadata(state_dict_metadata=dict(tensors), storage_data=storage), self.bytes_total

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
        spans = [self._range(item) for item in items]
        if self.location.is_local:
            self._read_mapped(items, spans, planner)
            return
        ranges = [(span.file, start, end) for span, start, end in spans]
        requests = coalesce(ranges, self.gap_bytes, self.part_bytes)
        self.bytes_read += sum(end - start for _, start, end in ranges)
        self.bytes_gaps += dropped_bytes(requests, ranges)
        # Each request's range as parts (request index, start, end).
        parts: list[tuple[int, int, int]] = []
        for r, req in enumerate(requests):
            parts.extend((r, s, e) for s, e in split_range(req.start, req.end, self.part_bytes))
        # A slice's target, from its request's first part until its last byte is in.
        sinks: dict[int, SliceSink] = {}
        strip = self.location.fs._strip_protocol
        for group in batches([e - s for _, s, e in parts], self.batch_bytes):
            chosen = [parts[k] for k in group]
            raw: list[bytes | None] = list(
                self._fetch(
                    [strip(requests[r].file) for r, _, _ in chosen],
                    [s for _, s, _ in chosen],
                    [e for _, _, e in chosen],
                )
            )
            for j, (r, s, e) in enumerate(chosen):
                req = requests[r]
                data = raw[j]
                raw[j] = None  # released once its slices are written: the batch shrinks
                assert data is not None
                view = memoryview(data)
                for i in req.members:
                    span, start, end = spans[i]
                    if s == req.start:
                        sinks[i] = SliceSink(items[i], span, end - start, planner)
                    if start < e and end > s:  # the slice's bytes in this part, in order
                        sinks[i].write(view[max(start, s) - s : min(end, e) - s])
                    if i in sinks and sinks[i].done:  # committed (a slice of no bytes at once)
                        del sinks[i]
                del data, view
        assert not sinks, f"slices never completed: {sorted(sinks)}"

    def _read_mapped(
        self, items: list[ReadItem], spans: list[tuple[Span, int, int]], planner: LoadPlanner
    ) -> None:
        """A local directory's files mapped, each slice's rows copied from the page cache (as
        safetensors' own `safe_open` does): no request latency to coalesce away, no raw buffer
        of up to `batch_bytes` beside the shards, and the ranks of a node share the pages.
        Read through fsspec ranges instead, a 413 MiB file loaded 5-8x slower."""
        mapped = MappedFiles()
        for item, (span, start, end) in zip(items, spans, strict=True):
            piece = mapped.range(span.file, start, end)
            self.bytes_read += end - start
            SliceSink(item, span, end - start, planner).write(piece)

    def _range(self, item: ReadItem) -> tuple[Span, int, int]:
        span = self.storage_data[item.storage_index]
        start, end = row_range(span, item.storage_offsets, item.lengths)
        return span, start, end
