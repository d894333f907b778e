"""Pretrained weights read whole, tensor by tensor, from object storage (moto), for the loaders
outside DCP's load plan: DeepSpeed ZeRO-3's module-by-module fill (rank 0 reads, DeepSpeed
broadcasts) and QLoRA's quantising `from_pretrained` (lazy tensors read as transformers asks).
Each gives the tensors (or logits) the same files give from a local directory, reading each
byte once. DeepSpeed itself runs under torchrun in test_zero3_loading.py; the module loop is
exercised here on plain parameters (one rank: every rank "keeps" its writes)."""

from __future__ import annotations

import logging
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from finetune_operator.api.spec import ModelSpec
from finetune_trainer import model as model_module
from finetune_trainer.deepspeed_loading import load_safetensors_zero3
from finetune_trainer.errors import UnsupportedConfigError
from finetune_trainer.location import Location, locate
from finetune_trainer.remote_tensors import SafetensorsSource, from_pretrained_lazy
from tests.objectstore import MotoServer
from tests.trainer.test_loading import INPUT, plain_logits, save_pretrained
from tests.trainer.test_remote_weights import Fetched, upload_dir


@pytest.fixture
def s3_tied(tmp_path: Path, s3_credentials: MotoServer) -> tuple[Location, Path]:
    """A tiny tied Llama as sharded safetensors, on disk and uploaded to a fresh bucket."""
    save_pretrained(tmp_path / "m", tied=True)
    uri = f"s3://{s3_credentials.new_bucket()}/models/tiny"
    location = locate(uri, "test", object_store=s3_credentials.spec())
    upload_dir(tmp_path / "m", location)
    return location, tmp_path / "m"


def files_of(local: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in local.glob("*.safetensors"):
        out.update(load_file(f))
    return out


def sizes(local: Path) -> tuple[int, int]:
    """(bytes of the safetensors files, bytes of their headers)."""
    files = list(local.glob("*.safetensors"))
    headers = sum(8 + struct.unpack("<Q", p.read_bytes()[:8])[0] for p in files)
    return sum(p.stat().st_size for p in files), headers


def test_tensors_read_by_ranges_equal_the_files_and_count_their_bytes(
    s3_tied: tuple[Location, Path],
) -> None:
    location, local = s3_tied
    want = files_of(local)
    total, headers = sizes(local)
    # Small parts: a tensor over several parts is put back together in order.
    source = SafetensorsSource(location, part_bytes=1000)
    assert source.bytes_read == headers and source.bytes_total == total
    names = sorted(want)
    got = source.read(names[:3])
    got.update(source.read(names[3:]))
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert source.bytes_read == total  # every byte once, headers included


def tiny_llama(tied: bool) -> LlamaForCausalLM:
    config = LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=259, max_position_embeddings=128,
        tie_word_embeddings=tied, bos_token_id=256, eos_token_id=257, pad_token_id=258,
    )  # fmt: skip
    torch.manual_seed(0)  # other weights than the files'
    return LlamaForCausalLM(config)


def test_zero3_module_fill_reads_each_tensor_once_from_s3(
    s3_tied: tuple[Location, Path], world_one: None
) -> None:
    """The ZeRO-3 fill's own loop (rank 0 reads a module's tensors, by ranges) on a model of
    plain parameters: the weights of the files, each byte read once, the count logged."""
    location, local = s3_tied
    from_s3, from_dir = tiny_llama(tied=True), tiny_llama(tied=True)
    fetched = Fetched()
    logger = logging.getLogger("finetune_trainer.deepspeed_loading")
    logger.addHandler(fetched)
    logger.setLevel(logging.INFO)
    try:
        with torch.no_grad():
            done = load_safetensors_zero3(from_s3, location)
            load_safetensors_zero3(from_dir, local)
    finally:
        logger.removeHandler(fetched)
    assert done == {id(p) for p in from_s3.parameters()}
    want = files_of(local)
    for name, p in from_s3.named_parameters():
        assert torch.equal(p, want[name]), name
    assert from_s3.lm_head.weight is from_s3.model.embed_tokens.weight
    total, _ = sizes(local)
    assert fetched.rows == [(total, total)] * 2  # the s3 read, then the local one
    with torch.no_grad():
        assert torch.equal(from_s3(input_ids=INPUT).logits, from_dir(input_ids=INPUT).logits)


def test_zero3_fill_refuses_a_mis_shaped_s3_checkpoint_naming_the_uri(
    s3_tied: tuple[Location, Path], world_one: None
) -> None:
    location, _ = s3_tied
    model = tiny_llama(tied=True)
    model.model.norm.weight = torch.nn.Parameter(torch.ones(65))
    with pytest.raises(UnsupportedConfigError) as err, torch.no_grad():
        load_safetensors_zero3(model, location)
    assert "'model.norm.weight'" in str(err.value) and location.url in str(err.value)
    assert "(64,)" in str(err.value)


def test_no_safetensors_under_the_prefix_is_refused_naming_it(
    tmp_path: Path, s3_credentials: MotoServer
) -> None:
    uri = f"s3://{s3_credentials.new_bucket()}/models/empty"
    location = locate(uri, "test", object_store=s3_credentials.spec())
    (location / "config.json").write_atomic(b"{}")
    with pytest.raises(UnsupportedConfigError, match=r"no \*\.safetensors objects under s3://"):
        SafetensorsSource(location)


def test_qlora_read_path_loads_from_s3_like_from_pretrained_of_the_directory(
    s3_tied: tuple[Location, Path],
) -> None:
    """QLoRA's `from_pretrained` from s3:// (model._load_qlora_base) without the 4-bit
    quantisation (bitsandbytes needs a GPU): transformers materialises the lazy tensors, so
    the model is the directory's, read once."""
    location, local = s3_tied
    fetched = Fetched()
    logger = logging.getLogger("finetune_trainer.remote_tensors")
    logger.addHandler(fetched)
    logger.setLevel(logging.INFO)
    try:
        # The options of model._load_qlora_base but the quantisation (and fp32, to compare).
        model = from_pretrained_lazy(
            location,
            AutoConfig.from_pretrained(local),
            dtype=torch.float32,
            device_map={"": torch.device("cpu")},
            attn_implementation="sdpa",
        ).eval()
    finally:
        logger.removeHandler(fetched)
    with torch.no_grad():
        assert torch.equal(model(input_ids=INPUT).logits, plain_logits(local))
    direct = AutoModelForCausalLM.from_pretrained(local, dtype=torch.float32)
    state = model.state_dict()
    for name, tensor in direct.state_dict().items():
        assert torch.equal(state[name], tensor), name
    total, _ = sizes(local)
    assert fetched.rows == [(total, total)]


def test_qlora_base_from_s3_routes_through_the_ranged_read(
    s3_tied: tuple[Location, Path],
    s3_credentials: MotoServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """model._load_qlora_base with an s3:// model: config fetched, weights read by ranges,
    in the base's bf16. The 4-bit config is left out (bitsandbytes needs a GPU)."""
    location, local = s3_tied
    monkeypatch.setenv("FT_DATA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(model_module, "_qlora_config", lambda: None)
    spec = ModelSpec(name="tiny-llama", source="uri", path=location.url)
    base = model_module._load_qlora_base(spec, torch.device("cpu"), s3_credentials.spec())
    want = files_of(local)
    for name, p in base.named_parameters():
        assert p.dtype == torch.bfloat16, name
        assert torch.equal(p, want[name].to(torch.bfloat16)), name
