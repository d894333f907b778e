"""The training loop. `Trainer.__init__` builds the components; `train()` reads like a table
of contents: load checkpoint -> step -> log -> maybe save, until done or told to stop."""

from __future__ import annotations

import contextlib
import logging
import math
import time

import torch

from finetune_operator.api.elastic_timeouts import collective_timeouts
from finetune_operator.api.jobconfig import JobConfig
from finetune_trainer.checkpointer import build_checkpointer
from finetune_trainer.collective_timeout import TrainingTimeout
from finetune_trainer.config import RuntimeEnv
from finetune_trainer.crash import write_round_id
from finetune_trainer.data import CacheSettings, build_dataset
from finetune_trainer.data.remote import stage_dataset
from finetune_trainer.data.shared import shared_cache_for
from finetune_trainer.deepspeed_engine import select_accelerator
from finetune_trainer.distributed import (
    default_store,
    init_distributed,
    select_device,
    set_training_timeout,
)
from finetune_trainer.errors import UnsupportedConfigError
from finetune_trainer.export import build_exporter
from finetune_trainer.faults import build_faults
from finetune_trainer.finish import (
    STOP_REASON_SIGNAL,
    finish_run,
    unrecovered_failure,
)
from finetune_trainer.loading import load_parallel_model
from finetune_trainer.loss_scale import build_loss_scale
from finetune_trainer.metrics import StepStats, TrainerMetrics
from finetune_trainer.model import weights_dir
from finetune_trainer.optim import build_optimizer, build_scheduler
from finetune_trainer.parallelize import check_precision
from finetune_trainer.sampler import StepSampler
from finetune_trainer.startup import StartupClock
from finetune_trainer.startup_barrier import StartupBarrier, job_wait_limit, round_name
from finetune_trainer.steptrace import build_step_trace
from finetune_trainer.stop_signal import StopSignal
from finetune_trainer.termination_log import clear_final_report, write_final_report
from finetune_trainer.tokenizer import build_tokenizer
from finetune_trainer.torch_floor import check_torch

log = logging.getLogger(__name__)


def gradient_accumulation(global_batch: int, world_size: int, micro_batch_size: int) -> int:
    if global_batch % (world_size * micro_batch_size):
        raise UnsupportedConfigError(
            f"training.globalBatchSize {global_batch} is not divisible by world size "
            f"{world_size} x micro-batch {micro_batch_size}; change globalBatchSize or the node range"
        )
    return global_batch // (world_size * micro_batch_size)


def precision_context(
    precision: str, device: torch.device, *, autocast: bool = True
) -> contextlib.AbstractContextManager[None]:
    """The forward's precision context: torch.autocast for bf16/fp16 where the strategy
    computes in an fp32 model (DDP; `Parallel.autocast`), nothing where it casts parameters
    itself (FSDP2's MixedPrecisionPolicy) or in fp32."""
    check_precision(precision)
    if precision in ("bf16", "fp16") and autocast:
        dtype = torch.bfloat16 if precision == "bf16" else torch.float16
        return torch.autocast(device.type, dtype=dtype)
    return contextlib.nullcontext()


def data_cache(
    env: RuntimeEnv, job: JobConfig, startup_timeout_s: float | None = None
) -> CacheSettings | None:
    """The pod's data cache, backed by the job's shared copy on its checkpoint storage. A pod
    waits for another's build of the blocks (data.build_claim) while it advances, and gives
    up after at most half the startup collective timeout without progress (a builder that
    stopped advancing is more likely stuck than slow): a waiter that gives up builds
    itself, and the builder's ranks wait for it at the start-up barrier (alive, not in a
    collective: startup_barrier.py)."""
    if env.data_cache_dir is None:
        return None
    owner = {"job": job.name, "namespace": job.namespace, "uid": job.uid}
    shared = shared_cache_for(job.spec.checkpoint, job.spec.storage.object_store, owner)
    wait = None if startup_timeout_s is None else startup_timeout_s / 2
    return CacheSettings(env.data_cache_dir, env.data_cache_limit_bytes, shared, wait)


