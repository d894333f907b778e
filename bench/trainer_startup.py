"""The trainer's cold start by phase: what every rank pays again on each recovery.

    python bench/trainer_startup.py [--rounds 5] [--part imports|data|torchrun|all]

Imports: fresh interpreters, interleaved round by round so load drift hits all alike:
`import torch` (the floor), the trainer's entry path now (`finetune_trainer.trainer`), and the
import set it had before the lazy imports (the same plus `EAGER_BEFORE`, the modules it used
to import at module level whatever the job).

Torchrun: the quickstart job (jsonl, DDP, torch backend, local checkpoints) under real
`torchrun --standalone --nproc-per-node=2` on CPU/gloo, a fresh start (2 steps, checkpoint at
step 2) and a resume from that checkpoint (to step 4), each timed by the trainer's own
"started in" line (process start -> imports -> process group -> data -> model -> resume ->
first step; the slower rank, which the group waits for; with that rank's CPU seconds, which
other processes' load on a shared machine barely moves) and by the wall clock from launching
torchrun to the first step's line. The baseline in the same run: the same jobs with the
before-import set preloaded by each worker, i.e. the trainer's imports as they were.

Data: reading the quickstart corpus as the trainer did before (`datasets`' json builder) and
as it does now, imports excluded.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "operator"), str(REPO / "trainer_image")]

import yaml  # noqa: E402

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
# What `finetune_trainer.trainer` imported at module level whatever the job, before it
# imported per job (git 43f4905): `datasets` (jsonl and parquet now read without it). The
# DeepSpeed, peft, bitsandbytes and s3fs paths were already imported only where used.
EAGER_BEFORE = ("datasets",)
STARTED = re.compile(r"rank(\d+) .*started in ([\d.]+) s \(cpu ([\d.]+) s\): (.*)$")
PHASES = ("imports", "group", "data", "model", "resume", "first step")


def _import_seconds(modules: list[str]) -> tuple[float, float]:
    """Wall and CPU (user + system) seconds of a fresh interpreter importing `modules`. CPU
    time barely moves with other processes' load on a shared machine; wall time does."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", "import " + ", ".join(modules)], env=_env())
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
    if proc.returncode != 0:
        raise RuntimeError(f"importing {modules} failed")
    return wall, usage.ru_utime + usage.ru_stime


def _env() -> dict[str, str]:
    path = os.pathsep.join([str(REPO / "operator"), str(REPO / "trainer_image")])
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1",
            "FT_METRICS_BASE_PORT": "0", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}  # fmt: skip


def imports(rounds: int) -> str:
    sets = {
        "import torch (floor)": ["torch"],
        "trainer entry, before": [*EAGER_BEFORE, "finetune_trainer.trainer"],
        "trainer entry, now": ["finetune_trainer.trainer"],
    }
    walls: dict[str, list[float]] = {name: [] for name in sets}
    cpus: dict[str, list[float]] = {name: [] for name in sets}
    _import_seconds(["finetune_trainer.trainer"])  # warm the page cache and .pyc files
    for _ in range(rounds):
        for name, modules in sets.items():
            wall, cpu = _import_seconds(modules)
            walls[name].append(wall)
            cpus[name].append(cpu)
    wall_med = {name: statistics.median(ts) for name, ts in walls.items()}
    cpu_med = {name: statistics.median(ts) for name, ts in cpus.items()}
    floor = cpu_med["import torch (floor)"]
    rows = [
        f"| {name} | {wall_med[name]:.2f} s | {min(walls[name]):.2f} s | {cpu_med[name]:.2f} s "
        f"| {cpu_med[name] / floor:.2f} |"
        for name in sets
    ]
    before, now = cpu_med["trainer entry, before"], cpu_med["trainer entry, now"]
    wall_before, wall_now = wall_med["trainer entry, before"], wall_med["trainer entry, now"]
    return "\n".join([
        f"Fresh interpreter, {rounds} interleaved rounds (python -c 'import ...').",
        "",
        "| import set | wall, median | wall, min | CPU, median | CPU x import torch |",
        "|---|---|---|---|---|",
        *rows,
        "",
        f"now / before: CPU {now / before:.2f} ({before - now:.2f} s less per rank start), "
        f"wall {wall_now / wall_before:.2f} ({wall_before - wall_now:.2f} s less)",
    ])  # fmt: skip


# The records of the quickstart corpus as the trainer read them before (datasets' json
# builder: a cold cache as in a replacement pod, then its cache as in a restarted container)
# and now, each in the same fresh interpreter after the imports both need.
READ_RECORDS = """
import os, sys, tempfile, time
os.environ["HF_DATASETS_CACHE"] = tempfile.mkdtemp()
import datasets
from finetune_operator.api.spec import DatasetSpec
from finetune_trainer.data.records import load_records, resolve_uri
spec = DatasetSpec(uri="builtin://quickstart")
def timed(f):
    t0 = time.perf_counter(); f(); return time.perf_counter() - t0
old = lambda: datasets.load_dataset("json", data_files=resolve_uri(spec.uri), split="train")
print(timed(old), timed(old), timed(lambda: load_records(spec)))
"""


def data(rounds: int) -> str:
    samples = []
    for _ in range(rounds):
        out = subprocess.run([sys.executable, "-c", READ_RECORDS], env=_env(), check=True,
                             capture_output=True, text=True).stdout  # fmt: skip
        samples.append([float(x) for x in out.split()])
    cold, cached, now = (statistics.median(s[i] for s in samples) for i in range(3))
    return "\n".join([
        f"Reading the quickstart jsonl (median of {rounds} fresh interpreters, imports excluded):",
        "",
        "| reader | seconds |",
        "|---|---|",
        f"| before: datasets json builder, cold cache (a replacement pod) | {cold:.3f} |",
        f"| before: datasets json builder, cached (a restarted container) | {cached:.3f} |",
        f"| now: json lines | {now:.3f} |",
    ])  # fmt: skip


