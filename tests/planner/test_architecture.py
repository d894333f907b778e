"""Parameter counts: catalog vs real HF modules on the meta device, and model resolution."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetune_operator.api.spec import ModelArchitecture, ModelSpec
from finetune_operator.planner import PlanningError, resolve_model, shape_of
from finetune_operator.planner.catalog import CatalogEntry, catalog_entries, lookup

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ENTRIES = catalog_entries()


def hf_config(a: ModelArchitecture) -> object:
    kw: dict[str, object] = dict(
        hidden_size=a.hidden_size,
        num_hidden_layers=a.num_hidden_layers,
        num_attention_heads=a.num_attention_heads,
        num_key_value_heads=a.num_key_value_heads or a.num_attention_heads,
        intermediate_size=a.intermediate_size,
        vocab_size=a.vocab_size,
        tie_word_embeddings=a.tie_word_embeddings,
        max_position_embeddings=a.max_position_embeddings or 4096,
    )
    if a.head_dim:
        kw["head_dim"] = a.head_dim
    if a.num_local_experts:
        key = "num_local_experts" if a.model_type == "mixtral" else "num_experts"
        kw[key] = a.num_local_experts
        kw["num_experts_per_tok"] = a.num_experts_per_tok
    if a.moe_intermediate_size:
        kw["moe_intermediate_size"] = a.moe_intermediate_size
    return transformers.AutoConfig.for_model(a.model_type, **kw)


def meta_parameter_count(a: ModelArchitecture) -> int:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config(a))
    return sum(p.numel() for p in model.parameters())


# The whole catalog builds on the meta device in ~5 s, so it stays in the default run.
@pytest.mark.parametrize("entry", ENTRIES, ids=[e.name for e in ENTRIES])
def test_catalog_count_equals_hf_module(entry: CatalogEntry) -> None:
    ours = shape_of(entry.architecture).total
    assert ours == entry.parameters  # the recorded (source) count
    assert ours == meta_parameter_count(entry.architecture)


@pytest.mark.parametrize("entry", [e for e in ENTRIES if e.active_parameters], ids=lambda e: e.name)
def test_moe_active_parameters(entry: CatalogEntry) -> None:
    assert shape_of(entry.architecture).active == entry.active_parameters


@pytest.mark.parametrize("name", ["meta-llama/Llama-3.1-8B", "Llama-3.1-8B", "llama-3.1-8b"])
def test_lookup_by_hub_id_or_short_name(name: str) -> None:
    entry = lookup(name)
    assert entry is not None and entry.parameters == 8_030_261_248


def test_resolve_from_config_json(tmp_path: Path) -> None:
    cfg = {
        "model_type": "qwen2",
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "intermediate_size": 4864,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "max_position_embeddings": 32768,
        "rope_theta": 1e6,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for name in (str(tmp_path), str(tmp_path / "config.json")):
        assert resolve_model(ModelSpec(name=name)).total == 494_032_768  # Qwen2.5-0.5B


def test_explicit_architecture_wins_over_catalog() -> None:
    arch = ModelArchitecture(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=172,
        vocab_size=259,
    )
    shape = resolve_model(ModelSpec(name="meta-llama/Llama-3.1-8B", architecture=arch))
    assert shape.total == meta_parameter_count(arch)


def test_unknown_model_names_architecture_field() -> None:
    with pytest.raises(PlanningError) as err:
        resolve_model(ModelSpec(name="acme/secret-model-9b"))
    assert err.value.field == "spec.model.architecture"
