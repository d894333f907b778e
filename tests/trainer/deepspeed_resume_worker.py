"""torchrun worker for the DeepSpeed resume tests and bench/deepspeed_resume.py: the real
trainer, with its DeepSpeed resume (finetune_trainer.deepspeed_resume.restore_in_groups) counted.

Each rank prints one line `resume-peak {json}` with the most bytes of tensors alive at once
allocated during the grouped restore (tests/trainer/zero3_loading_worker.LiveBytes: counted
per op, so the allocator's retention does not blur it; views of the engine's own partitions
are not allocations), the bytes it read from storage during the restore (`storage_bytes`:
counted in the checkpoint's storage reader, DCP's `read_data`, as the length of every saved
item it reads: DCP reads an item whole), the restore's own figures (ResumeStats), the largest
tensor and its peak RSS.

Environment:
  FT_TEST_RESUME_CAP   bytes: the group cap (the product's is 1 GiB; a tiny test model fits
                       whole in that, so the tests set a small one)
  FT_TEST_RESUME_OLD   "1": the path before groups (bench/deepspeed_resume.py), reproduced: one
                       group of every tensor of every parameter on every rank (full templates)
  FT_TEST_SAVE_WHOLE   "1": save in the layout written before the chunked one (one whole
                       tensor per key, written by one rank, round-robin), reproduced here, so
                       that the tests resume from such a checkpoint
"""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ["DS_ACCELERATOR"] = "cpu"

STORAGE_BYTES = [0]  # read from storage by this rank, counted in the reader


def count_storage_reads() -> None:
    from finetune_trainer.location import Location

    real = Location.dcp_reader

    def counting(self: Location) -> Any:
        reader = real(self)
        read_data = reader.read_data

        def counted(plan: Any, planner: Any) -> Any:
            STORAGE_BYTES[0] += sum(reader.storage_data[i.storage_index].length
                                    for i in plan.items)  # fmt: skip
            return read_data(plan, planner)

        reader.read_data = counted
        return reader

    Location.dcp_reader = counting  # type: ignore[method-assign]


def save_whole_layout() -> None:
    """The save before the chunked layout: every rank gathers every tensor whole, the rank
    owning it (round-robin by name) keeps it under `model.<name>` / `optim.<name>.<state>`."""
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    import finetune_trainer.deepspeed_checkpoint as checkpoint

    def capture(self: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        self._link_optimizer_state()
        world, rank = dist.get_world_size(), dist.get_rank()
        model_sd: dict[str, Any] = {}
        optim_sd: dict[str, Any] = {}
        for i, (name, p) in enumerate(checkpoint._trainable(self._engine().module)):
            full = safe_get_full_fp32_param(p)
            states = {k: safe_get_full_optimizer_state(p, k) for k in self._state_keys()}
            if i % world == rank:
                model_sd[name] = full.detach().cpu()
                optim_sd[name] = {k: v.detach().cpu() for k, v in states.items()}
        return model_sd, optim_sd

    checkpoint.DeepSpeedTrainState.capture_model_optim = capture  # type: ignore[method-assign]


def main() -> int:
    import torch.distributed as dist

    import finetune_trainer.deepspeed_checkpoint as checkpoint
    import finetune_trainer.deepspeed_resume as resume
    from finetune_trainer.__main__ import main as trainer_main
    from tests.trainer.zero3_loading_worker import LiveBytes

    count_storage_reads()
    if os.environ.get("FT_TEST_SAVE_WHOLE") == "1":
        save_whole_layout()
    real = resume.restore_in_groups
    old = os.environ.get("FT_TEST_RESUME_OLD") == "1"
    cap = 2**62 if old else int(os.environ.get("FT_TEST_RESUME_CAP", resume.RESUME_CHUNK_BYTES))
    if old:
        resume.owns_fragment = lambda p: True  # type: ignore[assignment]

    def counted(params: Any, state_keys: Any, read: Any, **kwargs: Any) -> Any:
        counter = LiveBytes(allocations_only=True)
        before = STORAGE_BYTES[0]
        with counter:
            stats = real(params, state_keys, read, **{**kwargs, "cap": cap})
        largest = max(p.ds_shape.numel() if hasattr(p, "ds_shape") else p.numel()
                      for _, p in params) * resume.FP32  # fmt: skip
        row = {"rank": dist.get_rank(), "world": dist.get_world_size(), "old": old,
               "live_peak": counter.peak, "largest": largest,
               "storage_bytes": STORAGE_BYTES[0] - before,
               "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               **stats.__dict__}  # fmt: skip
        print("resume-peak " + json.dumps(row), flush=True)
        return stats

    checkpoint.restore_in_groups = counted  # type: ignore[assignment]
    return trainer_main()


if __name__ == "__main__":
    from finetune_trainer.distributed import exit_process

    exit_process(main())  # not finalisation: see finetune_trainer.distributed
