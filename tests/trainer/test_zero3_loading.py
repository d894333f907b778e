"""DeepSpeed loading at scale under real torchrun on CPU/gloo (slow). ZeRO-3
(finetune_trainer.deepspeed_loading), 2 ranks: built partitioned under zero.Init, filled one
module at a time:

- inline: the initial weights equal the torch path's (build_model, the weights DDP/FSDP start
  from) for the same seed, exactly; the tied head stays tied; rotary buffers are fp32 and
  recomputed; and each rank's load peak (bytes of tensors alive at once, counted per op) stays
  within its partition plus one module gathered and its fp32 init, below the whole model
  (which every rank held before);
- pretrained safetensors (sharded files, tied) with LoRA on top: the base equals the files,
  the adapters equal the torch path's; the same from s3:// (moto) under ZeRO-3 and ZeRO-2
  (2 ranks, in the same torchrun run), with the bytes each rank read.

ZeRO-2 under bf16 (finetune_trainer.loading), 1 rank (the replica is the same at any world
size): built in the engine's dtype, so the load never holds an fp32 replica, with the torch
path's weights rounded to bf16 (what the engine's own cast gave) and fp32 buffers.
"""

from __future__ import annotations

import os
import struct
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from finetune_operator.api.jobconfig import JobConfig
from finetune_operator.planner.loading import striped_read_bytes
from finetune_trainer.location import locate
from tests.objectstore import MotoServer
from tests.trainer.conftest import REPO, TORCHRUN, write_job
from tests.trainer.test_loading import inline_job, pretrained_job, reference, save_pretrained
from tests.trainer.test_remote_weights import upload_dir

pytestmark = pytest.mark.slow

WORKER = REPO / "tests" / "trainer" / "zero3_loading_worker.py"
# The counter's own share of a load besides parameters: the rotary buffers, DeepSpeed's and
# the init's small tensors (measured: under 10 KiB on this model).
SLACK_BYTES = 32 * 2**10


def zero3(job: JobConfig, stage: int = 3) -> JobConfig:
    strategy = f"zero{stage}"
    spec = job.spec.model_copy(update={"strategy": job.spec.strategy.model_copy(
        update={"type": strategy, "backend": "deepspeed"})})  # fmt: skip
    plan = job.plan.model_copy(update={"strategy": strategy, "backend": "deepspeed",
                                       "device": "cpu"})  # fmt: skip
    return job.model_copy(update={"spec": spec, "plan": plan})


