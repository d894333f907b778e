"""Per-rank peak host memory while loading a ≥500M-parameter model under FSDP on CPU: the old
path (every rank builds the whole model, then `fully_shard`) against meta build -> shard ->
materialise, at 2 and 4 ranks, in the same run.

    python bench/model_loading.py [--worlds 2 4] [--paths old new] [--out bench/results/model_loading.txt]

On CPU the device is host memory: "peak" is the rise of each rank's resident set (ru_maxrss)
over its RSS when loading started. Bound checked: peak <= shard + one decoder layer + 256 MiB.
"""

from __future__ import annotations

import argparse
import json
import os
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

WORKER = REPO / "tests" / "trainer" / "loading_worker.py"
MIB = 2**20
SLACK_BYTES = 256 * MIB
# Wide and shallow: 534M parameters in 6 layers, so building it stays quick.
ARCH: dict[str, Any] = {
    "modelType": "llama", "hiddenSize": 2048, "numHiddenLayers": 6, "numAttentionHeads": 16,
    "numKeyValueHeads": 16, "intermediateSize": 8192, "vocabSize": 32000,
    "maxPositionEmbeddings": 512,
}  # fmt: skip


def big_job(world: int) -> JobConfig:
    spec = FineTuneJobSpec.model_validate({
        "model": {"name": "wide-llama", "source": "inline", "architecture": ARCH},
        "dataset": {"uri": "builtin://quickstart"},
        "training": {"maxSteps": 1, "globalBatchSize": 4, "precision": "fp32",
                     "activationCheckpointing": "none"},
        "resources": {"device": "cpu"},
        "strategy": {"type": "fsdp-full-shard"},
    })  # fmt: skip
    zero = MemoryBreakdown(parameters=0, gradients=0, optimizer=0, activations=0, buffers=0,
                           peak=0, reserved=0, total=0)  # fmt: skip
    plan = Plan(fits=True, world_size=world, nodes=1, gpus_per_node=world,
                strategy="fsdp-full-shard", micro_batch_size=1, gradient_accumulation_steps=1,
                activation_checkpointing=False, gpu_memory_bytes=2**34, headroom=0.5,
                estimated_step_seconds=1.0, reason="bench", memory=zero,
                architecture=spec.model.architecture)  # fmt: skip
    return JobConfig(name="bench", uid="bench", spec=spec, plan=plan)


def layer_bytes() -> int:
    arch = big_job(1).spec.model.architecture
    assert arch is not None
    return shape_of(arch).layer * 4  # fp32


def measure(world: int, path: str, workdir: Path) -> list[dict[str, Any]]:
    """One torchrun of `world` ranks loading the model by `path`; a row per rank."""
    job = workdir / f"job-{world}.json"
    job.write_text(json.dumps(big_job(world).to_json_dict()))
    out = workdir / f"rows-{world}-{path}.jsonl"
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    args = [torchrun, "--standalone", f"--nproc-per-node={world}", str(WORKER), "memory",
            str(out), str(job)] + (["--old"] if path == "old" else [])
    pythonpath = os.pathsep.join([str(REPO), str(REPO / "operator"), str(REPO / "trainer_image")])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath}
    done = subprocess.run(args, cwd=workdir, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(done.stdout[-2000:] + done.stderr[-2000:])
    return [json.loads(line) for line in out.read_text().splitlines()]


def load_peak(row: dict[str, Any]) -> int:
    return int(row["peak_rss"]) - int(row["base_rss"])


def bound(row: dict[str, Any]) -> int:
    return int(row["shard_bytes"]) + layer_bytes() + SLACK_BYTES


def report(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"model: {shape_of(big_job(1).spec.model.architecture).total / 1e6:.0f}M parameters "  # type: ignore[arg-type]
        f"(fp32, FSDP full shard, CPU/gloo); one layer = {layer_bytes() / MIB:.0f} MiB",
        f"{'world':>5} {'path':>4} {'rank':>4} {'shard MiB':>9} {'load peak MiB':>13} "
        f"{'bound MiB':>9} {'within':>6} {'seconds':>7}",
    ]
    for r in rows:
        lines.append(
            f"{r['world']:>5} {r['path']:>4} {r['rank']:>4} {r['shard_bytes'] / MIB:>9.0f} "
            f"{load_peak(r) / MIB:>13.0f} {bound(r) / MIB:>9.0f} "
            f"{'yes' if load_peak(r) <= bound(r) else 'NO':>6} {r['seconds']:>7.1f}"
        )
    for world in sorted({r["world"] for r in rows}):
        peaks = {p: max(load_peak(r) for r in rows if r["world"] == world and r["path"] == p)
                 for p in ("old", "new") if any(r["path"] == p and r["world"] == world
                                                for r in rows)}  # fmt: skip
        if len(peaks) == 2:
            lines.append(f"world {world}: worst rank's load peak old/new = "
                         f"{peaks['old'] / peaks['new']:.2f}x")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--paths", nargs="+", default=["old", "new"])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.worlds:
            for path in args.paths:
                rows += measure(world, path, Path(tmp))
    text = report(rows)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
