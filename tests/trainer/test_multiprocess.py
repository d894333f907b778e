"""Real torchrun runs on CPU/gloo with the tiny quickstart model (marked slow)."""

from __future__ import annotations

import json
import re
import signal
import urllib.request
from pathlib import Path

import pytest

from finetune_operator.api.constants import CHECKPOINT_COMMITTED_MARKER
from tests.trainer.conftest import (
    Proc,
    free_port,
    launch_standalone,
    make_job,
    step_lines,
    tail,
    wait_until,
    write_job,
)
from tests.trainer.test_components import METRIC_NAMES

pytestmark = pytest.mark.slow


def committed(root: Path) -> dict[int, dict[str, object]]:
    out = {}
    for marker in root.glob(f"step-*/{CHECKPOINT_COMMITTED_MARKER}"):
        meta = json.loads(marker.read_text())
        out[int(meta["step"])] = meta
    return out


def run(
    tmp_path: Path, procs: list[Proc], name: str, job_path: Path, nproc: int, **env: str
) -> Proc:
    return launch_standalone(
        job_path, cwd=tmp_path, log=tmp_path / f"{name}.log", nproc=nproc, procs=procs, **env
    )


def test_ddp_two_ranks_loss_goes_down_and_metrics_served(tmp_path: Path, procs: list[Proc]) -> None:
    job = write_job(
        tmp_path / "job.json", make_job(training={"maxSteps": 40}, checkpoint={"intervalSteps": 20})
    )
    port, ip = free_port("127.0.0.6"), "127.0.0.6"
    p = launch_standalone(
        job,
        cwd=tmp_path,
        log=tmp_path / "ddp.log",
        pod_ip=ip,
        procs=procs,
        FT_METRICS_BASE_PORT=str(port),
        FT_STEP_DELAY_SECONDS="0.1",
    )

    def scraped() -> str:
        try:
            with urllib.request.urlopen(f"http://{ip}:{port + 1}/metrics", timeout=2) as r:
                return str(r.read().decode())
        except OSError:
            return ""

    wait_until(
        lambda: re.search(r"^finetune_trainer_step\{.*\} ([1-9]\d*)", scraped(), re.M) is not None,
        90,
        "rank 1 metrics with a step > 0",
        p.log,
    )
    text = scraped()
    for name in METRIC_NAMES:
        assert re.search(rf'^{name}{{[^}}]*finetunejob="quickstart"[^}}]*rank="1"', text, re.M), (
            name
        )
    assert p.wait(120) == 0, tail(p.log)
    losses = [s["loss"] for s in step_lines(p.log)]
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < losses[0] - 2.0, losses  # ~5.6 -> ~2.7 on the corpus
    assert set(committed(tmp_path / "checkpoints" / "quickstart")) == {20, 40}


