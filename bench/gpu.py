"""The real trainer on a real GPU, against the planner and against Hugging Face Trainer.

For each configuration of MATRIX it builds the FineTuneJob spec a user would write (catalog
architecture, `source: inline` random init, one H100-80GB, pinned strategy, micro-batch and
activation checkpointing), plans it with the operator's own planner, writes the job.json the
operator would write and runs `torch.distributed.run --standalone --nproc_per_node 1 -m
finetune_trainer --config job.json` for a few steps (a checkpoint every 4). Then the same job
(model, micro-batch, accumulation, sequence, bf16 autocast, checkpointing, LoRA) under
transformers' `Trainer` in a fresh process. Prints per configuration:

  planned vs measured peak allocated and reserved (torch.cuda.max_memory_{allocated,reserved}),
  tokens/s, MFU, HF Trainer tokens/s and our ratio to it, planned vs measured step time,
  checkpoint blocking (the save's own blocking plus the step after it over a normal step)
  against a synchronous save of the same state (`--sync-save`: the same run with async off).

MFU counts model FLOPs only (recomputation is not useful work), per token
k * N_nonembedding + k * 2 * layers * seq * heads * head_dim (attention scores and values,
not halved for the causal mask, as TorchTitan and PaLM count it), k = 6 for full fine-tuning
and 4 for LoRA (no weight gradients of the frozen base), over the H100's dense bf16 peak
(989 TFLOP/s, planner.hardware.GPU_PRODUCTS).

    python bench/gpu.py [--only SUBSTR] [--steps 8] [--no-hf] [--sync-save] [--out DIR]

Needs a CUDA GPU; the trainer's own packages importable (PYTHONPATH=operator:trainer_image).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

GIB = 2**30
REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Case:
    name: str
    model: str  # catalog name
    method: str  # full | lora
    strategy: str  # ddp | fsdp-full-shard
    seq: int
    ac: bool
    micro: int
    batch: int  # global batch
    layers: int | None = None  # truncate depth (an 8B-class full fine-tune on one GPU)
    # Two saves of a ~3B full fine-tune's state (2 x 38 GB) do not fit the bench machine's disk.
    ckpt: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


MATRIX = [
    Case("qwen0.5b-full-ddp-2k", "Qwen/Qwen2.5-0.5B", "full", "ddp", 2048, False, 4, 8),
    Case(
        "llama1b-full-ddp-2k", "meta-llama/Llama-3.2-1B-Instruct", "full", "ddp", 2048, False, 4, 8
    ),
    Case(
        "llama1b-full-fsdp-4k-ac",
        "meta-llama/Llama-3.2-1B-Instruct",
        "full",
        "fsdp-full-shard",
        4096,
        True,
        2,
        8,
    ),
    Case(
        "llama3b-full-fsdp-2k-ac",
        "meta-llama/Llama-3.2-3B-Instruct",
        "full",
        "fsdp-full-shard",
        2048,
        True,
        2,
        8,
        ckpt=False,
    ),
    Case(
        "llama3b-lora-ddp-4k", "meta-llama/Llama-3.2-3B-Instruct", "lora", "ddp", 4096, False, 1, 8
    ),
    Case("llama8b-lora-ddp-2k-ac", "meta-llama/Llama-3.1-8B", "lora", "ddp", 2048, True, 2, 8),
    Case("qwen7b-lora-fsdp-1k", "Qwen/Qwen2.5-7B", "lora", "fsdp-full-shard", 1024, False, 4, 8),
    # Llama-3.1-8B's layers (8B-class matmul shapes) at 10 of 32 layers: a full fine-tune of the
    # whole 8B needs 128 GB of states, more than one 80 GB GPU; per-GPU MFU of an FSDP job over
    # 8 GPUs runs these same per-layer shapes.
    Case(
        "llama8b-l10-full-fsdp-4k-ac",
        "meta-llama/Llama-3.1-8B",
        "full",
        "fsdp-full-shard",
        4096,
        True,
        1,
        4,
        layers=10,
        ckpt=False,
    ),
    # The same 8B-class layers without activation checkpointing (8 layers to fit): the MFU
    # goal's configuration, no recomputation.
    Case(
        "llama8b-l8-full-fsdp-4k",
        "meta-llama/Llama-3.1-8B",
        "full",
        "fsdp-full-shard",
        4096,
        False,
        1,
        4,
        layers=8,
        ckpt=False,
    ),
]


# One LoRA setting for both sides of the comparison: the trainer's job and the HF baseline.
LORA_RANK, LORA_ALPHA, LORA_DROPOUT = 16, 32, 0.0
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ---- the job the operator would run ---------------------------------------------------------


def job_spec(case: Case, data: Path, ckpt: Path, steps: int, *, sync: bool) -> Any:
    from finetune_operator.api.spec import FineTuneJobSpec
    from finetune_operator.planner.catalog import lookup

    entry = lookup(case.model)
    assert entry is not None, case.model
    arch = entry.architecture.model_dump(by_alias=True, exclude_none=True)
    if case.layers:
        arch["numHiddenLayers"] = case.layers
    method: dict[str, Any] = {"type": case.method}
    if case.method == "lora":
        method["lora"] = {
            "rank": LORA_RANK,
            "alpha": LORA_ALPHA,
            "dropout": LORA_DROPOUT,
            "targetModules": list(LORA_TARGETS),
        }
    return FineTuneJobSpec.model_validate(
        {
            "model": {"name": case.model, "source": "inline", "architecture": arch},
            "dataset": {"uri": str(data), "format": "jsonl"},
            "method": method,
            "training": {
                "sequenceLength": case.seq,
                "globalBatchSize": case.batch,
                "microBatchSize": case.micro,
                "maxSteps": steps,
                "learningRate": 1e-5,
                "precision": "bf16",
                "activationCheckpointing": "full" if case.ac else "none",
                **case.extra,
            },
            "resources": {"gpu": {"product": "H100-80GB"}, "gpusPerNode": 1, "maxGPUs": 1},
            "strategy": {"type": case.strategy},
            "checkpoint": (
                {"uri": str(ckpt), "intervalSteps": 4, "keep": 1, "async": not sync}
                if case.ckpt
                else {"uri": str(ckpt), "enabled": False}
            ),
            # The bench's work directory stands for the job's shared volume (absolute paths
            # must lie on a declared mount).
            "storage": {
                "volumes": [{"name": "bench", "hostPath": {"path": str(ckpt.parent)}}],
                "volumeMounts": [{"name": "bench", "mountPath": str(ckpt.parent)}],
            },
        }
    )


def write_dataset(path: Path, tokens: int) -> None:
    """Random printable text: the byte tokenizer of inline models makes one token per byte."""
    rng = random.Random(0)
    alphabet = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ.,;0123456789\n"
    with path.open("w") as f:
        for _ in range(tokens // 4000 + 1):
            text = "".join(rng.choice(alphabet) for _ in range(4000))
            f.write(json.dumps({"text": text}) + "\n")


def model_flops_per_token(case: Case) -> float:
    from finetune_operator.planner.architecture import shape_of
    from finetune_operator.planner.catalog import lookup

    entry = lookup(case.model)
    assert entry is not None
    arch = entry.architecture
    if case.layers:
        arch = arch.model_copy(update={"num_hidden_layers": case.layers})
    m = shape_of(arch)
    k = 6 if case.method == "full" else 4
    n = m.total - m.embedding  # the head is a matmul per token; the embedding a lookup
    head_dim = arch.head_dim or arch.hidden_size // arch.num_attention_heads
    attn = 2 * arch.num_hidden_layers * case.seq * arch.num_attention_heads * head_dim
    return float(k * n + k * attn)


# ---- runs -----------------------------------------------------------------------------------


def run_trainer(
    case: Case, work: Path, steps: int, *, sync: bool, env: dict[str, str]
) -> dict[str, Any]:
    from finetune_operator.api.jobconfig import JobConfig
    from finetune_operator.planner import plan_job

    data = work / f"data-{case.seq}.jsonl"
    if not data.exists():
        write_dataset(data, case.seq * case.batch * 4)
    ckpt = work / f"ckpt-{case.name}"
    spec = job_spec(case, data, ckpt, steps, sync=sync)
    plan = plan_job(spec)
    job = JobConfig(name=case.name, uid=case.name, spec=spec, plan=plan)
    cfg = work / f"{case.name}.json"
    cfg.write_text(job.model_dump_json(by_alias=True))
    result: dict[str, Any] = {"plan": plan.model_dump(by_alias=True, mode="json")}
    # Run it even where the plan says it does not fit (too little headroom): the measurement
    # is what tells whether the planner was right.
    result["plan_fits"] = plan.fits
    t0 = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "1",
            "-m",
            "finetune_trainer",
            "--config",
            str(cfg),
        ],
        env={**os.environ, "FT_METRICS_BASE_PORT": "0", **env},
        capture_output=True,
        text=True,
        timeout=420,
    )
    result["wall_seconds"] = time.monotonic() - t0
    shutil.rmtree(ckpt, ignore_errors=True)
    steps_out, summary = [], None
    for line in proc.stdout.splitlines():
        if not line.startswith("{"):
            continue
        rec = json.loads(line)
        if "summary" in rec:
            summary = rec["summary"]
        elif "step" in rec:
            steps_out.append(rec)
    result["steps"] = steps_out
    result["summary"] = summary
    if proc.returncode != 0 or summary is None:
        result["error"] = f"trainer exit {proc.returncode}: {proc.stderr[-1500:]}"
    return result


def run_hf(case: Case, work: Path, steps: int) -> dict[str, Any]:
    cfg = work / f"{case.name}.hf.json"
    cfg.write_text(json.dumps({"case": asdict(case), "steps": steps}))
    proc = subprocess.run(
        [sys.executable, __file__, "--hf-worker", str(cfg)],
        capture_output=True,
        text=True,
        timeout=420,
    )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith('{"hf"'):
            return dict(json.loads(line)["hf"])
    return {"error": f"hf exit {proc.returncode}: {proc.stderr[-1500:]}"}


def hf_worker(path: Path) -> None:
    """The same job under transformers.Trainer: same architecture, random init, micro-batch,
    accumulation, sequence, bf16 (autocast over fp32 weights for full fine-tuning, a bf16 base
    with fp32 adapters for LoRA), checkpointing; its default optimizer (fused AdamW)."""
    import torch
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    raw = json.loads(path.read_text())
    case, steps = Case(**raw["case"]), int(raw["steps"])
    from finetune_operator.planner.catalog import lookup

    entry = lookup(case.model)
    assert entry is not None
    kw = entry.architecture.model_dump(exclude_none=True)
    model_type = kw.pop("model_type")
    if case.layers:
        kw["num_hidden_layers"] = case.layers
    config = AutoConfig.for_model(model_type, **kw)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    if case.method == "lora":
        from peft import LoraConfig, get_peft_model

        model = model.to(torch.bfloat16)
        lora = LoraConfig(
            r=LORA_RANK,
            lora_alpha=LORA_ALPHA,
            lora_dropout=LORA_DROPOUT,
            task_type="CAUSAL_LM",
            target_modules=list(LORA_TARGETS),
        )
        model = get_peft_model(model, lora, autocast_adapter_dtype=True)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()

    class Blocks(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
        def __len__(self) -> int:
            return case.batch * (steps + 1)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            g = torch.Generator().manual_seed(i)
            ids = torch.randint(0, 259, (case.seq,), generator=g)
            return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}

    times: list[float] = []

    class Clock(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            torch.cuda.synchronize()
            times.append(time.perf_counter())

    args = TrainingArguments(
        output_dir=str(path.parent / f"hf-{case.name}"),
        per_device_train_batch_size=case.micro,
        gradient_accumulation_steps=case.batch // case.micro,
        max_steps=steps,
        learning_rate=1e-5,
        bf16=True,
        gradient_checkpointing=case.ac,
        gradient_checkpointing_kwargs={"use_reentrant": False} if case.ac else None,
        save_strategy="no",
        report_to="none",
        logging_steps=1000,
        dataloader_num_workers=2,
        max_grad_norm=1.0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Blocks(), callbacks=[Clock()])
    trainer.train()
    dts = [b - a for a, b in itertools.pairwise(times)][1:]  # drop warm-up
    step = statistics.median(dts)
    print(
        json.dumps(
            {
                "hf": {
                    "step_seconds": step,
                    "tokens_per_second": case.batch * case.seq / step,
                    "optim": str(args.optim),
                    "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
                    "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
                }
            }
        ),
        flush=True,
    )


# ---- report ---------------------------------------------------------------------------------


def summarise(
    case: Case, res: dict[str, Any], hf: dict[str, Any] | None, sync: dict[str, Any] | None
) -> dict[str, Any]:
    out: dict[str, Any] = {"case": case.name}
    if "error" in res:
        out["error"] = res["error"][-600:]
        if not res.get("steps"):
            return out
    plan, mem = res["plan"], res["plan"]["memory"]
    steps = res["steps"]
    s = res.get("summary") or {}
    secs = [r["step_seconds"] for r in steps]
    # Steady state: skip step 1 (compile/allocator warm-up) and the step after each save.
    saved = {4 * i + 1 for i in range(1, 64)}
    normal = [r["step_seconds"] for r in steps if r["step"] > 1 and r["step"] not in saved]
    step = statistics.median(normal) if normal else float("nan")
    tps = case.batch * case.seq / step
    peak = 989e12
    out.update(
        plan_peak_gib=mem["peak"] / GIB,
        meas_peak_gib=s.get("peak_allocated_bytes", 0) / GIB,
        plan_reserved_gib=mem["reserved"] / GIB,
        meas_reserved_gib=s.get("peak_reserved_bytes", 0) / GIB,
        step_seconds=step,
        plan_step_seconds=plan["estimatedStepSeconds"],
        tokens_per_second=tps,
        mfu=tps * model_flops_per_token(case) / peak,
        compute_seconds=statistics.median([r["compute_seconds"] for r in steps[1:]] or [0.0]),
        wait_seconds=statistics.median([r["wait_seconds"] for r in steps[1:]] or [0.0]),
        steps=secs,
    )
    if out["meas_peak_gib"] and out["meas_reserved_gib"]:
        out["peak_err"] = out["plan_peak_gib"] / out["meas_peak_gib"] - 1
        out["reserved_err"] = out["plan_reserved_gib"] / out["meas_reserved_gib"] - 1
    after = [r["step_seconds"] for r in steps if r["step"] == 5]
    blocking = sum(s.get("checkpoint_blocking_seconds", []) or [0.0])
    out["ckpt_save_blocking"] = s.get("checkpoint_blocking_seconds")
    out["ckpt_commit_seconds"] = s.get("checkpoint_commit_seconds")
    if after:
        out["step_after_save"] = after[0]
        out["step_after_save_ratio"] = after[0] / step
        out["ckpt_blocking_seconds"] = blocking + max(0.0, after[0] - step)
    if hf and "tokens_per_second" in hf:
        out["hf_tokens_per_second"] = hf["tokens_per_second"]
        out["vs_hf"] = tps / hf["tokens_per_second"]
        out["hf_optim"] = hf.get("optim")
    elif hf:
        out["hf_error"] = hf.get("error", "")[-600:]
    if sync and sync.get("summary"):
        ss = sync["summary"]
        sync_steps = {r["step"]: r["step_seconds"] for r in sync["steps"]}
        sync_save = sum(ss.get("checkpoint_blocking_seconds", []) or [0.0])
        out["sync_save_seconds"] = sync_save + max(0.0, sync_steps.get(5, step) - step)
        if "ckpt_blocking_seconds" in out and out["sync_save_seconds"] > 0:
            out["blocking_vs_sync"] = out["ckpt_blocking_seconds"] / out["sync_save_seconds"]
    return out


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'config':30} {'peak plan/meas GiB':>19} {'err':>6} {'resv plan/meas GiB':>19} "
        f"{'err':>6} {'tok/s':>8} {'MFU':>6} {'HF tok/s':>8} {'xHF':>5} "
        f"{'step plan/meas s':>16} {'ckpt blk s':>10} {'/sync':>6}"
    )
    print(head)
    for r in rows:
        if "tokens_per_second" not in r:
            print(f"{r['case']:30} ERROR {r.get('error', '')[-300:]}")
            continue
        print(
            f"{r['case']:30} {r['plan_peak_gib']:8.2f}/{r['meas_peak_gib']:<8.2f} "
            f"{100 * r.get('peak_err', 0):+5.1f}% {r['plan_reserved_gib']:8.2f}/"
            f"{r['meas_reserved_gib']:<8.2f} {100 * r.get('reserved_err', 0):+5.1f}% "
            f"{r['tokens_per_second']:8.0f} {100 * r['mfu']:5.1f}% "
            f"{r.get('hf_tokens_per_second', 0):8.0f} {r.get('vs_hf', 0):5.2f} "
            f"{r['plan_step_seconds']:7.3f}/{r['step_seconds']:<7.3f} "
            f"{r.get('ckpt_blocking_seconds', 0):10.2f} {r.get('blocking_vs_sync', 0):6.3f}"
        )


def environment() -> dict[str, str]:
    import torch
    import transformers

    info = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": str(torch.version.cuda),
    }
    try:
        import peft

        info["peft"] = peft.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    with contextlib.suppress(OSError):
        info["driver"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated substrings of config names")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--no-hf", action="store_true", help="skip the HF Trainer baseline")
    ap.add_argument("--hf-only", action="store_true", help="only the HF Trainer baseline")
    ap.add_argument("--sync-save", action="store_true", help="also run with async checkpoints off")
    ap.add_argument("--alloc-conf", default=None, help="PYTORCH_CUDA_ALLOC_CONF for the trainer")
    ap.add_argument("--env", action="append", default=[], help="K=V for the trainer runs")
    ap.add_argument("--pythonpath", default=None, help="PYTHONPATH of the trainer runs")
    ap.add_argument("--no-ckpt", action="store_true", help="no checkpoints (faster)")
    ap.add_argument("--stop-at", type=float, default=1e12, help="start no run after this Unix time")
    ap.add_argument("--tag", default="", help="suffix of the result file")
    ap.add_argument("--work", default="/var/tmp/ftbench")  # not under /tmp: the pods' own mount
    ap.add_argument("--out", default=None, help="write gpu-results[-TAG].json here")
    ap.add_argument("--hf-worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.hf_worker:
        hf_worker(Path(args.hf_worker))
        return
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    env = dict(kv.split("=", 1) for kv in args.env)
    if args.alloc_conf is not None:
        env["PYTORCH_CUDA_ALLOC_CONF"] = args.alloc_conf
    if args.pythonpath:
        env["PYTHONPATH"] = args.pythonpath
    wanted = [w for w in args.only.split(",") if w]
    cases = [c for c in MATRIX if not wanted or any(w in c.name for w in wanted)]
    if args.no_ckpt:
        cases = [replace(c, ckpt=False) for c in cases]
    rows: list[dict[str, Any]] = []
    raw: dict[str, Any] = {}
    name = f"gpu-results-{args.tag}.json" if args.tag else "gpu-results.json"
    out_path = Path(args.out) / name if args.out else None
    info = {**environment(), "tag": args.tag, "trainer_env": json.dumps(env)}
    print(json.dumps(info), flush=True)
    for case in cases:
        if time.time() > args.stop_at:
            print(f"out of time: skipped {case.name}", flush=True)
            continue
        t0 = time.monotonic()
        if args.hf_only:
            hf = run_hf(case, work, args.steps)
            rows.append({"case": case.name, "hf": hf})
            raw[case.name] = {"hf": hf}
            print(json.dumps(rows[-1]), flush=True)
            if out_path:
                out_path.write_text(json.dumps({"env": info, "rows": rows, "raw": raw}, indent=1))
            continue
        res = run_trainer(case, work, args.steps, sync=False, env=env)
        sync = run_trainer(case, work, args.steps, sync=True, env=env) if args.sync_save else None
        hf = None if args.no_hf or "error" in res else run_hf(case, work, args.steps)
        row = summarise(case, res, hf, sync)
        row["bench_seconds"] = time.monotonic() - t0
        rows.append(row)
        raw[case.name] = {"trainer": res, "sync": sync, "hf": hf}
        print(json.dumps(row), flush=True)
        if out_path:
            out_path.write_text(json.dumps({"env": info, "rows": rows, "raw": raw}, indent=1))
    print_table([r for r in rows if "hf" not in r])


if __name__ == "__main__":
    main()
