"""The name of a tokenized-blocks cache entry (`cache.py`): a hash of everything that
determines the blocks (the input files' identity, the tokenizer's, the dataset spec, sequence
length, dtype and the entry format's version), so a changed file, a different tokenizer,
sequence length, packing, field or format version is a different entry."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from finetune_operator.api.spec import DatasetSpec
from finetune_trainer.data.cache_entry import CACHE_FORMAT_VERSION
from finetune_trainer.data.records import dataset_files, resolve_uri

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def files_identity(spec: DatasetSpec) -> list[list[Any]] | None:
    """(path, size, mtime ns) of every input file; None for a Hugging Face hub id, whose
    content cannot be checked without the network: such datasets are not cached. Content is
    not hashed (reading GBs at every start is what the cache avoids); a file rewritten in
    place keeping its size and mtime to the nanosecond would go unnoticed."""
    if spec.format in ("jsonl", "parquet"):
        paths = [Path(p) for p in dataset_files(spec)]
    else:
        root = Path(resolve_uri(spec.uri))
        if not root.is_dir():
            return None
        paths = sorted(p for p in root.rglob("*") if p.is_file())
    out: list[list[Any]] = []
    for path in paths:
        st = path.stat()
        out.append([str(path.resolve()), st.st_size, st.st_mtime_ns])
    return out


def corpus_bytes(files: list[list[Any]] | None) -> int:
    """Pure: the corpus's size from its identities (each holds the file's or object's size
    second); 0 when unknown (a hub dataset id)."""
    return sum(int(f[1]) for f in files or [])


def tokenizer_identity(tokenizer: PreTrainedTokenizerBase) -> str:
    """A hash of what decides the ids: the full tokenizer definition (fast tokenizers'
    serialized pipeline, else the vocabulary), special tokens and chat template."""
    import tokenizers
    import transformers

    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    extra = [
        type(tokenizer).__name__,
        len(tokenizer),
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        tokenizer.chat_template,
        transformers.__version__,
        tokenizers.__version__,
    ]
    h.update(json.dumps(extra, sort_keys=True, default=str).encode())
    return h.hexdigest()


def cache_key(
    spec: DatasetSpec, files: list[list[Any]], tokenizer_id: str, seq_len: int, dtype: str
) -> str:
    """Pure: the entry name for these inputs. Every DatasetSpec field but the cache's own size
    is in it, so a field added later cannot be forgotten here."""
    payload = {
        "version": CACHE_FORMAT_VERSION,
        "dataset": spec.model_dump(mode="json", exclude={"cache_size_limit"}),
        "files": files,
        "tokenizer": tokenizer_id,
        "sequence_length": seq_len,
        "dtype": dtype,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]