def _job_json(path: Path, steps: int, ckpt: Path) -> Path:
    from finetune_operator.api.jobconfig import JobConfig
    from finetune_operator.api.spec import FineTuneJobSpec
    from finetune_operator.planner import plan_job

    example = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
    raw: dict[str, Any] = example["spec"]
    raw["training"].update(maxSteps=steps, warmupSteps=1)
    raw["checkpoint"] = {"uri": ckpt.name, "intervalSteps": 2, "keep": 2}  # cwd: work
    raw.pop("output", None)
    spec = FineTuneJobSpec.model_validate(raw)
    plan = plan_job(spec).model_copy(update={"nodes": 1, "gpus_per_node": 2, "world_size": 2})
    job = JobConfig(name="bench", namespace="default", uid="bench", spec=spec, plan=plan)
    path.write_text(json.dumps(job.to_json_dict()))
    return path


def _run(work: Path, steps: int, ckpt: Path, preload: bool) -> tuple[float, dict[str, float]]:
    """One torchrun launch: seconds to the first step's line, and the slower rank's phases."""
    config = _job_json(work / f"job{steps}.json", steps, ckpt)
    entry = ["-m", "finetune_trainer"]
    if preload:
        # The worker imports the before-set first, then runs the same entry point.
        script = work / "preloaded.py"
        script.write_text(
            "".join(f"import {m}\n" for m in EAGER_BEFORE)
            + "import runpy\nrunpy.run_module('finetune_trainer', run_name='__main__')\n"
        )
        entry = [str(script)]
    args = [TORCHRUN, "--standalone", "--nproc-per-node=2", *entry, "--config", str(config)]
    t0 = time.monotonic()
    first: float | None = None
    per_rank: dict[int, dict[str, float]] = {}
    with subprocess.Popen(args, cwd=work, env=_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True) as proc:  # fmt: skip
        assert proc.stdout is not None
        for line in proc.stdout:
            if first is None and line.startswith('{"step"'):
                first = time.monotonic() - t0
            if m := STARTED.search(line):
                phases = dict(p.rsplit(" ", 1) for p in m.group(4).split(", "))
                rank = per_rank[int(m.group(1))] = {k: float(v) for k, v in phases.items()}
                rank["total"], rank["cpu"] = float(m.group(2)), float(m.group(3))
    if proc.returncode != 0 or first is None or len(per_rank) != 2:
        raise RuntimeError(f"trainer run failed (exit {proc.returncode})")
    return first, max(per_rank.values(), key=lambda p: p["total"])


def torchrun(rounds: int) -> str:
    results: dict[tuple[str, str], list[tuple[float, dict[str, float]]]] = {}
    with tempfile.TemporaryDirectory(prefix="ft-startup-") as tmp:
        for r in range(rounds):
            for variant, preload in (("before", True), ("now", False)):
                work = Path(tmp) / f"{variant}{r}"
                work.mkdir()
                ckpt = work / "ckpt"
                # Fresh start to step 2 (saves a checkpoint there), then resume to step 4.
                results.setdefault((variant, "fresh"), []).append(_run(work, 2, ckpt, preload))
                results.setdefault((variant, "resume"), []).append(_run(work, 4, ckpt, preload))
    header = (
        "| run | trainer | launch -> first step | started in | rank CPU | "
        + " | ".join(PHASES)
        + " |"
    )
    lines = [
        f"torchrun --standalone --nproc-per-node=2, quickstart (CPU/gloo), median of {rounds} "
        "rounds; phases of the slower rank, seconds.",
        "",
        header,
        "|" + "---|" * (5 + len(PHASES)),
    ]
    med: dict[tuple[str, str], float] = {}
    cpu: dict[tuple[str, str], float] = {}
    for run in ("fresh", "resume"):
        for variant in ("before", "now"):
            samples = results[(variant, run)]
            wall = statistics.median(s[0] for s in samples)
            med[(variant, run)] = wall
            phase = {k: statistics.median(s[1].get(k, 0.0) for s in samples)
                     for k in ("total", "cpu", *PHASES)}  # fmt: skip
            cpu[(variant, run)] = phase["cpu"]
            cells = " | ".join(f"{phase[k]:.2f}" for k in PHASES)
            lines.append(f"| {run} | {variant} | {wall:.2f} | {phase['total']:.2f} | "
                         f"{phase['cpu']:.2f} | {cells} |")  # fmt: skip
    lines.append("")
    for run in ("fresh", "resume"):
        before, now = med[("before", run)], med[("now", run)]
        cpu_before, cpu_now = cpu[("before", run)], cpu[("now", run)]
        lines.append(f"{run}: launch -> first step now / before = {now / before:.2f} "
                     f"({before - now:.2f} s less); rank CPU to first step now / before = "
                     f"{cpu_now / cpu_before:.2f} ({cpu_before - cpu_now:.2f} s less)")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--part", choices=["imports", "data", "torchrun", "all"], default="all")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(f"load: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")
    if args.part in ("imports", "all"):
        print(imports(args.rounds), "\n", flush=True)
    if args.part in ("data", "all"):
        print(data(args.rounds), "\n", flush=True)
    if args.part in ("torchrun", "all"):
        print(torchrun(args.rounds))
    print(f"load: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
