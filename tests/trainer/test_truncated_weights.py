"""A safetensors file shorter than its header says (a truncated copy on a volume, a download
that stopped part way, a broken upload) is refused by every pretrained-weights loader, naming
the file, the size its header promises and the size it has: before it is mapped (a mapped page
past a file's end is a SIGBUS, which torchrun reports as a signal, not a reason), and as a
refusal (UnsupportedConfigError: a restart would read the same file). Real files: a tiny Llama
saved sharded by transformers, one shard cut short."""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from finetune_operator.api.spec import ModelSpec
from finetune_trainer import model as model_module
from finetune_trainer.deepspeed_loading import load_safetensors_zero3
from finetune_trainer.errors import UnsupportedConfigError
from finetune_trainer.location import Location, locate
from finetune_trainer.pretrained import load_safetensors
from finetune_trainer.remote_tensors import SafetensorsSource
from tests.objectstore import MotoServer
from tests.trainer.test_loading import save_pretrained
from tests.trainer.test_remote_tensors import tiny_llama
from tests.trainer.test_remote_weights import upload_dir

CUT = 100  # bytes cut off the end of the largest shard


def truncate_largest(directory: Path) -> tuple[Path, int, int]:
    """The largest shard cut `CUT` bytes short: (its path, the size its header promises,
    the size it has)."""
    path = max(directory.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    assert len(data) - 8 - length > CUT  # the cut falls in the tensor data, not the header
    path.write_bytes(data[:-CUT])
    return path, len(data), len(data) - CUT


def assert_names_the_cut(
    err: pytest.ExceptionInfo[Exception], file: str, want: int, has: int
) -> None:
    message = str(err.value)
    assert isinstance(err.value, UnsupportedConfigError), message
    assert file in message, message
    assert f"{has} bytes, but its header's tensor data ends at byte {want}" in message
    assert f"truncated, {CUT} bytes short" in message


@pytest.fixture
def truncated(tmp_path: Path) -> tuple[Path, Path, int, int]:
    directory = tmp_path / "m"
    save_pretrained(directory, tied=True)
    return directory, *truncate_largest(directory)


def _dcp(model: nn.Module, weights: Path | Location) -> object:
    return load_safetensors(model, weights)


def _zero3(model: nn.Module, weights: Path | Location) -> object:
    return load_safetensors_zero3(model, weights)


@pytest.mark.parametrize("load", [_dcp, _zero3], ids=["dcp-fsdp-ddp", "zero3-fill"])
def test_a_truncated_local_file_is_refused_before_it_is_mapped(
    truncated: tuple[Path, Path, int, int],
    world_one: None,
    load: Callable[[nn.Module, Path | Location], object],
) -> None:
    directory, path, want, has = truncated
    model = tiny_llama(tied=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UnsupportedConfigError) as err, torch.no_grad():
        load(model, directory)
    assert_names_the_cut(err, str(path), want, has)
    # Refused at the headers: no tensor was written.
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_truncated_local_file_is_refused_by_the_qlora_load(
    truncated: tuple[Path, Path, int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """model._load_qlora_base from a directory (the 4-bit config left out: bitsandbytes needs
    a GPU): the same reader, the same refusal, not safetensors' own `incomplete metadata`."""
    directory, path, want, has = truncated
    monkeypatch.setattr(model_module, "_qlora_config", lambda: None)
    spec = ModelSpec(name="tiny-llama", source="pvc", path=str(directory))
    with pytest.raises(UnsupportedConfigError) as err:
        model_module._load_qlora_base(spec, torch.device("cpu"))
    assert_names_the_cut(err, str(path), want, has)


def test_a_short_s3_object_is_refused_by_the_whole_tensor_reader(
    truncated: tuple[Path, Path, int, int], s3_credentials: MotoServer
) -> None:
    """ZeRO-3's and QLoRA's s3:// reader: the object's listed size (its Content-Length) short
    of its header is the same refusal, naming the object (the DCP path's own test:
    test_remote_weights.test_a_truncated_weights_object_is_refused_naming_it)."""
    directory, path, want, has = truncated
    uri = f"s3://{s3_credentials.new_bucket()}/models/tiny"
    location = locate(uri, "test", object_store=s3_credentials.spec())
    upload_dir(directory, location)
    with pytest.raises(UnsupportedConfigError) as err:
        SafetensorsSource(location)
    assert_names_the_cut(err, f"{uri}/{path.name}", want, has)
