"""torchrun worker for the fp16 loss-scaling test: the real trainer on DeepSpeed with one
overflowing step injected (the first micro-batch of OVERFLOW_STEP backpropagates an infinite
loss, as a too-high loss scale would).

DeepSpeed's engine refuses fp16 on a CPU whose oneDNN lacks native fp16 (this machine's), by
its accelerator probe `is_fp16_supported()`; torch computes fp16 on any CPU, so the probe is
answered True here and only here: everything else (the fp16 module, the loss scaler, the
overflow check across ranks, the skipped step) is DeepSpeed's own code."""

from __future__ import annotations

import os

os.environ["DS_ACCELERATOR"] = "cpu"
OVERFLOW_STEP = 3


def main() -> int:
    from deepspeed.accelerator import get_accelerator

    import finetune_trainer.deepspeed_engine as engine
    from finetune_trainer.__main__ import main as trainer_main

    get_accelerator().is_fp16_supported = lambda: True  # type: ignore[method-assign]
    real = engine.deepspeed_parallel

    def with_overflow(*args, **kwargs):  # type: ignore[no-untyped-def]
        parallel = real(*args, **kwargs)
        backward, calls = parallel.backward, [0]

        def overflowing(loss):  # type: ignore[no-untyped-def]
            calls[0] += 1
            per_step = int(os.environ["FT_TEST_MICRO_BATCHES"])
            if calls[0] == (OVERFLOW_STEP - 1) * per_step + 1:
                loss = loss * float("inf")
            backward(loss)

        parallel.backward = overflowing
        return parallel

    engine.deepspeed_parallel = with_overflow
    return trainer_main()


if __name__ == "__main__":
    from finetune_trainer.distributed import exit_process

    exit_process(main())  # not finalisation: see finetune_trainer.distributed
