"""DeepSpeed ZeRO-1/2/3 behind the loop's `Parallel` contract.

The loop stays the same: forward and backward of each micro-batch, the sync point, then the
optimizer step. The hooks map it onto DeepSpeed's engine:

- `attach_optimizer(optimizer)`: the trainer's torch AdamW/SGD (built from spec.training) goes
  to `deepspeed.initialize` with the config generated from the plan
  (finetune_operator.api.deepspeed_config); the engine becomes `Parallel.model`. The LR schedule
  stays the trainer's, on the same torch optimizer (ZeRO shares its param_groups).
- `accumulate(last)`: tells the engine explicitly whether this micro-batch is the accumulation
  boundary (the loop owns the micro-batch count, which an elastic re-form changes), and lets
  the engine count every non-boundary micro-batch (`engine.step()` does not update there).
- `backward(loss)`: `engine.backward`, which applies fp16 loss scaling and ZeRO's gradient
  reduction hooks; the loop already divides the loss by the micro-batch count.
- `optimizer_step()`: `engine.step()` at the boundary: clipping (`gradient_clipping`), the
  optimizer, fp16 overflow check (a step with inf/nan gradients is skipped and the loss scale
  lowered: logged), zero_grad.
- `reduction_wait()`: the boundary backward's epilogue, where ZeRO blocks on the last gradient
  reductions (stage 1: the whole reduce; 2/3: the last buckets) until every peer has sent its
  gradients: waiting, not this rank's compute (the straggler signal). Collectives inside
  backward's hooks (ZeRO-2/3 buckets, ZeRO-3 gathers) and the post-step all-gather of
  ZeRO-1/2 still count as compute: a slow peer inflates every rank's compute a little there.

Loading: ZeRO-3 models arrive partitioned (built under `deepspeed.zero.Init` and filled one
module at a time: deepspeed_loading.py); ZeRO-1/2 keep a full replica by definition and arrive
materialised whole, already in the engine's parameter dtype (`param_dtype`), so no rank ever
holds the replica in fp32.

Not here: DeepSpeed's own checkpoints (deepspeed_checkpoint.py writes the trainer's committed
DCP checkpoints instead), DeepSpeedCPUAdam (it needs a compiled op; offload runs torch's AdamW
on the host).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from finetune_operator.api.deepspeed_config import deepspeed_config, zero_stage
from finetune_operator.api.jobconfig import JobConfig
from finetune_trainer.deepspeed_checkpoint import DeepSpeedTrainState, gather_module_state_dict
from finetune_trainer.errors import UnsupportedConfigError
from finetune_trainer.parallelize import Parallel

log = logging.getLogger(__name__)

ACCELERATOR_ENV = "DS_ACCELERATOR"


def select_accelerator(device: torch.device) -> None:
    """DeepSpeed picks its accelerator once, at first use, from DS_ACCELERATOR or by probing
    (CUDA when a GPU is visible). A CPU plan must run on the CPU accelerator (gloo) whatever
    is installed; a CUDA one keeps the environment's choice. Call before deepspeed is used."""
    if device.type == "cpu":
        os.environ[ACCELERATOR_ENV] = "cpu"


@dataclass
class _EngineBox:
    engine: Any = None
    epilogue_seconds: float = 0.0


def check_supported(job: JobConfig) -> None:
    spec, plan = job.spec, job.plan
    if plan.offload == "nvme":
        raise UnsupportedConfigError("strategy.offload nvme is not implemented; use cpu")
    if spec.training.optimizer not in ("adamw", "sgd"):
        raise UnsupportedConfigError(
            f"training.optimizer {spec.training.optimizer} is not implemented with DeepSpeed; "
            "use adamw or sgd"
        )
    if spec.method.type == "qlora":
        raise UnsupportedConfigError("method.type qlora is not implemented with DeepSpeed")
    if spec.training.precision == "fp16":
        from deepspeed.accelerator import get_accelerator

        # DeepSpeed's own probe (its engine refuses the same): the CPU accelerator has fp16
        # only on CPUs with native fp16 in oneDNN.
        if not get_accelerator().is_fp16_supported():
            raise UnsupportedConfigError(
                "training.precision fp16 is not supported by DeepSpeed on this device; use bf16"
            )


