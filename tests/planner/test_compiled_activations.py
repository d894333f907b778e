"""The compiled-block activation model (planner/compiled.py) against inductor's real
partitioner.

Each case compiles one tiny HF decoder layer with inductor's own `compile_fx` (its
decompositions, joint-graph passes and `min_cut_rematerialization_partition`), replacing only
the code generator: the forward graph it would generate code for is recorded and the run
stops there. The forward graph's outputs beyond the layer's own output are exactly what the
compiled block saves for backward; the bytes of those that depend on the layer input
(activations: not parameters, their autocast casts, or the shared RoPE cos/sin) over the
tokens is the per-token figure the planner's closed form must give.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from finetune_operator.api.spec import ModelArchitecture  # noqa: E402
from finetune_operator.planner.activations import activation_model  # noqa: E402
from finetune_operator.planner.architecture import shape_of  # noqa: E402
from finetune_operator.planner.compiled import compiled_layer_bytes_per_token  # noqa: E402

BATCH, SEQ = 2, 16
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
VIEWS = {"view", "_unsafe_view", "permute", "transpose", "t", "expand", "unsqueeze", "squeeze"}


class _Recorded(Exception):
    """Stops the compile once the partitioned forward graph is in hand."""


def _arch(model_type: str) -> dict[str, Any]:
    # q_dim (4 x 32 = 128) differs from hidden (96) and kv (2 heads: GQA), so every term of
    # the closed form is told apart.
    return {
        "model_type": model_type,
        "hidden_size": 96,
        "intermediate_size": 160,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": 128,
    }


def _base(node: Any) -> Any:
    while (
        node.op == "call_function" and getattr(node.target, "__name__", "").split(".")[0] in VIEWS
    ):
        node = node.args[0]
    return node


def _depends_on(node: Any, source: Any) -> bool:
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n is source:
            return True
        if n in seen:
            continue
        seen.add(n)
        todo.extend(n.all_input_nodes)
    return False


def _saved_activation_bytes(graph: Any) -> int:
    """Bytes of the forward graph's saved outputs (all but the first, the layer's output)
    that derive from the layer input, each storage counted once (views share their base)."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    x = placeholders[0]  # the hidden states: the layer's first input
    output = next(n for n in graph.nodes if n.op == "output")
    bases = {}
    for o in output.args[0][1:]:
        if not hasattr(o, "meta") or not isinstance(o.meta.get("val"), torch.Tensor):
            continue
        b = _base(o)
        if _depends_on(b, x):
            v = b.meta["val"]
            bases[b.name] = v.numel() * v.element_size()
    return sum(bases.values())


def _partitioned_bytes_per_token(model_type: str, regime: str, targets: tuple[str, ...]) -> float:
    from torch._inductor.compile_fx import compile_fx

    graphs: list[Any] = []

    def record(gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
        if not kwargs.get("is_backward"):
            graphs.append(gm.graph)
        raise _Recorded

    torch._dynamo.reset()
    config = transformers.AutoConfig.for_model(**_arch(model_type))
    bf16 = torch.bfloat16
    full = not targets
    # DDP full: fp32 model under autocast; LoRA: bf16 base, adapters fp32 under autocast
    # (DDP) or bf16 (FSDP2's param dtype); FSDP2 full: bf16 parameters.
    dtype = torch.float32 if regime == "autocast" and full else bf16
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation="sdpa", dtype=dtype
        )
        if targets:
            from peft import LoraConfig, get_peft_model

            lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=list(targets))
            model = get_peft_model(model, lora, autocast_adapter_dtype=regime == "autocast")
    model.to_empty(device="cpu")
    if regime == "param":
        model.to(bf16)
    model.train()
    layer = next(m for m in model.modules() if type(m).__name__.endswith("DecoderLayer"))
    compiled = torch.compile(layer, backend=functools.partial(compile_fx, inner_compile=record))
    x = torch.zeros(BATCH, SEQ, 96, dtype=dtype, requires_grad=True)
    cos = torch.zeros(BATCH, SEQ, 32, dtype=dtype)
    autocast = torch.autocast("cpu", dtype=bf16, enabled=regime == "autocast")
    with autocast, pytest.raises(Exception) as err:
        compiled(x, attention_mask=None, position_embeddings=(cos, cos), position_ids=None)
    assert graphs, f"the compile failed before partitioning: {err.value!r}"
    return _saved_activation_bytes(graphs[0]) / (BATCH * SEQ)


@pytest.mark.parametrize(
    ("model_type", "regime", "targets"),
    [
        pytest.param("llama", "param", (), id="llama-full-bf16"),
        pytest.param("qwen2", "autocast", (), id="qwen2-full-autocast"),
        pytest.param("qwen2", "autocast", ALL, id="qwen2-lora-all-autocast"),
    ],
)
@pytest.mark.slow  # inductor's import and one compile per case: ~15 s in all on 2 cores
def test_closed_form_is_what_the_partitioner_saves(
    model_type: str, regime: str, targets: tuple[str, ...]
) -> None:
    m = shape_of(ModelArchitecture.model_validate(_arch(model_type)))
    lora_autocast = regime == "autocast" and bool(targets)
    modelled = compiled_layer_bytes_per_token(
        m,
        2,
        autocast=regime == "autocast" and not targets,
        lora_targets=targets,
        lora_rank=8 if targets else 0,
        lora_autocast=lora_autocast,
    )
    traced = _partitioned_bytes_per_token(model_type, regime, targets)
    # Under autocast each adapter may keep a second rank-r cast, which the model counts
    # whether or not the partitioner keeps it (2 bytes x 8 per adapter and token at most).
    slack = 2 * 8 * len(targets) if lora_autocast else 0
    assert traced <= modelled <= traced + slack


def test_compiled_blocks_save_less_than_eager() -> None:
    """The planner only ever lowers the eager count by compiling (never raises it)."""
    m = shape_of(ModelArchitecture.model_validate(_arch("llama")))
    for autocast in (False, True):
        kw: dict[str, Any] = {"tokens": 1, "seq": SEQ, "e": 2, "attention": "sdpa"}
        eager = activation_model(m, autocast=autocast, **kw).per_layer
        compiled = activation_model(m, autocast=autocast, compiled=True, **kw).per_layer
        assert compiled < eager
    eager_lora = activation_model(m, lora_targets=ALL, lora_rank=8, lora_compute="param", **kw)
    compiled_lora = activation_model(
        m, lora_targets=ALL, lora_rank=8, lora_compute="param", compiled=True, **kw
    )
    assert compiled_lora.per_layer < eager_lora.per_layer
    # LoRA dropout (random ops change the cut) keeps the eager count.
    dropout = {"lora_targets": ALL, "lora_rank": 8, "lora_dropout": 0.1}
    assert (
        activation_model(m, compiled=True, **dropout, **kw).per_layer
        == activation_model(m, **dropout, **kw).per_layer
    )
