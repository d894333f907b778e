"""Bytes each rank reads from storage to resume a DeepSpeed checkpoint, before against after
the chunked layout, in the same run; with each rank's host memory.

For each world (2, 4) and ZeRO stage (1, 2, 3), a small llama (SMALL: ~9M parameters, ~100 MB
of fp32 master + AdamW state) trains one step on CPU/gloo under the real trainer, commits a
checkpoint and is started again on it under tests/trainer/deepspeed_resume_worker.py, which
counts the bytes DCP's storage reader reads (every saved item it reads, whole) and the live
tensor bytes of the restore. Twice:
- before: the trainer as of commit BEFORE (`git archive`d to a temporary directory): the whole
  layout (one full tensor per key), every rank reading every master weight, and under ZeRO-3
  every tensor;
- after: this tree: the chunked layout, each rank reading the chunks of what it holds.
(`--before 6991b80 --stages 1 2`: the chunked layout before ZeRO-1/2 ranks read their
fragments' ranges instead of the whole tensors of their parameters.)

"read" is a rank's bytes read from storage during the restore, "ckpt" the checkpoint's data
files, "live" the most bytes of tensors alive at once during the restore, "rss" the rank's peak
RSS over the whole run (the engine and the step before included).

    DS_ACCELERATOR=cpu python bench/deepspeed_resume.py [--worlds 2 4] [--stages 1 2 3]
        [--before REV] [--out bench/results/deepspeed_resume_reads.txt]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "operator"), str(REPO / "trainer_image")]

from bench.model_loading import ARCH, big_job  # noqa: E402
from finetune_operator.api.jobconfig import JobConfig  # noqa: E402
from finetune_operator.api.model_spec import ModelArchitecture  # noqa: E402
from finetune_operator.planner.architecture import shape_of  # noqa: E402
from tests.trainer.conftest import free_port, standalone_args, trainer_env  # noqa: E402
from tests.trainer.test_zero3_loading import zero3  # noqa: E402

RESUME_WORKER = REPO / "tests" / "trainer" / "deepspeed_resume_worker.py"
# The commit the chunked layout started from: the trainer "before".
BEFORE = "b47e689"
MIB = 2**20
# ~9M parameters: big enough that DCP's per-item overhead does not blur the bytes, small
# enough for 24 torchrun launches of up to 4 ranks on a small machine.
SMALL = {**ARCH, "hiddenSize": 256, "numHiddenLayers": 4, "numAttentionHeads": 4,
         "numKeyValueHeads": 4, "intermediateSize": 1024, "vocabSize": 8000}  # fmt: skip


def resume_job(world: int, stage: int, workdir: Path) -> JobConfig:
    """One fp32 step, a checkpoint at it, no export (no output.uri)."""
    job = zero3(big_job(world), stage=stage)
    spec = job.spec.model_copy(deep=True)
    spec.model.architecture = ModelArchitecture.model_validate(SMALL)
    spec.training.sequence_length = 32
    spec.training.global_batch_size = world  # one short sample a rank
    spec.checkpoint.enabled = True
    spec.checkpoint.interval_steps = 1
    spec.checkpoint.uri = str(workdir / "checkpoints")
    plan = job.plan.model_copy(update={"architecture": spec.model.architecture})
    return job.model_copy(update={"spec": spec, "plan": plan})


def run(workdir: Path, job: JobConfig, name: str, program: list[str], code: Path) -> str:
    config = workdir / f"{name}.json"
    config.write_text(json.dumps(job.to_json_dict()))
    args = standalone_args(job.plan.world_size, config, free_port(), program)
    env = {**os.environ, **trainer_env("127.0.0.1"), "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": os.pathsep.join([str(code / "operator"),
                                          str(code / "trainer_image")])}  # fmt: skip
    done = subprocess.run(args, cwd=workdir, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{name}: " + done.stdout[-3000:] + done.stderr[-3000:])
    return done.stdout + done.stderr


def measure(world: int, stage: int, code: Path, label: str, tmp: Path) -> list[dict[str, Any]]:
    workdir = tmp / f"{label}-w{world}-z{stage}"
    workdir.mkdir()
    job = resume_job(world, stage, workdir)
    run(workdir, job, "save", ["-m", "finetune_trainer"], code)
    out = run(workdir, job, "resume", [str(RESUME_WORKER)], code)
    # The ranks' lines may interleave in the shared output: each row is flat JSON.
    rows = [json.loads(x) for x in re.findall(r"resume-peak (\{[^{}]*\})", out)]
    assert len(rows) == world, out[-3000:]
    (step,) = (p for p in (workdir / "checkpoints").rglob("step-*") if p.is_dir())
    stored = sum(f.stat().st_size for f in step.glob("*.distcp"))
    return [{**r, "stage": stage, "code": label, "stored": stored} for r in rows]


def report(rows: list[dict[str, Any]]) -> str:
    params = shape_of(ModelArchitecture.model_validate(SMALL)).total
    lines = [f"llama {params / 1e6:.1f}M parameters, fp32 AdamW, CPU/gloo; per rank: bytes read "
             "from storage during the resume, live tensor peak of the restore, peak RSS",
             f"{'world':>5} {'ZeRO':>4} {'code':>6} {'rank':>4} {'read MiB':>8} {'ckpt MiB':>8} "
             f"{'live MiB':>8} {'rss MiB':>8}"]  # fmt: skip
    for r in sorted(rows, key=lambda r: (r["world"], r["stage"], r["code"] != "before",
                                         r["rank"])):  # fmt: skip
        lines.append(
            f"{r['world']:>5} {r['stage']:>4} {r['code']:>6} {r['rank']:>4} "
            f"{r['storage_bytes'] / MIB:>8.1f} {r['stored'] / MIB:>8.1f} "
            f"{r['live_peak'] / MIB:>8.1f} {r['peak_rss'] / MIB:>8.0f}"
        )
    lines.append("summary: all ranks' reads / the checkpoint (N ranks reading it all: N.00x); "
                 "the most a rank read / the checkpoint; worst live peak")  # fmt: skip
    for world, stage in sorted({(r["world"], r["stage"]) for r in rows}):
        parts = []
        for code in ("before", "after"):
            mine = [r for r in rows if (r["world"], r["stage"], r["code"]) == (world, stage, code)]
            if not mine:
                continue
            stored = mine[0]["stored"]
            total = sum(r["storage_bytes"] for r in mine) / stored
            most = max(r["storage_bytes"] for r in mine) / stored
            live = max(r["live_peak"] for r in mine) / MIB
            parts.append(f"{code} {total:.2f}x (rank max {most:.2f}x, live {live:.1f} MiB)")
        lines.append(f"world {world} ZeRO-{stage}: " + "; ".join(parts))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--stages", nargs="+", type=int, default=[1, 2, 3], choices=[1, 2, 3])
    parser.add_argument("--before", default=BEFORE, help="git revision of the 'before' trainer")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--rows", type=Path, default=None,
                        help="JSON lines of measured rows: appended to, and not measured again")  # fmt: skip
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    if args.rows and args.rows.exists():
        rows = [json.loads(x) for x in args.rows.read_text().splitlines() if x]
    done = {(r["world"], r["stage"], r["code"]) for r in rows}
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        before = tmp / "before"
        before.mkdir()
        archive = subprocess.run(["git", "archive", args.before, "operator", "trainer_image"],
                                 cwd=REPO, check=True, capture_output=True).stdout  # fmt: skip
        subprocess.run(["tar", "-x", "-C", str(before)], input=archive, check=True)
        for world in args.worlds:
            for stage in args.stages:
                for label, code in (("before", before), ("after", REPO)):
                    if (world, stage, label) in done:
                        continue
                    new = measure(world, stage, code, label, tmp)
                    rows += new
                    if args.rows:
                        with args.rows.open("a") as f:
                            f.writelines(json.dumps(r) + "\n" for r in new)
                    print(f"measured world {world} ZeRO-{stage} {label}", flush=True)
    text = report(rows)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
