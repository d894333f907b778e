"""Tables of bench/gpu.py's GPU results against the planner as it is now.

Reads the result files bench/gpu.py wrote on the GPU machine (kept under
bench/results/gpu-h100/, one per device call and variant: `callN-TAG.json`), re-plans each
configuration with the current planner (the same FineTuneJob spec, bench/gpu.py's job_spec) and
prints markdown: throughput against HF Trainer, MFU, the ablation of each throughput change,
planned vs measured peak allocated / reserved memory and step time, checkpoint blocking.

    python bench/gpu_report.py [bench/results/gpu-h100] > bench/results/gpu-h100.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu

GIB = 2**30
TRAINER_TAGS = ("final", "final2", "new")  # the shipped trainer code, newest first
EAGER_TAGS = ("base", "nocompile")  # runs without torch.compile (FT_COMPILE=0 or before it)
CODE = {
    "base": "before (float(loss) per micro-batch, pageable batches, foreach AdamW, eager)",
    "nocompile": "no host sync per micro-batch + pinned batches + fused AdamW, eager",
    "new": "+ per-block torch.compile (call 1, before the checkpoint-staging merge)",
    "final": "shipped: all of the above + overlapped DDP + own pinned checkpoint staging",
    "final2": "shipped (as final)",
}


def load(folder: Path) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for f in sorted(folder.glob("call*-*.json")):
        tag = f.stem.split("-", 1)[1]
        out[tag] = json.loads(f.read_text())
    return out


def planned(case: gpu.Case, compiled: bool = True) -> Any:
    """The current planner's plan of `case`; `compiled=False` plans eager blocks (the runs
    made with FT_COMPILE=0)."""
    from finetune_operator.planner import plan_job

    # Any absolute work dir off the pod's own mounts (/tmp is one): only the plan is used.
    work = Path("/bench-work")
    spec = gpu.job_spec(case, work / "d.jsonl", work / "ckpt", 8, sync=False)
    return plan_job(spec, compile_blocks=compiled)


def pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def main() -> None:
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "results/gpu-h100"
    runs = load(folder)
    cases = {c.name: c for c in gpu.MATRIX}
    trainer: dict[str, tuple[str, dict[str, Any]]] = {}
    for tag in TRAINER_TAGS:
        for row in runs.get(tag, {}).get("rows", []):
            if "tokens_per_second" in row and row["case"] not in trainer:
                trainer[row["case"]] = (tag, row)
    hf: dict[str, float] = {}
    for run in runs.values():
        for row in run.get("rows", []):
            if "hf_tokens_per_second" in row:
                hf.setdefault(row["case"], row["hf_tokens_per_second"])
            elif isinstance(row.get("hf"), dict) and "tokens_per_second" in row["hf"]:
                hf.setdefault(row["case"], row["hf"]["tokens_per_second"])
    env = next(iter(runs.values()))["env"]
    print("# bench/gpu.py on one H100 80GB\n")
    print(
        f"GPU {env.get('gpu')}, driver {env.get('driver')}, CUDA {env.get('cuda')}, "
        f"torch {env.get('torch')}, transformers {env.get('transformers')}, peft "
        f"{env.get('peft')}; bf16, one GPU (world size 1), `source: inline` random init, byte "
        "tokenizer, packed random text. Each configuration is the operator's own job.json "
        "(FineTuneJob spec -> planner -> JobConfig) run under `torch.distributed.run "
        "--nproc_per_node 1 -m finetune_trainer`; steps 5-6, the first (compilation, "
        "allocator warm-up) and the one after a checkpoint left out of the median. HF Trainer: "
        "transformers.Trainer on the same model, micro-batch, accumulation, sequence, bf16 "
        "autocast, checkpointing and LoRA, its default fused AdamW, in a fresh process on the "
        "same GPU. MFU: model FLOPs (6N, 4N for LoRA, + attention, no recomputation) over 989 "
        "TFLOP/s. Planned figures are the current planner's, re-planned from the same spec "
        "(`python bench/gpu_report.py`).\n"
    )
    print("## Throughput\n")
    print("| configuration | tok/s | MFU | HF Trainer tok/s | vs HF | code |")
    print("|---|---:|---:|---:|---:|---|")
    for name, (tag, r) in trainer.items():
        h = hf.get(name)
        vs = f"{r['tokens_per_second'] / h:.2f}x" if h else "not measured"
        hs = f"{h:,.0f}" if h else "not measured"
        print(
            f"| {name} | {r['tokens_per_second']:,.0f} | {100 * r['mfu']:.1f}% | {hs} | {vs} "
            f"| {tag} |"
        )
    missing = [n for n in cases if n not in trainer]
    if missing:
        print(f"\nNot measured (device time ran out): {', '.join(missing)}.")
    print("\n## Each throughput change, same configuration, same GPU\n")
    print("| configuration | " + " | ".join(CODE[t] for t in ("base", "nocompile", "new")) + " |")
    print("|---|---:|---:|---:|")
    for name in cases:
        cells = []
        for tag in ("base", "nocompile", "new", "final"):
            row = next((r for r in runs.get(tag, {}).get("rows", []) if r["case"] == name), None)
            cells.append(f"{row['tokens_per_second']:,.0f}" if row and "mfu" in row else "")
        if sum(bool(c) for c in cells) >= 2:
            last = cells[2] or cells[3]
            print(f"| {name} | {cells[0] or '-'} | {cells[1] or '-'} | {last or '-'} |")
    print("\n## Memory and step time: planner (now) vs measured\n")
    print(
        "| configuration | peak planned | peak measured | error | reserved planned | "
        "reserved measured | error | step planned | step measured | error | fits |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    peak_errs, res_errs = [], []
    rows = dict(trainer)
    for tag in ("nocompile", "base"):
        for r in runs.get(tag, {}).get("rows", []):
            rows.setdefault(f"{r['case']} (eager, {tag})", (tag, r))
    for name, (tag, r) in rows.items():
        case = cases[name.split(" ")[0]]
        plan = planned(case, compiled=tag not in EAGER_TAGS)
        mem = plan.memory
        pk, rs = r["meas_peak_gib"], r["meas_reserved_gib"]
        ep, er = mem.peak / GIB / pk - 1, mem.reserved / GIB / rs - 1
        es = plan.estimated_step_seconds / r["step_seconds"] - 1
        if tag != "base":  # the base trainer ran foreach AdamW, which the planner no longer models
            peak_errs.append((name, ep, case.ac or tag == "nocompile"))
            res_errs.append((name, er, case.ac or tag == "nocompile"))
        print(
            f"| {name} | {mem.peak / GIB:.2f} | {pk:.2f} | {pct(ep)} | {mem.reserved / GIB:.2f} "
            f"| {rs:.2f} | {pct(er)} | {plan.estimated_step_seconds:.3f} | "
            f"{r['step_seconds']:.3f} | {pct(es)} | {plan.fits} |"
        )
    exact = [e for _, e, eager_or_ac in peak_errs if eager_or_ac]
    if exact:
        print(
            f"\nPeak allocated, eager or checkpointed runs ({len(exact)}): mean |error| "
            f"{100 * sum(abs(e) for e in exact) / len(exact):.1f}%, worst "
            f"{100 * max(abs(e) for e in exact):.1f}%. Reserved, same runs: mean |error| "
            f"{100 * sum(abs(e) for _, e, a in res_errs if a) / len(exact):.1f}%, worst "
            f"{100 * max(abs(e) for _, e, a in res_errs if a):.1f}%."
        )
    print("\n## Checkpoints (async, own pinned staging; save at step 4, final save at step 5)\n")
    print(
        "| configuration | save call + staging wait (s) | step after save / normal | "
        "stall estimate (s) | async save to commit (s) |"
    )
    print("|---|---:|---:|---:|---:|")
    for tag in ("final",):
        for run_case, raw in runs.get(tag, {}).get("raw", {}).items():
            s = raw["trainer"].get("summary") or {}
            row = next(r for r in runs[tag]["rows"] if r["case"] == run_case)
            if not s.get("checkpoint_blocking_seconds"):
                continue
            print(
                f"| {run_case} | {s['checkpoint_blocking_seconds'][0]:.2f} | "
                f"{row.get('step_after_save_ratio', 0):.2f} | "
                f"{s['checkpoint_stall_seconds'][0]:.2f} | "
                f"{s['checkpoint_commit_seconds'][0]:.1f} |"
            )
    print("\n## Caching-allocator pools at the end of each run (stream: reserved / allocated)\n")
    for tag in ("final", "final2"):
        for run_case, raw in runs.get(tag, {}).get("raw", {}).items():
            segs = (raw["trainer"].get("summary") or {}).get("segments_by_stream", {})
            parts = [
                f"{'compute' if k.startswith('0:') else 'side'} {k.split(':')[1]} "
                f"{v[1] / GIB:.2f} / {v[2] / GIB:.2f} GiB"
                for k, v in segs.items()
            ]
            print(f"- {run_case}: " + "; ".join(parts))


if __name__ == "__main__":
    main()
