"""The training blocks: built from the records by streaming (`blocks.py`), through the
per-pod cache when the pod has one (`cache.py`), and served as batches."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from finetune_operator.api.spec import DatasetSpec
from finetune_trainer.data.blocks import BlockPacker, pad_id_for, stream_blocks, token_dtype
from finetune_trainer.data.cache import CacheSettings, cached_entry
from finetune_trainer.data.cache_entry import EntryWriter
from finetune_trainer.data.cache_key import cache_key, files_identity, tokenizer_identity
from finetune_trainer.data.remote import StagedDataset
from finetune_trainer.errors import UnsupportedConfigError
from finetune_trainer.startup_progress import directory_bytes, phase

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
Blocks = np.ndarray[Any, np.dtype[Any]]


def pack(seqs: list[list[int]], seq_len: int) -> Blocks:
    """Concatenate all samples and cut full blocks of `seq_len` (the tail is dropped)."""
    return BlockPacker(seq_len, np.dtype(np.int64), None).add(seqs)


def pad_or_truncate(seqs: list[list[int]], seq_len: int, pad_id: int) -> Blocks:
    return BlockPacker(seq_len, np.dtype(np.int64), pad_id).add(seqs)


@dataclass
class TokenBlocks:
    """Fixed-length token blocks (in memory, or mapped from the data cache); `pad_id` marks
    positions that carry no loss (unpacked data). `source` says where they came from:
    `tokenized`, `cache built` or `cache hit`."""

    blocks: Blocks
    pad_id: int | None
    source: str = "tokenized"

    def __len__(self) -> int:
        return int(self.blocks.shape[0])

    def batch(self, indices: list[int], device: torch.device) -> dict[str, torch.Tensor]:
        # Fancy indexing copies just these rows (from the page cache when mapped).
        ids = torch.from_numpy(self.blocks[indices].astype(np.int64))
        labels = ids.clone()
        attn = torch.ones_like(ids)
        if self.pad_id is not None:
            pad = ids == self.pad_id
            labels[pad] = IGNORE_INDEX
            attn[pad] = 0
        host = {"input_ids": ids, "labels": labels, "attention_mask": attn}
        if device.type == "cuda":
            # From pinned memory, asynchronously: a pageable copy synchronises the stream, so
            # the CPU would wait for the previous backward before queueing this forward.
            return {k: v.pin_memory().to(device, non_blocking=True) for k, v in host.items()}
        return {k: v.to(device) for k, v in host.items()}

    def count_tokens(self, indices: list[int]) -> int:
        """Tokens that carry loss in these samples, counted on the host (reading the count
        back from the GPU would synchronise every micro-batch)."""
        blocks = self.blocks[indices]
        if self.pad_id is None:
            return int(blocks.size)
        return int((blocks != self.pad_id).sum())


def _in_memory(
    spec: DatasetSpec, tokenizer: PreTrainedTokenizerBase, packer: BlockPacker
) -> Blocks:
    parts = list(stream_blocks(spec, tokenizer, packer))
    if not parts:
        return np.empty((0, packer.seq_len), dtype=packer.dtype)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _cached(
    cache: CacheSettings,
    spec: DatasetSpec,
    tokenizer: PreTrainedTokenizerBase,
    packer: BlockPacker,
    staged: StagedDataset | None,
) -> tuple[Blocks | None, str]:
    # A staged (object-store) dataset is keyed on the objects' identity (ETag, size,
    # version) and the job's own URI, not on the local copy's paths and mtimes.
    files = staged.files if staged is not None else files_identity(spec)
    if files is None:
        log.info(
            "dataset %s: a hub dataset is not cached (its content cannot be checked)", spec.uri
        )
        return None, "tokenized"
    key = cache_key(spec, files, tokenizer_identity(tokenizer), packer.seq_len, packer.dtype.str)
    read = staged.spec if staged is not None else spec

    def build(writer: EntryWriter) -> int:
        for blocks in stream_blocks(read, tokenizer, packer):
            writer.write(blocks)
        return packer.samples

    # Every identity holds the file's size second: the corpus's size bounds a wait for
    # another pod's build of the entry.
    source_bytes = sum(int(f[1]) for f in files)
    entry, outcome = cached_entry(cache, key, build, dtype=packer.dtype, seq_len=packer.seq_len,
                                  source_bytes=source_bytes)  # fmt: skip
    if entry is None:
        return None, "tokenized"
    packer.samples = entry.samples
    return entry.blocks, f"cache {outcome}"


def build_dataset(
    spec: DatasetSpec,
    tokenizer: PreTrainedTokenizerBase,
    seq_len: int,
    cache: CacheSettings | None = None,
    staged: StagedDataset | None = None,
) -> TokenBlocks:
    """The dataset's blocks; through `cache` when given (a hit neither reads the records
    nor calls the tokenizer). `staged`: the pod's local copy of an object-store dataset
    (data.remote), read in its place."""
    pad_id = pad_id_for(spec, tokenizer)
    dtype = token_dtype(tokenizer)
    blocks: Blocks | None = None
    source = "tokenized"
    packer = BlockPacker(seq_len, dtype, pad_id)
    # Progress (startup_progress.py): records tokenized, another pod's build advancing, and
    # the bytes under the pod's cache (a copy of the shared entry, or a local rank's build
    # this rank waits for on the key's lock).
    directory = cache.directory if cache is not None else None
    with phase("data", probe=None if directory is None else lambda: directory_bytes(directory)):
        if cache is not None:
            blocks, source = _cached(cache, spec, tokenizer, packer, staged)
        if blocks is None:
            packer = BlockPacker(seq_len, dtype, pad_id)
            blocks = _in_memory(staged.spec if staged is not None else spec, tokenizer, packer)
    if len(blocks) == 0:
        raise UnsupportedConfigError(
            f"dataset {spec.uri!r} yields no block of training.sequenceLength {seq_len} tokens"
        )
    log.info(
        "dataset %s: %d records -> %d blocks of %d (%s)",
        spec.uri,
        packer.samples,
        len(blocks),
        seq_len,
        source,
    )
    return TokenBlocks(blocks=blocks, pad_id=pad_id, source=source)
