"""torchrun worker for the DeepSpeed resume tests and bench/model_loading.py: the real trainer,
with its DeepSpeed resume (finetune_trainer.deepspeed_resume.restore_in_groups) counted.

Each rank prints one line `resume-peak {json}` with the most bytes of tensors alive at once
allocated during the grouped restore (tests/trainer/zero3_loading_worker.LiveBytes: counted
per op, so the allocator's retention does not blur it; views of the engine's own partitions
are not allocations), what it read, the budget, the number of groups,
the largest tensor and its peak RSS.

Environment:
  FT_TEST_RESUME_CAP  bytes: the group cap (the product's is 1 GiB; a tiny test model fits
                      whole in that, so the tests set a small one)
  FT_TEST_RESUME_OLD  "1": the path before groups, reproduced: one group of every tensor of
                      every parameter on every rank (the full templates)
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


def main() -> int:
    import torch.distributed as dist

    import finetune_trainer.deepspeed_checkpoint as checkpoint
    import finetune_trainer.deepspeed_resume as resume
    from finetune_trainer.__main__ import main as trainer_main
    from tests.trainer.zero3_loading_worker import LiveBytes

    real = resume.restore_in_groups
    old = os.environ.get("FT_TEST_RESUME_OLD") == "1"
    cap = 2**62 if old else int(os.environ.get("FT_TEST_RESUME_CAP", resume.RESUME_CHUNK_BYTES))
    if old:
        resume.owns_optimizer_fragment = lambda p: True  # type: ignore[assignment]

    def counted(params: Any, state_keys: Any, read: Any, **kwargs: Any) -> resume.ResumeStats:
        counter = LiveBytes(allocations_only=True)
        with counter:
            stats = real(params, state_keys, read, **{**kwargs, "cap": cap})
        largest = max(resume.full_shape(p).numel() * resume.FP32 for _, p in params)
        row = {"rank": dist.get_rank(), "world": dist.get_world_size(), "old": old,
               "live_peak": counter.peak, "largest": largest,
               "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               **stats.__dict__}  # fmt: skip
        print("resume-peak " + json.dumps(row), flush=True)
        return stats

    checkpoint.restore_in_groups = counted  # type: ignore[assignment]
    return trainer_main()


if __name__ == "__main__":
    sys.exit(main())
