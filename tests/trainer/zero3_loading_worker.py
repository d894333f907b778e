"""Run under torchrun by test_zero3_loading.py and bench/model_loading.py: load a DeepSpeed
job's model the way the trainer does (finetune_trainer.loading: ZeRO-3 partitioned under
zero.Init), then report.

Modes:
  model   OUT JOB [JOB...]   rank 0 writes {"state": every parameter gathered whole,
                    "buffers", "tied", "rows": per rank, "live_peak" (the most bytes of
                    tensors alive at once while loading), "shard_bytes" (its partition) and
                    "fetched" (the bytes an object-store read logged)} of the first JOB to
                    OUT (torch.save), and the same of each JOB, loaded in turn, as "runs"
  memory  OUT JOB [--old]   peak RSS while loading, per rank, appended as JSON lines to OUT
                    (--old: the previous path, the whole model on every rank, then
                    partitioned as `deepspeed.initialize` did)

The live-tensor count (`LiveBytes`) sees every tensor storage an aten op creates on this
rank and when it is freed, so its peak is the load's own allocation peak, without the
allocator's and Python's noise that RSS carries (which needs a large model to see).
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
import time
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from finetune_operator.api.jobconfig import JobConfig
from finetune_trainer import replica_loading
from finetune_trainer.deepspeed_engine import (
    import_deepspeed,
    job_deepspeed_config,
    select_accelerator,
)
from finetune_trainer.distributed import exit_process
from finetune_trainer.loading import load_parallel_model
from finetune_trainer.model import build_model
from finetune_trainer.pretrained import hf_model
from finetune_trainer.tokenizer import build_tokenizer
from tests.trainer.loading_worker import rss_bytes

CPU = torch.device("cpu")


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storages alive, counted as ops create them and freed by a finalizer
    on the storage (views of one storage count once); `peak` the most at any time."""

    def __init__(self, *, allocations_only: bool = False) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0
        # True: an output that shares an input's storage (a view, an in-place op) is not
        # counted: among a live engine's buffers, a view of one is no new allocation.
        self.allocations_only = allocations_only

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = (
            {_storage_ptr(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            if self.allocations_only
            else set()
        )
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = id(storage)
                if key in self.live or (inputs and _storage_ptr(t) in inputs):
                    continue
                self.live[key] = storage.nbytes()
                self.current += self.live[key]
                self.peak = max(self.peak, self.current)
                weakref.finalize(storage, self._free, key)
        return out

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)


def _storage_ptr(t: torch.Tensor) -> int:
    if t.device.type == "meta":
        return -1
    try:
        return int(t.untyped_storage().data_ptr())
    except RuntimeError:  # a wrapper subclass with no data of its own (a collective's result)
        return -1


class Fetched(logging.Handler):
    """What an object-store load logs having read (and, striped, in how many DCP loads)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, int]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if hasattr(record, "bytes_read"):
            self.rows.append({"bytes_read": record.bytes_read, "bytes_total": record.bytes_total,
                              "loads": getattr(record, "loads", 1)})  # fmt: skip


def partition_bytes(model: torch.nn.Module) -> int:
    total = 0
    for p in model.parameters():
        local = getattr(p, "ds_tensor", p)
        total += local.numel() * local.element_size()
    return total


def old_path(job: JobConfig, tok: Any) -> torch.nn.Module:
    """The loading before zero.Init: the whole model on every rank, partitioned after (what
    `deepspeed.initialize` does to a materialised module, up to its optimizer)."""
    spec = job.spec
    model = build_model(spec.model, spec.method, tok, CPU, activation_checkpointing=False,
                        precision=spec.training.precision, architecture=job.plan.architecture,
                        seed=spec.training.seed)  # fmt: skip
    config, _ = job_deepspeed_config(job)
    deepspeed = import_deepspeed()
    deepspeed.init_distributed(dist_backend="gloo", dist_init_required=False)
    deepspeed.zero.Init(module=model, config_dict_or_path=config)
    return model


def gathered(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    deepspeed = import_deepspeed()
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        with deepspeed.zero.GatheredParameters([p] if hasattr(p, "ds_id") else []):
            out[name] = p.detach().clone()
    return out


def load(job: JobConfig, old: bool) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Load `job`'s model (the trainer's path, or the old one), with this rank's figures."""
    rank, world = dist.get_rank(), dist.get_world_size()
    tok = build_tokenizer(job.spec.model, job.spec.storage.object_store)
    fetched = Fetched()  # the bytes an object-store load logs having read
    logging.getLogger("finetune_trainer").addHandler(fetched)
    logging.getLogger("finetune_trainer").setLevel(logging.INFO)
    base = rss_bytes()
    counter = LiveBytes()
    t0 = time.perf_counter()
    try:
        with counter:
            model = old_path(job, tok) if old else load_parallel_model(job, tok, CPU, world).model
    finally:
        logging.getLogger("finetune_trainer").removeHandler(fetched)
    seconds = time.perf_counter() - t0
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    mine = {"rank": rank, "world": world, "path": "old" if old else "new", "base_rss": base,
            "peak_rss": peak_rss, "shard_bytes": partition_bytes(model),
            "live_peak": counter.peak, "seconds": round(seconds, 2),
            "fetched": fetched.rows}  # fmt: skip
    return model, mine


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    jobs = [Path(a) for a in sys.argv[3:] if not a.startswith("--")]
    old = "--old" in sys.argv
    if "FT_TEST_STRIPE_BYTES" in os.environ:  # a test's small groups: several DCP loads
        replica_loading.STRIPE_BYTES = int(os.environ["FT_TEST_STRIPE_BYTES"])
    select_accelerator(CPU)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    import_deepspeed()  # its import is not the load's
    runs = []
    for job_path in jobs:  # each job loaded in turn: one torchrun start for several loads
        model, mine = load(JobConfig.model_validate_json(job_path.read_text()), old)
        rows: list[Any] = [None] * world
        dist.all_gather_object(rows, mine)
        if mode == "memory":
            if rank == 0:
                with out.open("a") as f:
                    f.writelines(json.dumps(r) + "\n" for r in rows)
            continue
        base_model = hf_model(model)
        tied = base_model.get_output_embeddings().weight is base_model.get_input_embeddings().weight
        buffers = {n: b.clone() for n, b in model.named_buffers()}
        runs.append({"state": gathered(model), "buffers": buffers, "tied": tied, "rows": rows})
        del model, base_model
    if mode == "model" and rank == 0:
        torch.save({**runs[0], "runs": runs}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_process(0)  # not finalisation: see finetune_trainer.distributed.exit_process
