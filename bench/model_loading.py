"""Per-rank peak host memory while loading a ≥500M-parameter model on CPU, old path against
new, at 2 and 4 ranks, in the same run:
- FSDP (`old`/`new`): every rank builds the whole model, then `fully_shard`; against meta
  build -> shard -> materialise;
- DeepSpeed ZeRO-3 (`z3-old`/`z3-new`): every rank builds the whole model, then ZeRO-3
  partitions it (what `deepspeed.initialize` did); against the build under
  `deepspeed.zero.Init` filled one module at a time (finetune_trainer.deepspeed_loading).

    python bench/model_loading.py [--worlds 2 4] [--paths old new z3-old z3-new] [--out bench/results/model_loading.txt]

On CPU the device is host memory: "peak" is the rise of each rank's resident set (ru_maxrss)
over its RSS when loading started; for ZeRO-3 rows "live" is also the most bytes of tensors
alive at once on the rank (counted per op: tests/trainer/zero3_loading_worker.py), which the
allocator's retention does not blur. Bound checked: peak <= shard + one decoder layer + 256 MiB
(FSDP); shard + the largest module twice (gathered, and its fp32 init) + 256 MiB (ZeRO-3).
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
sys.path[:0] = [str(REPO / "operator"), str(REPO / "trainer_image")]

from finetune_operator.api.jobconfig import JobConfig  # noqa: E402
from finetune_operator.api.plan import MemoryBreakdown, Plan  # noqa: E402
from finetune_operator.api.spec import FineTuneJobSpec  # noqa: E402
from finetune_operator.planner.architecture import shape_of  # noqa: E402
from finetune_operator.planner.loading import largest_module_parameters  # noqa: E402

WORKER = REPO / "tests" / "trainer" / "loading_worker.py"
ZERO3_WORKER = REPO / "tests" / "trainer" / "zero3_loading_worker.py"
MIB = 2**20
# Lines of a rank's stderr worth quoting when a run fails.
WORDS = re.compile(r"terminate called|Fatal Python error|Error|what\(\)|Killed|Traceback")
SLACK_BYTES = 256 * MIB
# Wide and shallow: 534M parameters in 6 layers, so building it stays quick.
ARCH: dict[str, Any] = {
    "modelType": "llama", "hiddenSize": 2048, "numHiddenLayers": 6, "numAttentionHeads": 16,
    "numKeyValueHeads": 16, "intermediateSize": 8192, "vocabSize": 32000,
    "maxPositionEmbeddings": 512,
}  # fmt: skip


def big_job(world: int, strategy: str = "fsdp-full-shard") -> JobConfig:
    backend = "deepspeed" if strategy == "zero3" else "fsdp"
    spec = FineTuneJobSpec.model_validate({
        "model": {"name": "wide-llama", "source": "inline", "architecture": ARCH},
        "dataset": {"uri": "builtin://quickstart"},
        "training": {"maxSteps": 1, "globalBatchSize": 4, "precision": "fp32",
                     "activationCheckpointing": "none"},
        "resources": {"device": "cpu"},
        "strategy": {"type": strategy, "backend": backend},
    })  # fmt: skip
    zero = MemoryBreakdown(parameters=0, gradients=0, optimizer=0, activations=0, buffers=0,
                           peak=0, reserved=0, total=0)  # fmt: skip
    plan = Plan(fits=True, world_size=world, nodes=1, gpus_per_node=world,
                strategy=strategy, backend=backend, micro_batch_size=1, gradient_accumulation_steps=1,
                activation_checkpointing=False, gpu_memory_bytes=2**34, headroom=0.5,
                estimated_step_seconds=1.0, reason="bench", memory=zero,
                architecture=spec.model.architecture)  # fmt: skip
    return JobConfig(name="bench", uid="bench", spec=spec, plan=plan)


def layer_bytes() -> int:
    arch = big_job(1).spec.model.architecture
    assert arch is not None
    return shape_of(arch).layer * 4  # fp32


def largest_module_bytes() -> int:
    arch = big_job(1).spec.model.architecture
    assert arch is not None
    return largest_module_parameters(shape_of(arch)) * 4  # fp32


def measure(
    world: int, path: str, workdir: Path, mmap_threshold: int | None = None
) -> list[dict[str, Any]]:
    """One torchrun of `world` ranks loading the model by `path`; a row per rank.
    `mmap_threshold`: glibc's MALLOC_MMAP_THRESHOLD_ for the ranks (fixed: no dynamic
    threshold, so freed large blocks go back to the system instead of staying in the heap)."""
    zero3 = path.startswith("z3-")
    job = workdir / f"job-{world}-{path}.json"
    job.write_text(
        json.dumps(big_job(world, "zero3" if zero3 else "fsdp-full-shard").to_json_dict())
    )
    out = workdir / f"rows-{world}-{path}.jsonl"
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    args = [
        torchrun,
        "--standalone",
        f"--nproc-per-node={world}",
        str(ZERO3_WORKER if zero3 else WORKER),
        "memory",
        str(out),
        str(job),
    ]
    args += ["--old"] if path.endswith("old") else []
    pythonpath = os.pathsep.join([str(REPO), str(REPO / "operator"), str(REPO / "trainer_image")])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath, "DS_ACCELERATOR": "cpu"}
    if mmap_threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    done = subprocess.run(args, cwd=workdir, env=env, capture_output=True, text=True)
    if done.returncode:
        # torchrun's summary at the end says only which rank died and by which signal: keep
        # the ranks' own last words (an abort's "terminate called ...", a traceback) too.
        said = [line for line in done.stderr.splitlines() if WORDS.search(line)]
        raise RuntimeError("\n".join(said[-20:]) + "\n" + done.stderr[-2000:])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    return [{**r, "path": path} for r in rows]


def load_peak(row: dict[str, Any]) -> int:
    return int(row["peak_rss"]) - int(row["base_rss"])


def bound(row: dict[str, Any]) -> int:
    if str(row["path"]).startswith("z3-"):
        return int(row["shard_bytes"]) + 2 * largest_module_bytes() + SLACK_BYTES
    return int(row["shard_bytes"]) + layer_bytes() + SLACK_BYTES


def report(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"model: {shape_of(big_job(1).spec.model.architecture).total / 1e6:.0f}M parameters "  # type: ignore[arg-type]
        f"(fp32, CPU/gloo; FSDP full shard: old/new, DeepSpeed ZeRO-3: z3-old/z3-new); "
        f"one layer = {layer_bytes() / MIB:.0f} MiB, largest module = "
        f"{largest_module_bytes() / MIB:.0f} MiB",
        f"{'world':>5} {'path':>6} {'rank':>4} {'shard MiB':>9} {'load peak MiB':>13} "
        f"{'bound MiB':>9} {'within':>6} {'seconds':>7} {'live MiB':>8}",
    ]
    for r in rows:
        live = f"{r['live_peak'] / MIB:.0f}" if "live_peak" in r else "-"
        lines.append(
            f"{r['world']:>5} {r['path']:>6} {r['rank']:>4} {r['shard_bytes'] / MIB:>9.0f} "
            f"{load_peak(r) / MIB:>13.0f} {bound(r) / MIB:>9.0f} "
            f"{'yes' if load_peak(r) <= bound(r) else 'NO':>6} {r['seconds']:>7.1f} "
            f"{live:>8}"
        )
    for world in sorted({r["world"] for r in rows}):
        for old, new, label in (("old", "new", "FSDP"), ("z3-old", "z3-new", "ZeRO-3")):
            peaks = {p: max(load_peak(r) for r in rows if r["world"] == world and r["path"] == p)
                     for p in (old, new) if any(r["path"] == p and r["world"] == world
                                                for r in rows)}  # fmt: skip
            if len(peaks) == 2:
                lines.append(
                    f"world {world} {label}: worst rank's load peak old/new = "
                    f"{peaks[old] / peaks[new]:.2f}x"
                )
            live = {p: max(int(r.get("live_peak", 0)) for r in rows
                           if r["world"] == world and r["path"] == p) for p in peaks}  # fmt: skip
            if len(live) == 2 and live[new]:
                lines.append(
                    f"world {world} {label}: worst rank's live tensor peak old/new = "
                    f"{live[old] / live[new]:.2f}x"
                )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--paths", nargs="+", default=["old", "new", "z3-old", "z3-new"])
    parser.add_argument(
        "--mmap-threshold",
        type=int,
        default=None,
        help="MALLOC_MMAP_THRESHOLD_ for the ranks (default: glibc's dynamic one)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.worlds:
            for path in args.paths:
                rows += measure(world, path, Path(tmp), args.mmap_threshold)
    text = report(rows)
    if args.mmap_threshold is not None:
        text = f"glibc MALLOC_MMAP_THRESHOLD_={args.mmap_threshold}\n{text}"
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
