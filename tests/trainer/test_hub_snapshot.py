"""Which files a hub model's snapshot downloads (finetune_trainer.hub_snapshot.weight_files):
the safetensors files the reader will read, not every `*.safetensors` of the repository (a
consolidated copy beside the shards was downloaded too: twice the data). Checked through
huggingface_hub's own filter (`filter_repo_objects`, what snapshot_download applies to
allow_patterns); the hub I/O itself needs the network and is not run here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from huggingface_hub.utils import filter_repo_objects
from torch import nn

from finetune_trainer.errors import UnsupportedConfigError
from finetune_trainer.hub_snapshot import weight_files
from finetune_trainer.pretrained import load_safetensors

CONFIG = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
          "special_tokens_map.json", "tokenizer.model", "README.md", ".gitattributes"]  # fmt: skip
SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
SMALL = ["config.json", "generation_config.json", "special_tokens_map.json", "tokenizer.json",
         "tokenizer.model", "tokenizer_config.json"]  # fmt: skip


def _index(files: list[str]) -> bytes:
    weight_map = {f"model.layers.{i}.weight": file for i, file in enumerate(files)}
    return json.dumps({"metadata": {"total_size": 1}, "weight_map": weight_map}).encode()


def _downloaded(repo_files: list[str], index: bytes | None) -> list[str]:
    patterns = weight_files(repo_files, index, "org/model")
    return sorted(filter_repo_objects(repo_files, allow_patterns=patterns))


def test_sharded_with_a_consolidated_copy_downloads_the_shards_only() -> None:
    repo = [*CONFIG, *SHARDS, "model.safetensors.index.json", "model.safetensors",
            "consolidated.safetensors", "original/consolidated.00.pth"]  # fmt: skip
    got = _downloaded(repo, _index(SHARDS))
    assert got == sorted([*SMALL, "model.safetensors.index.json", *SHARDS])


def test_only_a_consolidated_file_downloads_it() -> None:
    got = _downloaded([*CONFIG, "model.safetensors"], None)
    assert got == sorted([*SMALL, "model.safetensors"])


def test_shards_without_an_index_download_every_top_level_shard() -> None:
    got = _downloaded([*CONFIG, *SHARDS, "adapters/adapter_model.safetensors"], None)
    assert got == sorted([*SMALL, *SHARDS])


def test_an_index_naming_a_file_the_repo_lacks_is_refused_naming_the_repo() -> None:
    with pytest.raises(UnsupportedConfigError, match=r"org/model.*00002-of-00002.*not there"):
        weight_files(
            [*CONFIG, SHARDS[0], "model.safetensors.index.json"], _index(SHARDS), "org/model"
        )
    with pytest.raises(UnsupportedConfigError, match=r"org/model.*not a safetensors index"):
        weight_files([*CONFIG, *SHARDS], b"<html>", "org/model")


def test_a_bin_only_repo_downloads_no_weights_and_is_refused_as_before(tmp_path: Path) -> None:
    repo = [*CONFIG, "pytorch_model.bin"]
    got = _downloaded(repo, None)
    assert got == SMALL
    for name in got:  # the snapshot as it would be downloaded
        (tmp_path / name).write_text("{}")
    with pytest.raises(UnsupportedConfigError, match=r"no \*\.safetensors weights in .*\.bin"):
        load_safetensors(nn.Linear(1, 1), tmp_path)
