"""`ftjob run --local job.yaml`: the job on the embedded cluster, with a progress display.

Exit codes: 0 Succeeded, 1 Failed, 2 refused (invalid manifest), 3 timed out."""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import yaml
from kubernetes.client.exceptions import ApiException

from finetune_local.progress import ProgressTracker, summarize
from finetune_local.session import LocalSession, is_finished, phase_of
from finetune_operator.api.manifest import ManifestError, load_manifest

EXIT_SUCCEEDED, EXIT_FAILED, EXIT_REFUSED, EXIT_TIMEOUT = 0, 1, 2, 3


def _refusal(err: ApiException) -> str:
    """The API server's Status message (it names the field), not the HTTP noise around it."""
    try:
        body = yaml.safe_load(err.body or "") or {}
    except yaml.YAMLError:
        body = {}
    return str(body.get("message") or err.reason)


def run_local(
    manifest_path: str | Path,
    *,
    data_dir: str | Path | None = None,
    timeout_seconds: float = 1800.0,
    nodes: int = 4,
    keep: bool = False,
    out: TextIO = sys.stdout,
) -> int:
    try:
        manifest = load_manifest(manifest_path)
    except ManifestError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_REFUSED
    doc: dict[str, Any] = yaml.safe_load(Path(manifest_path).read_text())
    with LocalSession(data_dir, nodes=nodes, namespaces=[manifest.namespace]) as session:
        print(f"local cluster: {session.data_dir} (kubeconfig: "
              f"{session.cluster.kubeconfig_path})", file=out)
        try:
            session.submit(doc)
        except ApiException as err:
            print(f"error: the API server refused {manifest_path}: {_refusal(err)}", file=sys.stderr)
            return EXIT_REFUSED
        tracker = ProgressTracker(started=time.monotonic())

        def show(job: dict[str, Any]) -> None:
            line = tracker.observe(job, time.monotonic())
            if line:
                print(line, file=out, flush=True)

        try:
            job = session.wait_for(
                manifest.name, is_finished, namespace=manifest.namespace,
                timeout=timeout_seconds, on_poll=show,
            )
        except TimeoutError as err:
            print(f"error: {err}", file=sys.stderr)
            return EXIT_TIMEOUT
        print(summarize(job), file=out)
        kept = keep or data_dir is not None
        print(f"cluster state, pod logs and checkpoints: {session.data_dir}"
              + ("" if kept else " (removed now; --keep keeps them)"), file=out)
    if not kept:
        shutil.rmtree(session.data_dir, ignore_errors=True)
    return EXIT_SUCCEEDED if phase_of(job) == "Succeeded" else EXIT_FAILED
