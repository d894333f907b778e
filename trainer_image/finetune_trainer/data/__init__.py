"""Training data: the loader (`dataset.py`: records from jsonl, parquet, HF datasets or a
shipped corpus, tokenized and packed into fixed-length blocks) and the corpora shipped with the
trainer (`quickstart.jsonl`, written by `generate_quickstart.py`)."""

from finetune_trainer.data.dataset import (
    IGNORE_INDEX,
    Records,
    TokenBlocks,
    build_dataset,
    load_records,
    pack,
    pad_or_truncate,
    resolve_uri,
)

__all__ = [
    "IGNORE_INDEX",
    "Records",
    "TokenBlocks",
    "build_dataset",
    "load_records",
    "pack",
    "pad_or_truncate",
    "resolve_uri",
]