def test_fsdp_two_ranks_checkpoint_loads_at_world_one(tmp_path: Path, procs: list[Proc]) -> None:
    root = tmp_path / "checkpoints" / "quickstart"
    two = write_job(
        tmp_path / "two.json",
        make_job(
            strategy="fsdp-full-shard", training={"maxSteps": 20}, checkpoint={"intervalSteps": 10}
        ),
    )
    # The pod's data cache (finetune_trainer.data.cache): the two local ranks build it once,
    # and it is published to the job's checkpoint directory (finetune_trainer.data.shared).
    cache = str(tmp_path / "data-cache")
    p = run(tmp_path, procs, "fsdp2", two, 2, FT_DATA_CACHE_DIR=cache)
    assert p.wait(120) == 0, tail(p.log)
    built = p.log.read_text()
    assert (built.count("(cache built)"), built.count("(cache hit)")) == (2, 2), tail(p.log)
    assert {s: m["worldSize"] for s, m in committed(root).items()} == {10: 2, 20: 2}
    assert len(list((root / "step-00000020").glob("*.distcp"))) == 2  # one shard file per rank
    loss20 = step_lines(p.log)[-1]["loss"]

    one = write_job(
        tmp_path / "one.json",
        make_job(
            strategy="fsdp-full-shard", training={"maxSteps": 30}, checkpoint={"intervalSteps": 10}
        ),
    )
    # As a replacement pod on another node: an empty cache of its own, the same checkpoints.
    q = run(tmp_path, procs, "fsdp1", one, 1, FT_DATA_CACHE_DIR=str(tmp_path / "data-cache-b"))
    assert q.wait(120) == 0, tail(q.log)
    log = q.log.read_text()
    assert "world 1, micro-batch 2, grad accumulation 4" in log
    assert "resumed from checkpoint step 20" in log
    # The cold start by phase, logged once at the first step (finetune_trainer.startup); the
    # data came from the job's shared copy, untokenized.
    assert re.search(
        r"rank0 INFO .*started in [\d.]+ s \(cpu [\d.]+ s\): imports [\d.]+, group [\d.]+, "
        r"data [\d.]+ \(cache shared hit\), model [\d.]+, resume [\d.]+, first step [\d.]+$",
        log,
        re.M,
    )
    steps = step_lines(q.log)
    assert [s["step"] for s in steps] == list(range(21, 31))
    assert abs(steps[0]["loss"] - loss20) < 0.4, (steps[0]["loss"], loss20)  # not a fresh model
    assert committed(root)[30]["worldSize"] == 1


def test_resume_after_kill_continues_from_last_commit(tmp_path: Path, procs: list[Proc]) -> None:
    root = tmp_path / "checkpoints" / "quickstart"
    job = write_job(
        tmp_path / "job.json", make_job(training={"maxSteps": 30}, checkpoint={"intervalSteps": 5})
    )
    p = run(tmp_path, procs, "first", job, 2, FT_STEP_DELAY_SECONDS="0.15")
    wait_until(lambda: max(committed(root), default=0) >= 10, 90, "a commit at step 10", p.log)
    p.kill(signal.SIGKILL)
    p.wait(30)
    last = max(committed(root))
    junk = root / "step-00009999"
    junk.mkdir()  # an uncommitted leftover: must be ignored and cleaned
    # Newer than every committed step: left at start, deleted by the first purge after the
    # grace (no lagging view here to wait for).
    q = run(tmp_path, procs, "second", job, 2, FT_CHECKPOINT_CLEANUP_GRACE_SECONDS="0")
    assert q.wait(120) == 0, tail(q.log)
    resumed = int(re.findall(r"resumed from checkpoint step (\d+)", q.log.read_text())[0])
    assert resumed >= last >= 10
    assert step_lines(q.log)[0]["step"] == resumed + 1
    assert not junk.exists()
    assert max(committed(root)) == 30 and len(committed(root)) == 3


def test_sigterm_makes_a_final_checkpoint(tmp_path: Path, procs: list[Proc]) -> None:
    root = tmp_path / "checkpoints" / "quickstart"
    job = write_job(
        tmp_path / "job.json",
        make_job(training={"maxSteps": 200}, checkpoint={"intervalSteps": 1000}),
    )
    p = run(tmp_path, procs, "term", job, 2, FT_STEP_DELAY_SECONDS="0.1")
    wait_until(lambda: len(step_lines(p.log)) >= 4, 90, "a few steps", p.log)
    # A graceful pod delete: SIGTERM to the container's first process, the launcher only;
    # torchrun forwards it to both workers.
    p.popen.send_signal(signal.SIGTERM)
    assert p.wait(60) == 143, tail(p.log)  # stopped by its own signal (launch.py)
    text = p.log.read_text()
    assert "Traceback" not in text and "SignalException" not in text, tail(p.log)
    assert "torchrun stopped by SIGTERM" in text, tail(p.log)
    stopped = [int(s) for s in re.findall(r"stopped at step (\d+)", text)]
    assert len(stopped) == 2 and stopped[0] == stopped[1], tail(p.log)
    assert list(committed(root)) == [stopped[0]], tail(p.log)  # not on the 1000-step interval
