"""Run under torchrun by test_loading.py and bench/model_loading.py: build the job's model the
way the trainer does (meta -> shard -> materialise), then report per rank.

Modes:
  model   OUT JOB   rank 0 writes {"logits": of a fixed input, "state": the full state dict,
                    "tied": whether the head is still the embedding, "fetched": per rank, the
                    bytes of pretrained weights read from object storage} to OUT (torch.save)
  memory  OUT JOB [--old]   peak RSS while loading, per rank, appended as JSON lines to OUT
                    (--old: the previous path, a whole model per rank, then fully_shard)
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from finetune_operator.api.jobconfig import JobConfig
from finetune_trainer.distributed import exit_process
from finetune_trainer.loading import load_parallel_model
from finetune_trainer.model import build_model
from finetune_trainer.parallelize import parallelize
from finetune_trainer.tokenizer import build_tokenizer

CPU = torch.device("cpu")
INPUT = torch.tensor([[1, 5, 9, 42, 7, 3, 100, 17]] * 2)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def local_bytes(model: torch.nn.Module) -> int:
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


class Fetched(logging.Handler):
    """What finetune_trainer.pretrained logs of a ranged (object-store) read, and
    finetune_trainer.replica_loading of a striped one (bytes only)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, int]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if hasattr(record, "bytes_read"):
            keys = ("bytes_read", "bytes_total", "bytes_gaps", "bytes_index", "requests")
            self.rows.append({k: getattr(record, k) for k in keys if hasattr(record, k)})


def main() -> None:
    mode, out, job_path = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    old = "--old" in sys.argv
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    job = JobConfig.model_validate_json(job_path.read_text())
    spec = job.spec
    tok = build_tokenizer(spec.model, spec.storage.object_store)
    torch.manual_seed(spec.training.seed)
    fetched = Fetched()
    for source in ("finetune_trainer.pretrained", "finetune_trainer.replica_loading"):
        logging.getLogger(source).addHandler(fetched)
        logging.getLogger(source).setLevel(logging.INFO)
    base = rss_bytes()
    t0 = time.perf_counter()
    if old:  # the whole model on every rank, then sharded (the code before meta loading)
        model = build_model(
            spec.model,
            spec.method,
            tok,
            CPU,
            activation_checkpointing=False,
            precision=spec.training.precision,
            architecture=job.plan.architecture,
        )
        wrapped = parallelize(model, job.plan, CPU, world, precision=spec.training.precision).model
    else:
        wrapped = load_parallel_model(job, tok, CPU, world).model
    seconds = time.perf_counter() - t0
    if mode == "memory":
        row = {
            "rank": rank,
            "world": world,
            "path": "old" if old else "new",
            "base_rss": base,
            "peak_rss": peak_rss_bytes(),
            "shard_bytes": local_bytes(wrapped),
            "seconds": round(seconds, 2),
        }
        rows = [None] * world
        dist.all_gather_object(rows, row)
        if rank == 0:
            with out.open("a") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
    else:
        wrapped.eval()
        with torch.no_grad():
            logits = wrapped(input_ids=INPUT).logits
        state = get_model_state_dict(
            wrapped, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        inner = getattr(wrapped, "module", wrapped)  # DDP wraps; FSDP2 does not
        base = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
        tied = base.get_output_embeddings().weight is base.get_input_embeddings().weight
        reads: list[object] = [None] * world
        dist.all_gather_object(reads, fetched.rows[0] if fetched.rows else None)
        if rank == 0:
            torch.save({"logits": logits, "state": state, "tied": tied, "fetched": reads}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_process(0)  # not finalisation: see finetune_trainer.distributed.exit_process
