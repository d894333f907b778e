"""Planner accuracy against PyTorch's own accounting, beside the public estimators.

For every configuration of tests/planner/test_trace_accuracy.py (and a few 7B-class shapes with
--large) it traces one training step (planner/trace.py) and prints, each against the traced peak:
our planner's `estimate_memory`, `accelerate estimate-memory` (its "Training using Adam" figure,
computed by accelerate's own functions on a meta-device model), DeepSpeed's
`estimate_zero{2,3}_model_states_mem_needs` (the formulas behind the *_all_live helpers) and
`llm-analysis` (training(), peak = weights + optimizer + grads + activations). Writes
bench/results/planner_accuracy.txt and bench/results/trace_vs_estimate.md.

    python bench/planner_accuracy.py [--large] [--only SUBSTRING]
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
MIB = 2**20


def _load_matrix() -> Any:
    path = REPO / "tests" / "planner" / "test_trace_accuracy.py"
    spec = importlib.util.spec_from_file_location("trace_matrix", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["trace_matrix"] = mod
    spec.loader.exec_module(mod)
    return mod


M = _load_matrix()


def _large_rows() -> list[Any]:
    from finetune_operator.planner.catalog import lookup

    for name in ("meta-llama/Llama-2-7b-hf", "meta-llama/Llama-3.1-8B"):
        entry = lookup(name)
        if entry is not None:
            M.ARCHS[name.rsplit("/", 1)[-1]] = entry.architecture
    rows = []
    for arch in ("Llama-2-7b-hf", "Llama-3.1-8B"):
        if arch in M.ARCHS:
            rows += [
                M.Row(arch, strategy="fsdp-full-shard", world=8, seq=4096, ac=True),
                M.Row(arch, "lora", "ddp", 1, seq=2048, ac=True),
            ]
    return rows


# ---- the public estimators, each returning per-GPU bytes or None when it cannot answer ----


def _meta_model(row: Any) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    from finetune_operator.planner.trace_model import hf_config

    auto: Any = AutoModelForCausalLM
    with torch.device("meta"):
        return auto.from_config(hf_config(M.ARCHS[row.arch]))


def accelerate_estimate(row: Any, model: Any) -> int | None:
    """`accelerate estimate-memory --dtypes bfloat16`: max of its training-usage entries."""
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes

    total_size, _largest = calculate_maximum_sizes(model)  # fp32 bytes of the model
    usage = estimate_training_usage(total_size, "bfloat16")
    return int(max(usage.values()))


def deepspeed_estimate(row: Any, model: Any) -> int | None:
    """DeepSpeed's model-states formulas (no activations): ZeRO-3 for full shard, ZeRO-2 for
    shard-grad-op, ZeRO-2 at one GPU for DDP (its 2 + 18 bytes per parameter)."""
    try:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    except ImportError:
        return None
    total = sum(p.numel() for p in model.parameters())
    if row.strategy in ("fsdp-full-shard", "zero3"):
        largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
        _cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
            total,
            largest,
            num_gpus_per_node=row.world,
            cpu_offload=False,
            cpu_offload_params=False,
        )
        return int(gpu)
    n = row.world if row.strategy == "fsdp-shard-grad-op" else 1
    _cpu, gpu = estimate_zero2_model_states_mem_needs(total, num_gpus_per_node=n, cpu_offload=False)
    return int(gpu)


def llm_analysis_estimate(row: Any, model: Any) -> int | None:
    """llm-analysis training() peak; it has no LoRA (counts full fine-tuning) and no MoE-free
    ffn that is not a multiple of the width, so ffn_embed_dim is set after validation."""
    try:
        import llm_analysis.analysis as la
    except ImportError:
        return None
    logging.disable(logging.CRITICAL)
    a = M.ARCHS[row.arch]
    h, ffn = a.hidden_size, a.moe_intermediate_size or a.intermediate_size
    mc = la.ModelConfig(
        name=row.arch,
        num_layers=a.num_hidden_layers,
        n_head=a.num_attention_heads,
        hidden_dim=h,
        vocab_size=a.vocab_size,
        max_seq_len=max(row.seq, 4096),
        num_key_value_heads=a.num_key_value_heads or a.num_attention_heads,
        ffn_embed_dim=4 * h,
        moe_num_experts=a.num_local_experts or 1,
        moe_top_k=a.num_experts_per_tok or 1,
    )
    mc.ffn_embed_dim, mc.expansion_ratio = ffn, ffn / h
    gpu = la.GPUConfig(
        name="h100-sxm-80gb",
        mem_per_GPU_in_GB=80,
        hbm_bandwidth_in_GB_per_sec=3350,
        intra_node_bandwidth_in_GB_per_sec=450,
        intra_node_min_message_latency=8e-6,
        peak_fp16_TFLOPS=989,
    )
    zero = {"fsdp-full-shard": la.DSZeRO.STAGE_3, "fsdp-shard-grad-op": la.DSZeRO.STAGE_2}
    analysis = la.LLMAnalysis(mc, gpu, parallelism_config=la.ParallelismConfig(dp_size=row.world))
    out = analysis.training(
        batch_size_per_gpu=row.batch,
        gradient_accumulation_steps=1,
        seq_len=row.seq,
        activation_recomputation=(
            la.ActivationRecomputation.FULL if row.ac else la.ActivationRecomputation.NONE
        ),
        ds_zero=zero.get(row.strategy, la.DSZeRO.NONE),
        flash_attn=True,
        mlp_gated_linear_units=True,
    )
    return int(out["(weight+op_state+grad+act)_memory_per_gpu"])


TOOLS: dict[str, Callable[[Any, Any], int | None]] = {
    "accelerate": accelerate_estimate,
    "deepspeed": deepspeed_estimate,
    "llm-analysis": llm_analysis_estimate,
}


def _safe(fn: Callable[[Any, Any], int | None], row: Any, model: Any) -> int | None:
    try:
        return fn(row, model)
    except Exception:  # e.g. llm-analysis asserts when the model does not fit its GPU
        return None


def _err(value: int | None, ref: int) -> float | None:
    return None if value is None else (value - ref) / ref * 100


def _fmt(err: float | None) -> str:
    return f"{err:+8.1f}%" if err is not None else "      n/a"


def run(rows: list[Any]) -> tuple[list[str], list[str], dict[str, list[float]]]:
    names = ["planner", *TOOLS]
    head = f"{'configuration':<62}{'traced':>9}{'s':>6}" + "".join(f"{n:>13}" for n in names)
    table, off = [head, "-" * len(head)], []
    errors: dict[str, list[float]] = {n: [] for n in names}
    for row in rows:
        t0 = time.perf_counter()
        try:
            trace = M.traced(row)
        except Exception as exc:  # a row that cannot be traced is reported, not fatal
            table.append(f"{row.id:<62} trace failed: {exc}")
            print(table[-1], flush=True)
            continue
        secs = time.perf_counter() - t0
        peak, est = M.estimate(row)
        model = _meta_model(row)
        values = {"planner": peak} | {n: _safe(f, row, model) for n, f in TOOLS.items()}
        errs = {n: _err(v, trace.peak) for n, v in values.items()}
        for n, e in errs.items():
            if e is not None:
                errors[n].append(abs(e))
        line = f"{row.id:<62}{trace.peak / MIB:>9.0f}{secs:>6.1f}" + "".join(
            f"{_fmt(errs[n]):>13}" for n in names
        )
        table.append(line)
        print(line, flush=True)
        if abs(errs["planner"] or 0) > M.TOLERANCE * 100:
            off.append(_off_row(row, trace, est, errs["planner"] or 0))
    table.append("-" * len(head))
    for label, fn in (("mean |error|", statistics.fmean), ("worst |error|", max)):
        cells = "".join(f"{(f'{fn(errors[n]):.1f}%' if errors[n] else 'n/a'):>13}" for n in names)
        table.append(f"{label:<77}{cells}")
    return table, off, errors


def _off_row(row: Any, trace: Any, est: Any, err: float) -> str:
    b = est.breakdown
    t_states = trace.parameters + trace.gradients + trace.optimizer
    e_states = b.parameters + b.gradients + b.optimizer

    def d(e: int, t: int) -> str:
        return f"{(e - t) / MIB:+.0f}"

    return (
        f"| {row.id} | {err:+.1f}% | {est.peak_phase} / {trace.peak_phase} | "
        f"{d(b.parameters, trace.parameters)} | {d(b.gradients, trace.gradients)} | "
        f"{d(b.optimizer, trace.optimizer)} | "
        f"{d(b.peak - e_states, trace.peak - t_states)} |"
    )


def write(table: list[str], off: list[str], n_rows: int) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    note = (
        "Errors are (tool - traced) / traced of the per-GPU peak of allocated tensor memory.\n"
        "Traced: planner/trace.py, one steady-state step under FakeTensorMode + MemTracker /\n"
        "FSDPMemTracker, bf16-mixed unless the id says otherwise. accelerate and DeepSpeed\n"
        "count model states only (no activations, no sharding for accelerate); llm-analysis has\n"
        "no LoRA, so LoRA rows are full fine-tuning to it.\n\n"
    )
    (RESULTS / "planner_accuracy.txt").write_text(note + "\n".join(table) + "\n")
    md = [
        "# Planner estimate vs traced peak: rows outside ±5%",
        "",
        f"{len(off)} of {n_rows} rows. Deltas are estimate - traced in MiB; 'rest' is the peak",
        "minus the resident states (activations + temporaries + gathers + loss tensors).",
        "",
        "| row | peak error | phase est / traced | params | grads | optimizer | rest at peak |",
        "|---|---|---|---|---|---|---|",
        *off,
    ]
    (RESULTS / "trace_vs_estimate.md").write_text("\n".join(md) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--large", action="store_true", help="add 7B-class shapes")
    parser.add_argument("--only", default="", help="rows whose id contains this")
    args = parser.parse_args()
    rows = list(M.MATRIX) + (_large_rows() if args.large else [])
    rows = [r for r in rows if args.only in r.id]
    table, off, _ = run(rows)
    print("\n".join(table[-2:]))
    if not args.only:
        write(table, off, len(rows))


if __name__ == "__main__":
    main()
