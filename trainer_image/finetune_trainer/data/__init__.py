"""Training data: records read from jsonl, parquet, HF datasets or a shipped corpus
(`records.py`), tokenized and packed into fixed-length blocks as a stream (`blocks.py`),
cached per pod across restarts (`cache.py`) and served as batches (`dataset.py`); the corpora
shipped with the trainer (`quickstart.jsonl`, written by `generate_quickstart.py`)."""

from finetune_trainer.data.cache import CacheSettings
from finetune_trainer.data.dataset import (
    IGNORE_INDEX,
    TokenBlocks,
    build_dataset,
    pack,
    pad_or_truncate,
)
from finetune_trainer.data.records import Records, load_records, resolve_uri

__all__ = [
    "IGNORE_INDEX",
    "CacheSettings",
    "Records",
    "TokenBlocks",
    "build_dataset",
    "load_records",
    "pack",
    "pad_or_truncate",
    "resolve_uri",
]
