"""Two `ftjob run --local` at once on one host (two local clusters: disjoint pod addresses,
both rendezvous stores on port 29400), then one killed with SIGKILL and the other stopped with
Ctrl-C: no process of either cluster is left, and Ctrl-C exits 130 without a traceback."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import EXAMPLES, REPO, wait_until
from tests.e2e.conftest import step_records
from tests.e2e.processes import cluster_processes

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def _manifest(tmp_path: Path, name: str) -> Path:
    doc: dict[str, Any] = yaml.safe_load((EXAMPLES / "quickstart.yaml").read_text())
    doc["metadata"]["name"] = name
    doc["spec"]["training"]["maxSteps"] = 5000  # still training when it is stopped
    doc["spec"]["checkpoint"].update(uri=f"checkpoints/{name}", intervalSteps=1000)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _start(tmp_path: Path, name: str) -> tuple[subprocess.Popen[str], Path]:
    data = tmp_path / name / "cluster"
    proc = subprocess.Popen(
        [sys.executable, "-m", "finetune_operator.cli", "run", "--local",
         str(_manifest(tmp_path, name)), "--data-dir", str(data), "--timeout", "600"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    return proc, data


def _training(data: Path) -> bool:
    logs = list((data / "pods" / "default").glob("*-worker-*/trainer.log"))
    return any(len(step_records(log)) >= 2 for log in logs)


def _pod_ips(data: Path) -> set[str]:
    ips = set()
    for hosts in (data / "pods" / "default").glob("*/etc-hosts"):
        for line in hosts.read_text().splitlines():
            if line and not line.startswith("#"):
                ips.add(line.split()[0])
    return ips - {"127.0.0.1", "::1"}


def test_two_local_clusters_then_kill9_and_ctrl_c_leave_no_process(tmp_path: Path) -> None:
    killed, killed_data = _start(tmp_path, "ft-a")
    interrupted, interrupted_data = _start(tmp_path, "ft-b")
    procs = [killed, interrupted]
    try:
        started = time.monotonic()
        for data in (killed_data, interrupted_data):
            wait_until(lambda d=data: _training(d), f"training under {data}", 300, 1.0)
        print(f"\nboth local clusters training after {time.monotonic() - started:.1f} s")
        ips_a, ips_b = _pod_ips(killed_data), _pod_ips(interrupted_data)
        assert ips_a and ips_b and not ips_a & ips_b, (ips_a, ips_b)
        assert cluster_processes(killed_data) and cluster_processes(interrupted_data)

        t0 = time.monotonic()
        killed.send_signal(signal.SIGKILL)
        killed.wait(30)
        wait_until(
            lambda: not cluster_processes(killed_data),
            "no process of the killed run",
            60,
            0.5,
            detail=lambda: str(cluster_processes(killed_data)),
        )
        print(f"kill -9 of ftjob run: all pod processes gone in {time.monotonic() - t0:.1f} s")
        assert _training(interrupted_data) and interrupted.poll() is None  # the other goes on

        t0 = time.monotonic()
        interrupted.send_signal(signal.SIGINT)
        _, err = interrupted.communicate(timeout=120)
        assert interrupted.returncode == 130, err[-3000:]
        assert "Traceback" not in err, err[-3000:]
        assert "SIGINT" in err
        assert not cluster_processes(interrupted_data), cluster_processes(interrupted_data)
        print(f"Ctrl-C of ftjob run: exited 130, nothing left, in {time.monotonic() - t0:.1f} s")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
