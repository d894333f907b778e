"""Reading records: jsonl, parquet, HF datasets, or a corpus shipped beside this package.

Two shapes: `load_records` (every row, for callers that want the whole table) and
`field_batches` (one field's values, a bounded batch at a time: what tokenizing streams over,
so a GB-scale corpus is never held as Python objects)."""

from __future__ import annotations

import glob
import itertools
import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from finetune_operator.api.spec import DatasetSpec
from finetune_trainer.errors import UnsupportedConfigError

if TYPE_CHECKING:
    import datasets
    import pyarrow as pa

BUILTIN_PREFIX = "builtin://"
BUILTIN = {"quickstart": "quickstart.jsonl"}
# A batch ends at whichever comes first: enough rows to keep the tokenizer's batching
# efficient, or enough characters to bound memory when rows are whole documents. A fast
# tokenizer's output costs ~100 bytes a token (ids, offsets, token strings, masks) until it
# is packed: 1 M characters is ~100 MB at one token a byte, ~25 MB for a BPE vocabulary.
BATCH_ROWS = 1024
BATCH_CHARS = 1 << 20


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
            f"dataset.uri {uri!r}: only paths, HF dataset ids, builtin:// and s3:// "
            "(fetched first: data.remote) are read"
        )
    return uri


def dataset_files(spec: DatasetSpec) -> list[str]:
    """The files a jsonl/parquet dataset reads, in name order (a glob may match several)."""
    path = resolve_uri(spec.uri)
    # A missing file is the job's error, not a crash to restart: every restart would fail the
    # same way, so refuse it (the operator then fails the job naming the field).
    paths = sorted(glob.glob(path))
    if not paths:
        where = "" if path == spec.uri else f" ({path})"
        if not os.path.isabs(path):
            # Read in the pod's working directory, not where the user ran kubectl or ftjob
            # (`ftjob run --local`: <its dir>/shared): say which, and what works everywhere.
            where += (
                f" in the working directory {os.getcwd()}: use an absolute path on a volume of "
                "spec.storage"
            )
        raise UnsupportedConfigError(f"dataset.uri {spec.uri!r}: no such file{where}")
    # A directory (the reference allows one) is read as its *.<format> files: opened as a
    # file it was an IsADirectoryError, a crash torchrun restarted in vain.
    files: list[str] = []
    for found in paths:
        if not os.path.isdir(found):
            files.append(found)
            continue
        inside = sorted(glob.glob(os.path.join(glob.escape(found), f"*.{spec.format}")))
        if not inside:
            raise UnsupportedConfigError(
                f"dataset.uri {spec.uri!r}: {found} is a directory with no *.{spec.format} "
                f"file in it: name the files (e.g. '{os.path.join(found, '*.' + spec.format)}') "
                "or set dataset.format"
            )
        files += inside
    return files


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


def _jsonl_rows(uri: str, paths: list[str]) -> Iterator[dict[str, Any]]:
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise UnsupportedConfigError(
                        # json's msg ("Invalid control character at") names no place:
                        # the column does, and the user is told what to do with the line.
                        f"dataset.uri {uri!r}: {path} line {n} is not JSON ({e.msg} column "
                        f"{e.colno}); fix or remove that line (one JSON object per line)"
                    ) from None
                if not isinstance(row, dict):
                    raise UnsupportedConfigError(
                        f"dataset.uri {uri!r}: {path} line {n} is not a JSON object"
                    )
                yield row


def _read_parquet(paths: list[str]) -> pa.Table:
    import pyarrow as pa
    import pyarrow.parquet as pq

    return pa.concat_tables([pq.read_table(p) for p in paths], promote_options="default")


def _load_hf(path: str) -> datasets.Dataset:
    import datasets  # HF dataset ids and save_to_disk directories only

    if Path(path).is_dir():
        loaded = datasets.load_from_disk(path)
        return loaded["train"] if isinstance(loaded, datasets.DatasetDict) else loaded
    from finetune_trainer.hub_snapshot import downloading

    with downloading(path, "datasets"):  # the start-up barrier judges its progress
        return datasets.load_dataset(path, split="train")


def load_records(spec: DatasetSpec) -> Records:
    """Every record in memory (read without `datasets` for jsonl/parquet: its import, pandas
    and all, is ~1 s CPU of every rank's start, paid again on each recovery)."""
    if spec.format == "jsonl":
        return Records.of_rows(list(_jsonl_rows(spec.uri, dataset_files(spec))))
    if spec.format == "parquet":
        return Records.of_table(_read_parquet(dataset_files(spec)))
    return Records.of_dataset(_load_hf(resolve_uri(spec.uri)))


@dataclass
class FieldBatches:
    """One field's values in bounded batches, in record order (None where a record lacks
    it), and, once iterated, the columns seen: a field that no record has is refused by the
    caller after the pass (a later jsonl row may still bring it)."""

    batches: Iterator[list[Any]]
    seen: dict[str, None] = field(default_factory=dict)  # grows as jsonl rows are read

    @property
    def columns(self) -> list[str]:
        return list(self.seen)


def _batched(values: Iterable[Any]) -> Iterator[list[Any]]:
    batch: list[Any] = []
    chars = 0
    for value in values:
        batch.append(value)
        chars += len(value) if isinstance(value, str) else 1
        if len(batch) >= BATCH_ROWS or chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def field_batches(spec: DatasetSpec, name: str) -> FieldBatches:
    if spec.format == "jsonl":
        out = FieldBatches(iter(()))

        def values() -> Iterator[Any]:
            for row in _jsonl_rows(spec.uri, dataset_files(spec)):
                out.seen.update(dict.fromkeys(row))
                yield row.get(name)

        out.batches = _batched(values())
        return out
    if spec.format == "parquet":
        return _parquet_batches(dataset_files(spec), name)
    ds = _load_hf(resolve_uri(spec.uri))
    if name not in ds.column_names:
        return FieldBatches(iter(()), dict.fromkeys(ds.column_names))
    return FieldBatches(_batched(ds[name]), dict.fromkeys(ds.column_names))


def _parquet_batches(paths: list[str], name: str) -> FieldBatches:
    import pyarrow.parquet as pq

    files = [pq.ParquetFile(p) for p in paths]
    columns = dict.fromkeys(n for f in files for n in f.schema_arrow.names)

    def values() -> Iterator[Any]:
        for f in files:
            if name not in f.schema_arrow.names:  # as concat_tables' promotion: nulls
                yield from itertools.repeat(None, f.metadata.num_rows)
                continue
            for batch in f.iter_batches(batch_size=BATCH_ROWS, columns=[name]):
                yield from batch.column(0).to_pylist()

    return FieldBatches(_batched(values()) if name in columns else iter(()), columns)
