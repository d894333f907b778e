"""Training data: load records (jsonl, parquet, HF datasets, or a corpus shipped beside this file),
tokenize a text field or chat messages, and pack them into fixed-length blocks."""

from __future__ import annotations

import glob
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import torch
from transformers import PreTrainedTokenizerBase

from finetune_operator.api.spec import DatasetSpec
from finetune_trainer.errors import UnsupportedConfigError

log = logging.getLogger(__name__)

BUILTIN_PREFIX = "builtin://"
BUILTIN = {"quickstart": "quickstart.jsonl"}
IGNORE_INDEX = -100


def resolve_uri(uri: str) -> str:
    """`builtin://<name>` is a file shipped in this package; relative paths are taken against
    the working directory; anything else (an HF dataset id) is passed through."""
    if uri.startswith(BUILTIN_PREFIX):
        name = uri.removeprefix(BUILTIN_PREFIX)
        if name not in BUILTIN:
            raise UnsupportedConfigError(
                f"dataset.uri {uri!r}: unknown builtin dataset; known: {sorted(BUILTIN)}"
            )
        return str(Path(__file__).with_name(BUILTIN[name]))
    if uri.startswith("file://"):
        return uri.removeprefix("file://")
    if "://" in uri:
        raise UnsupportedConfigError(
            f"dataset.uri {uri!r}: only local/shared-filesystem paths, HF dataset ids and "
            "builtin:// are implemented yet"
        )
    return uri


def load_records(spec: DatasetSpec) -> datasets.Dataset:
    path = resolve_uri(spec.uri)
    if spec.format in ("jsonl", "parquet"):
        # A missing file is the job's error, not a crash to restart: every restart would fail
        # the same way, so refuse it (the operator then fails the job naming the field).
        if not glob.glob(path):
            where = "" if path == spec.uri else f" ({path})"
            raise UnsupportedConfigError(f"dataset.uri {spec.uri!r}: no such file{where}")
        builder = "json" if spec.format == "jsonl" else "parquet"
        return datasets.load_dataset(builder, data_files=path, split="train")
    if Path(path).is_dir():
        loaded = datasets.load_from_disk(path)
        return loaded["train"] if isinstance(loaded, datasets.DatasetDict) else loaded
    return datasets.load_dataset(path, split="train")


def _token_lists(
    records: datasets.Dataset, spec: DatasetSpec, tokenizer: PreTrainedTokenizerBase
) -> list[list[int]]:
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if spec.messages_field:
        field = spec.messages_field
        if field not in records.column_names:
            raise UnsupportedConfigError(f"dataset.messagesField {field!r} not in the records")
        out: list[list[int]] = []
        for row in records:
            ids: Any = tokenizer.apply_chat_template(row[field], tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            out.append([*list(ids), *eos])
        return out
    field = spec.text_field or "text"
    if field not in records.column_names:
        raise UnsupportedConfigError(
            f"dataset.textField {field!r} not in the records (columns: {records.column_names})"
        )
    texts = [str(t) for t in records[field]]
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [[*bos, *ids, *eos] for ids in encoded]


def pack(seqs: list[list[int]], seq_len: int) -> torch.Tensor:
    """Concatenate all samples and cut full blocks of `seq_len` (the tail is dropped)."""
    flat = torch.tensor([t for s in seqs for t in s], dtype=torch.int32)
    n = flat.numel() // seq_len
    return flat[: n * seq_len].view(n, seq_len)


def pad_or_truncate(seqs: list[list[int]], seq_len: int, pad_id: int) -> torch.Tensor:
    out = torch.full((len(seqs), seq_len), pad_id, dtype=torch.int32)
    for i, s in enumerate(seqs):
        s = s[:seq_len]
        out[i, : len(s)] = torch.tensor(s, dtype=torch.int32)
    return out


@dataclass
class TokenBlocks:
    """Fixed-length token blocks; `pad_id` marks positions that carry no loss (unpacked data)."""

    blocks: torch.Tensor
    pad_id: int | None

    def __len__(self) -> int:
        return int(self.blocks.shape[0])

    def batch(self, indices: list[int], device: torch.device) -> dict[str, torch.Tensor]:
        ids = self.blocks[indices].long()
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
            return int(blocks.numel())
        return int((blocks != self.pad_id).sum())


def build_dataset(
    spec: DatasetSpec, tokenizer: PreTrainedTokenizerBase, seq_len: int
) -> TokenBlocks:
    records = load_records(spec)
    seqs = _token_lists(records, spec, tokenizer)
    if spec.packing:
        blocks, pad_id = pack(seqs, seq_len), None
    else:
        pad = tokenizer.pad_token_id
        if pad is None:
            raise UnsupportedConfigError("dataset.packing false needs a tokenizer with a pad token")
        blocks, pad_id = pad_or_truncate(seqs, seq_len, int(pad)), int(pad)
    if len(blocks) == 0:
        raise UnsupportedConfigError(
            f"dataset {spec.uri!r} yields no block of training.sequenceLength {seq_len} tokens"
        )
    log.info("dataset %s: %d records -> %d blocks of %d", spec.uri, len(seqs), len(blocks), seq_len)
    return TokenBlocks(blocks=blocks, pad_id=pad_id)
