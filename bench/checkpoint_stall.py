"""What a checkpoint save costs the training loop, on CPU under torchrun (2 ranks, gloo):
the trainer's checkpointer (own staging buffers) against the baseline the trainer used before
(plain `dcp.async_save` with a reused `DefaultStager`), both measured in the same run, on a
small Llama (FSDP2 over the 2 ranks), with the same step loop and the same stall estimator.

    torchrun --standalone --nproc_per_node 2 bench/checkpoint_stall.py [--steps 40 --every 8]

Per save it prints: blocking (save call + staging wait before the optimizer step), the
measured excess step time over the steps that ran while the save was in flight (vs the median
of recent save-free steps), the stall estimate the trainer reports
(`finetune_trainer_checkpoint_stall_seconds`), and the ratios to a synchronous `dcp.save` of
the same state. Each save's write completes before the next save starts.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

from finetune_operator.api.spec import CheckpointSpec
from finetune_trainer.dcp_checkpointer import DcpCheckpointer
from finetune_trainer.metrics import TrainerMetrics
from finetune_trainer.sampler import StepSampler
from finetune_trainer.stall import Stall, StallEstimator
from finetune_trainer.state import TrainState

CONFIG = dict(
    hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=4, vocab_size=8192, max_position_embeddings=1024, tie_word_embeddings=True,
)  # fmt: skip


def build() -> TrainState:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    rank, world = dist.get_rank(), dist.get_world_size()
    sampler = StepSampler(num_samples=10_000, global_batch=2 * world, micro_batch_size=2, rank=rank,
                          world_size=world, seed=0)  # fmt: skip
    return TrainState(model, opt, sched, sampler, rank=rank, seed=0)


def train_step(state: TrainState, before_optimizer: Callable[[], None], seq: int) -> float:
    t0 = time.perf_counter()
    ids = torch.randint(0, CONFIG["vocab_size"], (2, seq))
    state.model(input_ids=ids, labels=ids).loss.backward()
    before_optimizer()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    state.step += 1
    # Every rank agrees on the step time (the slowest), as the synchronous loop would.
    t = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def run_ours(state: TrainState, group: dist.ProcessGroup, root: Path, args: Any) -> list[Stall]:
    metrics = TrainerMetrics(job="bench", rank=dist.get_rank(), device=torch.device("cpu"),
                             restarts=0, total_steps=args.steps)  # fmt: skip
    spec = CheckpointSpec.model_validate({"uri": "ours", "intervalSteps": args.every, "keep": 1})
    ckpt = DcpCheckpointer(spec, state, group=group, world_size=dist.get_world_size(),
                           metrics=metrics, meta={}, cwd=root)  # fmt: skip
    ckpt.prepare()
    for i in range(1, args.steps + 1):
        metrics.observe_step_time(train_step(state, ckpt.wait_for_staging, args.seq))
        if i % args.every == 0:
            ckpt.finish()
            ckpt.maybe_save(i)
    ckpt.finish()
    ckpt.close()
    assert ckpt.last_failed_step == 0, "a save failed"
    return metrics.stalls


def run_default_stager(state: TrainState, group: dist.ProcessGroup, root: Path,
                       args: Any) -> list[Stall]:  # fmt: skip
    """The previous trainer code path, measured with the same estimator."""
    stager = DefaultStager(StagingOptions(False, False, True, False))
    est, stalls = StallEstimator(), []
    upload: Future[Any] | None = None
    staging: Future[Any] | None = None

    def wait_for_staging() -> None:
        nonlocal staging
        if staging is not None:
            w0 = time.perf_counter()
            staging.result()
            est.staging_wait(time.perf_counter() - w0)
            staging = None

    for i in range(1, args.steps + 1):
        t = train_step(state, wait_for_staging, args.seq)
        done = upload is None or upload.done()
        stalls += [s for s in (est.step(t, write_done=done),) if s is not None]
        if i % args.every == 0:
            if upload is not None:
                upload.result()
            stalls += [s for s in (est.close(),) if s is not None]
            shutil.rmtree(root / "default", ignore_errors=True)
            c0 = time.perf_counter()
            resp = dcp.async_save(state.capture(), checkpoint_id=root / "default" / str(i),
                                  process_group=group, async_stager=stager)  # fmt: skip
            staging = getattr(resp, "staging_completion", None)
            upload = getattr(resp, "upload_completion", resp)
            stalls += est.save(i, time.perf_counter() - c0, write_done=False)
    if upload is not None:
        upload.result()
    stalls += [s for s in (est.close(),) if s is not None]
    stager.close()
    return stalls


def sync_save_seconds(state: TrainState, group: dist.ProcessGroup, root: Path) -> float:
    times = []
    for n in range(3):
        c0 = time.perf_counter()
        dcp.save(state.capture(), checkpoint_id=root / f"sync{n}", process_group=group)
        times.append(time.perf_counter() - c0)
        shutil.rmtree(root / f"sync{n}", ignore_errors=True)
    return statistics.median(times)


def summary(name: str, stalls: list[Stall], sync_s: float) -> dict[str, Any]:
    rows = [
        {"step": s.step, "blocking_s": round(s.blocking, 4), "staging_wait_s": round(s.wait, 4),
         "excess_s": round(s.stall - (s.blocking - s.wait), 4), "stall_s": round(s.stall, 4),
         "window_steps": s.steps, "blocking_over_sync": round(s.blocking / sync_s, 4),
         "stall_over_sync": round(s.stall / sync_s, 4)}
        for s in stalls
    ]  # fmt: skip
    blocking = statistics.mean(s.blocking for s in stalls)
    stall = statistics.mean(s.stall for s in stalls)
    return {
        "name": name,
        "saves": rows,
        "mean_blocking_s": blocking,
        "mean_stall_s": stall,
        "blocking_over_sync": blocking / sync_s,
        "stall_over_sync": stall / sync_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    group = dist.new_group(backend="gloo")
    box = [tempfile.mkdtemp(prefix="ckpt-stall-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    root = Path(str(box[0]))
    state = build()
    for _ in range(3):  # warm-up outside any measurement
        train_step(state, lambda: None, args.seq)
    ours = run_ours(state, group, root, args)
    base = run_default_stager(state, group, root, args)
    sync_s = sync_save_seconds(state, group, root)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
        n = sum(p.numel() for p in state.model.parameters())
        a, b = summary("ours (HostStaging)", ours, sync_s), summary("DefaultStager", base, sync_s)
        out = {"torch": torch.__version__, "world": dist.get_world_size(),
               "params": n, "sync_save_s": sync_s, "ours": a,
               "default_stager": b,
               "ours_over_default": {"blocking": a["mean_blocking_s"] / b["mean_blocking_s"],
                                     "stall": a["mean_stall_s"] / b["mean_stall_s"]}}  # fmt: skip
        print(json.dumps(out, indent=1), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
