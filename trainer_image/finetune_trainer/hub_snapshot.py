"""Which files of a Hugging Face hub repository a pretrained model downloads.

A repository may hold the same weights twice: sharded `model-0000N-of-0000M.safetensors` with
their `model.safetensors.index.json`, and beside them a consolidated `model.safetensors` or
`consolidated.safetensors` (Mistral's). Downloading every `*.safetensors` fetched both, twice
the data, though the reader (finetune_trainer.safetensors_index) reads only the files the
index names. So the snapshot asks for those files alone: the index's when the repository has
one, else every top-level `*.safetensors` (what the reader would read), plus the config and
tokenizer files. `weight_files` decides (pure); `download_snapshot` does the hub I/O."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable
from pathlib import Path

from finetune_trainer.errors import UnsupportedConfigError
from finetune_trainer.safetensors_index import INDEX_NAME, files_to_read, parse_index
from finetune_trainer.startup_progress import directory_bytes, phase

# Config, index, tokenizer (tokenizer.json, tokenizer.model, vocab/merges .txt): small files
# the trainer reads beside the weights.
CONFIG_PATTERNS = ("*.json", "*.model", "*.txt")
# How much longer than the startup timeout a hub download may show no progress before the
# start-up barrier calls it stuck (startup_progress.stall_limit). Its progress is the bytes
# under the repo's hub cache folder, which grow as a file arrives over HTTP (`.incomplete`
# files); a transfer backend that assembles a file before writing it (Xet chunks) would show
# nothing until the file is whole: the largest file a model is usually split into
# (save_pretrained's 5 GB shards) at a slow node's 10 MB/s from the hub.
HUB_LARGEST_FILE_BYTES = 5 * 10**9
HUB_SLOW_BYTES_PER_S = 10**7
HUB_STALL_EXTRA_S = HUB_LARGEST_FILE_BYTES / HUB_SLOW_BYTES_PER_S


def snapshot_bytes(repo: str, kind: str = "models") -> int:
    """The bytes of `repo`'s hub cache folder, partial downloads included; for a dataset
    (`kind` "datasets") also the `datasets` cache, where its Arrow copy is written."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    folder = repo_folder_name(repo_id=repo, repo_type=kind.removesuffix("s"))
    total = directory_bytes(Path(constants.HF_HUB_CACHE) / folder)
    if kind == "datasets":
        from datasets import config

        total += directory_bytes(Path(config.HF_DATASETS_CACHE))
    return total


def downloading(repo: str, kind: str = "models") -> contextlib.AbstractContextManager[None]:
    """The start-up phase of a download from `repo` (startup_progress.py)."""
    probe = functools.partial(snapshot_bytes, repo, kind)
    return phase(f"hub download of {repo}", probe, HUB_STALL_EXTRA_S)


def weight_files(repo_files: Iterable[str], index_json: bytes | None, repo: str = "") -> list[str]:
    """The snapshot's allow_patterns: the config/tokenizer patterns and, by exact name, the
    safetensors files the reader will read (`index_json`: the repository's
    model.safetensors.index.json, None when it has none). A `.bin`-only repository gets no
    weight file: the loader then refuses it, saying to convert it to safetensors. An index
    that is no index, or names a file the repository lacks, is refused naming the repo."""
    # The reader lists the snapshot directory's own files: a subfolder's are never read.
    top_level = [f for f in repo_files if "/" not in f]
    url = f"{repo}/{INDEX_NAME}" if repo else INDEX_NAME
    try:
        weight_map = parse_index(url, index_json) if index_json is not None else None
        weights = files_to_read(top_level, weight_map, url)
    except ValueError as e:
        raise UnsupportedConfigError(f"spec.model: hub model {repo!r}: {e}") from None
    return [*CONFIG_PATTERNS, *weights]


@functools.cache
def download_snapshot(repo: str, revision: str | None) -> Path:
    """Download what `weight_files` picks (the file list and the index first) and return the
    snapshot directory. Once per process: the trainer asks before the start-up barrier (so a
    replacement pod's download is waited for there) and again when it builds the model; the
    second ask would list the repo and check every file's revision over the network again. Offline (HF_HUB_OFFLINE=1) there is no file list: the cached
    snapshot is used as it is, as snapshot_download does offline."""
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download
    from huggingface_hub.errors import OfflineModeIsEnabled

    with downloading(repo):
        try:
            files = HfApi().list_repo_files(repo, revision=revision)
        except OfflineModeIsEnabled:
            return Path(snapshot_download(repo, revision=revision))
        index = None
        if INDEX_NAME in files:
            index = Path(hf_hub_download(repo, INDEX_NAME, revision=revision)).read_bytes()
        patterns = weight_files(files, index, repo)
        return Path(snapshot_download(repo, revision=revision, allow_patterns=patterns))
