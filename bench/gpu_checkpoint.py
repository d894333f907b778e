"""Checkpoint stall on a GPU: the trainer's own checkpointer (`DcpCheckpointer` with its
`HostStaging` buffers) on a Llama-3.2-1B-shaped full fine-tune (random init, FSDP2 world 1,
bf16 compute, fp32 master weights and AdamW state: ~14.8 GB of checkpoint state), against
DCP's `DefaultStager` (what the trainer used before) and a synchronous `dcp.save`, all
measured in the same run.

    python3 -m torch.distributed.run --standalone --nproc_per_node 1 bench/gpu_checkpoint.py \
        --dir /dev/shm/ckpt --json out.json

Prints per save: committed?, time the save call held the loop, staging wait before the next
optimizer step, the step after the save vs the median save-free step, and the trainer's stall
estimate; then the synchronous save of the same state, and the ratios the goals are stated in
(step after a save <= 1.2x a normal step, blocking <= 2% of a synchronous save). Each write
completes before the next save starts (the bench waits for it outside the timed region, as a
save interval longer than a write would). Checkpoints are deleted as it goes (keep=1).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

from finetune_operator.api.spec import CheckpointSpec
from finetune_trainer.dcp_checkpointer import DcpCheckpointer
from finetune_trainer.metrics import TrainerMetrics
from finetune_trainer.sampler import StepSampler
from finetune_trainer.state import TrainState

# meta-llama/Llama-3.2-1B config.json (1.24B parameters, tied embeddings).
LLAMA_3_2_1B = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
TINY = dict(
    LLAMA_3_2_1B,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1024,
)


def build(device: torch.device, tiny: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    cfg = LlamaConfig(**(TINY if tiny else LLAMA_3_2_1B))
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with device:
        model = LlamaForCausalLM(cfg)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    return model, opt


class Loop:
    def __init__(
        self,
        model: torch.nn.Module,
        opt: torch.optim.Optimizer,
        device: torch.device,
        batch: int,
        seq: int,
        vocab: int,
    ) -> None:
        self.model, self.opt, self.device = model, opt, device
        self.batch, self.seq, self.vocab = batch, seq, vocab

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step(self, before_optimizer: Any = None) -> float:
        """One step in the trainer's order; wall time including the optimizer's GPU work."""
        t0 = time.perf_counter()
        ids = torch.randint(0, self.vocab, (self.batch, self.seq), device=self.device)
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.sync()  # the trainer syncs here too (its step timing)
        if before_optimizer is not None:
            before_optimizer()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.sync()
        return time.perf_counter() - t0


def trainer_saves(
    loop: Loop,
    state: TrainState,
    ckpt: DcpCheckpointer,
    metrics: TrainerMetrics,
    steps: int,
    every: int,
) -> dict[str, Any]:
    times: list[float] = []
    saves: list[dict[str, Any]] = []
    prepare_s = 0.0
    for i in range(1, steps + 1):
        t = loop.step(ckpt.wait_for_staging)
        state.step = i
        times.append(t)
        metrics.observe_step_time(t)
        if i == 1:  # the trainer's maybe_save does this after the first step
            prepare_t = time.perf_counter()
            ckpt.prepare()
            prepare_s = time.perf_counter() - prepare_t
        if saves and saves[-1]["step"] == i - 1:
            saves[-1]["step_after_s"] = t
        if i % every == 0 and i < steps:
            w0 = time.perf_counter()
            ckpt.finish()  # previous write done (outside the timed save: interval > write)
            wait_prev = time.perf_counter() - w0
            c0 = time.perf_counter()
            ckpt.maybe_save(i)
            saves.append(
                {"step": i, "call_s": time.perf_counter() - c0, "prev_write_wait_s": wait_prev}
            )
    ckpt.finish()
    clean = [t for j, t in enumerate(times, 1) if j > 1 and (j - 1) % every != 0]
    median = statistics.median(clean)
    by_step = {s.step: s for s in metrics.stalls}
    for s in saves:
        est = by_step.get(s["step"])
        s["staging_wait_s"] = est.wait if est else None
        s["window_steps"] = est.steps if est else None
        s["blocking_s"] = est.blocking if est else None
        s["stall_estimate_s"] = est.stall if est else None
        s["step_after_ratio"] = s.get("step_after_s", 0.0) / median
    return {
        "prepare_s": prepare_s,
        "staging_bytes": ckpt.staging.allocated_bytes if ckpt.staging else 0,
        "staging_allocations": ckpt.staging.allocations if ckpt.staging else 0,
        "median_step_s": median,
        "saves": saves,
        "committed_last": ckpt.last_committed_step,
        "failed_last": ckpt.last_failed_step,
        "failures": metrics.ckpt_failures._value.get(),
    }


def default_stager_saves(
    loop: Loop, state: TrainState, group: dist.ProcessGroup, root: Path, median: float
) -> list[dict[str, Any]]:
    """The previous trainer code: dcp.async_save with a (reused) DefaultStager."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    cuda = loop.device.type == "cuda"
    stager = DefaultStager(StagingOptions(cuda, False, True, cuda))
    out: list[dict[str, Any]] = []
    for n in range(2):
        path = root / f"default-{n}"
        rec: dict[str, Any] = {"save": n + 1}
        try:
            c0 = time.perf_counter()
            resp = dcp.async_save(
                state.capture(), checkpoint_id=path, process_group=group, async_stager=stager
            )
            rec["call_s"] = time.perf_counter() - c0
            staging = getattr(resp, "staging_completion", None)
            upload = getattr(resp, "upload_completion", resp)
            waited: list[float] = []

            def wait(staging: Any = staging, waited: list[float] = waited) -> None:
                w0 = time.perf_counter()
                if staging is not None:
                    staging.result()
                waited.append(time.perf_counter() - w0)

            rec["step_after_s"] = loop.step(wait)
            rec["staging_wait_s"] = waited[0]
            rec["blocking_s"] = rec["call_s"] + waited[0]
            rec["step_after_ratio"] = rec["step_after_s"] / median
            upload.result()
            rec["ok"] = True
        except BaseException as e:  # whatever DCP raises (KeyError seen on torch 2.11)
            rec["ok"] = False
            rec["error"] = f"{type(e).__name__}: {e}"[:200]
        shutil.rmtree(path, ignore_errors=True)
        out.append(rec)
    stager.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/ckpt-bench")
    ap.add_argument("--steps", type=int, default=17)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--tiny", action="store_true", help="a small model (CPU smoke run)")
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--sync-reference",
        type=float,
        default=None,
        help="synchronous save seconds measured earlier, for a run that skips its own",
    )
    ap.add_argument(
        "--device-snapshot",
        action="store_true",
        help="stage through a snapshot in GPU memory (FT_CHECKPOINT_DEVICE_SNAPSHOT)",
    )
    ap.add_argument(
        "--budget",
        type=float,
        default=170.0,
        help="seconds; later phases (sync save, DefaultStager) are skipped past it",
    )
    args = ap.parse_args()

    if args.device_snapshot:
        os.environ["FT_CHECKPOINT_DEVICE_SNAPSHOT"] = "1"
    cuda = torch.cuda.is_available()
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    )
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
    group = dist.new_group(backend="gloo")
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    t0 = time.perf_counter()
    model, opt = build(device, args.tiny)
    vocab = (TINY if args.tiny else LLAMA_3_2_1B)["vocab_size"]
    loop = Loop(model, opt, device, args.batch, args.seq, vocab)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    sampler = StepSampler(
        num_samples=10_000,
        global_batch=args.batch,
        micro_batch_size=args.batch,
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        seed=0,
    )
    state = TrainState(model, opt, sched, sampler, rank=dist.get_rank(), seed=0)
    metrics = TrainerMetrics(
        job="bench", rank=dist.get_rank(), device=device, reforms=0, total_steps=args.steps
    )
    spec = CheckpointSpec.model_validate({"uri": "ours", "intervalSteps": args.every, "keep": 1})
    ckpt = DcpCheckpointer(
        spec,
        state,
        group=group,
        world_size=dist.get_world_size(),
        metrics=metrics,
        meta={"job": "bench"},
        device=device,
        cwd=root,
    )
    build_s = time.perf_counter() - t0
    ours = trainer_saves(loop, state, ckpt, metrics, args.steps, args.every)
    ckpt.close()
    shutil.rmtree(root / "ours", ignore_errors=True)

    sync_s = float("nan")
    if time.perf_counter() - t0 < args.budget:
        c0 = time.perf_counter()
        dcp.save(state.capture(), checkpoint_id=root / "sync", process_group=group)
        sync_s = time.perf_counter() - c0
        shutil.rmtree(root / "sync", ignore_errors=True)
    baseline: list[dict[str, Any]] = []
    if time.perf_counter() - t0 < args.budget:
        baseline = default_stager_saves(loop, state, group, root, ours["median_step_s"])
    shutil.rmtree(root, ignore_errors=True)

    if sync_s != sync_s and args.sync_reference:  # NaN: skipped in this run
        sync_s = args.sync_reference
    props = torch.cuda.get_device_properties(device) if cuda else None
    result = {
        "device": props.name if props else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "model": "tiny" if args.tiny else "Llama-3.2-1B shape, FSDP2 world 1, bf16 compute",
        "tokens_per_step": args.batch * args.seq,
        "device_snapshot": args.device_snapshot,
        "max_memory_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0,
        "max_memory_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30 if cuda else 0,
        "build_s": build_s,
        "sync_save_s": sync_s,
        "total_s": time.perf_counter() - t0,
        "ours": ours,
        "default_stager": baseline,
    }
    worst_after = max(s["step_after_ratio"] for s in ours["saves"])
    worst_block = max((s["blocking_s"] or 0.0) for s in ours["saves"])
    result["goals"] = {
        "step_after_save_ratio_max": worst_after,
        "blocking_over_sync_max": worst_block / sync_s,
        "default_stager_blocking_over_sync": [
            b["blocking_s"] / sync_s for b in baseline if b.get("ok")
        ],
    }
    if dist.get_rank() == 0:
        print(json.dumps(result, indent=1, default=float), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1, default=float) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
