"""Fault drills on a long job of the local cluster, shared by the end-to-end suite
(`test_faults.py`, which asserts on them) and `bench/recovery.py` (which prints them).

Each drill waits until the job trains on both workers with a checkpoint newer than its last
resume, injects one fault, and waits until training goes past the step it had reached; it
checks the steps redone (at most one checkpoint interval, two where the newest checkpoint was
destroyed) and what was counted (`status.restarts`: failures; `status.preemptions`: not).

What counts (README "One restart budget"): a trainer SIGKILLed, or SIGTERMed alone, inside its
pod is a failure of that pod's own that its torchrun spent a restart on: it counts once,
while the pod runs (its trainers export the count, the operator's restart ledger adds it),
whether the pod later recovers, is stopped (SIGTERM of the pod: a preemption, its kill still
counted) or deleted. Before the ledger these drills expected 0 for each such kill: in-pod
restarts reached `status.restarts` only when a pod gave up, so a job could spend more than
maxRestarts + 1 attempts. The drills kill in worker-1, then twice in worker-0: failures
alternating between pods, each counted (the highest over the pods would have said 2).
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune_local.session import LocalSession, phase_of
from finetune_operator.api.constants import LABEL_JOB
from tests.conftest import wait_until
from tests.e2e.conftest import committed_steps, step_records

INTERVAL = 5  # checkpoint every 5 steps (1 s at 0.2 s a step)
FAULTS_JOB = "ft-faults"
# Long enough for every drill with room to spare: the drills end near step 60-65 (three runs
# seen), and training past that is only paid for, never asserted on.
FAULTS_STEPS = 120
RESUMED_LINE = re.compile(r"resumed from checkpoint step (\d+)")


def _status(job: dict[str, Any]) -> dict[str, Any]:
    return dict(job.get("status") or {})


@dataclass
class Recovery:
    fault: str
    step_at_fault: int
    resumed_from: int | None
    seconds: float
    restarts: int
    preemptions: int


# How long a counted fault may take to show in status.restarts once training goes on (the
# operator's next scrape: every 2 s in the e2e sessions, 10 s by default), and a failed pod's
# replacement to be made (its backoff: 1 s doubled per failure counted before).
COUNT_TIMEOUT = 60


class FaultRunner:
    """Drives the faults job: inject, wait until steps progress past the fault, report."""

    def __init__(self, session: LocalSession, name: str) -> None:
        self.session, self.name = session, name
        self.pods = session.data_dir / "pods" / "default"
        self.results: list[Recovery] = []

    def logs(self) -> list[Path]:
        return sorted(self.pods.glob(f"{self.name}-worker-*/trainer.log"))

    def max_step(self) -> int:
        return max((r["step"] for log in self.logs() for r in step_records(log)), default=0)

    def resumes_by_log(self) -> dict[Path, list[int]]:
        """Each worker log's 'resumed from checkpoint step N' values, in order."""
        return {
            log: [int(m) for m in RESUMED_LINE.findall(log.read_text(errors="replace"))]
            for log in self.logs()
        }

    def resumes(self) -> list[int]:
        return [n for found in self.resumes_by_log().values() for n in found]

    def resumes_since(self, before: dict[Path, list[int]]) -> list[int]:
        """Resumes logged since the snapshot `before` (per log: logs are not in time order)."""
        return [
            n
            for log, found in self.resumes_by_log().items()
            for n in found[len(before.get(log, [])) :]
        ]

    def job(self) -> dict[str, Any]:
        return self.session.get(self.name)

    def trainer_pid(self, pod: str) -> int:
        agent = self.session.cluster.pod_main_pid("default", pod)
        assert agent is not None, f"{pod} is not running"

        def find() -> int | None:
            for proc in Path("/proc").iterdir():
                if not proc.name.isdigit():
                    continue
                try:
                    ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
                    cmd = (proc / "cmdline").read_bytes()
                except (OSError, ValueError, IndexError):
                    continue
                if ppid == agent and b"finetune_trainer" in cmd:
                    return int(proc.name)
            return None

        return wait_until(find, f"the trainer process of {pod}", 60, 0.5)

    def ready(self, min_step_ahead: int = 3) -> int:
        """Wait until both workers train and a checkpoint newer than the last resume exists."""
        base = self.max_step()

        def settled() -> bool:
            s = _status(self.job())
            ckpt = int((s.get("lastCheckpoint") or {}).get("step") or 0)
            return (s.get("readyWorkers") == 2 and self.max_step() >= base + min_step_ahead
                    and ckpt > max(self.resumes(), default=0))  # fmt: skip

        wait_until(settled, f"{self.name} to train on 2 workers", 240, 0.5,
                   detail=lambda: str(_status(self.job())))  # fmt: skip
        assert phase_of(self.job()) == "Running"
        return self.max_step()

    def inject(
        self,
        fault: str,
        action: Callable[[], None],
        *,
        max_redone: int = INTERVAL,
        timeout: float = 240,
        counts: int = 0,
    ) -> Recovery:
        """`counts`: the failures the fault adds to status.restarts; waited for (the count
        comes with the operator's next scrape), then the caller asserts the exact figure."""
        self.ready()
        resumes_before = self.resumes_by_log()
        before = _status(self.job())
        step = self.max_step()
        t0 = time.monotonic()
        action()

        def recovered() -> bool:
            return bool(self.resumes_since(resumes_before)) and self.max_step() > step + 1

        wait_until(recovered, f"training to go on after: {fault}", timeout, 0.25,
                   detail=lambda: str(_status(self.job())))  # fmt: skip
        seconds = time.monotonic() - t0

        def settled() -> bool:
            # A failed pod's replacement waits its backoff, doubled for every failure counted
            # before (in-pod restarts included): the survivors may train on before it is made.
            job = self.job()
            added = int(_status(job).get("restarts") or 0) - int(before.get("restarts") or 0)
            return added >= counts and phase_of(job) == "Running"

        wait_until(settled, f"{counts} restarts counted, Running again after: {fault}",
                   COUNT_TIMEOUT, 0.25, detail=lambda: str(_status(self.job())))  # fmt: skip
        resumed = min(self.resumes_since(resumes_before))
        after = _status(self.job())
        result = Recovery(
            fault, step, resumed, seconds,
            int(after.get("restarts") or 0) - int(before.get("restarts") or 0),
            int(after.get("preemptions") or 0) - int(before.get("preemptions") or 0),
        )  # fmt: skip
        self.results.append(result)
        print(f"\n{fault}: step {step} -> resumed from {resumed} ({max(0, step - resumed)} redone), "
              f"steps again after {seconds:.1f} s; restarts +{result.restarts}, "
              f"preemptions +{result.preemptions}")  # fmt: skip
        # +1: the step in flight. A graceful stop may resume past `step` (the trainers went on
        # until they noticed, then saved): nothing redone.
        assert step - resumed <= max_redone + 1, result
        assert phase_of(self.job()) == "Running"
        return result