def run(
    tmp_path: Path,
    job: JobConfig,
    name: str,
    ranks: int = 2,
    more: tuple[JobConfig, ...] = (),
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """`job` loaded under torchrun (and each of `more` after it, in the same run: its results
    in "runs"), with `env` added to the workers' environment."""
    cfgs = [str(write_job(tmp_path / f"{name}-{i}.json", j)) for i, j in enumerate((job, *more))]
    out = tmp_path / f"{name}.pt"
    args = [TORCHRUN, "--standalone", f"--nproc-per-node={ranks}", str(WORKER), "model",
            str(out), *cfgs]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", **(env or {}),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    done = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result: dict[str, Any] = torch.load(out, weights_only=False)
    return result


def test_inline_init_equals_the_torch_path_and_no_rank_holds_the_model(tmp_path: Path) -> None:
    job = zero3(inline_job(strategy="ddp", tied=True))
    got = run(tmp_path, job, "inline")
    ref = reference(job)
    state = got["state"]
    assert set(state) == {n for n, _ in ref.named_parameters()}
    for name, p in ref.named_parameters():
        assert state[name].dtype == torch.float32, name
        assert torch.equal(state[name], p.detach()), name
    assert got["tied"]
    for name, b in ref.named_buffers():
        assert got["buffers"][name].dtype == torch.float32
        assert torch.equal(got["buffers"][name], b), name

    whole = sum(p.numel() * 4 for p in ref.parameters())
    largest = max(p.numel() * 4 for p in ref.parameters())
    # zero.Init partitions the head before the tie replaces it, and DeepSpeed keeps that
    # partition: the build's partitions count it.
    head = ref.config.vocab_size * ref.config.hidden_size * 4
    rows = got["rows"]
    assert sum(r["shard_bytes"] for r in rows) <= whole + 2 * 4 * len(rows)  # padding
    for r in rows:
        built = r["shard_bytes"] + head // len(rows)
        # Partitions + one module gathered + (rank 0) its fp32 init.
        assert r["live_peak"] <= built + 2 * largest + SLACK_BYTES, (r, largest)
        assert r["live_peak"] < whole, (r, whole)


def on_s3(job: JobConfig, server: MotoServer, uri: str) -> JobConfig:
    model = job.spec.model.model_copy(update={"source": "uri", "path": uri})
    storage = job.spec.storage.model_copy(update={"object_store": server.spec()})
    spec = job.spec.model_copy(update={"model": model, "storage": storage})
    return job.model_copy(update={"spec": spec})


def test_pretrained_safetensors_with_lora_land_in_the_partitions_from_a_volume_or_s3(
    tmp_path: Path, s3_credentials: MotoServer
) -> None:
    """One torchrun, three loads of the same files: ZeRO-3 from the directory, ZeRO-3 from
    s3:// (rank 0 reads each module's ranges, DeepSpeed broadcasts), ZeRO-2 from s3:// (a
    stripe per rank, all-gathered). Every load gives the files' weights; from s3:// the
    ranks together read the data once, each rank the headers besides."""
    weights = tmp_path / "weights"
    save_pretrained(weights, tied=True)
    uri = f"s3://{s3_credentials.new_bucket()}/models/tiny"
    upload_dir(weights, locate(uri, "test", object_store=s3_credentials.spec()))
    job = zero3(pretrained_job(weights, strategy="ddp", method="lora"))
    zero3_s3 = on_s3(job, s3_credentials, uri)
    zero2_s3 = on_s3(zero3(pretrained_job(weights, strategy="ddp", method="lora"), stage=2),
                     s3_credentials, uri)  # fmt: skip
    # Stripes in groups of at most 40 KiB per rank: several DCP loads, as a model over 256 MiB
    # per rank takes.
    got = run(tmp_path, job, "pretrained", more=(zero3_s3, zero2_s3),
              env={"FT_TEST_STRIPE_BYTES": str(40 << 10)})  # fmt: skip
    files: dict[str, torch.Tensor] = {}
    for f in weights.glob("*.safetensors"):
        files.update(load_file(f))
    ref = dict(reference(job).named_parameters())
    prefix = "base_model.model."
    for run_ in got["runs"]:
        assert run_["tied"]
        state = run_["state"]
        for key, tensor in files.items():
            name = prefix + key.replace("_proj.weight", "_proj.base_layer.weight")
            if name not in state:
                name = prefix + key
            assert torch.equal(state[name], tensor.float()), key
        adapters = [n for n in state if ".lora_" in n]
        assert adapters
        for name in adapters:
            assert torch.equal(state[name], ref[name].detach()), name

    total = sum(p.stat().st_size for p in weights.glob("*.safetensors"))
    headers = sum(
        8 + struct.unpack("<Q", p.read_bytes()[:8])[0] for p in weights.glob("*.safetensors")
    )
    local, z3, z2 = ([r["fetched"] for r in run_["rows"]] for run_ in got["runs"])
    # ZeRO-3, from the volume (mapped) as from s3:// (by ranges): rank 0 reads every tensor
    # and the headers, which rank 1 gets from it (to check the shapes) without a read.
    assert local == z3 == [[{"bytes_read": total, "bytes_total": total, "loads": 1}],
                           [{"bytes_read": 0, "bytes_total": total, "loads": 1}]]  # fmt: skip
    # ZeRO-2: each rank its stripe (the rows of dim 0, halved), rank 0 the headers once for
    # every rank and every DCP load; together every byte once.
    loads = z2[0][0]["loads"]
    assert loads > 1 and all(rows[0]["loads"] == loads for rows in z2)
    per_rank = [rows[0]["bytes_read"] for rows in z2]
    assert sum(per_rank) == total, (per_rank, total, headers, loads)
    assert per_rank[0] - headers < 0.6 * (total - headers), (per_rank, total, headers)
    assert per_rank[1] < 0.6 * (total - headers), (per_rank, total, headers)
    # ZeRO-2's striped read, measured against the planner's figure for it
    # (planner.loading.striped_read_bytes, with this test's stripe cap): beside the replica,
    # each rank's tensor peak stays within it (it outgrew the replica plus one module's fp32
    # init, the figure counted before, while DTensor.full_tensor gathered).
    base = [t for n, t in got["runs"][2]["state"].items() if ".lora_" not in n]
    largest = max(t.numel() * t.element_size() for t in base)
    e = base[0].element_size()
    replica = sum(t.numel() * t.element_size() for t in base)
    stripes = striped_read_bytes(replica, largest, 2, element_bytes=e, stripe_bytes=40 << 10)
    for r in got["runs"][2]["rows"]:
        assert r["live_peak"] <= r["shard_bytes"] + stripes, (r, stripes)


def test_zero2_bf16_replica_is_built_in_bf16_never_in_fp32(tmp_path: Path) -> None:
    inline = inline_job(strategy="ddp", tied=True)
    training = inline.spec.training.model_copy(update={"precision": "bf16"})
    job = zero3(inline.model_copy(update={"spec": inline.spec.model_copy(
        update={"training": training})}), stage=2)  # fmt: skip
    got = run(tmp_path, job, "zero2", ranks=1)
    ref = reference(job)
    state = got["state"]
    assert set(state) == {n for n, _ in ref.named_parameters()}
    for name, p in ref.named_parameters():
        assert state[name].dtype == torch.bfloat16, name
        assert torch.equal(state[name], p.detach().to(torch.bfloat16)), name
    assert got["tied"]
    for name, b in ref.named_buffers():  # the engine keeps buffers (rotary inv_freq) fp32
        assert got["buffers"][name].dtype == torch.float32, name
        assert torch.equal(got["buffers"][name], b), name

    whole_fp32 = sum(p.numel() * 4 for p in ref.parameters())
    largest = max(p.numel() * 4 for p in ref.parameters())
    (row,) = got["rows"]
    assert row["shard_bytes"] == whole_fp32 // 2
    # The bf16 replica plus one module's fp32 init and its bf16 copy-out; the fp32 replica
    # that the old path built (and the engine then cast) would be whole_fp32 on its own.
    assert row["live_peak"] <= whole_fp32 // 2 + 2 * largest + SLACK_BYTES, (row, largest)
    assert row["live_peak"] < whole_fp32, (row, whole_fp32)
