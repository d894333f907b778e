"""Loading at scale (DESIGN.md §6): meta build -> shard -> materialise. The weights a rank
ends with do not depend on the world size or the strategy; pretrained safetensors land in the
shards with the logits of a plain `from_pretrained`; tied heads stay tied; catalog models
build from the plan's resolved architecture."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from finetune_operator.api.jobconfig import JobConfig
from finetune_operator.api.spec import MethodSpec, ModelSpec
from finetune_trainer.errors import UnsupportedConfigError
from finetune_trainer.loading import load_parallel_model
from finetune_trainer.model import build_model
from finetune_trainer.tokenizer import build_byte_tokenizer
from tests.trainer.conftest import REPO, TORCHRUN, make_job, write_job

CPU = torch.device("cpu")
WORKER = REPO / "tests" / "trainer" / "loading_worker.py"
INPUT = torch.tensor([[1, 5, 9, 42, 7, 3, 100, 17]] * 2)  # loading_worker.INPUT


def inline_job(
    *, strategy: str, method: str = "full", tied: bool = False, precision: str = "fp32"
) -> JobConfig:
    job = make_job(strategy=strategy, training={"precision": precision})
    assert job.spec.model.architecture is not None
    job.spec.model.architecture.tie_word_embeddings = tied
    job.spec.method = MethodSpec(type=method)  # type: ignore[arg-type]
    return job


def pretrained_job(path: Path, *, strategy: str, method: str = "full") -> JobConfig:
    job = make_job(strategy=strategy)
    job.spec.model = ModelSpec(name=str(path), source="pvc")
    job.spec.method = MethodSpec(type=method)  # type: ignore[arg-type]
    return job


def reference(job: JobConfig) -> torch.nn.Module:
    spec = job.spec
    return build_model(
        spec.model,
        spec.method,
        build_byte_tokenizer(),
        CPU,
        activation_checkpointing=False,
        precision=spec.training.precision,
        seed=spec.training.seed,
    )


def save_pretrained(path: Path, *, tied: bool) -> LlamaForCausalLM:
    """A small Llama written as Hugging Face writes checkpoints: sharded safetensors."""
    torch.manual_seed(7)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=259,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(path, max_shard_size="40KB")
    build_byte_tokenizer().save_pretrained(path)
    assert len(list(path.glob("*.safetensors"))) > 3
    return model


def plain_logits(path: Path) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=INPUT).logits


def run_workers(tmp_path: Path, job: JobConfig, nproc: int, name: str) -> dict[str, Any]:
    cfg = write_job(tmp_path / f"{name}.json", job)
    out = tmp_path / f"{name}.pt"
    args = [
        TORCHRUN,
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(WORKER),
        "model",
        str(out),
        str(cfg),
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result: dict[str, Any] = torch.load(out, weights_only=False)
    return result


# ---- one process -------------------------------------------------------------------------


def test_plain_build_keeps_ties_padding_row_and_rotary_buffers() -> None:
    model = reference(inline_job(strategy="ddp", tied=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.count_nonzero(model.model.embed_tokens.weight[258]) == 0  # pad row
    fresh = LlamaForCausalLM(model.config)
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, fresh.model.rotary_emb.inv_freq)
    std = model.model.layers[0].mlp.up_proj.weight.std().item()
    assert abs(std - model.config.initializer_range) < 0.002


def test_same_seed_same_weights_and_lora_base_is_the_full_base() -> None:
    full = reference(inline_job(strategy="ddp"))
    again = reference(inline_job(strategy="ddp"))
    lora = reference(inline_job(strategy="ddp", method="lora"))
    for (name, p), q in zip(full.named_parameters(), again.parameters(), strict=True):
        assert torch.equal(p, q), name
    base = lora.get_base_model()
    torch.testing.assert_close(
        base.model.layers[1].self_attn.q_proj.base_layer.weight,
        full.model.layers[1].self_attn.q_proj.weight,
        rtol=0,
        atol=0,
    )
    assert torch.count_nonzero(base.model.layers[1].self_attn.q_proj.lora_B.default.weight) == 0


@pytest.mark.parametrize("strategy", ["fsdp-full-shard", "ddp"])
def test_sharded_and_replicated_loads_equal_the_plain_build(world_one: None, strategy: str) -> None:
    job = inline_job(strategy=strategy, method="lora", tied=True, precision="bf16")
    parallel = load_parallel_model(job, build_byte_tokenizer(), CPU, 1)
    got = get_model_state_dict(parallel.model)
    want = get_model_state_dict(reference(job))
    assert set(got) == set(want)
    for key, value in want.items():
        local = got[key].full_tensor() if hasattr(got[key], "full_tensor") else got[key]
        assert local.dtype == value.dtype and torch.equal(local, value), key


def test_catalog_model_builds_from_the_plans_architecture(world_one: None) -> None:
    job = inline_job(strategy="fsdp-full-shard")
    arch = job.spec.model.architecture
    job.spec.model = ModelSpec(name="some-catalog-model", source="inline")
    job.plan.architecture = arch
    model = load_parallel_model(job, build_byte_tokenizer(), CPU, 1).model
    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 2
    job.plan.architecture = None
    with pytest.raises(UnsupportedConfigError, match=r"needs model\.architecture"):
        load_parallel_model(job, build_byte_tokenizer(), CPU, 1)


@pytest.mark.parametrize("strategy", ["fsdp-full-shard", "ddp"])
def test_pretrained_world_one_matches_from_pretrained(
    tmp_path: Path, world_one: None, strategy: str
) -> None:
    save_pretrained(tmp_path / "m", tied=False)
    job = pretrained_job(tmp_path / "m", strategy=strategy)
    model = load_parallel_model(job, build_byte_tokenizer(), CPU, 1).model.eval()
    with torch.no_grad():
        logits = model(input_ids=INPUT).logits
    assert torch.equal(logits, plain_logits(tmp_path / "m"))


def test_pretrained_without_safetensors_is_refused_naming_the_field(tmp_path: Path) -> None:
    LlamaConfig(
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        vocab_size=259,
    ).save_pretrained(tmp_path)
    job = pretrained_job(tmp_path, strategy="ddp")
    with pytest.raises(UnsupportedConfigError, match=r"spec.model: no \*.safetensors"):
        reference(job)


# ---- torchrun ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(("world", "method", "tied"), [(2, "full", False), (4, "lora", True)])
def test_pretrained_sharded_load_gives_from_pretrained_logits(
    tmp_path: Path, world: int, method: str, tied: bool
) -> None:
    save_pretrained(tmp_path / "m", tied=tied)
    job = pretrained_job(tmp_path / "m", strategy="fsdp-full-shard", method=method)
    got = run_workers(tmp_path, job, world, "pretrained")
    assert got["tied"] == tied
    # LoRA B starts at zero: the adapted model's logits are the base's.
    assert torch.equal(got["logits"], plain_logits(tmp_path / "m"))
    # Every shard (base from disk, adapters from the seeded init) as one process builds it:
    # the weights do not depend on the world size.
    want = get_model_state_dict(reference(job))
    assert set(got["state"]) == set(want)
    for key, value in want.items():
        assert torch.equal(got["state"][key], value), key
