"""`ftjob run --local job.yaml`: the job on the embedded cluster, with a progress display.

Exit codes: 0 Succeeded, 1 Failed, 2 refused (an invalid manifest, or one the operator would
fail before making a pod), 3 timed out, 128 + N stopped by signal N (SIGINT 130, SIGTERM 143,
SIGHUP 129). On any of those signals the local cluster
is taken down (every pod process killed) before exiting; on the runner's own death (SIGKILL)
the pods die with it (podinit's parent-death signal)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shlex
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from finetune_local.podrunner import IsolationUnavailableError
from finetune_local.progress_lines import ProgressTracker, summarize
from finetune_local.runfit import NodeCapacityError, check_node_capacity, too_big_for_a_node
from finetune_local.session import LocalSession, default_data_dir, is_finished, phase_of
from finetune_operator.api.capabilities import trainer_refusals
from finetune_operator.api.manifest import Manifest, ManifestError, load_manifest

EXIT_SUCCEEDED, EXIT_FAILED, EXIT_REFUSED, EXIT_TIMEOUT = 0, 1, 2, 3


def _refusal(err: ApiException) -> str:
    """The API server's Status message (it names the field), not the HTTP noise around it."""
    try:
        body = yaml.safe_load(err.body or "") or {}
    except yaml.YAMLError:
        body = {}
    return str(body.get("message") or err.reason)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stopped(BaseException):
    """A stop signal arrived: unwind (tearing the cluster down), then exit 128 + signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_stopped(signum: int, frame: FrameType | None) -> None:
    for sig in STOP_SIGNALS:  # a second Ctrl-C must not interrupt the teardown
        signal.signal(sig, signal.SIG_IGN)
    raise Stopped(signum)


@contextlib.contextmanager
def stop_signals_raise() -> Iterator[None]:
    """SIGINT/SIGTERM/SIGHUP raise `Stopped` in the main thread while the block runs."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signals are the main thread's; an embedding caller handles them
        return
    previous = {sig: signal.signal(sig, _raise_stopped) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


LOCK_FILE = ".ftjob-run.lock"


def _claim(directory: Path) -> TextIO | str:
    """The directory's lock, held (flock: released by the kernel when this process dies,
    however), or why it is not to be had. Two runs on one --data-dir both "succeeded" while
    their pods wrote one checkpoint directory and one model, and the kubeconfig named only the
    second cluster."""
    lock = (directory / LOCK_FILE).open("a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "?"
        lock.close()
        return (
            f"--data-dir {directory}: another `ftjob run --local` (pid {holder}) is using it; "
            "wait for it, or give this run another directory"
        )
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock


def operator_refusal(manifest: Manifest) -> str | None:
    """Why the operator would end this job Failed before creating anything (InvalidSpec,
    PlanInfeasible or Unsupported), found as `ftjob plan` finds it; None when it would run.

    Without it a spec `ftjob plan` refuses (memory '16GB', a dataset on s3:// without
    credentials, a pod too small) started a cluster, then ended Failed (exit 1) with a pod-log
    path to a pod that was never made."""
    from finetune_operator.planner import PlanningError, plan_job

    try:
        plan = plan_job(manifest.spec)
    except PlanningError as err:
        return str(err)  # "field: reason"
    if not plan.fits:
        return f"no configuration fits: {plan.reason}"
    refusals = trainer_refusals(manifest.spec, plan)
    return "the trainer cannot run this job: " + "; ".join(refusals) if refusals else None


def run_local(
    manifest_path: str | Path,
    *,
    data_dir: str | Path | None = None,
    timeout_seconds: float = 1800.0,
    nodes: int = 4,
    keep: bool = False,
    out: TextIO = sys.stdout,
    node_capacity: dict[str, str] | None = None,
) -> int:
    """Run the job on a fresh local cluster of ``nodes`` nodes, each of the default capacity
    (:data:`finetune_local.nodes.DEFAULT_CAPACITY`) with ``node_capacity`` over it."""
    capacity = dict(node_capacity or {})
    try:
        manifest = load_manifest(manifest_path)
    except ManifestError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_REFUSED
    if manifest.spec.resources.device != "cpu":  # it would wait for a node until --timeout
        print(
            "error: spec.resources.device: the local cluster's nodes have no GPUs (its pods "
            "are processes on this machine's CPU): set resources.device: cpu to run "
            f"{manifest_path} here, or apply it to a cluster with GPUs",
            file=sys.stderr,
        )
        return EXIT_REFUSED
    try:
        check_node_capacity(capacity)
    except NodeCapacityError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_REFUSED
    refusal = operator_refusal(manifest)
    if refusal:  # what the operator would fail at once: no cluster started to report it
        print(f"error: {refusal}", file=sys.stderr)
        return EXIT_REFUSED
    too_big = too_big_for_a_node(manifest.spec, capacity)
    if too_big is not None:
        print(f"error: {too_big}", file=sys.stderr)
        return EXIT_REFUSED
    # The object as the reader saw it (a `---` or a `kind: List` around it, timestamps kept
    # as strings), exactly what kubectl would send: never the file parsed a second way.
    doc = manifest.document
    try:
        directory = Path(data_dir) if data_dir is not None else default_data_dir()
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        where = "--data-dir" if data_dir is not None else "the local cluster's directory"
        # mkdir says "File exists" of a file where the directory should be.
        why = "not a directory" if isinstance(err, FileExistsError) else err.strerror or str(err)
        print(f"error: {where} {err.filename or data_dir}: {why}", file=sys.stderr)
        return EXIT_REFUSED
    lock = _claim(directory)
    if isinstance(lock, str):
        print(f"error: {lock}", file=sys.stderr)
        return EXIT_REFUSED
    try:
        with lock, stop_signals_raise():
            return _run(
                doc,
                manifest_path,
                manifest.name,
                manifest.namespace,
                directory,
                timeout_seconds,
                nodes,
                keep or data_dir is not None,
                out,
                capacity,
            )
    except IsolationUnavailableError as err:  # not root: no pod could run (nothing started)
        print(f"error: {err}", file=sys.stderr)
        if data_dir is None:  # the directory this run made holds only the failed probe
            shutil.rmtree(directory, ignore_errors=True)
        return EXIT_REFUSED
    except Stopped as stop:
        name = signal.Signals(stop.signum).name
        # The checkpoints are in the directory: run again on it and the trainer resumes from
        # the newest (a fresh directory would start over). Quoted: paths with spaces.
        again = shlex.join(["ftjob", "run", "--local", "--data-dir", str(directory),
                            str(manifest_path)])  # fmt: skip
        print(
            f"{name}: the local cluster and its pods were stopped; its state and pod logs "
            f"are kept in {directory}; `{again}` resumes from its last checkpoint",
            file=sys.stderr,
        )
        return 128 + stop.signum


def _run(
    doc: dict[str, Any],
    manifest_path: str | Path,
    name: str,
    namespace: str,
    data_dir: Path,
    timeout_seconds: float,
    nodes: int,
    keep: bool,
    out: TextIO,
    node_capacity: dict[str, str],
) -> int:
    with LocalSession(
        data_dir, nodes=nodes, namespaces=[namespace], node_capacity=node_capacity
    ) as session:
        print(
            f"local cluster: {session.data_dir} (kubeconfig: {session.cluster.kubeconfig_path})",
            file=out,
        )
        try:
            if namespace != "default":
                # The cluster is this run's own: nobody else could create the namespace the
                # manifest names (it was "namespaces 'team-a' not found", exit 2).
                assert session.core is not None
                session.core.create_namespace(
                    client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace))
                )
            session.submit(doc)
        except ApiException as err:
            print(
                f"error: the API server refused {manifest_path}: {_refusal(err)}", file=sys.stderr
            )
            return EXIT_REFUSED
        tracker = ProgressTracker(started=time.monotonic())
        seen: list[dict[str, Any]] = []  # the newest observation: what a timeout reports

        def show(job: dict[str, Any]) -> None:
            seen[:] = [job]
            line = tracker.observe(job, time.monotonic())
            if line:
                print(line, file=out, flush=True)
            if line and phase_of(job) == "Suspended":
                # It waits (until --timeout, 30 minutes by default) for someone to resume it;
                # without this line nobody is told who, or how.
                patch = shlex.quote('{"spec":{"suspend":false}}')
                print(
                    f"  spec.suspend is true: kubectl --kubeconfig "
                    f"{shlex.quote(str(session.cluster.kubeconfig_path))} -n {namespace} patch "
                    f"ftj {name} --type=merge -p {patch} resumes it",
                    file=out,
                    flush=True,
                )

        try:
            job = session.wait_for(
                name,
                is_finished,
                namespace=namespace,
                timeout=timeout_seconds,
                on_poll=show,
            )
        except TimeoutError:
            if seen:  # its conditions say what it waits for (e.g. pods Pending, and why)
                print(summarize(seen[0], session.data_dir / "shared"), file=out)
            # Said in the words of the flag, not the poll's ("condition not reached in 5 s").
            phase = (phase_of(seen[0]) if seen else "") or "not yet observed"
            print(
                f"error: --timeout {timeout_seconds:g} s passed with {namespace}/{name} "
                f"{phase}, not finished; cluster state and pod logs kept in {session.data_dir}",
                file=sys.stderr,
            )
            return EXIT_TIMEOUT
        print(summarize(job, session.data_dir / "shared"), file=out)
        failed = phase_of(job) != "Succeeded"
        pod_logs = session.data_dir / "pods" / namespace
        # The operator deletes a failed job's pods; their logs stay on disk (a job refused
        # before any pod was made has none to point at).
        if failed and pod_logs.is_dir() and any(pod_logs.iterdir()):
            print(
                f"pod logs: {pod_logs}/<pod>-<uid>/*.log",
                file=sys.stderr,
            )
        # A failed job's logs are what the user needs next: never removed.
        kept = keep or failed
        # The trained model a successful run names is what it was run for: never removed.
        model = None if kept else trained_model_inside(job, session.data_dir)
        print(
            f"cluster state, pod logs and checkpoints: {session.data_dir}"
            + ("" if kept else " (removed now; --keep keeps them)"),
            file=out,
        )
        if model is not None:
            print(f"trained model kept: {model}", file=out)
    if not kept:
        remove_all_but(session.data_dir, model)
    return EXIT_SUCCEEDED if phase_of(job) == "Succeeded" else EXIT_FAILED


def trained_model_inside(job: dict[str, Any], data_dir: Path) -> Path | None:
    """Where a Succeeded job's exported model is, when the run's directory holds it (a
    relative `spec.output.uri` resolves in the pods' working directory, `<dir>/shared`);
    None for an object store, a path elsewhere, or no model written."""
    uri = (job.get("spec", {}).get("output") or {}).get("uri")
    if phase_of(job) != "Succeeded" or not uri or "://" in str(uri):
        return None
    path = (data_dir / "shared" / str(uri)).resolve()  # an absolute uri replaces the base
    root = data_dir.resolve()
    if path == root or not path.is_relative_to(root) or not path.exists():
        return None
    return path


def remove_all_but(root: Path, keep: Path | None) -> None:
    """Remove `root`, or, with `keep` (a path inside it), everything in it but `keep`."""
    if keep is None:
        shutil.rmtree(root, ignore_errors=True)
        return
    here = root.resolve()
    for part in keep.relative_to(here).parts:
        for child in here.iterdir():
            if child.name == part:
                continue
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
        here = here / part
