"""Per-rank host memory of a DeepSpeed resume, old path against new, in the same run.

bench/model_loading.py's 534M model (and a ~130M one), ZeRO-2 bf16 at 2 ranks on CPU/gloo:
the real trainer takes one step and commits a checkpoint, then is started again on it, once
per path, under tests/trainer/deepspeed_resume_worker.py, which counts the restore:
- old: the path before groups (FT_TEST_RESUME_OLD): full fp32 templates of every tensor of
  every parameter on every rank, then handed to DeepSpeed;
- new: finetune_trainer.deepspeed_resume: groups of at most 1 GiB (or --cap), each rank
  reading only what it holds (bench/results/deepspeed_resume.txt was measured before the
  chunked layout, when each rank still read every master weight; the bytes each rank reads
  from storage now: bench/deepspeed_resume_reads.py).
"live" is the most bytes of tensors allocated and alive at once during the restore (counted per
op, so the allocator's retention does not blur it), "read" what the rank read, "rss" the rank's
peak RSS over the whole run (the step before the save included).

    DS_ACCELERATOR=cpu python bench/deepspeed_resume.py [--models mid wide] [--paths old new]
        [--cap BYTES] [--out bench/results/deepspeed_resume.txt]

The old path on the 534M model needs ~10 GB a rank (the 6.4 GB of templates beside the engine):
run `--models wide --paths new` on a machine that cannot hold 20 GB for two ranks; its "old" is
then the templates alone (`full`, 12 bytes a parameter: a lower bound of that path's peak).
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
from finetune_operator.api.deepspeed_config import RESUME_CHUNK_BYTES  # noqa: E402
from finetune_operator.api.jobconfig import JobConfig  # noqa: E402
from finetune_operator.api.model_spec import ModelArchitecture  # noqa: E402
from finetune_operator.planner.architecture import shape_of  # noqa: E402
from tests.trainer.conftest import free_port, standalone_args, trainer_env  # noqa: E402
from tests.trainer.test_zero3_loading import zero3  # noqa: E402

RESUME_WORKER = REPO / "tests" / "trainer" / "deepspeed_resume_worker.py"
MIB = 2**20
WORLD = 2
# ~133M parameters: the old path fits two ranks on a small machine.
MID = {**ARCH, "hiddenSize": 1024, "numHiddenLayers": 4, "numAttentionHeads": 8,
       "numKeyValueHeads": 8, "intermediateSize": 4096}  # fmt: skip
MODELS: dict[str, dict[str, Any]] = {"wide": ARCH, "mid": MID}  # 534M, 133M


def resume_job(model: str, workdir: Path) -> JobConfig:
    """ZeRO-2, bf16, one step, a checkpoint at it, no export (no output.uri)."""
    job = zero3(big_job(WORLD), stage=2)
    spec = job.spec.model_copy(deep=True)
    spec.model.architecture = ModelArchitecture.model_validate(MODELS[model])
    spec.training.precision = "bf16"
    # One short sample a rank: the step only has to create the optimizer states.
    spec.training.sequence_length = 32
    spec.training.global_batch_size = WORLD
    spec.checkpoint.enabled = True
    spec.checkpoint.interval_steps = 1
    spec.checkpoint.uri = str(workdir / "checkpoints")
    plan = job.plan.model_copy(update={"architecture": spec.model.architecture})
    return job.model_copy(update={"spec": spec, "plan": plan})


def run(workdir: Path, job: JobConfig, name: str, program: list[str], **env: str) -> str:
    config = workdir / f"{name}.json"
    config.write_text(json.dumps(job.to_json_dict()))
    args = standalone_args(WORLD, config, free_port(), program)
    full_env = {**os.environ, **trainer_env("127.0.0.1", **env), "DS_ACCELERATOR": "cpu",
                "PYTHONPATH": os.pathsep.join([str(REPO / "operator"),
                                               str(REPO / "trainer_image")])}  # fmt: skip
    done = subprocess.run(args, cwd=workdir, env=full_env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{name}: " + done.stdout[-3000:] + done.stderr[-3000:])
    return done.stdout + done.stderr


def measure(model: str, paths: list[str], cap: int, workdir: Path) -> list[dict[str, Any]]:
    job = resume_job(model, workdir)
    run(workdir, job, f"{model}-save", ["-m", "finetune_trainer"])
    rows: list[dict[str, Any]] = []
    for path in paths:
        env = {"FT_TEST_RESUME_CAP": str(cap)}
        if path == "old":
            env["FT_TEST_RESUME_OLD"] = "1"
        out = run(workdir, job, f"{model}-{path}", [str(RESUME_WORKER)], **env)
        found = [json.loads(x) for x in re.findall(r"^resume-peak (\{.*\})$", out, re.M)]
        assert len(found) == WORLD, out[-3000:]
        rows += [{**r, "model": model, "path": path} for r in found]
    return rows


def budget(row: dict[str, Any]) -> str:
    return "all" if row["path"] == "old" else f"{row['budget'] / MIB:.0f}"


def report(rows: list[dict[str, Any]], cap: int) -> str:
    lines = [f"ZeRO-2 bf16, {WORLD} ranks, CPU/gloo; group cap {cap / MIB:.0f} MiB (budget: the "
             "cap or the largest tensor)",
             f"{'model':>6} {'params':>7} {'path':>4} {'rank':>4} {'groups':>6} {'budget MiB':>10} "
             f"{'live MiB':>8} {'read MiB':>8} {'full MiB':>8} {'rss MiB':>8}"]  # fmt: skip
    for r in sorted(rows, key=lambda r: (r["model"], r["path"] != "old", r["rank"])):
        params = shape_of(ModelArchitecture.model_validate(MODELS[r["model"]])).total
        lines.append(
            f"{r['model']:>6} {params / 1e6:>6.0f}M {r['path']:>4} {r['rank']:>4} "
            f"{r['groups']:>6} {budget(r):>10} {r['live_peak'] / MIB:>8.0f} "
            f"{r['read_bytes'] / MIB:>8.0f} {r['full_bytes'] / MIB:>8.0f} "
            f"{r['peak_rss'] / MIB:>8.0f}"
        )
    for model in sorted({r["model"] for r in rows}):
        new = [r for r in rows if r["model"] == model and r["path"] == "new"]
        old = [r for r in rows if r["model"] == model and r["path"] == "old"]
        if not new:
            continue
        worst_new = max(r["live_peak"] for r in new)
        if old:
            worst_old = max(r["live_peak"] for r in old)
            lines.append(f"{model}: worst rank's live peak during the resume old/new = "
                         f"{worst_old / MIB:.0f}/{worst_new / MIB:.0f} MiB = "
                         f"{worst_old / worst_new:.2f}x")  # fmt: skip
        else:
            full = new[0]["full_bytes"]
            lines.append(f"{model}: worst rank's live peak during the resume new = "
                         f"{worst_new / MIB:.0f} MiB; old (not run: its templates alone) >= "
                         f"{full / MIB:.0f} MiB = {full / worst_new:.2f}x")  # fmt: skip
        read = max(r["read_bytes"] for r in new) / new[0]["full_bytes"]
        lines.append(f"{model}: each rank read <= {read:.0%} of the checkpoint's bytes (old: 100%)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mid", "wide"], choices=sorted(MODELS))
    parser.add_argument("--paths", nargs="+", default=["old", "new"], choices=["old", "new"])
    parser.add_argument("--cap", type=int, default=RESUME_CHUNK_BYTES)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    for model in args.models:
        with tempfile.TemporaryDirectory() as tmp:
            rows += measure(model, args.paths, args.cap, Path(tmp))
    text = report(rows, args.cap)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