def _corrupt_in_place(file: Path) -> None:
    data = bytearray(file.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 16] = bytes(b ^ 0xFF for b in data[middle : middle + 16])
    file.write_bytes(bytes(data))


def faults_job(
    doc: dict[str, Any], name: str = FAULTS_JOB, steps: int = FAULTS_STEPS
) -> dict[str, Any]:
    """The quickstart as the long job the drills run on."""
    doc = {**doc, "metadata": {"name": name}, "spec": dict(doc["spec"])}
    doc["spec"]["training"] = {**doc["spec"]["training"], "maxSteps": steps}
    doc["spec"]["checkpoint"] = {**doc["spec"]["checkpoint"], "uri": f"checkpoints/{name}",
                                 "intervalSteps": INTERVAL, "keep": 3}  # fmt: skip
    # Each job exports to its own directory: the output of another job is never replaced.
    doc["spec"]["output"] = {**doc["spec"].get("output", {}), "uri": f"output/{name}"}
    # torchrun spends its own --max-restarts (the job's budget left when the pod is made) on
    # every trainer it restarts in the pod (SIGKILL, SIGTERM of a trainer, a peer lost): room
    # for the drills.
    doc["spec"]["faultTolerance"] = {"maxRestarts": 10, "backoffSeconds": 1}
    return doc