class Trainer:
    def __init__(self, job: JobConfig, env: RuntimeEnv) -> None:
        self.startup = StartupClock()
        self.startup.mark("imports")
        check_torch(torch.__version__)  # before anything that would fail less clearly
        self.job, self.env, spec = job, env, job.spec
        self.stop_signal = StopSignal()
        self.faults = build_faults(env.faults, env.rank)
        self.device = select_device(spec.resources.device, env)
        select_accelerator(self.device)  # before anything imports deepspeed
        timeouts = collective_timeouts(spec, job.plan)
        self.dist = init_distributed(
            self.device, env, timeout_s=timeouts.startup, checkpoint_timeout_s=timeouts.checkpoint
        )
        # Generous while starting and around saves, a few step times once warm.
        self.timeout = TrainingTimeout(job, timeouts, set_training_timeout)
        # Beats while this rank does its own start-up work (data, a hub snapshot): its peers
        # wait for it at the barrier below, not in a collective (startup_barrier.py).
        barrier = StartupBarrier(
            default_store(), self.dist.rank, self.dist.world_size, timeouts.startup,
            round_id=round_name(env.restart_count, agent_store=env.agent_store),
        ).start()  # fmt: skip
        # The round's id next to this rank's error file: the launcher counts the attempt's
        # failure by it, once for every pod of the round (crash.write_round_id).
        round_id = barrier.agree_round_id()
        write_round_id(round_id)
        self.startup.mark("group")
        world, micro_batch_size = self.dist.world_size, job.plan.micro_batch_size
        self.grad_accum = gradient_accumulation(
            spec.training.global_batch_size, world, micro_batch_size
        )
        check_precision(spec.training.precision)  # refuse early
        torch.manual_seed(spec.training.seed)

        tokenizer = build_tokenizer(spec.model, spec.storage.object_store, env.data_cache_dir)
        store = spec.storage.object_store
        staged = stage_dataset(
            spec.dataset, store, env.data_cache_dir, env.data_cache_limit_bytes,
            agree=self.dist.rank0s,
        )  # fmt: skip
        # No collective runs until every rank has its blocks (one pod may wait for another's
        # build of them: data.build_claim; ranks done early wait at the barrier below).
        cache = data_cache(env, job, timeouts.startup)
        self.data = build_dataset(
            spec.dataset, tokenizer, spec.training.sequence_length, cache=cache, staged=staged
        )
        self.faults.after_data()
        self.startup.mark("data", note=self.data.source)
        # A hub model's snapshot (a replacement pod downloads it) before the meeting too.
        weights_dir(spec.model, store, env.data_cache_dir)
        # The first collective after the ranks' own work is the model's loading: meet first,
        # for as long as the others are alive and starting (the wait counts in `model`).
        waited = barrier.arrive(job_wait_limit(job, timeouts.startup, staged))
        if waited > 1.0:
            log.info("start-up: waited %.1f s for the other ranks' data and model files", waited)
        self.parallel = load_parallel_model(
            job,
            tokenizer,
            self.device,
            env.local_world_size,
            # The plan says whether the blocks are compiled (its activation memory assumes
            # it); FT_COMPILE=0 still forces eager, for debugging, at eager's memory.
            compile_model=job.plan.compiled_blocks and env.compile and self.device.type == "cuda",
            data_cache_dir=env.data_cache_dir,
        )
        self.model = self.parallel.model
        self.total_steps = spec.training.max_steps or math.ceil(
            (spec.training.epochs or 1.0) * len(self.data) / spec.training.global_batch_size
        )
        self.optimizer = build_optimizer(self.model, spec.training)
        self.parallel.attach_optimizer(self.optimizer)  # DeepSpeed: the engine is built here
        self.model = self.parallel.model
        self.scheduler = build_scheduler(self.optimizer, spec.training, self.total_steps)
        # fp16: dynamic loss scaling, all ranks skipping the same overflowing steps.
        self.loss_scale = build_loss_scale(
            spec.training.precision, self.device, backend=job.plan.backend
        )
        self.sampler = StepSampler(
            num_samples=len(self.data),
            global_batch=spec.training.global_batch_size,
            micro_batch_size=micro_batch_size,
            rank=self.dist.rank,
            world_size=world,
            seed=spec.training.seed,
        )
        self.metrics = TrainerMetrics(
            job=job.name,
            rank=self.dist.rank,
            device=self.device,
            reforms=env.restart_count,
            total_steps=self.total_steps,
            own_rounds=env.own_rounds,
            round_id=round_id,
        )
        self.state = self.parallel.state_type(
            self.model,
            self.optimizer,
            self.scheduler,
            self.sampler,
            rank=self.dist.rank,
            seed=spec.training.seed,
            loss_scale=self.loss_scale,
        )
        # Who owns the checkpoint and output directories (finetune_trainer.ownership), and
        # (in each COMMITTED marker) the backend whose format a checkpoint is in.
        storage_meta = {
            "job": job.name,
            "namespace": job.namespace,
            "uid": job.uid,
            "strategy": self.parallel.strategy,
            "backend": job.plan.backend,
        }
        self.checkpointer = build_checkpointer(
            spec.checkpoint,
            self.state,
            group=self.dist.checkpoint_group,
            world_size=world,
            metrics=self.metrics,
            meta=storage_meta,
            device=self.device,
            object_store=spec.storage.object_store,
        )
        self.exporter = build_exporter(
            spec.output,
            model=self.parallel.export_module() if self.parallel.export_module else self.model,
            gather=self.parallel.gather_full_state_dict,
            tokenizer=tokenizer,
            method=spec.method,
            rank=self.dist.rank,
            meta=storage_meta,
            object_store=spec.storage.object_store,
        )
        self.step_trace = build_step_trace(env, rank=self.dist.rank)
        self.hard_exit = False
        if self.device.type == "cuda":
            # Memory peaks are the training step's (what the planner predicts), not the
            # model build's transients (an fp32 random init cast to a bf16 base).
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        log.info(
            "world %d, micro-batch %d, grad accumulation %d, %d steps, strategy %s",
            world,
            micro_batch_size,
            self.grad_accum,
            self.total_steps,
            self.parallel.strategy,
        )
        self.startup.mark("model")

    def train(self) -> int:
        """Run to `total_steps` or until stopped; returns the process exit code."""
        if self.env.local_rank == 0:
            clear_final_report()
        self.state.step = self.checkpointer.load()
        self.checkpointer.prepare()
        self.startup.mark("resume")
        # Report the resumed step from the first scrape on: a restarted rank must not look
        # as if the job went back to step 0.
        self.metrics.step.set(self.state.step)
        self.metrics.serve(self.env.metrics_port, self.env.pod_ip)
        stop = False
        loss: float | None = None
        while self.state.step < self.total_steps and not stop:
            self.timeout.before_step()
            stats, stop, time_due = self.train_step()
            self.timeout.step_done(stats.step_seconds)
            loss = stats.loss
            self.metrics.observe_step(stats, self.dist.world_size)
            last = self.state.step == self.total_steps
            self.timeout.relax()  # also for the stop path and the export after the loop
            saved = self.checkpointer.maybe_save(
                self.state.step, force=stop or last, time_due=time_due
            )
            self.timeout.saved(saved)
            self.step_trace.record(stats, checkpoint=saved)
            if "first step" not in self.startup.marks:
                self.startup.mark("first step")
                log.info("%s", self.startup.summary(cpu_seconds=time.process_time()))
        # A resume with no step left never entered the loop: its export at the startup timeout.
        self.timeout.relax()
        end = finish_run(
            self.checkpointer,
            self.stop_signal,
            step=self.state.step,
            stopped=stop,
            grace_seconds=self.env.grace_seconds,
        )
        code, self.hard_exit = end.code, end.hard_exit
        self.metrics.log_summary()
        # Only a completed run exports (collective); a stopped one resumes and exports later,
        # and so does one whose final checkpoint failed (it exits non-zero and is restarted).
        output = None
        if not (stop or code):
            # The final save is committed and no other follows: the staging buffer (the
            # whole checkpoint state, pinned on CUDA) goes before the export gathers the model
            # on rank 0's host, so the two never add up. close() again later is a no-op.
            self.checkpointer.close()
            output = self.exporter.export(self.state.step, loss=loss)
        if self.env.local_rank == 0:  # one report per pod
            write_final_report(
                step=self.state.step,
                loss=loss,
                checkpoint_step=self.checkpointer.last_committed_step,
                checkpoint_failed_step=unrecovered_failure(self.checkpointer),
                rank=self.dist.rank,
                output=str(output) if output else None,
                resumed_from_step=self.checkpointer.resumed_from_step,
                skipped=self.checkpointer.skipped,
                stop_reason=STOP_REASON_SIGNAL if stop and self.stop_signal.requested else None,
            )
        return code

    def train_step(self) -> tuple[StepStats, bool, bool]:
        t0 = time.perf_counter()
        loss, tokens = self._forward_backward(self.sampler.next_step())
        self._device_sync()
        t1 = time.perf_counter()
        stop, loss, tokens, time_due = self._sync_point(loss, tokens)
        t2 = time.perf_counter()
        self.checkpointer.wait_for_staging()  # the optimizer is about to change live tensors
        t3 = time.perf_counter()
        lr = self._optimizer_step()
        t4 = time.perf_counter()
        self.state.step += 1
        # Waiting: blocked at the sync point, and (DDP) in the overlapped gradient all-reduce
        # after this rank's own backward was done. Compute is the rest of forward, backward and
        # the optimizer: this rank's own work, what straggler detection compares.
        reduction_wait = min(self.parallel.reduction_wait(), t1 - t0)
        stats = StepStats(
            step=self.state.step,
            loss=loss,
            lr=lr,
            tokens=int(tokens),
            step_seconds=t4 - t0,
            compute_seconds=(t1 - t0 - reduction_wait) + (t4 - t3),
            wait_seconds=(t2 - t1) + reduction_wait,
            loss_scale=self.loss_scale.value(),
        )
        return stats, stop, time_due

    def _forward_backward(self, micro_batches: list[list[int]]) -> tuple[torch.Tensor, float]:
        """Forward and backward of every micro-batch; returns the loss summed on the device
        (read once, at the step's sync point: no host synchronisation per micro-batch) and the
        tokens counted on the host."""
        self.model.train()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        tokens = 0.0
        precision = self.job.spec.training.precision
        autocast = self.parallel.autocast
        for i, indices in enumerate(micro_batches):
            batch = self.data.batch(indices, self.device)
            with self.parallel.accumulate(i == len(micro_batches) - 1):
                with precision_context(precision, self.device, autocast=autocast):
                    # No KV cache (HF builds one in train mode without checkpointing): it
                    # makes every compiled block guard on its own cache layer, one recompile
                    # per layer, and past dynamo's recompile limit the remaining blocks would
                    # silently run eager, at more memory than the plan assumes.
                    # The output is not kept: its logits would live through backward.
                    loss = self.model(**batch, use_cache=False).loss / len(micro_batches)
                self.parallel.backward(self.loss_scale.scale(loss))
            loss_sum += loss.detach()
            tokens += self.data.count_tokens(indices)
            self.faults.after_micro_batch(self.state.step + 1, len(micro_batches))
            self.metrics.beat()
        return loss_sum, tokens

    def _sync_point(self, loss: torch.Tensor, tokens: float) -> tuple[bool, float, float, bool]:
        """The step's one deliberate rendezvous of all ranks: agree on stopping and on a
        time-based save, and sum loss and tokens. Time blocked here is wait, not compute."""
        stop_s, loss_s, tokens_s, due_s = self.dist.all_reduce_sum(
            [
                float(self.stop_signal.requested),
                loss,
                tokens,
                float(self.checkpointer.time_due()),
            ]
        )
        return stop_s > 0, loss_s / self.dist.world_size, tokens_s, due_s > 0

    def _optimizer_step(self) -> float:
        lr = float(self.optimizer.param_groups[0]["lr"])
        if self.parallel.optimizer_step is not None:
            self.parallel.optimizer_step()  # clips, steps and zeroes itself
            self.scheduler.step()
            return lr
        self.faults.before_optimizer_step(self.state.step + 1, self.model)
        # Clipping compares the true gradient norm: unscale first (a no-op unless fp16).
        self.loss_scale.unscale(self.optimizer)
        max_norm = self.job.spec.training.max_grad_norm
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(
                [p for p in self.model.parameters() if p.grad is not None], max_norm
            )
        if not self.loss_scale.step(self.optimizer):  # skipped on every rank alike
            log.warning(
                "step %d: fp16 gradients overflowed, optimizer step skipped; loss scale now %g",
                self.state.step + 1,
                self.loss_scale.value(),
            )
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=self.parallel.zero_grad_set_to_none)
        return lr

    def _device_sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        self.step_trace.close()
        if not self.hard_exit:
            self.checkpointer.close()
