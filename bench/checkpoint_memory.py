"""A checkpoint save's host memory, measured against the plan's figure: the real trainer on
CPU under torchrun (2 ranks, gloo, the trainer's launcher), a small inline Llama, saves every
few steps, run three times: checkpoints off, sync saves, async saves. A sampler reads each
rank's RSS every 10 ms until rank 0 logs "training complete" (the export after it is not a
save); the peaks' differences to the run without checkpoints are what the saves held.

    PYTHONPATH=operator:trainer_image:local_cluster python bench/checkpoint_memory.py \\
        [--strategy ddp|fsdp-full-shard] [--hidden 512 --layers 8]

It prints, per run, each rank's peak RSS and its excess over the run without checkpoints, and
the plan's figure for the same spec (planner/checkpoint_memory.py: S staged + S written for
async on a CPU device, nothing for sync; S = model_states.checkpoint_state_bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import yaml

from finetune_operator.api.jobconfig import JobConfig
from finetune_operator.api.spec import FineTuneJobSpec
from finetune_operator.planner import plan_job
from finetune_operator.planner.model_states import checkpoint_state_bytes
from finetune_operator.planner.planning import build_problem
from finetune_operator.planner.search import evaluate, strategies_for

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20


def spec_for(args: argparse.Namespace, checkpoint: dict[str, Any]) -> FineTuneJobSpec:
    raw = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())["spec"]
    arch = raw["model"]["architecture"]
    arch.update(hiddenSize=args.hidden, numHiddenLayers=args.layers, numAttentionHeads=8,
                numKeyValueHeads=4, intermediateSize=args.hidden * 11 // 4)  # fmt: skip
    raw["training"].update(maxSteps=args.steps, globalBatchSize=4, microBatchSize=2,
                           sequenceLength=64)  # fmt: skip
    raw["resources"].update(gpusPerNode=2, minNodes=1, maxNodes=1, memory="16Gi")
    raw["strategy"] = {"type": args.strategy}
    raw["checkpoint"] = {"uri": "checkpoints", "intervalSteps": args.every, **checkpoint}
    raw["output"] = {"uri": "output"}
    return FineTuneJobSpec.model_validate(raw)


def planned_save(spec: FineTuneJobSpec) -> tuple[int, int, int]:
    """(S, the save's bytes the plan counts, the process's whole need) for the plan's
    configuration."""
    plan = plan_job(spec)
    p = build_problem(spec)
    row = next(r for r in strategies_for(p, plan.world_size) if r.name == plan.strategy)
    ev = evaluate(p, plan.world_size, row, plan.micro_batch_size, plan.activation_checkpointing)
    state = checkpoint_state_bytes(p.model, ev.shape, ev.cand)
    return state, ev.save.host_peak, ev.device_need


def trainer_command(spec: FineTuneJobSpec, cwd: Path, name: str) -> tuple[list[str], Path]:
    """torchrun (the trainer's own launcher) for `spec` at 2 local ranks, its job.json written
    in `cwd`: (the command, the config path the trainer processes are started with)."""
    job = JobConfig(name=name, uid=name, spec=spec, plan=plan_job(spec))
    config = cwd / "job.json"
    config.write_text(json.dumps(job.to_json_dict()))
    cmd = [sys.executable, "-m", "finetune_trainer.launch", "--nnodes=1", "--nproc-per-node=2",
           "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", f"--rdzv-id={name}",
           "--max-restarts=0", "-m", "finetune_trainer", "--config", str(config)]  # fmt: skip
    return cmd, config


TRAINER_ENV = {"OMP_NUM_THREADS": "1", "FT_METRICS_BASE_PORT": "0", "POD_IP": "127.0.0.1",
               "PYTHONUNBUFFERED": "1"}  # fmt: skip


def run(spec: FineTuneJobSpec, cwd: Path) -> list[int]:
    cmd, config = trainer_command(spec, cwd, "ckmem")
    log = cwd / "log.txt"
    env = {**os.environ, **TRAINER_ENV}
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
        agent = psutil.Process(proc.pid)
        peaks: dict[int, int] = {}
        while proc.poll() is None:
            if "training complete" in log.read_text(errors="replace"):
                break
            for child in agent.children(recursive=True):
                try:
                    if child.cmdline()[-2:] == ["--config", str(config)] and child.pid != proc.pid:
                        peaks[child.pid] = max(peaks.get(child.pid, 0), child.memory_info().rss)
                except psutil.Error:
                    continue
            time.sleep(0.01)
        if proc.wait(timeout=300) != 0:
            sys.exit(f"trainer failed:\n{log.read_text()[-4000:]}")
    return sorted(peaks.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--strategy", default="ddp")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=4)
    args = ap.parse_args()
    modes = {"off": {"enabled": False}, "sync": {"async": False}, "async": {"async": True}}
    base: list[int] = []
    for name, checkpoint in modes.items():
        spec = spec_for(args, checkpoint)
        with tempfile.TemporaryDirectory() as tmp:
            peaks = run(spec, Path(tmp))
        staged, planned, need = planned_save(spec)
        base = base or peaks
        excess = [p - b for p, b in zip(peaks, base, strict=True)]
        print(f"{args.strategy} {name}: peak RSS per rank {[round(p / MIB) for p in peaks]} MiB, "
              f"over no checkpoints {[round(e / MIB) for e in excess]} MiB; plan: S "
              f"{staged / MIB:.0f} MiB, save {planned / MIB:.0f} MiB, process "
              f"{need / MIB:.0f} MiB")  # fmt: skip


if __name__ == "__main__":
    main()
