"""Checkpoints on shared storage, end to end on the local cluster:

- a PersistentVolumeClaim: the job mounts a claim, the local kubelet binds it to a host
  directory on first use (as a provisioner would), a killed worker's replacement resumes from
  the checkpoints on the claim, and nothing lands in the pods' working directory;
- object storage: the pretrained model (config, tokenizer, safetensors read by ranges into
  the shards), the dataset, checkpoints and the exported model on s3:// (a real S3-compatible
  server, moto's, started by the test), the credentials from a Secret the job names. Without the
  Secret the workers do not start and the job says why; once it exists they train; a worker
  stopped with SIGTERM (a preemption) makes the group's final save to the bucket, the group
  resumes from exactly that step, and the model lands in the bucket."""

from __future__ import annotations

import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from finetune_local.session import LocalSession, is_finished, phase_of
from finetune_operator.api.constants import COND_WORKERS_READY
from finetune_trainer import checkpoint_store as store
from finetune_trainer.data import resolve_uri
from finetune_trainer.export import FINISHED_MARKER, resolve_output
from finetune_trainer.location import Location, locate
from tests.e2e.conftest import committed_steps, resumed_steps, slowed_session
from tests.objectstore import CREDENTIALS, MotoServer, moto_server

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
CLAIM = "ft-pvc-shared"


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSession]:
    yield from slowed_session(tmp_path_factory, "e2e-storage", nodes=3)


def _checkpoint(job: dict[str, Any]) -> int:
    return int((job.get("status", {}).get("lastCheckpoint") or {}).get("step") or 0)


def test_checkpoint_and_resume_through_a_claim(
    session: LocalSession, quickstart_doc: dict[str, Any]
) -> None:
    assert session.core is not None
    session.core.create_namespaced_persistent_volume_claim("default", {
        "metadata": {"name": CLAIM},
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}},
    })  # fmt: skip
    spec = quickstart_doc["spec"]
    quickstart_doc["metadata"]["name"] = "ft-pvc"
    spec["training"]["maxSteps"] = 20
    spec["checkpoint"].update({"uri": "/shared/checkpoints/ft-pvc", "intervalSteps": 5})
    spec["output"]["uri"] = "/shared/output/ft-pvc"
    spec["storage"] = {"claims": [{"claimName": CLAIM, "mountPath": "/shared"}]}
    session.submit(quickstart_doc)
    job = session.wait_for("ft-pvc", lambda j: _checkpoint(j) >= 5, timeout=120)
    at_kill = _checkpoint(job)
    assert session.cluster.kill_pod_processes("default", "ft-pvc-worker-1")
    job = session.wait_for("ft-pvc", is_finished, timeout=180)
    assert phase_of(job) == "Succeeded", job.get("status")
    assert job["status"]["restarts"] >= 1

    claim = session.core.read_namespaced_persistent_volume_claim(CLAIM, "default")
    assert claim.status.phase == "Bound"
    volume = session.data_dir / "pvcs" / "default" / CLAIM
    assert committed_steps(volume / "checkpoints" / "ft-pvc")[-1] == 20
    assert (volume / "output" / "ft-pvc" / "config.json").is_file()
    assert not (session.data_dir / "shared" / "shared").exists()  # not the working directory
    log = session.cluster.pod_log_path("default", "ft-pvc-worker-0")
    assert log is not None
    resumed = resumed_steps(log)
    assert resumed and min(resumed) >= at_kill > 0, (resumed, at_kill)


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    # On loopback, which the local cluster's pods share with the host (as pods reach a
    # store's Service or endpoint on a real cluster).
    with moto_server(log=tmp_path_factory.mktemp("moto") / "moto.log") as server:
        yield server


def _condition_message(job: dict[str, Any], ctype: str) -> str:
    conditions = job.get("status", {}).get("conditions") or []
    return str(next((c.get("message") for c in conditions if c["type"] == ctype), ""))


