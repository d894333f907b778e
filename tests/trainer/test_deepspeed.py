"""DeepSpeed ZeRO-1/2/3 under real torchrun on CPU/gloo with the tiny quickstart model (slow).

One torch DDP run of the job is the reference; each DeepSpeed run trains the same job (fp32,
the same global batches: the sampler does not depend on the world size or the backend), so
its loss curve must match DDP's step for step, within floating-point noise. Each run checks
several properties at once to keep the multi-process time down:

- ZeRO-1 with optimizer offload, 2 ranks: the curve, committed checkpoints (in the whole layout
  of checkpoints written before the chunked one), the export; then resumed from its first
  checkpoint, read in groups of one tensor, each rank reading from storage only the tensors
  of its own partition's parameters, to the same export;
- ZeRO-2, 2 ranks, stopped mid-run by SIGTERM (its final save, chunked); resumed as ZeRO-3 with
  parameter and optimizer offload on 1 rank: resume at another world size (and stage), the
  loss going on as DDP's does, the resume's peak of live tensor bytes one group, not the whole
  checkpoint (tests/trainer/deepspeed_resume_worker.py counts it, and the bytes read);
- ZeRO-3, 2 ranks, built partitioned under zero.Init: the curve (the initial weights are the
  torch path's), saved in the whole layout; resumed from it on ZeRO-3 with hpZ at 2 ranks
  (every rank reading every tensor) to the same weights, its next checkpoints chunked, recording each
  parameter's full shape (compared at a resume); resumed from one of those on ZeRO-2 at 2
  ranks, each reading only the saved chunks overlapping its fragments: the checkpoint about
  once in all, not once per rank;
- fp16 LoRA on ZeRO-2: one overflowing step is skipped and the loss scale lowered, training
  goes on; the user's deepspeedConfig is merged (hysteresis kept, a contradicting key
  overridden); the adapters are exported.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import signal
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

from finetune_operator.api.jobconfig import JobConfig
from finetune_operator.api.spec import MethodSpec
from finetune_trainer.deepspeed_layout import SHAPES_KEY
from tests.trainer.conftest import (
    REPO,
    TRAINER_PROGRAM,
    Proc,
    launch_standalone,
    make_job,
    step_lines,
    tail,
    wait_until,
    write_job,
)
from tests.trainer.test_multiprocess import committed

pytestmark = pytest.mark.slow

STEPS = 8
# fp32 on both sides; ZeRO sums the gradients in another order than DDP's buckets.
LOSS_TOLERANCE = 0.02
FP16_WORKER = REPO / "tests" / "trainer" / "deepspeed_fp16_worker.py"
RESUME_WORKER = REPO / "tests" / "trainer" / "deepspeed_resume_worker.py"
# The resume's group cap for the tiny model (the product's, 1 GiB, holds it whole): below
# its largest tensor, so each group is one tensor and the budget that tensor.
RESUME_CAP = 64 * 2**10
# DeepSpeed's and DCP's small tensors besides the groups (flattened views' metadata, the
# scalars of the plan exchange).
RESUME_SLACK_BYTES = 64 * 2**10


def ds_job(
    strategy: str,
    *,
    offload: str = "none",
    training: dict[str, Any] | None = None,
    checkpoint: dict[str, Any] | None = None,
    deepspeed_config: dict[str, Any] | None = None,
) -> JobConfig:
    job = make_job(strategy=strategy, training={"maxSteps": STEPS, **(training or {})},
                   checkpoint=checkpoint)  # fmt: skip
    spec = job.spec.model_copy(update={"strategy": job.spec.strategy.model_copy(update={
        "backend": "deepspeed", "offload": offload, "deepspeed_config": deepspeed_config})})  # fmt: skip
    plan = job.plan.model_copy(update={"backend": "deepspeed", "offload": offload, "device": "cpu"})
    return job.model_copy(update={"spec": spec, "plan": plan})


def launch(
    tmp: Path, name: str, job: JobConfig, nproc: int,
    program: Sequence[str] = TRAINER_PROGRAM, **env: str,
) -> Proc:  # fmt: skip
    return launch_standalone(
        write_job(tmp / f"{name}.json", job),
        cwd=tmp,
        log=tmp / f"{name}.log",
        nproc=nproc,
        program=program,
        **env,
    )


@pytest.fixture(scope="module")
def ddp_losses(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[float]]:
    tmp = tmp_path_factory.mktemp("ddp")
    p = launch(tmp, "ddp", make_job(training={"maxSteps": STEPS},
                                    checkpoint={"enabled": False}), 2)  # fmt: skip
    try:
        assert p.wait(180) == 0, tail(p.log)
        losses = [s["loss"] for s in step_lines(p.log)]
    finally:
        p.close()
    assert len(losses) == STEPS
    yield losses


def assert_matches(losses: dict[int, float], reference: list[float]) -> None:
    for step, loss in losses.items():
        assert abs(loss - reference[step - 1]) < LOSS_TOLERANCE, (step, loss, reference)


def deepspeed_config_logged(log: Path) -> dict[str, Any]:
    line = re.search(r"DeepSpeed config: (\{.*\})$", log.read_text(), re.M)
    assert line, tail(log)
    return dict(json.loads(line.group(1)))


def test_zero1_with_optimizer_offload_matches_ddp(
    tmp_path: Path, procs: list[Proc], ddp_losses: list[float]
) -> None:
    job = ds_job("zero1", offload="cpu", checkpoint={"intervalSteps": 4})
    # Saved in the whole layout (one full tensor per key) that checkpoints written before the
    # chunked layout have: they must still resume.
    p = launch(tmp_path, "zero1", job, 2, [str(RESUME_WORKER)], FT_TEST_SAVE_WHOLE="1")
    procs.append(p)
    assert p.wait(180) == 0, tail(p.log)
    config = deepspeed_config_logged(p.log)
    assert config["zero_optimization"]["stage"] == 1
    assert config["zero_optimization"]["offload_optimizer"] == {"device": "cpu",
                                                                 "pin_memory": False}  # fmt: skip
    assert_matches({s["step"]: s["loss"] for s in step_lines(p.log)}, ddp_losses)
    root = tmp_path / "checkpoints" / "quickstart"
    assert {s: m["worldSize"] for s, m in committed(root).items()} == {4: 2, 8: 2}
    exported = tmp_path / "output" / "quickstart" / "model.safetensors"
    first = load_file(exported)

    # Resumed from step 4 (step 8 lost), in groups of one tensor: each rank reads only the
    # tensors of the parameters in its own ZeRO-1 partition (masters included: the
    # low-precision weights are all-gathered by DeepSpeed), and training goes on to the same
    # weights (a state not restored would change them).
    shutil.rmtree(root / "step-00000008")
    again = launch(tmp_path, "zero1-resume", job, 2, [str(RESUME_WORKER)],
                   FT_TEST_RESUME_CAP=str(RESUME_CAP))  # fmt: skip
    procs.append(again)
    assert again.wait(180) == 0, tail(again.log)
    assert "resumed from checkpoint step 4" in again.log.read_text()
    assert_matches({s["step"]: s["loss"] for s in step_lines(again.log)}, ddp_losses)
    second = load_file(exported)
    assert first.keys() == second.keys()
    for name, t in first.items():
        assert torch.allclose(t, second[name], atol=1e-5), name
    rows = resume_rows(again.log)
    assert len(rows) == 2 and not any(r["chunked"] for r in rows), rows
    full = rows[0]["full_bytes"]
    # Every tensor read by its partition's rank; a parameter across the partition boundary
    # (master and two states) by both.
    assert full <= sum(r["read_bytes"] for r in rows) <= full + 2 * 3 * rows[0]["largest"], rows
    stored = checkpoint_bytes(root / "step-00000004")
    for row in rows:
        assert row["storage_bytes"] < stored, (row, stored)  # each skipped the other's part
        assert_resume_bounded(row)
    # Together less than before, when each rank also read every master weight it did not own.
    assert sum(r["storage_bytes"] for r in rows) < stored + full / 3, (rows, stored)


def test_zero2_sigterm_resumes_as_zero3_offload_at_world_one(
    tmp_path: Path, procs: list[Proc], ddp_losses: list[float]
) -> None:
    root = tmp_path / "checkpoints" / "quickstart"
    first = launch(tmp_path, "zero2", ds_job("zero2", checkpoint={"intervalSteps": 3}), 2,
                   FT_STEP_DELAY_SECONDS="0.4")  # fmt: skip
    procs.append(first)
    wait_until(lambda: 3 in committed(root) and len(step_lines(first.log)) >= 4, 150,
               "zero2 committed step 3 and went on", first.log)  # fmt: skip
    first.kill(signal.SIGTERM)  # a preemption: finish the step, final save, exit
    assert first.wait(90) != 0, tail(first.log)
    before = {s["step"]: s["loss"] for s in step_lines(first.log)}
    assert_matches(before, ddp_losses)
    stopped = max(before)
    assert stopped < STEPS, before  # stopped mid-run, not finished
    assert stopped in committed(root), tail(first.log)  # the final save on SIGTERM

    second = launch(tmp_path, "zero3", ds_job("zero3", offload="cpu",
                                               checkpoint={"intervalSteps": 3}), 1,
                    [str(RESUME_WORKER)], FT_TEST_RESUME_CAP=str(RESUME_CAP))  # fmt: skip
    procs.append(second)
    assert second.wait(240) == 0, tail(second.log)
    log = second.log.read_text()
    resumed = int(re.findall(r"resumed from checkpoint step (\d+)", log)[0])
    assert resumed == stopped
    (row,) = resume_rows(second.log)
    assert row["groups"] > 1 and row["read_bytes"] == row["full_bytes"]  # world 1: all its own
    # Saved in chunks at 2 ranks, read whole at 1: every chunk once.
    assert row["chunked"], row
    assert row["storage_bytes"] <= checkpoint_bytes(root / f"step-{stopped:08d}"), row
    assert_resume_bounded(row)
    assert "world 1, micro-batch 2, grad accumulation 4" in log
    config = deepspeed_config_logged(second.log)["zero_optimization"]
    assert config["stage"] == 3 and config["offload_param"]["device"] == "cpu"
    after = {s["step"]: s["loss"] for s in step_lines(second.log)}
    assert sorted(after) == list(range(resumed + 1, STEPS + 1))
    assert_matches(after, ddp_losses)  # the same model and optimizer state went on
    assert committed(root)[STEPS]["worldSize"] == 1


def assert_shapes_recorded(path: Path, marker: dict[str, Any]) -> None:
    """The COMMITTED marker's record (deepspeed_layout.SHAPES_KEY) names every chunked
    parameter, each with a shape of its saved element count; the matrices 2-D."""
    metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    counts = {k.removeprefix("model.chunked."): math.prod(m.size)
              for k, m in metadata.items() if k.startswith("model.chunked.")}  # fmt: skip
    recorded = marker[SHAPES_KEY]
    assert isinstance(recorded, dict) and recorded.keys() == counts.keys(), marker
    assert all(math.prod(recorded[n]) == c for n, c in counts.items()), recorded
    assert any(len(shape) == 2 for shape in recorded.values()), recorded


def resume_rows(log: Path) -> list[dict[str, Any]]:
    # The ranks' lines may interleave in the shared log: each row is flat JSON.
    rows = [json.loads(x) for x in re.findall(r"resume-peak (\{[^{}]*\})", log.read_text())]
    assert rows, tail(log)
    return sorted(rows, key=lambda r: r["rank"])


def assert_resume_bounded(row: dict[str, Any]) -> None:
    """The grouped restore's peak of live tensor bytes: one group (the budget) plus what the
    engine and DCP hold around one tensor (DCP's read of the item, the gathered ZeRO-3
    parameter), below the full templates every rank held before (the checkpoint's every
    tensor: `full_bytes`, on its own)."""
    assert row["budget"] == max(RESUME_CAP, row["largest"]), row
    assert row["live_peak"] <= row["budget"] + 3 * row["largest"] + RESUME_SLACK_BYTES, row
    assert row["live_peak"] < row["full_bytes"], row


def test_fp16_overflow_step_is_skipped_and_training_recovers(
    tmp_path: Path, procs: list[Proc]
) -> None:
    user = {"fp16": {"hysteresis": 1, "initial_scale_power": 10}, "gradient_accumulation_steps": 9}
    job = ds_job("zero2", training={"precision": "fp16", "maxSteps": 6},
                 checkpoint={"enabled": False}, deepspeed_config=user)  # fmt: skip
    # LoRA, to run peft's frozen base and fp32 adapters through DeepSpeed too.
    lora = MethodSpec.model_validate({"type": "lora", "lora": {"rank": 4, "alpha": 8}})
    job = job.model_copy(update={"spec": job.spec.model_copy(update={"method": lora})})
    micro = job.spec.training.global_batch_size // job.plan.micro_batch_size  # one rank
    p = launch(tmp_path, "fp16", job, 1, [str(FP16_WORKER)], FT_TEST_MICRO_BATCHES=str(micro))
    procs.append(p)
    assert p.wait(180) == 0, tail(p.log)
    log = p.log.read_text()
    assert "the plan overrides these keys of yours: gradient_accumulation_steps" in log
    config = deepspeed_config_logged(p.log)
    assert config["fp16"]["enabled"] is True and config["fp16"]["hysteresis"] == 1
    # 2^10, halved once by the overflow (hysteresis 1: at the first one).
    assert "optimizer step skipped (1 skipped so far), loss scale now 512" in log, tail(p.log)
    losses = {s["step"]: s["loss"] for s in step_lines(p.log)}
    assert sorted(losses) == list(range(1, 7))
    assert log.count("optimizer step skipped") == 1  # only the poisoned step
    # The forward losses stay finite (only the backward was poisoned): no inf/nan reached the
    # weights, and training goes on learning after the skipped step.
    assert all(math.isfinite(x) for x in losses.values()), losses
    assert losses[6] < losses[1], losses
    # Only the adapters are exported for LoRA, gathered out of ZeRO's partitions.
    assert (tmp_path / "output" / "quickstart" / "adapter_model.safetensors").is_file()


def test_zero3_two_ranks_built_partitioned_matches_ddp(
    tmp_path: Path, procs: list[Proc], ddp_losses: list[float]
) -> None:
    """ZeRO-3 at 2 ranks builds under zero.Init (deepspeed_loading) from the torch path's
    initial weights: the same loss curve as DDP's. The optimizer groups the matrices by their
    real shape (a grouping by the empty partition placeholders left an empty group, which
    broke the LR scheduler at the first step). It saves in the whole layout of checkpoints
    written before the chunked one, as the code before it did under ZeRO-3."""
    job = ds_job("zero3", checkpoint={"intervalSteps": 4})
    p = launch(tmp_path, "zero3-2", job, 2, [str(RESUME_WORKER)], FT_TEST_SAVE_WHOLE="1")
    procs.append(p)
    assert p.wait(180) == 0, tail(p.log)
    assert deepspeed_config_logged(p.log)["zero_optimization"]["stage"] == 3
    # The real parameter count, not the partitions' empty placeholders.
    counts = re.findall(r"model tiny-llama: (\d+) parameters", p.log.read_text())
    assert counts and all(int(c) > 100_000 for c in counts), counts
    losses = {s["step"]: s["loss"] for s in step_lines(p.log)}
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert_matches(losses, ddp_losses)
    exported = tmp_path / "output" / "quickstart" / "model.safetensors"
    first = load_file(exported)

    # Resumed from the whole-layout step 4 (step 8 lost) on ZeRO-3 at 2 ranks: each rank reads
    # every tensor whole (DCP reads a saved item whole) and keeps its partition; training goes
    # on to the same weights, and the next saves (every 2 steps) are chunked. With hpZ (a
    # group of 2: here the world): its secondary partitions, made by zero.Init from the
    # initial weights, are dropped after the load (deepspeed_fragments.refresh_low_precision);
    # kept, the forward used them (step 5's loss 5.25 against DDP's 4.92, tried by hand).
    root = tmp_path / "checkpoints" / "quickstart"
    shutil.rmtree(root / "step-00000008")
    job = ds_job("zero3", checkpoint={"intervalSteps": 2},
                 deepspeed_config={"zero_optimization": {"zero_hpz_partition_size": 2}})  # fmt: skip
    again = launch(tmp_path, "zero3-2-resume", job, 2, [str(RESUME_WORKER)],
                   FT_TEST_RESUME_CAP=str(RESUME_CAP))  # fmt: skip
    procs.append(again)
    assert again.wait(180) == 0, tail(again.log)
    assert "resumed from checkpoint step 4" in again.log.read_text()
    assert deepspeed_config_logged(again.log)["zero_optimization"]["zero_hpz_partition_size"] == 2
    after = {s["step"]: s["loss"] for s in step_lines(again.log)}
    assert sorted(after) == list(range(5, STEPS + 1))
    assert_matches(after, ddp_losses)
    assert_same_weights(first, load_file(exported))
    rows = resume_rows(again.log)
    assert len(rows) == 2 and not any(r["chunked"] for r in rows), rows
    stored = checkpoint_bytes(root / "step-00000004")
    for row in rows:
        assert row["read_bytes"] == row["full_bytes"], row  # every tensor, whole
        assert row["full_bytes"] <= row["storage_bytes"] <= stored, (row, stored)
        assert_resume_bounded(row)
    # The marker records each parameter's full shape (ZeRO-3's, not the empty placeholder's),
    # which the flattened tensors' metadata lacks: the resume below compares it (refused if
    # it differed) and loads.
    assert committed(root).keys() == {4, 6, 8}
    assert_shapes_recorded(root / "step-00000006", committed(root)[6])

    # Resumed from the chunked step 6 (step 8 lost) on ZeRO-2 at 2 ranks: each rank's
    # fragment of each parameter is an arbitrary range of the flattened tensor, read through
    # the saved chunks that overlap it only: together the checkpoint about once (a chunk
    # across the partition boundary read by both), not once per rank.
    shutil.rmtree(root / "step-00000008")
    zero2 = launch(tmp_path, "zero2-2-resume", ds_job("zero2", checkpoint={"intervalSteps": 2}),
                   2, [str(RESUME_WORKER)], FT_TEST_RESUME_CAP=str(RESUME_CAP))  # fmt: skip
    procs.append(zero2)
    assert zero2.wait(180) == 0, tail(zero2.log)
    assert "resumed from checkpoint step 6" in zero2.log.read_text()
    after = {s["step"]: s["loss"] for s in step_lines(zero2.log)}
    assert sorted(after) == [7, 8]
    assert_matches(after, ddp_losses)
    assert_same_weights(first, load_file(exported))
    rows = resume_rows(zero2.log)
    assert len(rows) == 2 and all(r["chunked"] for r in rows), rows
    full = rows[0]["full_bytes"]
    # The templates are the fragments: the two ranks' partitions, each tensor once (the
    # whole tensors across the partition boundary were read by both ranks before).
    assert sum(r["read_bytes"] for r in rows) == full, rows
    stored = checkpoint_bytes(root / "step-00000006")
    for row in rows:
        assert row["storage_bytes"] < 0.75 * stored, (row, stored)
        assert_resume_bounded(row)
    # Each tensor's chunks once, but for those across the boundary (master and two states of
    # one parameter, each read whole by both ranks).
    assert sum(r["storage_bytes"] for r in rows) <= stored + 3 * rows[0]["largest"], rows


def assert_same_weights(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> None:
    """Exports of the same job, one interrupted and resumed: a state not restored would
    change the weights (fp32; ZeRO-2 and ZeRO-3 sum the gradients in other orders)."""
    assert first.keys() == second.keys()
    for name, t in first.items():
        assert torch.allclose(t, second[name], atol=1e-5), name


def checkpoint_bytes(step_dir: Path) -> int:
    """What a checkpoint step holds in storage: its DCP data files (every saved item)."""
    return sum(f.stat().st_size for f in step_dir.glob("*.distcp"))
