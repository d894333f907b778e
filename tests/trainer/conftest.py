"""Helpers for trainer tests: job configs from the quickstart example, and torchrun launches."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

from finetune_operator.api.jobconfig import JobConfig
from finetune_operator.api.plan import MemoryBreakdown, Plan
from finetune_operator.api.spec import FineTuneJobSpec
from tests.conftest import json_lines
from tests.conftest import wait_until as shared_wait_until

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "examples" / "quickstart.yaml"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
# What a worker pod runs (resources/worker.py): torchrun behind the trainer's launcher.
LAUNCHER = [sys.executable, "-m", "finetune_trainer.launch"]


def quickstart_spec() -> dict[str, Any]:
    return yaml.safe_load(QUICKSTART.read_text())["spec"]


def make_job(
    *,
    strategy: str = "ddp",
    micro_batch_size: int = 2,
    training: dict[str, Any] | None = None,
    checkpoint: dict[str, Any] | None = None,
    name: str = "quickstart",
) -> JobConfig:
    raw = quickstart_spec()
    raw["strategy"] = {"type": strategy}
    raw["training"].update(training or {})
    raw["checkpoint"].update(checkpoint or {})
    spec = FineTuneJobSpec.model_validate(raw)
    zero = MemoryBreakdown(
        parameters=0,
        gradients=0,
        optimizer=0,
        activations=0,
        buffers=0,
        peak=0,
        reserved=0,
        total=0,
    )
    plan = Plan(
        fits=True,
        world_size=2,
        nodes=2,
        gpus_per_node=1,
        strategy=strategy,
        micro_batch_size=micro_batch_size,
        gradient_accumulation_steps=2,
        activation_checkpointing=False,
        gpu_memory_bytes=2**31,
        headroom=0.5,
        estimated_step_seconds=0.1,
        reason="test",
        memory=zero,
    )
    return JobConfig(name=name, namespace="default", uid="test-uid", spec=spec, plan=plan)


def write_job(path: Path, job: JobConfig) -> Path:
    path.write_text(json.dumps(job.to_json_dict()))
    return path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def one_rank_env() -> dict[str, str]:
    """The environment torchrun gives the only rank of a one-process job (a free port), for a
    trainer started in a subprocess without torchrun."""
    return {
        "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
        "FT_METRICS_BASE_PORT": "0", "OMP_NUM_THREADS": "1",
    }  # fmt: skip


@pytest.fixture(scope="module")
def world_one() -> Iterator[None]:
    """A one-rank gloo process group for a module's in-process tests (torch imported here:
    this conftest serves tests that never import it)."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ckpt_group(world_one: None) -> Iterator[ProcessGroup]:
    """The one-rank world plus a gloo group of the checkpointer's own (async saves need one)."""
    import torch.distributed as dist

    yield dist.new_group(backend="gloo")


def step_lines(log: Path) -> list[dict[str, Any]]:
    """The rank-0 JSON step lines of a torchrun log."""
    return [r for r in json_lines(log.read_text(errors="replace")) if "step" in r]


class Proc:
    """A torchrun (or store) process in its own session, like a pod's process tree."""

    def __init__(self, args: list[str], *, cwd: Path, log: Path, env: dict[str, str]) -> None:
        self.log = log
        self._fh = log.open("w")
        self.popen = subprocess.Popen(
            args,
            cwd=cwd,
            stdout=self._fh,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            start_new_session=True,
        )

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group (agent and its workers): a pod going away."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, sig)

    def wait(self, timeout: float) -> int:
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.popen.wait(10)
            raise AssertionError(f"timed out; log tail:\n{tail(self.log)}") from None
        finally:
            self._fh.flush()

    def close(self) -> None:
        if self.popen.poll() is None:
            self.kill()
            self.popen.wait(10)
        self._fh.close()


def tail(log: Path, n: int = 60) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:])


def wait_until(
    cond: Callable[[], bool], timeout: float, what: str, log: Path | None = None
) -> None:
    shared_wait_until(cond, what, timeout, detail=(lambda: tail(log)) if log else None)


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for p in started:
        p.close()


def trainer_env(pod_ip: str, **extra: str) -> dict[str, str]:
    return {
        "POD_IP": pod_ip,
        "FT_METRICS_BASE_PORT": "0",
        "OMP_NUM_THREADS": "1",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
        # As the trainer image runs it (trainer_image/Dockerfile): every print is written through.
        "PYTHONUNBUFFERED": "1",
        **extra,
    }


# What the launcher runs on each rank: the trainer's module, as the worker pod does.
TRAINER_PROGRAM = ("-m", "finetune_trainer")


def standalone_args(
    nproc: int,
    config: Path,
    port: int,
    program: Sequence[str] = TRAINER_PROGRAM,
    max_restarts: int = 0,
) -> list[str]:
    return [
        *LAUNCHER,
        "--nnodes=1",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=standalone",
        f"--max-restarts={max_restarts}",
        *program,
        "--config",
        str(config),
    ]


def launch_standalone(
    config: Path,
    *,
    cwd: Path,
    log: Path,
    nproc: int = 2,
    program: Sequence[str] = TRAINER_PROGRAM,
    pod_ip: str = "127.0.0.1",
    procs: list[Proc] | None = None,
    max_restarts: int = 0,
    **env: str,
) -> Proc:
    """One node of `nproc` ranks behind the trainer's launcher, on a free rendezvous port:
    the trainer (or `program`, a worker script replacing the trainer's `-m finetune_trainer`)
    on `config`, with the pod's environment plus `env`. Added to `procs` (the fixture that
    kills what is left at teardown) when given."""
    p = Proc(standalone_args(nproc, config, free_port(), program, max_restarts), cwd=cwd, log=log,
             env=trainer_env(pod_ip, **env))  # fmt: skip
    if procs is not None:
        procs.append(p)
    return p


def start_rendezvous_store(cwd: Path, procs: list[Proc]) -> int:
    """The standalone rendezvous store (what the operator's rendezvous pod runs) on a free
    port of 127.0.0.1, logging to `cwd`/store.log, added to `procs`; returns once it is READY,
    with its port."""
    port = free_port()
    store = Proc([sys.executable, "-m", "finetune_trainer.rendezvous", "--port", str(port),
                  "--host", "127.0.0.1"], cwd=cwd, log=cwd / "store.log", env={})  # fmt: skip
    procs.append(store)
    wait_until(lambda: "READY" in store.log.read_text(), 30, "store", store.log)
    return port


# Rendezvous timing knobs on top of the operator's `is_host=false`: a dead node's keep-alive
# expires after 2 s x 3 and a round closes 5 s after min nodes joined (defaults: 5 x 3 and
# 30 s), so a re-form takes ~10 s instead of ~45 s.
FAST_RDZV_CONF = "is_host=false,last_call_timeout=5,keep_alive_interval=2,keep_alive_max_attempt=3"


def elastic_args(
    *,
    config: Path,
    endpoint: str,
    pod_ip: str,
    min_nodes: int,
    max_nodes: int,
    restarts: int,
    rdzv_conf: str = FAST_RDZV_CONF,
) -> list[str]:
    """The operator's worker command, plus `--local-addr` for the pod address."""
    return [
        *LAUNCHER,
        f"--nnodes={min_nodes}:{max_nodes}",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        "--rdzv-id=test-uid",
        f"--rdzv-conf={rdzv_conf}",
        f"--max-restarts={restarts}",
        f"--local-addr={pod_ip}",
        "-m",
        "finetune_trainer",
        "--config",
        str(config),
    ]
