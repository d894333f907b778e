"""A sharded checkpoint in a local directory, read by the whole-tensor loaders (ZeRO-3's
module fill, QLoRA's lazy from_pretrained): its `model.safetensors.index.json` decides which
files are read and which file each tensor comes from, as it does on s3:// and for the DCP
loaders. A consolidated `model.safetensors` of other values left beside the shards (an
earlier save) is ignored, not read, and cannot win. DeepSpeed itself runs in
test_zero3_loading.py; the module loop runs here on plain parameters (one rank)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from finetune_operator.api.spec import ModelSpec
from finetune_trainer import model as model_module
from finetune_trainer.deepspeed_loading import load_safetensors_zero3
from tests.trainer.test_loading import save_pretrained
from tests.trainer.test_remote_tensors import files_of, sizes, tiny_llama
from tests.trainer.test_remote_weights import Fetched


@pytest.fixture
def sharded_with_stale_copy(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny Llama saved sharded (with its index), and beside it a consolidated
    model.safetensors holding every tensor with other values. Returns the directory and the
    shards' tensors (what the index names)."""
    directory = tmp_path / "m"
    save_pretrained(directory, tied=True)
    want = files_of(directory)
    assert (directory / "model.safetensors.index.json").is_file()
    save_file({k: v + 1 for k, v in want.items()}, str(directory / "model.safetensors"))
    return directory, want


def test_zero3_fill_from_a_directory_reads_only_what_the_index_names(
    sharded_with_stale_copy: tuple[Path, dict[str, torch.Tensor]], world_one: None
) -> None:
    directory, want = sharded_with_stale_copy
    stale = directory / "model.safetensors"
    model = tiny_llama(tied=True)
    fetched = Fetched()
    logger = logging.getLogger("finetune_trainer.deepspeed_loading")
    logger.addHandler(fetched)
    logger.setLevel(logging.INFO)
    try:
        with torch.no_grad():
            done = load_safetensors_zero3(model, directory)
    finally:
        logger.removeHandler(fetched)
    assert done == {id(p) for p in model.parameters()}
    for name, p in model.named_parameters():
        assert torch.equal(p, want[name]), name
    # Every byte of the shards once (headers included), none of the stale copy's.
    total, _ = sizes(directory)
    shards = total - stale.stat().st_size
    assert fetched.rows == [(shards, shards)]


def test_qlora_base_from_a_directory_reads_only_what_the_index_names(
    sharded_with_stale_copy: tuple[Path, dict[str, torch.Tensor]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """model._load_qlora_base from a directory (the 4-bit config left out: bitsandbytes needs
    a GPU): the lazy tensors of the same reader, the shards' values in the base's bf16."""
    directory, want = sharded_with_stale_copy
    monkeypatch.setattr(model_module, "_qlora_config", lambda: None)
    spec = ModelSpec(name="tiny-llama", source="pvc", path=str(directory))
    base = model_module._load_qlora_base(spec, torch.device("cpu"))
    for name, p in base.named_parameters():
        assert p.dtype == torch.bfloat16, name
        assert torch.equal(p, want[name].to(torch.bfloat16)), name