def _upload_pretrained(architecture: dict[str, Any], local: Path, target: Location) -> None:
    """The quickstart's architecture as a Hugging Face model directory, in the bucket."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune_operator.api.spec import ModelArchitecture
    from finetune_trainer.model import hf_config_kwargs
    from finetune_trainer.tokenizer import build_byte_tokenizer

    tok = build_byte_tokenizer()
    kwargs = hf_config_kwargs(ModelArchitecture.model_validate(architecture))
    config = LlamaConfig(**kwargs, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(local, max_shard_size="100KB")
    tok.save_pretrained(local)
    for path in sorted(local.iterdir()):
        (target / path.name).upload(path)


def test_checkpoint_and_resume_through_s3_with_a_secret(
    session: LocalSession, s3: MotoServer, quickstart_doc: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:  # fmt: skip
    assert session.core is not None
    bucket = s3.new_bucket()
    name, secret = "ft-s3", "ft-s3-credentials"
    spec = quickstart_doc["spec"]
    quickstart_doc["metadata"]["name"] = name
    spec["training"]["maxSteps"] = 15
    spec["checkpoint"].update({"uri": f"s3://{bucket}/checkpoints/{name}", "intervalSteps": 5})
    spec["output"]["uri"] = f"s3://{bucket}/models/{name}"
    spec["storage"] = {"objectStore": {"secretName": secret, "endpointUrl": s3.endpoint,
                                       "region": "eu-west-1", "pathStyle": True}}  # fmt: skip
    # The base model and the corpus are read from the bucket too.
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    base = f"s3://{bucket}/base/{name}"
    _upload_pretrained(spec["model"]["architecture"], tmp_path / "base",
                       locate(base, "test", object_store=s3.spec()))  # fmt: skip
    corpus = locate(f"s3://{bucket}/data/quickstart.jsonl", "test", object_store=s3.spec())
    corpus.upload(Path(resolve_uri(spec["dataset"]["uri"])))
    spec["model"].update({"source": "uri", "path": base})
    spec["dataset"]["uri"] = corpus.url
    session.submit(quickstart_doc)

    # No Secret yet: the workers wait in CreateContainerConfigError, and the job says so.
    missing = f'CreateContainerConfigError: secret "{secret}" not found'
    job = session.wait_for(name, lambda j: missing in _condition_message(j, COND_WORKERS_READY),
                           timeout=120)  # fmt: skip
    assert phase_of(job) == "Pending" and not job["status"].get("restarts")
    assert session.cluster.pod_log_path("default", f"{name}-worker-0") is None  # never ran

    session.core.create_namespaced_secret("default", {
        "metadata": {"name": secret}, "stringData": dict(CREDENTIALS)})  # fmt: skip
    job = session.wait_for(name, lambda j: _checkpoint(j) >= 5, timeout=300)
    at_kill = _checkpoint(job)
    assert session.cluster.kill_pod_processes("default", f"{name}-worker-1", signal.SIGTERM)
    # Generous: a stop, a re-form and the replacement's start take long on a loaded machine.
    job = session.wait_for(name, is_finished, timeout=420)
    assert phase_of(job) == "Succeeded", job.get("status")
    assert job["status"]["preemptions"] >= 1 and not job["status"].get("restarts"), job["status"]
    assert job["status"].get("resumedFromStep", 0) > 0, job["status"]
    log = session.cluster.pod_log_path("default", f"{name}-worker-0")
    assert log is not None
    text = log.read_text(errors="replace")
    # The surviving rank stopped with its peer at step S after the final save of S was
    # committed to the bucket, and the re-formed group resumed from S: no step redone.
    stopped = re.search(r"stopped at step (\d+) \(last committed checkpoint: step (\d+)\)", text)
    assert stopped is not None, text[-3000:]
    stop_step, committed = int(stopped.group(1)), int(stopped.group(2))
    assert stop_step == committed >= at_kill > 0, (stop_step, committed, at_kill)
    assert resumed_steps(log)[0] == stop_step, resumed_steps(log)
    # DDP: each start of the worker read its stripe of the replica when the group had peers
    # (they read the rest: finetune_trainer.replica_loading), the whole model when alone;
    # sharded strategies read their shards (tests/trainer/test_remote_weights.py).
    read = re.findall(
        r"pretrained weights(?: \(striped over (\d+) ranks[^)]*\))?: read (\d+) of (\d+) "
        r"bytes from s3://",
        text,
    )
    assert read, text[-3000:]
    for ranks, n, total in ((int(r or 1), int(n), int(t)) for r, n, t in read):
        if ranks == 1:
            assert n == total, read
        else:  # about 1/ranks of the data, plus every header
            assert 0.9 * total <= n * ranks and n < total, read
    assert f"dataset {corpus.url}: fetched 1 objects" in text

    # What the job wrote is in the bucket, and nothing of it on a local disk.
    root = store.resolve_root(spec["checkpoint"]["uri"], object_store=s3.spec())
    steps = [c.step for c in store.committed_newest_first(root)]
    assert steps[0] == 15 and len(steps) == spec["checkpoint"].get("keep", 3), steps  # keep-last-K
    assert store.manifest_of(store.read_marker(store.step_dir(root, steps[0])))
    output = resolve_output(spec["output"]["uri"], object_store=s3.spec())
    assert {"config.json", "model.safetensors", FINISHED_MARKER} <= set(output.sizes())
    assert not list((session.data_dir / "shared").glob(f"**/{name}"))