def run_drills(session: LocalSession, name: str = FAULTS_JOB) -> list[Recovery]:
    """Every drill, in order, on the running job `name`; asserts what each must show."""
    runner = FaultRunner(session, name)
    cluster = session.cluster
    root = session.data_dir / "shared" / "checkpoints" / name
    worker = [f"{name}-worker-0", f"{name}-worker-1"]

    r = runner.inject(
        "SIGKILL trainer", lambda: os.kill(runner.trainer_pid(worker[1]), signal.SIGKILL),
        counts=1,
    )  # fmt: skip
    # torchrun restarts it inside the pod, and the restart spends the job's budget.
    assert (r.restarts, r.preemptions) == (1, 0), r

    corrupted: list[int] = []

    def corrupt_newest_and_crash() -> None:
        # Freeze both trainers so no commit lands between choosing the newest and the crash.
        pids = [runner.trainer_pid(w) for w in worker]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        newest = committed_steps(root)[-1]
        corrupted.append(newest)
        _corrupt_in_place(next((root / f"step-{newest:08d}").glob("*.distcp")))
        # What a crash in the middle of an async save leaves: a newer step, not committed.
        partial = root / f"step-{newest + 1:08d}"
        partial.mkdir()
        (partial / "__0_0.distcp").write_bytes(b"\0" * 1024)
        os.kill(pids[0], signal.SIGKILL)
        os.kill(pids[1], signal.SIGCONT)

    r = runner.inject("corrupt newest checkpoint in place + crash during a save",
                      corrupt_newest_and_crash, max_redone=2 * INTERVAL, counts=1)  # fmt: skip
    assert r.resumed_from is not None and r.resumed_from < corrupted[0], (r, corrupted)
    assert (r.restarts, r.preemptions) == (1, 0), r  # worker-0's trainer killed: its own

    def names_skipped() -> dict[str, Any] | None:
        job = runner.job()
        return job if corrupted[0] in _status(job).get("skippedCheckpoints", []) else None

    job = wait_until(names_skipped, "status to name the skipped checkpoint", 60, 0.5)
    assert _status(job)["resumedFromStep"] >= r.resumed_from
    # The partial save: newer than every committed step at the restart (perhaps a commit this
    # node's view hides), so left by the start-up cleanup, and gone with the purge after the
    # first commit past it (checkpoint_store.cleanup_plan).
    partial = root / f"step-{corrupted[0] + 1:08d}"
    wait_until(lambda: not partial.exists() or None, "the partial save to be purged", 60, 0.5)

    # No 300 s exit barrier: the stopped trainer exits non-zero and its group re-forms.
    # A trainer stopped alone (not its pod) leaves no error file: a failure of its pod's own,
    # as a kill; worker-0's second.
    r = runner.inject("SIGTERM trainer", lambda: os.kill(runner.trainer_pid(worker[0]), signal.SIGTERM),
                      timeout=120, counts=1)  # fmt: skip
    assert (r.restarts, r.preemptions) == (1, 0), r

    # worker-1's kill (the first drill) was counted while it ran; its launcher carries the same
    # count out on the SIGTERM, which the ledger has already: nothing more, a preemption.
    r = runner.inject("SIGTERM pod (node shutdown, spot reclaim)",
                      lambda: cluster.kill_pod_processes("default", worker[1], signal.SIGTERM))  # fmt: skip
    assert (r.restarts, r.preemptions) == (0, 1), r

    assert session.core is not None
    core = session.core
    # worker-0's two kills stay counted once the pod and its ledger entry are gone.
    r = runner.inject("delete worker pod", lambda: core.delete_namespaced_pod(worker[0], "default"))
    assert r.restarts == 0, r

    for n in (1, 2):
        r = runner.inject(f"delete rendezvous pod ({n})",
                          lambda: core.delete_namespaced_pod(f"{name}-rdzv", "default"))  # fmt: skip
        assert r.restarts == 0, r

    def pod_uids() -> dict[str, str]:
        pods = core.list_namespaced_pod("default", label_selector=f"{LABEL_JOB}={name}").items
        return {p.metadata.name: p.metadata.uid for p in pods}

    before_restart: dict[str, str] = {}

    def operator_down_while_worker_dies() -> None:
        before_restart.update(pod_uids())
        session.stop_operator()
        cluster.kill_pod_processes("default", worker[1])  # SIGKILL: a real failure
        time.sleep(3)
        session.restart_operator()

    r = runner.inject("operator down while a worker dies", operator_down_while_worker_dies,
                      counts=1)  # fmt: skip
    assert r.restarts == 1, r  # counted once, by the operator that came back
    # It adopted what still ran (nothing lost in an operator restart): the rendezvous and the
    # surviving worker are the same pods; only the failed worker was replaced.
    after_restart = pod_uids()
    for pod in (f"{name}-rdzv", worker[0]):
        assert pod in before_restart and after_restart.get(pod) == before_restart[pod], (
            pod, before_restart, after_restart)  # fmt: skip
    assert after_restart.get(worker[1]) not in (None, before_restart.get(worker[1]))
    return runner.results
