"""Accuracy contract (DESIGN.md §4): the planner's per-candidate peak of allocated tensor memory
is within ±5% of PyTorch's own accounting of one real training step (planner/trace.py).

Each row is traced once per session. Most rows are `slow` (and `inprocess`); a handful run by
default. The same
MATRIX feeds bench/planner_accuracy.py, which also writes bench/results/trace_vs_estimate.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache

import pytest

from finetune_operator.api.spec import LoraSpec, ModelArchitecture
from finetune_operator.planner import Candidate, TrainingShape, estimate_memory, shape_of
from finetune_operator.planner.catalog import lookup
from finetune_operator.planner.trace import TraceConfig, TraceResult, run_trace

TOLERANCE = 0.05


def _catalog(name: str) -> ModelArchitecture:
    entry = lookup(name)
    assert entry is not None, name
    return entry.architecture


def _arch(
    model_type: str,
    h: int,
    layers: int,
    heads: int,
    kv: int,
    inter: int,
    vocab: int,
    **extra: object,
) -> ModelArchitecture:
    return ModelArchitecture.model_validate(
        {
            "model_type": model_type,
            "hidden_size": h,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv,
            "intermediate_size": inter,
            "vocab_size": vocab,
            **extra,
        }
    )


ARCHS: dict[str, ModelArchitecture] = {
    # Llama-3 widths and 128k vocabulary, 4 layers: the logits term dominates.
    "llama3-gqa-4l": _arch("llama", 1024, 4, 16, 4, 3584, 128256),
    # Llama-2 layout: MHA, 32k vocabulary.
    "llama2-mha-4l": _arch("llama", 1024, 4, 16, 16, 2816, 32000),
    # SmolLM-135M's real shape (tied embeddings, 9 heads over 3 KV heads, 30 layers).
    "smollm-135m": _arch("llama", 576, 30, 9, 3, 1536, 49152, tie_word_embeddings=True),
    # Mistral-7B-v0.3 proportions scaled down (32768 vocabulary, 4 KV heads of 8).
    "mistral-4l": _arch("mistral", 1024, 4, 8, 4, 3584, 32768),
    "qwen2.5-0.5b": _catalog("Qwen/Qwen2.5-0.5B"),  # real config: biases, tied, 24 layers
    "qwen3-0.6b": _catalog("Qwen/Qwen3-0.6B"),  # real config: qk-norm, head_dim 128, tied
    # A tiny Mixtral: 4 experts, top-2.
    "mixtral-tiny": _arch(
        "mixtral", 512, 2, 8, 2, 1024, 32000, num_local_experts=4, num_experts_per_tok=2
    ),
}

LORA = LoraSpec(
    rank=16, alpha=32, dropout=0.05, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]
)


@dataclass(frozen=True)
class Row:
    arch: str
    method: str = "full"
    strategy: str = "ddp"
    world: int = 1
    batch: int = 1
    seq: int = 1024
    ac: bool = False
    precision: str = "bf16-mixed"
    fast: bool = False

    @property
    def id(self) -> str:
        ac = "ac" if self.ac else "noac"
        prec = "" if self.precision == "bf16-mixed" else f"-{self.precision}"
        return (
            f"{self.arch}-{self.method}-{self.strategy}-n{self.world}-b{self.batch}"
            f"-s{self.seq}-{ac}{prec}"
        )


def _rows() -> list[Row]:
    r = Row
    rows = [
        # Fast (default run): one per strategy, small models.
        r("llama2-mha-4l", seq=512, fast=True),
        r("llama2-mha-4l", "lora", "fsdp-full-shard", 2, seq=512, fast=True),
        r("mistral-4l", strategy="fsdp-shard-grad-op", world=8, seq=512, ac=True, fast=True),
        r("mixtral-tiny", strategy="fsdp-full-shard", world=8, seq=512, fast=True),
    ]
    for arch in ("llama3-gqa-4l", "llama2-mha-4l", "mistral-4l"):
        rows += [
            r(arch, seq=2048),
            r(arch, seq=2048, precision="bf16-pure"),
            r(arch, "lora", seq=4096, ac=True),
            r(arch, strategy="fsdp-full-shard", world=2, batch=2, seq=1024),
            r(arch, strategy="fsdp-full-shard", world=8, seq=4096, ac=True),
            r(arch, "lora", "fsdp-full-shard", 8, seq=2048),
            r(arch, strategy="fsdp-shard-grad-op", world=8, seq=1024, ac=True),
            r(arch, "lora", "fsdp-shard-grad-op", 2, batch=2, seq=512),
        ]
    rows += [
        r("llama3-gqa-4l", world=2, seq=1024),
        r("llama2-mha-4l", "lora", world=2, batch=2, seq=1024, ac=True),
        r("smollm-135m", seq=2048),
        r("smollm-135m", "lora", "fsdp-full-shard", 8, seq=4096, ac=True),
        r("smollm-135m", strategy="fsdp-shard-grad-op", world=2, batch=4, seq=1024),
        r("qwen2.5-0.5b", strategy="fsdp-full-shard", world=8, seq=2048),
        r("qwen2.5-0.5b", "lora", seq=2048, ac=True),
        r("qwen2.5-0.5b", strategy="fsdp-shard-grad-op", world=8, seq=4096, ac=True),
        r("qwen3-0.6b", strategy="fsdp-full-shard", world=8, seq=4096, ac=True),
        r("qwen3-0.6b", "lora", "fsdp-full-shard", 2, seq=1024),
        r("mixtral-tiny", seq=1024, precision="bf16-pure"),  # see TraceConfig: no MoE autocast
        r("mixtral-tiny", "lora", "fsdp-full-shard", 2, seq=2048, ac=True),
        r("mixtral-tiny", strategy="fsdp-shard-grad-op", world=8, batch=2, seq=1024),
    ]
    return rows


MATRIX = _rows()


def trace_config(row: Row) -> TraceConfig:
    return TraceConfig(
        arch=ARCHS[row.arch],
        method=row.method,
        lora=LORA if row.method == "lora" else None,  # type: ignore[arg-type]
        strategy=row.strategy,
        world_size=row.world,
        micro_batch_size=row.batch,  # type: ignore[arg-type]
        seq_len=row.seq,
        checkpointing=row.ac,
        precision=row.precision,  # type: ignore[arg-type]
        # The planner assumes DDP with gradient_as_bucket_view=True (grads are the buckets).
        ddp_bucket_view=True,
    )


def estimate(row: Row) -> tuple[int, object]:
    """The planner's per-candidate estimate for the row: (peak bytes, MemoryEstimate)."""
    shape = TrainingShape(
        micro_batch_size=row.batch,
        seq_len=row.seq,
        precision="bf16",
        method=row.method,  # type: ignore[arg-type]
        lora_rank=LORA.rank,
        lora_targets=tuple(LORA.target_modules),
        lora_dropout=LORA.dropout,
        attention="sdpa",
        checkpointing=row.ac,
        master_weights=False if row.precision == "bf16-pure" else None,
    )
    cand = Candidate(strategy=row.strategy, world_size=row.world, gpus_per_node=row.world)  # type: ignore[arg-type]
    est = estimate_memory(shape_of(ARCHS[row.arch]), shape, cand)
    return est.breakdown.peak, est


