"""What the straggler signal costs DDP (issue 7 item 5): step time of three ways to reduce
gradients, in one run, on 2 CPU ranks over gloo (same model, same batches, interleaved rounds):

  plain    DDP as shipped by torch: buckets all-reduced during backward (overlap), nothing timed;
  former   the trainer's former design: a comm hook that only records the buckets, all-reduced
           after the step's sync point (no overlap), so compute and wait are separable;
  trainer  the trainer's DDP now (finetune_trainer.parallelize.apply_ddp): plain DDP's overlap,
           plus a comm hook that marks the last bucket handed over (ReductionClock), so the
           time blocked in the reduction afterwards counts as wait.

Then the signal itself: with rank 1 slowed by a fixed delay per step (half a step by default,
counted in its compute, as the trainer's FT_STEP_DELAY_SECONDS does), the trainer design must
report rank 1's compute higher by about the delay and rank 0's wait higher by about the delay;
and the clock's own cost (a mark per bucket) against a step.

    python bench/ddp_overlap.py [--rounds 5] [--steps 6] [--delay 0.5]

Needs only CPU; PYTHONPATH=operator:trainer_image. On a GPU machine with 2+ GPUs the same
comparison would run on NCCL; with one GPU there is no reduction to overlap.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "operator"), str(REPO / "trainer_image")]


def tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=688,
        vocab_size=2048,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


class FormerCapture:
    """The former design, kept here as the baseline: record buckets, reduce them later."""

    def __init__(self) -> None:
        self.buffers: dict[int, torch.Tensor] = {}

    def hook(self, state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        self.buffers[bucket.index()] = bucket.buffer()
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    def all_reduce(self) -> None:
        for i in sorted(self.buffers):
            dist.all_reduce(self.buffers[i])
            self.buffers[i].div_(dist.get_world_size())
        self.buffers.clear()


Variant = tuple[
    nn.Module,
    Callable[[bool], contextlib.AbstractContextManager[None]],
    Callable[[], None],
    Callable[[], float],
]


def build(kind: str, base: nn.Module) -> Variant:
    model = copy.deepcopy(base)
    if kind == "trainer":
        from finetune_trainer.parallelize import apply_ddp

        par = apply_ddp(model, torch.device("cpu"), "fp32")
        return par.model, par.accumulate, lambda: None, par.reduction_wait
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True, broadcast_buffers=False)

    @contextlib.contextmanager
    def accumulate(last: bool) -> Iterator[None]:
        with contextlib.nullcontext() if last else ddp.no_sync():
            yield

    if kind == "former":
        cap = FormerCapture()
        ddp.register_comm_hook(None, lambda state, bucket: cap.hook(state, bucket))
        return ddp, accumulate, cap.all_reduce, lambda: 0.0
    return ddp, accumulate, lambda: None, lambda: 0.0


def step(
    v: Variant, opt: torch.optim.Optimizer, batches: list[torch.Tensor], delay: float
) -> dict[str, float]:
    model, accumulate, after_sync, reduction_wait = v
    t0 = time.perf_counter()
    if delay:
        time.sleep(delay)
    for i, ids in enumerate(batches):
        with accumulate(i == len(batches) - 1):
            (model(input_ids=ids, labels=ids).loss / len(batches)).backward()
    t1 = time.perf_counter()
    flag = torch.zeros(4, dtype=torch.float64)
    dist.all_reduce(flag)  # the sync point
    t2 = time.perf_counter()
    after_sync()
    t3 = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=False)
    t4 = time.perf_counter()
    waited = min(reduction_wait(), t1 - t0)
    return {
        "step": t4 - t0,
        "compute": (t1 - t0 - waited) + (t4 - t3),
        "wait": (t2 - t1) + waited + (t3 - t2),
    }


def worker(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    base = tiny_llama()
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, 2048, (2, 128), generator=g) for _ in range(2)]
    kinds = ["plain", "former", "trainer"]
    variants = {k: build(k, base) for k in kinds}
    opts = {k: torch.optim.AdamW(variants[k][0].parameters(), lr=1e-4) for k in kinds}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for k in kinds:  # warm-up
        step(variants[k], opts[k], batches, 0.0)
    for r in range(args.rounds):
        for k in kinds[r % 3 :] + kinds[: r % 3]:  # rotate the order: no variant always first
            for _ in range(args.steps):
                times[k].append(step(variants[k], opts[k], batches, 0.0)["step"])
    # The signal: rank 1 slowed by `delay` x the median step, trainer design.
    delay = args.delay * statistics.median(times["plain"])
    slowed = [
        step(variants["trainer"], opts["trainer"], batches, delay if rank == 1 else 0.0)
        for _ in range(args.steps * 2)
    ]
    # What the trainer design adds to plain DDP: one clock mark per bucket per step.
    from finetune_trainer.reduction_clock import ReductionClock

    clock, n = ReductionClock(torch.device("cpu")), 20000
    t0 = time.perf_counter()
    for _ in range(n):
        clock.bucket_ready()
    mark = (time.perf_counter() - t0) / n
    from finetune_trainer.parallelize import BUCKET_BYTES

    grad_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    buckets = -(-grad_bytes // BUCKET_BYTES) + 1  # at most: DDP's first bucket is 1 MiB
    result = {
        "rank": rank,
        "delay": delay,
        "mark_seconds": mark,
        "buckets": buckets,
        "median_step": {k: statistics.median(v) for k, v in times.items()},
        "slowed_compute": statistics.median(s["compute"] for s in slowed),
        "slowed_wait": statistics.median(s["wait"] for s in slowed),
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--delay", type=float, default=0.5, help="rank 1's delay, x the step")
    args = ap.parse_args()
    import tempfile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(worker, args=(port, args, out), nprocs=2)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in (0, 1)]
    med = {k: statistics.mean(r["median_step"][k] for r in ranks) for k in ranks[0]["median_step"]}
    print("DDP, 2 ranks gloo, tiny Llama (4 layers, h=256), 2 micro-batches of 2x128 per step")
    print(f"{'design':10} {'step s':>8} {'vs plain':>9}")
    for k, v in med.items():
        print(f"{k:10} {v:8.4f} {v / med['plain'] - 1:+8.1%}")
    r0, r1 = ranks
    overhead = r0["buckets"] * r0["mark_seconds"] / med["plain"]
    print(
        f"clock cost: {r0['buckets']} bucket marks x {1e6 * r0['mark_seconds']:.2f} us = "
        f"{overhead:.2e} of a step"
    )
    print(
        f"signal, rank 1 slowed by {r1['delay']:.3f}s/step (trainer design): "
        f"compute rank0 {r0['slowed_compute']:.4f} rank1 {r1['slowed_compute']:.4f} "
        f"(diff {r1['slowed_compute'] - r0['slowed_compute']:+.4f}); "
        f"wait rank0 {r0['slowed_wait']:.4f} rank1 {r1['slowed_wait']:.4f} "
        f"(diff {r0['slowed_wait'] - r1['slowed_wait']:+.4f})"
    )


if __name__ == "__main__":
    main()
