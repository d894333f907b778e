"""Training data: load records (jsonl, parquet, HF datasets, or a corpus shipped beside this file),
tokenize a text field or chat messages, and pack them into fixed-length blocks."""

from __future__ import annotations

import glob
import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from finetune_operator.api.spec import DatasetSpec
from finetune_trainer.errors import UnsupportedConfigError

if TYPE_CHECKING:
    import datasets
    import pyarrow as pa
    from transformers import PreTrainedTokenizerBase

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


@dataclass(frozen=True)
class Records:
    """The loaded records, whatever read them: column names, one column, or every row."""

    column_names: list[str]
    column: Callable[[str], list[Any]]
    rows: Callable[[], Iterable[dict[str, Any]]]

    @classmethod
    def of_rows(cls, rows: list[dict[str, Any]]) -> Records:
        """Rows as read, each with every column (None where a row lacks it), as `datasets`
        gives them; nested values stay as written."""
        names = list(dict.fromkeys(k for row in rows for k in row))
        return cls(
            names,
            lambda f: [row.get(f) for row in rows],
            lambda: ({k: row.get(k) for k in names} for row in rows),
        )

    @classmethod
    def of_table(cls, table: pa.Table) -> Records:
        return cls(table.column_names, lambda f: table.column(f).to_pylist(), table.to_pylist)

    @classmethod
    def of_dataset(cls, ds: datasets.Dataset) -> Records:
        return cls(ds.column_names, lambda f: list(ds[f]), lambda: iter(ds))


def _read_jsonl(uri: str, paths: list[str]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise UnsupportedConfigError(
                        f"dataset.uri {uri!r}: {path} line {n} is not JSON ({e.msg})"
                    ) from None
                if not isinstance(row, dict):
                    raise UnsupportedConfigError(
                        f"dataset.uri {uri!r}: {path} line {n} is not a JSON object"
                    )
                rows.append(row)
    return rows


def _read_parquet(paths: list[str]) -> pa.Table:
    import pyarrow as pa
    import pyarrow.parquet as pq

    return pa.concat_tables([pq.read_table(p) for p in paths], promote_options="default")


def load_records(spec: DatasetSpec) -> Records:
    path = resolve_uri(spec.uri)
    if spec.format in ("jsonl", "parquet"):
        # A missing file is the job's error, not a crash to restart: every restart would fail
        # the same way, so refuse it (the operator then fails the job naming the field).
        paths = sorted(glob.glob(path))
        if not paths:
            where = "" if path == spec.uri else f" ({path})"
            raise UnsupportedConfigError(f"dataset.uri {spec.uri!r}: no such file{where}")
        # Read without `datasets` (its import, pandas and all, is ~1 s CPU of every rank's start,
        # paid again on each recovery) and without writing its cache.
        if spec.format == "jsonl":
            return Records.of_rows(_read_jsonl(spec.uri, paths))
        return Records.of_table(_read_parquet(paths))
    import datasets  # HF dataset ids and save_to_disk directories only

    if Path(path).is_dir():
        loaded = datasets.load_from_disk(path)
        ds = loaded["train"] if isinstance(loaded, datasets.DatasetDict) else loaded
        return Records.of_dataset(ds)
    return Records.of_dataset(datasets.load_dataset(path, split="train"))


def _token_lists(
    records: Records, spec: DatasetSpec, tokenizer: PreTrainedTokenizerBase
) -> list[list[int]]:
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if spec.messages_field:
        field = spec.messages_field
        if field not in records.column_names:
            raise UnsupportedConfigError(f"dataset.messagesField {field!r} not in the records")
        out: list[list[int]] = []
        for row in records.rows():
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
    texts = [str(t) for t in records.column(field)]
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