def deepspeed_parallel(model: nn.Module, job: JobConfig, device: torch.device) -> Parallel:
    """A `Parallel` whose engine is created by `attach_optimizer` (DeepSpeed needs the
    optimizer at initialize). `model` is materialised: whole on every rank (ZeRO-1/2), or
    already partitioned by zero.Init (ZeRO-3: finetune_trainer.deepspeed_loading)."""
    check_supported(job)
    stage = zero_stage(job.plan.strategy)
    box = _EngineBox()
    parallel = Parallel(
        model=model,
        strategy=job.plan.strategy,
        autocast=False,  # the engine holds bf16/fp16 parameters and fp32 masters itself
        zero_grad_set_to_none=True,
    )

    def engine() -> Any:
        if box.engine is None:
            raise RuntimeError("DeepSpeed engine used before attach_optimizer")
        return box.engine

    def attach_optimizer(optimizer: torch.optim.Optimizer) -> None:
        box.engine = initialize(model, optimizer, job)
        parallel.model = box.engine
        _time_epilogue(box)

    @contextlib.contextmanager
    def accumulate(last: bool) -> Iterator[None]:
        eng = engine()
        eng.set_gradient_accumulation_boundary(last)
        if last:
            box.epilogue_seconds = 0.0
        yield
        if not last:
            eng.step()  # counts the micro-batch; no update off the boundary

    def backward(loss: torch.Tensor) -> None:
        engine().backward(loss, scale_wrt_gas=False)

    def optimizer_step() -> None:
        eng = engine()
        eng.step()
        if not eng.was_step_applied():
            scaler = getattr(eng.optimizer, "loss_scaler", None)
            log.warning(
                "fp16 gradient overflow: optimizer step skipped (%d skipped so far), loss "
                "scale now %s",
                eng.skipped_steps,
                getattr(scaler, "cur_scale", "?"),
            )

    parallel.attach_optimizer = attach_optimizer
    parallel.accumulate = accumulate
    parallel.backward = backward
    parallel.optimizer_step = optimizer_step
    parallel.reduction_wait = lambda: box.epilogue_seconds
    parallel.state_type = DeepSpeedTrainState
    parallel.export_module = lambda: engine().module
    parallel.gather_full_state_dict = lambda: gather_module_state_dict(engine().module, stage)
    return parallel


def import_deepspeed() -> Any:
    """deepspeed, with its shared-memory comm op switched off (below): call before DeepSpeed's
    comm starts (zero.Init or initialize)."""
    import deepspeed
    import deepspeed.ops

    # DeepSpeed's torch comm backend JIT-compiles a shared-memory all-reduce op (C++, ninja)
    # when it starts on the CPU accelerator, for inference's all-reduce only: training never
    # calls it. The build needs a compiler in the image, takes a minute per pod start (its
    # cache is under $HOME, which a pod does not keep), and hung pods on the local cluster.
    # Marked incompatible, DeepSpeed skips it (deepspeed.comm.torch.build_shm_op).
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


def job_deepspeed_config(job: JobConfig) -> tuple[dict[str, Any], list[str]]:
    """The DeepSpeed config of `job` at the world size it runs at now, and the user's keys
    the plan overrode."""
    world = dist.get_world_size()
    micro = job.plan.micro_batch_size
    grad_accum = job.spec.training.global_batch_size // (world * micro)
    return deepspeed_config(job.spec, job.plan, world_size=world, grad_accum=grad_accum)


def param_dtype(config: dict[str, Any]) -> torch.dtype:
    """The dtype the engine keeps module parameters in: the config's half precision, else
    fp32 (what `deepspeed.initialize` casts a materialised model's parameters to, and what
    zero.Init partitions are created in)."""
    if config.get("bf16", {}).get("enabled"):
        return torch.bfloat16
    if config.get("fp16", {}).get("enabled"):
        return torch.float16
    return torch.float32


def cast_whole_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Give every floating parameter that is not a ZeRO-3 partition `dtype`, one parameter at
    a time, in place (`p.data`, so ties and optimizer references hold), as the engine's own
    mixed-precision cast does; buffers keep theirs (the engine keeps rotary `inv_freq` fp32).
    On meta parameters it costs nothing."""
    for p in model.parameters():
        if not hasattr(p, "ds_id") and p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


def initialize(model: nn.Module, optimizer: torch.optim.Optimizer, job: JobConfig) -> Any:
    deepspeed = import_deepspeed()
    config, overridden = job_deepspeed_config(job)
    rank = dist.get_rank()
    if overridden and rank == 0:
        log.warning(
            "strategy.deepspeedConfig: the plan overrides these keys of yours: %s",
            ", ".join(overridden),
        )
    if rank == 0:
        log.info("DeepSpeed config: %s", json.dumps(config, sort_keys=True))
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=config, dist_init_required=False
    )
    return engine


def _time_epilogue(box: _EngineBox) -> None:
    """Time the engine's backward epilogue at the boundary (see the module docstring). An
    instance attribute over the bound method: the engine calls it as `self._backward_epilogue()`."""
    eng = box.engine
    inner = eng._backward_epilogue

    def timed() -> None:
        if not eng.is_gradient_accumulation_boundary():
            inner()
            return
        # Host time: the epilogue blocks on the reductions (gloo), or on CUDA ends by
        # synchronising ZeRO's reduction stream.
        t = time.perf_counter()
        inner()
        box.epilogue_seconds += time.perf_counter() - t

    eng._backward_epilogue = timed
