"""Tokenizing and packing as a stream: field values in, fixed-length token blocks out, a
batch at a time, so memory is bounded by a batch and not by the corpus.

The blocks are exactly what tokenizing the whole corpus at once gave: every sample is
`bos + ids + eos` (text) or the chat template's ids + `eos` (messages); packing concatenates
all samples and cuts `seq_len` blocks, dropping the tail; without packing each sample is
truncated or padded to one block."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from finetune_operator.api.spec import DatasetSpec
from finetune_trainer.data.records import FieldBatches, field_batches
from finetune_trainer.errors import UnsupportedConfigError
from finetune_trainer.startup_progress import advance

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def token_dtype(tokenizer: PreTrainedTokenizerBase) -> np.dtype[Any]:
    """The narrowest unsigned type that holds every id: 2 bytes a token for vocabularies up
    to 65,536 ids (Llama 2, Mistral, Phi: half the memory and cache), else 4. The largest id
    is taken from the vocabulary, not only its length: some leave gaps."""
    largest = max([len(tokenizer) - 1, *tokenizer.get_vocab().values()])
    return np.dtype(np.uint16 if largest < 1 << 16 else np.uint32)


class BlockPacker:
    """Token sequences in, full blocks out; packing keeps the tail for the next batch."""

    def __init__(self, seq_len: int, dtype: np.dtype[Any], pad_id: int | None) -> None:
        self.seq_len, self.dtype, self.pad_id = seq_len, dtype, pad_id
        self.carry = np.empty(0, dtype=dtype)
        self.samples = 0

    def _array(self, ids: list[int]) -> np.ndarray[Any, np.dtype[Any]]:
        arr = np.asarray(ids, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(self.dtype).max):
            raise ValueError(f"token id outside {self.dtype} (tokenizer longer than it says?)")
        return arr.astype(self.dtype)

    def add(self, seqs: list[list[int]]) -> np.ndarray[Any, np.dtype[Any]]:
        """The blocks these sequences complete, shape (n, seq_len)."""
        self.samples += len(seqs)
        if self.pad_id is None:
            flat = np.concatenate([self.carry, self._array(list(itertools.chain(*seqs)))])
            n = flat.size // self.seq_len
            self.carry = flat[n * self.seq_len :].copy()
            return flat[: n * self.seq_len].reshape(n, self.seq_len)
        out = np.full((len(seqs), self.seq_len), self.pad_id, dtype=self.dtype)
        for i, s in enumerate(seqs):
            row = self._array(s[: self.seq_len])
            out[i, : row.size] = row
        return out


def _samples(
    values: list[Any], spec: DatasetSpec, tokenizer: PreTrainedTokenizerBase
) -> list[list[int]]:
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if spec.messages_field:
        out: list[list[int]] = []
        for messages in values:
            ids: Any = tokenizer.apply_chat_template(messages, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            out.append([*list(ids), *eos])
        return out
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    encoded = tokenizer([str(t) for t in values], add_special_tokens=False)["input_ids"]
    return [[*bos, *ids, *eos] for ids in encoded]


def pad_id_for(spec: DatasetSpec, tokenizer: PreTrainedTokenizerBase) -> int | None:
    """None for packed data (every position carries loss), else the tokenizer's pad id."""
    if spec.packing:
        return None
    if tokenizer.pad_token_id is None:
        raise UnsupportedConfigError("dataset.packing false needs a tokenizer with a pad token")
    return int(tokenizer.pad_token_id)


def stream_blocks(
    spec: DatasetSpec, tokenizer: PreTrainedTokenizerBase, packer: BlockPacker
) -> Iterator[np.ndarray[Any, np.dtype[Any]]]:
    """The dataset's blocks, a batch of records at a time; refuses (after the pass) a field
    that no record has."""
    name = spec.messages_field or spec.text_field or "text"
    source: FieldBatches = field_batches(spec, name)
    for values in source.batches:
        if spec.messages_field and name not in source.columns:
            _refuse_missing(spec, name, source.columns)  # no template for what is not there
        blocks = packer.add(_samples(values, spec, tokenizer))
        advance(len(values))  # records tokenized: the start-up barrier's progress
        if len(blocks):
            yield blocks
    if name not in source.columns:
        _refuse_missing(spec, name, source.columns)


def _refuse_missing(spec: DatasetSpec, name: str, columns: list[str]) -> None:
    which = "messagesField" if spec.messages_field else "textField"
    raise UnsupportedConfigError(
        f"dataset.{which} {name!r} not in the records (columns: {columns})"
    )
