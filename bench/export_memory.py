"""The export's host memory on rank 0, measured against the plan's figure: the real trainer
on CPU under torchrun (2 ranks, gloo), a small inline Llama, checkpoints off, run twice:
`output.uri` unset, then set. A sampler reads each rank's RSS every 10 ms until the trainer
exits; rank 0's peak over the run without an export is what the export held (the trainer's
resident states stay beside it, in both runs).

    PYTHONPATH=operator:trainer_image:local_cluster python bench/export_memory.py \\
        [--strategy ddp|fsdp-full-shard] [--method full|lora] [--merge] [--hidden 512 --layers 8]

It prints each rank's peak RSS, rank 0's excess, and the plan's figures (export_memory: the
gathered state dict on rank 0, and the share of it each process's budget counts).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from checkpoint_memory import (  # type: ignore[import-not-found]
    TRAINER_ENV,
    spec_for,
    trainer_command,
)

from finetune_operator.api.spec import FineTuneJobSpec
from finetune_operator.planner import plan_job
from finetune_operator.planner.planning import build_problem
from finetune_operator.planner.search import evaluate, strategies_for

MIB = 2**20


def run(spec: FineTuneJobSpec, cwd: Path) -> dict[int, tuple[int, int, int]]:
    """Per local rank: (peak RSS while training, RSS when rank 0 logs "training complete",
    peak RSS after it: the export's phase)."""
    cmd, config = trainer_command(spec, cwd, "exmem")
    log = cwd / "log.txt"
    env = {**os.environ, **TRAINER_ENV}
    training: dict[int, int] = {}
    at_end: dict[int, int] = {}
    after: dict[int, int] = {}
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
        agent = psutil.Process(proc.pid)
        while proc.poll() is None:
            done = "training complete" in log.read_text(errors="replace")
            for child in agent.children(recursive=True):
                try:
                    if child.cmdline()[-2:] != ["--config", str(config)]:
                        continue
                    rank = int(child.environ()["LOCAL_RANK"])
                    rss = child.memory_info().rss
                except (psutil.Error, KeyError, ValueError):
                    continue  # not a trainer (the agent) or gone
                if not done:
                    training[rank] = max(training.get(rank, 0), rss)
                else:
                    at_end.setdefault(rank, rss)
                    after[rank] = max(after.get(rank, 0), rss)
            time.sleep(0.01)
        if proc.wait() != 0:
            sys.exit(f"trainer failed:\n{log.read_text()[-4000:]}")
    if spec.output.uri and "exported the" not in log.read_text():
        sys.exit(f"no export logged:\n{log.read_text()[-4000:]}")
    return {r: (training[r], at_end.get(r, 0), after.get(r, 0)) for r in sorted(training)}


def planned(spec: FineTuneJobSpec) -> tuple[int, int]:
    plan = plan_job(spec)
    p = build_problem(spec)
    row = next(r for r in strategies_for(p, plan.world_size) if r.name == plan.strategy)
    ev = evaluate(p, plan.world_size, row, plan.micro_batch_size, plan.activation_checkpointing)
    return ev.export_bytes, ev.export_share


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--strategy", default="fsdp-full-shard")
    ap.add_argument("--method", default="full", choices=["full", "lora"])
    ap.add_argument("--merge", action="store_true")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    args.every = args.steps
    spec = spec_for(args, {"enabled": False})
    method = {"type": args.method}
    if args.method == "lora":
        method["lora"] = {"rank": 8, "alpha": 16, "targetModules": ["q_proj", "v_proj"]}
    spec = spec.model_copy(update={"method": type(spec.method).model_validate(method)})
    if args.merge:
        spec = spec.model_copy(
            update={"output": spec.output.model_copy(update={"merge_lora": True})}
        )  # type: ignore[union-attr]
    without = spec.model_copy(update={"output": type(spec.output)()})
    peaks = {}
    for name, s in (("no output", without), ("output", spec)):
        with tempfile.TemporaryDirectory() as tmp:
            peaks[name] = run(s, Path(tmp))
        for rank, (train, end, after) in peaks[name].items():
            print(f"{name}: rank {rank} peak RSS training {train / MIB:.0f} MiB, at its end "
                  f"{end / MIB:.0f} MiB, after it {after / MIB:.0f} MiB (+{(after - end) / MIB:.0f})")  # fmt: skip
    gathered, share = planned(spec)
    print(f"{args.strategy} {args.method}{' merge' if args.merge else ''}: plan: gathered "
          f"{gathered / MIB:.0f} MiB on rank 0, {share / MIB:.0f} MiB per process")  # fmt: skip


if __name__ == "__main__":
    main()