@cache
def traced(row: Row) -> TraceResult:
    return run_trace(trace_config(row))


def _params() -> list[object]:
    # inprocess: one traced step is pure CPU in this process (fake tensors, no I/O, no waits);
    # `make test` runs these rows with the quick tests, where they use the core the multi-process
    # and end-to-end tests leave idle while they wait.
    marks = {True: (), False: (pytest.mark.slow, pytest.mark.inprocess)}
    return [pytest.param(row, id=row.id, marks=marks[row.fast]) for row in MATRIX]


def test_matrix_covers_the_contract() -> None:
    assert len(MATRIX) >= 40
    assert len({r.arch for r in MATRIX}) >= 6
    assert {r.strategy for r in MATRIX} >= {"ddp", "fsdp-full-shard", "fsdp-shard-grad-op"}
    assert {r.world for r in MATRIX} >= {1, 2, 8}
    assert {r.method for r in MATRIX} == {"full", "lora"} and {r.ac for r in MATRIX} == {
        True,
        False,
    }
    assert min(r.seq for r in MATRIX) == 512 and max(r.seq for r in MATRIX) == 4096
    assert len({r.id for r in MATRIX}) == len(MATRIX)
    assert replace(MATRIX[0], fast=False).id == MATRIX[0].id


@pytest.mark.parametrize("row", _params())
def test_planner_peak_within_5_percent_of_trace(row: Row) -> None:
    pytest.importorskip("torch")
    trace = traced(row)
    peak, est = estimate(row)
    err = (peak - trace.peak) / trace.peak
    assert abs(err) <= TOLERANCE, (
        f"{row.id}: planner peak {peak / 2**20:.1f} MiB vs traced {trace.peak / 2**20:.1f} MiB "
        f"({err:+.1%}); planner {est}; trace {trace.summary()}"
    )
