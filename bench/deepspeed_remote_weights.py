"""Bytes each rank of a DeepSpeed job fetches of pretrained safetensors on object storage, at
several world sizes, in the same run: ZeRO-3 (rank 0 reads each module's ranges, DeepSpeed
broadcasts: finetune_trainer.deepspeed_loading) and ZeRO-2 (a full replica per rank, read in
one stripe per rank and all-gathered: finetune_trainer.replica_loading), against the baseline
of every rank reading the whole model (what a replica read per rank costs: `world` x model).

A 16M-parameter Llama (64 MiB in fp32, several safetensors shards) is saved to a bucket of
moto's S3 server on loopback; torchrun ranks (DS_ACCELERATOR=cpu, gloo) load it the trainer's
way (tests/trainer/zero3_loading_worker.py) and report the bytes they read; the loaded weights
are checked against the files.

    python bench/deepspeed_remote_weights.py [--worlds 2 4] [--out FILE]

moto serves from memory on the same machine: the seconds say nothing of a real store's
throughput, only the byte counts carry over.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "operator"), str(REPO / "trainer_image")]

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from finetune_operator.api.jobconfig import JobConfig  # noqa: E402
from finetune_operator.api.spec import ModelSpec  # noqa: E402
from finetune_trainer.location import locate  # noqa: E402
from finetune_trainer.tokenizer import build_byte_tokenizer  # noqa: E402
from tests.objectstore import CREDENTIALS, moto_server  # noqa: E402
from tests.trainer.conftest import TORCHRUN, make_job, write_job  # noqa: E402

WORKER = REPO / "tests" / "trainer" / "zero3_loading_worker.py"
MIB = 2**20


def save_model(path: Path) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=8, vocab_size=32000, max_position_embeddings=256,
                         bos_token_id=256, eos_token_id=257, pad_token_id=258)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(path, max_shard_size="20MB")
    build_byte_tokenizer().save_pretrained(path)


def deepspeed_job(stage: int, uri: str, store: object) -> JobConfig:
    job = make_job(strategy="ddp")
    strategy = f"zero{stage}"
    job.spec.strategy = job.spec.strategy.model_copy(
        update={"type": strategy, "backend": "deepspeed"}
    )
    job.plan = job.plan.model_copy(
        update={"strategy": strategy, "backend": "deepspeed", "device": "cpu"}
    )
    job.spec.model = ModelSpec(name="bench-llama", source="uri", path=uri)
    job.spec.storage.object_store = store  # type: ignore[assignment]
    return job


def run(world: int, jobs: list[JobConfig], tmp: Path) -> tuple[list[list[int]], float]:
    cfgs = [str(write_job(tmp / f"job-{world}-{i}.json", j)) for i, j in enumerate(jobs)]
    out = tmp / f"out-{world}.pt"
    env = {**os.environ, **CREDENTIALS, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "operator"),
                                          str(REPO / "trainer_image")])}  # fmt: skip
    t0 = time.perf_counter()
    done = subprocess.run([TORCHRUN, "--standalone", f"--nproc-per-node={world}", str(WORKER),
                           "model", str(out), *cfgs], cwd=tmp, env=env, capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    seconds = time.perf_counter() - t0
    if done.returncode:
        raise SystemExit(done.stdout[-3000:] + done.stderr[-3000:])
    got = torch.load(out, weights_only=False)
    files: dict[str, torch.Tensor] = {}
    for f in (tmp / "m").glob("*.safetensors"):
        files.update(load_file(f))
    fetched = []
    for run_ in got["runs"]:
        for key, tensor in files.items():
            assert torch.equal(run_["state"][key], tensor), f"{key} differs"
        fetched.append([sum(r["bytes_read"] for r in row["fetched"]) for row in run_["rows"]])
    return fetched, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    os.environ.update(CREDENTIALS)
    lines = []
    with tempfile.TemporaryDirectory() as d, moto_server() as server:
        tmp = Path(d)
        save_model(tmp / "m")
        total = sum(p.stat().st_size for p in (tmp / "m").glob("*.safetensors"))
        uri = f"s3://{server.new_bucket()}/models/bench"
        target = locate(uri, "bench", object_store=server.spec())
        for path in sorted((tmp / "m").iterdir()):
            (target / path.name).upload(path)
        jobs = [deepspeed_job(stage, uri, server.spec()) for stage in (3, 2)]
        lines.append(f"model: {total / MIB:.1f} MiB of safetensors; baseline: every rank "
                     "reads it whole (world x model)")  # fmt: skip
        lines.append(f"{'stage':>5} {'ranks':>5} {'per rank MiB':>24} {'sum/model':>9} "
                     f"{'baseline/sum':>12} {'seconds':>8}")  # fmt: skip
        for world in args.worlds:
            fetched, seconds = run(world, jobs, tmp)
            for stage, per_rank in zip((3, 2), fetched, strict=True):
                ranks = " ".join(f"{n / MIB:.1f}" for n in per_rank)
                lines.append(f"{stage:>5} {world:>5} {ranks:>24} {sum(per_rank) / total:>9.3f} "
                             f"{world * total / sum(per_rank):>11.2f}x {seconds:>8.1f}")  # fmt: skip
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
