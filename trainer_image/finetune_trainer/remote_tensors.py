"""Whole safetensors tensors read from an object-store prefix (by byte ranges) or a local
directory (mapped), for the loaders that do not fill their parameters through DCP's load plan:

- DeepSpeed ZeRO-3 (finetune_trainer.deepspeed_loading): rank 0 reads one module's tensors at
  a time, DeepSpeed broadcasts them;
- QLoRA (finetune_trainer.model): transformers quantises while loading, one tensor at a time,
  from lazy tensors (`lazy_state_dict`) that read their bytes when it asks for them.

The headers come from the DCP reader's own metadata read (RangedSafetensorsReader: the same
validation, the same refusals), the bytes through the same retried, split ranged GETs
(finetune_trainer.ranged_reads): one client, one retry policy for every s3:// weights read.
A local directory's files are mapped (safetensors_ranges.MappedFiles) after the same header
checks, so a truncated file is refused naming it, and a sharded checkpoint's index decides
which file each tensor comes from, on a volume as on a bucket. `bytes_read` counts what this
process fetched, headers included."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from finetune_trainer.errors import UnsupportedConfigError
from finetune_trainer.location import Location
from finetune_trainer.pretrained import weights_error
from finetune_trainer.ranged_reads import (
    PART_BYTES,
    RetryPolicy,
    cat_ranges_retrying,
    split_range,
)
from finetune_trainer.safetensors_header import DTYPES, Span
from finetune_trainer.safetensors_ranges import MappedFiles, RangedSafetensorsReader

if TYPE_CHECKING:
    from transformers import PretrainedConfig

log = logging.getLogger(__name__)

# safetensors' own dtype names, as a lazy tensor reports them (transformers asks `get_dtype`).
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class SafetensorsSource:
    """The safetensors under `location` (a prefix or a local directory): their headers read
    at construction (every tensor's name, dtype, shape and byte span), tensors read whole on
    demand."""

    def __init__(
        self,
        location: Location,
        *,
        part_bytes: int = PART_BYTES,
        retry: RetryPolicy | None = None,
        shared: bool = False,
    ) -> None:
        self.location = location
        self.part_bytes = part_bytes
        # shared: rank 0 reads the headers for every rank (a caller every rank reaches alike).
        self._reader = RangedSafetensorsReader(
            location, part_bytes=part_bytes, retry=retry, shared=shared
        )
        try:
            found = any(e.name.endswith(".safetensors") for e in location.children())
            metadata = self._reader.read_metadata() if found else None
        except (OSError, ValueError) as e:
            raise weights_error(location, e) from e
        if metadata is None:
            where = "files in" if location.is_local else "objects under"
            raise UnsupportedConfigError(
                f"spec.model: no *.safetensors {where} {location.url} (the trainer "
                "reads Hugging Face safetensors; convert .bin checkpoints with save_pretrained)"
            )
        self.spans: dict[str, Span] = {
            index.fqn: span for index, span in metadata.storage_data.items()
        }
        self.bytes_total = self._reader.bytes_total
        self._data_bytes = 0
        self._lock = threading.Lock()  # transformers may materialise from worker threads
        self._mapped = MappedFiles() if location.is_local else None

    @property
    def bytes_read(self) -> int:
        return self._reader.bytes_read + self._data_bytes

    def shape(self, name: str) -> tuple[int, ...] | None:
        span = self.spans.get(name)
        return None if span is None else span.shape

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The named tensors, whole, in their stored dtype: every range (split into parts of
        `part_bytes`) requested concurrently, each part retried on its own."""
        names = list(names)
        spans = [self.spans[n] for n in names]
        if self._mapped is not None:
            return self._read_mapped(names, spans, self._mapped)
        parts = [
            (i, s, e)
            for i, sp in enumerate(spans)
            for s, e in split_range(sp.begin, sp.end, self.part_bytes)
        ]
        fs = self.location.fs
        try:
            got = cat_ranges_retrying(
                fs,
                [fs._strip_protocol(spans[i].file) for i, _, _ in parts],
                [s for _, s, _ in parts],
                [e for _, _, e in parts],
                [spans[i].file for i, _, _ in parts],
                self._reader.retry,
            )
        except (OSError, ValueError) as e:
            raise weights_error(self.location, e) from e
        buffers = [bytearray(sp.end - sp.begin) for sp in spans]
        for (i, s, _), data in zip(parts, got, strict=True):
            at = s - spans[i].begin
            buffers[i][at : at + len(data)] = data
        with self._lock:
            self._data_bytes += sum(len(b) for b in got)
        return _tensors(names, spans, buffers)

    def _read_mapped(
        self, names: list[str], spans: list[Span], mapped: MappedFiles
    ) -> dict[str, torch.Tensor]:
        # Copied out of the mapping (as safe_open's get_tensor does): the caller keeps or
        # quantises the tensor after the mapping is gone.
        with self._lock:
            try:
                buffers = [bytearray(mapped.range(sp.file, sp.begin, sp.end)) for sp in spans]
            except (OSError, ValueError) as e:
                raise weights_error(self.location, e) from e
            self._data_bytes += sum(len(b) for b in buffers)
        return _tensors(names, spans, buffers)


def _tensors(
    names: list[str], spans: list[Span], buffers: list[bytearray]
) -> dict[str, torch.Tensor]:
    return {
        name: torch.frombuffer(buf, dtype=sp.dtype).view(sp.shape)
        if buf
        else torch.empty(sp.shape, dtype=sp.dtype)  # frombuffer refuses an empty buffer
        for name, sp, buf in zip(names, spans, buffers, strict=True)
    }


class LazyTensor:
    """One tensor of a SafetensorsSource, read when indexed (`t[...]`): the interface of
    safetensors' `safe_open(...).get_slice(name)` that transformers' loader uses on a
    state dict's values, so that it materialises (and quantises) one tensor at a time."""

    def __init__(self, source: SafetensorsSource, name: str) -> None:
        self.source = source
        self.name = name
        self._span = source.spans[name]

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._span.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self._span.dtype

    def get_shape(self) -> list[int]:
        return list(self._span.shape)

    def get_dtype(self) -> str:
        return _DTYPE_NAMES[self._span.dtype]

    def __getitem__(self, index: object) -> torch.Tensor:
        return self.source.read([self.name])[self.name][index]  # type: ignore[index]


def lazy_state_dict(source: SafetensorsSource) -> dict[str, LazyTensor]:
    """Every tensor of `source`, unread, by checkpoint name."""
    return {name: LazyTensor(source, name) for name in source.spans}


def from_pretrained_lazy(location: Location, config: PretrainedConfig, **kwargs: Any) -> nn.Module:
    """`AutoModelForCausalLM.from_pretrained` of the model whose safetensors are under
    `location` (a prefix, its `config` fetched beforehand: remote_model.model_files; or a
    local directory), with the loader's own options (`quantization_config`, `device_map`,
    `dtype`...). transformers reads a state dict's values as it reads a local file's lazy
    slices: one at a time when it quantises, each by byte ranges (or from the mapped file)
    here, so the model is read once and never held whole in the load's dtype."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    source = SafetensorsSource(location)
    # The concrete class: the Auto class wants a name or path to resolve, and a state dict
    # comes with neither.
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    model: nn.Module = model_class.from_pretrained(
        None, config=config, state_dict=lazy_state_dict(source), **kwargs
    )
    log.info(
        "pretrained weights: read %d of %d bytes from %s",
        source.bytes_read,
        source.bytes_total,
        location.url,
        extra={"bytes_read": source.bytes_read, "bytes_total": source.bytes_total},
    )
    return model
