"""Which safetensors file holds each tensor of a Hugging Face checkpoint: the index
(`model.safetensors.index.json`) when there is one, else every `*.safetensors` file.

A model of 10 GB or more is always saved sharded, with an index whose `weight_map` names the
file of every tensor. The directory (or object-store prefix) may hold more than the index
names: the shards of an earlier save with another shard size, or a consolidated
`model.safetensors` beside the shards. Reading every file would then find tensors twice (and
refuse) or, worse, read tensors the index does not point at. So with an index, only the files
it names are read, and each tensor only from the file it names; a file it names that is
missing, or a tensor it maps that its file does not hold, is refused (an upload that stopped
part way, or an index from another save). Pure functions: the reader does the I/O."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

SUFFIX = ".safetensors"
INDEX_NAME = "model.safetensors.index.json"
# An index maps names to files of a few dozen bytes each: a 100k-tensor model is a few MB.
MAX_INDEX_BYTES = 64 << 20


def parse_index(url: str, raw: bytes) -> dict[str, str]:
    """The index's weight_map (tensor name -> file name in the same directory). Not JSON, no
    weight_map object, or a file that is not a plain `*.safetensors` name of the same
    directory is an error naming the index."""
    try:
        index = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{url}: not a safetensors index (not JSON: {e})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{url}: not a safetensors index (no weight_map of tensor to file)")
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file.endswith(SUFFIX) or "/" in file:
            raise ValueError(
                f"{url}: weight_map[{name!r}] is {file!r}, not a *.safetensors file of the "
                "same directory"
            )
    return dict(weight_map)


def files_to_read(
    listed: Iterable[str], weight_map: Mapping[str, str] | None, index_url: str = INDEX_NAME
) -> list[str]:
    """The safetensors files to read, sorted: those the index names (all of them must be
    listed), or, without an index, every `*.safetensors` listed."""
    present = {n for n in listed if n.endswith(SUFFIX)}
    if weight_map is None:
        return sorted(present)
    named = set(weight_map.values())
    missing = sorted(named - present)
    if missing:
        raise ValueError(
            f"{index_url} names {missing}, not there (an upload that stopped part way, or "
            "an index from another save: upload the model again)"
        )
    return sorted(named)


def ignored_files(listed: Iterable[str], weight_map: Mapping[str, str] | None) -> list[str]:
    """The `*.safetensors` files listed that the index does not name (not read)."""
    if weight_map is None:
        return []
    return sorted({n for n in listed if n.endswith(SUFFIX)} - set(weight_map.values()))


def owned(file: str, tensors: Iterable[str], weight_map: Mapping[str, str] | None) -> list[str]:
    """Which of the tensors in `file` are read from it: those the index maps to it (all of
    them without an index)."""
    if weight_map is None:
        return list(tensors)
    return [t for t in tensors if weight_map.get(t) == file]


def absent(found: Mapping[str, str], weight_map: Mapping[str, str]) -> list[tuple[str, str]]:
    """(tensor, file) of each tensor the index maps that its file does not hold; `found` is
    tensor -> the file it was read from."""
    return sorted((t, f) for t, f in weight_map.items() if found.get(t) != f)
