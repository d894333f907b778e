"""Bytes each rank fetches of pretrained safetensors on object storage, against the whole model
(what a download per rank would fetch), at several FSDP world sizes, in the same run; and the
GET requests the server saw, with adjacent ranges coalesced (the default) against one request
per range (FT_RANGE_GAP_BYTES=-1), counted in moto's request log.

A 67M-parameter Llama (256 MiB in fp32, 5 safetensors shards) is saved to a bucket of moto's S3 server
on loopback; torchrun ranks load it the trainer's way (meta -> shard -> ranged reads into the
shards: finetune_trainer.safetensors_ranges) and report the bytes they read; the loaded
logits are checked against `from_pretrained` of the same files.

    python bench/remote_weights.py [--worlds 1 2 4] [--out bench/results/remote_weights.txt]

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
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402

from finetune_operator.api.jobconfig import JobConfig  # noqa: E402
from finetune_operator.api.spec import ModelSpec  # noqa: E402
from finetune_trainer.location import locate  # noqa: E402
from finetune_trainer.tokenizer import build_byte_tokenizer  # noqa: E402
from tests.objectstore import CREDENTIALS, MotoServer, moto_server  # noqa: E402
from tests.trainer.conftest import TORCHRUN, make_job, write_job  # noqa: E402

WORKER = REPO / "tests" / "trainer" / "loading_worker.py"
INPUT = torch.tensor([[1, 5, 9, 42, 7, 3, 100, 17]] * 2)  # loading_worker.INPUT
MIB = 2**20


def save_model(path: Path) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=768, intermediate_size=2048, num_hidden_layers=6,
                         num_attention_heads=12, vocab_size=16000, max_position_embeddings=256,
                         bos_token_id=256, eos_token_id=257, pad_token_id=258)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(path, max_shard_size="60MB")
    build_byte_tokenizer().save_pretrained(path)


def gets(log: Path, key: str) -> int:
    """GET requests of the safetensors (and their index) under `key` (bucket/prefix) in moto's
    request log: one line per HTTP request the server answered."""
    lines = log.read_text().splitlines()
    return sum(1 for line in lines if f"GET /{key}/" in line and ".safetensors" in line)


def run(world: int, job: JobConfig, tmp: Path, gap: int | None) -> tuple[list[int], int, float]:
    cfg = write_job(tmp / f"job-{world}.json", job)
    out = tmp / f"out-{world}.pt"
    knob = {} if gap is None else {"FT_RANGE_GAP_BYTES": str(gap)}
    env = {**os.environ, **CREDENTIALS, **knob, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "operator"),
                                          str(REPO / "trainer_image")])}  # fmt: skip
    t0 = time.perf_counter()
    done = subprocess.run([TORCHRUN, "--standalone", f"--nproc-per-node={world}", str(WORKER),
                           "model", str(out), str(cfg)], cwd=tmp, env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    seconds = time.perf_counter() - t0
    if done.returncode:
        raise SystemExit(done.stdout[-3000:] + done.stderr[-3000:])
    got = torch.load(out, weights_only=False)
    reference = AutoModelForCausalLM.from_pretrained(tmp / "m", dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(got["logits"], reference(input_ids=INPUT).logits), "logits differ"
    rows = got["fetched"]
    # What each rank fetched: what it needed, the gaps coalescing dropped, the index.
    fetched = [r["bytes_read"] + r["bytes_gaps"] + r["bytes_index"] for r in rows]
    return fetched, rows[0]["bytes_total"], seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    os.environ.update(CREDENTIALS)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        log = tmp / "moto.log"
        with moto_server(log=log) as server:
            lines = measure(server, tmp, log, args.worlds)
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


def measure(server: MotoServer, tmp: Path, log: Path, worlds: list[int]) -> list[str]:
    lines = []
    save_model(tmp / "m")
    uri = f"s3://{server.new_bucket()}/models/bench"
    target = locate(uri, "bench", object_store=server.spec())
    for path in sorted((tmp / "m").iterdir()):
        (target / path.name).upload(path)
    job = make_job(strategy="fsdp-full-shard")
    job.spec.model = ModelSpec(name="bench-llama", source="uri", path=uri)
    job.spec.storage.object_store = server.spec()
    key = uri.removeprefix("s3://")
    lines.append(f"{'ranks':>5} {'model MiB':>10} {'max per rank MiB':>17} "
                 f"{'whole/rank':>10} {'sum/model':>9} {'GETs 1/range':>12} "
                 f"{'GETs merged':>11} {'fewer':>6} {'seconds':>8}")  # fmt: skip
    for world in worlds:
        before = gets(log, key)
        run(world, job, tmp, gap=-1)
        baseline = gets(log, key) - before
        fetched, total, seconds = run(world, job, tmp, gap=None)
        merged = gets(log, key) - before - baseline
        lines.append(f"{world:>5} {total / MIB:>10.1f} {max(fetched) / MIB:>17.1f} "
                     f"{total / max(fetched):>9.2f}x {sum(fetched) / total:>9.3f} "
                     f"{baseline:>12} {merged:>11} {baseline / merged:>5.1f}x "
                     f"{seconds:>8.1f}")  # fmt: skip
    return lines


if __name__ == "__main__":
    main()
