"""A pretrained model under an object-store prefix (`model.source: uri`, `model.path:
s3://bucket/prefix`): its small files fetched, its weights left where they are.

config.json, the tokenizer's files and the generation config are what transformers needs as
a directory: each rank fetches them into its own temporary directory (kilobytes to tens of
megabytes; a rank never waits on another for them). The safetensors are not fetched: they are
read by byte ranges straight into each rank's shards (finetune_trainer.safetensors_ranges)."""

from __future__ import annotations

import atexit
import fnmatch
import functools
import logging
import shutil
import tempfile
from pathlib import Path

from finetune_operator.api.spec import ModelSpec
from finetune_operator.api.storage import ObjectStoreSpec, is_object_store_uri
from finetune_trainer.errors import UnsupportedConfigError
from finetune_trainer.location import Location, access_problem, locate

log = logging.getLogger(__name__)

# What transformers reads of a model directory besides the weights (the hub download's
# allow-list, plus chat templates and tiktoken vocabularies kept as their own files).
SMALL_FILES = ("*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken")
# A "small" file bigger than this is not a config or tokenizer: refused, not fetched.
MAX_SMALL_FILE_BYTES = 512 << 20


def weights_field(spec: ModelSpec) -> str:
    return "spec.model.path" if spec.path else "spec.model.name"


def remote_weights(spec: ModelSpec, store: ObjectStoreSpec | None) -> Location | None:
    """The object-store prefix of a pretrained model, None for a path, a hub id or inline."""
    uri = spec.weights_location()
    if uri is None or spec.source != "uri" or not is_object_store_uri(uri):
        return None
    return locate(uri, weights_field(spec), object_store=store)


def small_file_names(names: list[str]) -> list[str]:
    """Pure: which entries of the model's prefix are fetched (configs and tokenizer files)."""
    return sorted(n for n in names if any(fnmatch.fnmatch(n, p) for p in SMALL_FILES))


@functools.cache
def model_files(location: Location, field: str = "spec.model.path") -> Path:
    """A local directory with the model's config and tokenizer files, fetched once per
    process (and removed when it exits). A missing prefix, no config.json or denied access
    is a configuration error naming the URI."""
    try:
        entries = location.children()
    except OSError as e:
        raise UnsupportedConfigError(
            f"{field} {location.url!r}: {access_problem(e) or e}"
        ) from e
    names = small_file_names([e.name for e in entries if not e.is_dir])
    if "config.json" not in names:
        raise UnsupportedConfigError(
            f"{field} {location.url!r}: no config.json there (a Hugging Face model "
            "directory as save_pretrained writes it: config.json, tokenizer files, "
            "*.safetensors)"
        )
    sizes = {e.name: e.size for e in entries}
    too_big = [n for n in names if sizes[n] > MAX_SMALL_FILE_BYTES]
    if too_big:
        raise UnsupportedConfigError(
            f"{field} {location.url!r}: {too_big} are over "
            f"{MAX_SMALL_FILE_BYTES >> 20} MiB: not config or tokenizer files"
        )
    directory = Path(tempfile.mkdtemp(prefix="finetune-model-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    for name in names:
        source = location / name
        try:
            data = source.read_bytes()
        except OSError as e:
            raise UnsupportedConfigError(
                f"{field} {source.url!r}: {access_problem(e) or e}"
            ) from e
        if len(data) != sizes[name]:
            raise OSError(f"{source.url}: read {len(data)} bytes of {sizes[name]} (truncated)")
        (directory / name).write_bytes(data)
    log.info("model files %s fetched from %s", names, location.url)
    return directory
