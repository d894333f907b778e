"""`ftjob run --local` before and after the cluster: what it submits and what it says when the
job failed (no cluster is started here: the cluster part is the end-to-end tests')."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from finetune_local import runner
from finetune_operator.cli import main
from tests.conftest import EXAMPLES

QUICKSTART = (EXAMPLES / "quickstart.yaml").read_text()


def stand_in_session(
    tmp_path: Path,
    polls: list[dict[str, Any]],
    error: str = "stop here",
    finished: dict[str, Any] | None = None,
) -> type:
    """A stand-in for LocalSession (what is under test is the runner's report, not the
    cluster): its wait shows the runner `polls`, then returns `finished` or, without one,
    times out with `error` (`{name}`: the job's name)."""

    class Session:
        data_dir = tmp_path / "cluster"

        class cluster:  # attribute access as on LocalSession
            kubeconfig_path = tmp_path / "cluster" / "kubeconfig"

        def __init__(self, data_dir: Path | None = None, *_: object, **__: object) -> None:
            if data_dir is not None:
                self.data_dir = data_dir

        def __enter__(self) -> Session:
            return self

        def __exit__(self, *_: object) -> None:
            return None

        def submit(self, doc: dict[str, Any]) -> None:
            pass

        def wait_for(self, name: str, until: Any, *, on_poll: Any, **_: Any) -> dict[str, Any]:
            for status in polls:
                on_poll(status)
            if finished is None:
                raise TimeoutError(error.format(name=name))
            return finished

    return Session


@pytest.mark.parametrize(
    "content",
    [
        QUICKSTART + "---\n",
        "---\n" + QUICKSTART + "\n---\n---\n",
        yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": [yaml.safe_load(QUICKSTART)]}),
        QUICKSTART.replace("source: inline", "source: inline\n    revision: 2024-01-01"),
    ],
    ids=["trailing-separator", "separators", "single-item-list", "date-like-string"],
)
def test_submits_the_one_object_that_plan_accepts(
    content: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever `ftjob plan` accepts, `run --local` submits the same FineTuneJob, as JSON."""
    submitted: list[dict[str, Any]] = []
    monkeypatch.setenv("FTJOB_LOCAL_DIR", str(tmp_path / "runs"))
    monkeypatch.setattr(runner, "_run", lambda doc, *_: submitted.append(doc) or 0)
    path = tmp_path / "job.yaml"
    path.write_text(content)
    assert runner.run_local(path) == 0
    assert submitted[0]["kind"] == "FineTuneJob"
    assert submitted[0]["metadata"]["name"] == "quickstart"
    json.dumps(submitted[0])  # kubectl's JSON: a YAML date would not serialise


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--nodes", "0"), ("--nodes", "-2"), ("--timeout", "0"), ("--timeout", "nan")],
)
def test_run_refuses_non_positive_settings(
    flag: str, value: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runner, "_run", lambda *_: 0)  # no cluster, whatever happens
    with pytest.raises(SystemExit) as exit_:
        main(["run", "--local", str(EXAMPLES / "quickstart.yaml"), flag, value])
    assert exit_.value.code == 2
    assert f"argument {flag}: must be greater than 0" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["a-file", "under-a-file", "env-under-a-file"])
def test_an_unusable_cluster_directory_exits_2_naming_it(
    where: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--data-dir` (or FTJOB_LOCAL_DIR) that cannot be a directory: one line, no traceback,
    no cluster started."""
    started: list[object] = []
    monkeypatch.setattr(runner, "_run", lambda *args: started.append(args) or 0)
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    argv = ["run", "--local", str(EXAMPLES / "quickstart.yaml")]
    if where == "a-file":
        argv += ["--data-dir", str(a_file)]
    elif where == "under-a-file":
        argv += ["--data-dir", str(a_file / "runs")]
    else:
        monkeypatch.setenv("FTJOB_LOCAL_DIR", str(a_file / "runs"))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(a_file) in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and not started


def test_a_stopped_run_says_how_to_resume_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C keeps the directory, checkpoints and all; running again on it resumes from the
    newest, but only the --data-dir of the stopped run does that (a fresh one starts over), so
    the message gives that command, quoted for a path with spaces."""

    def interrupted(*_: object) -> int:
        raise runner.Stopped(signal.SIGINT)

    monkeypatch.setattr(runner, "_run", interrupted)
    path = tmp_path / "my job.yaml"
    path.write_text(QUICKSTART)
    code = runner.run_local(path, data_dir=tmp_path / "c")
    assert code == 130
    err = capsys.readouterr().err
    assert err.startswith("SIGINT: the local cluster and its pods were stopped; ")
    assert f"`ftjob run --local --data-dir {tmp_path / 'c'} '{path}'` resumes" in err


def test_a_data_dir_in_use_by_another_run_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two runs on one --data-dir both ran to 'Succeeded', their pods writing one checkpoint
    directory and one model: the second is refused while the first holds the directory, and
    the directory is free again once that run ends."""
    import fcntl

    started: list[object] = []
    monkeypatch.setattr(runner, "_run", lambda *args: started.append(args) or 0)
    cluster = tmp_path / "c"
    cluster.mkdir()
    with (cluster / runner.LOCK_FILE).open("a+") as other:  # another run holds it
        other.write("4242\n")
        other.flush()
        fcntl.flock(other, fcntl.LOCK_EX)
        assert runner.run_local(EXAMPLES / "quickstart.yaml", data_dir=cluster) == 2
        err = capsys.readouterr().err
        assert err.startswith(
            f"error: --data-dir {cluster}: another `ftjob run --local` (pid 4242)"
        )
        assert not started
    assert runner.run_local(EXAMPLES / "quickstart.yaml", data_dir=cluster) == 0
    assert len(started) == 1


def test_the_manifests_namespace_is_created_in_the_runs_own_cluster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`metadata.namespace: team-a` was refused ("namespaces 'team-a' not found"): nobody
    could have created it in a cluster that lives only for the run."""
    calls: list[tuple[str, Any]] = []

    class Core:
        def create_namespace(self, body: Any) -> None:
            calls.append(("namespace", body.metadata.name))

    class Session:
        data_dir = tmp_path / "cluster"
        core = Core()

        class cluster:  # attribute access as on LocalSession
            kubeconfig_path = tmp_path / "cluster" / "kubeconfig"

        def __init__(self, *_: object, namespaces: list[str], **__: object) -> None:
            calls.append(("watched", namespaces))

        def __enter__(self) -> Session:
            return self

        def __exit__(self, *_: object) -> None:
            return None

        def submit(self, doc: dict[str, Any]) -> None:
            calls.append(("job", doc["metadata"]["namespace"]))

        def wait_for(self, *_: object, **__: object) -> None:
            raise TimeoutError("stop here")

    monkeypatch.setattr(runner, "LocalSession", Session)
    path = tmp_path / "job.yaml"
    path.write_text(QUICKSTART.replace("name: quickstart", "name: quickstart\n  namespace: team-a"))
    assert runner.run_local(path, data_dir=tmp_path / "cluster") == runner.EXIT_TIMEOUT
    assert calls == [("watched", ["team-a"]), ("namespace", "team-a"), ("job", "team-a")]


def test_a_suspended_job_says_how_to_resume_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`spec.suspend: true` waited until --timeout with only 'Suspended' on screen."""
    suspended = {"metadata": {"name": "quickstart"}, "status": {"phase": "Suspended"}}

    # The same status twice (no change): said once.
    monkeypatch.setattr(runner, "LocalSession", stand_in_session(tmp_path, [suspended] * 2))
    code = runner.run_local(EXAMPLES / "quickstart.yaml", data_dir=tmp_path / "cluster",
                            out=sys.stdout)  # fmt: skip
    assert code == runner.EXIT_TIMEOUT
    kubeconfig = tmp_path / "cluster" / "kubeconfig"
    hint = (
        f"  spec.suspend is true: kubectl --kubeconfig {kubeconfig} -n default patch ftj "
        """quickstart --type=merge -p '{"spec":{"suspend":false}}' resumes it"""
    )
    assert capsys.readouterr().out.count(hint) == 1


def test_a_timeout_shows_the_last_status_seen(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Timed out (e.g. pods Pending for GPUs the local nodes lack): the job's conditions, which
    say why, are printed, not only that the time passed. The session here is a stand-in:
    what is under test is the runner's report, not the cluster."""
    pending = {
        "metadata": {"name": "quickstart"},
        "status": {
            "phase": "Pending",
            "conditions": [
                {"type": "WorkersReady", "status": "False", "reason": "WorkersNotReady",
                 "message": "pod quickstart-worker-0 Pending: 0/4 nodes have nvidia.com/gpu"},
            ],
        },
    }  # fmt: skip

    session = stand_in_session(tmp_path, [pending], "default/{name}: condition not reached in 60 s")
    monkeypatch.setattr(runner, "LocalSession", session)
    code = runner.run_local(EXAMPLES / "quickstart.yaml", data_dir=tmp_path / "cluster",
                            timeout_seconds=60, out=sys.stdout)  # fmt: skip
    out = capsys.readouterr()
    assert code == runner.EXIT_TIMEOUT
    # It said "default/quickstart: condition not reached in 60 s": which condition?
    assert "--timeout 60 s passed with default/quickstart Pending, not finished" in out.err
    assert "FineTuneJob quickstart: Pending" in out.out
    assert "0/4 nodes have nvidia.com/gpu" in out.out


def test_a_gpu_job_is_refused_at_once_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The local cluster's nodes have no GPUs: a GPU job would sit Pending until --timeout
    (30 minutes by default). It is refused before any cluster starts."""
    started: list[object] = []
    monkeypatch.setattr(runner, "_run", lambda *args: started.append(args) or 0)
    code = runner.run_local(EXAMPLES / "llama-3.1-8b-lora.yaml", data_dir=tmp_path / "c")
    err = capsys.readouterr().err
    assert code == runner.EXIT_REFUSED and not started
    assert err.startswith("error: spec.resources.device: ") and "no GPUs" in err


@pytest.mark.parametrize(
    ("old", "new", "says"),
    [
        # InvalidSpec: a memory size in another notation
        ("memory: 2Gi", "memory: 16GB", "error: spec.resources.memory: '16GB' is not a Kubernetes"),
        # InvalidSpec: object storage without credentials
        ("uri: builtin://quickstart", "uri: s3://bucket/d.jsonl", "error: spec.dataset.uri: "),
        # PlanInfeasible: a pod too small for its process
        ("memory: 2Gi", "memory: 100Mi", "error: no configuration fits: Nothing fits in 100.0 MiB"),
    ],
    ids=["memory-unit", "s3-without-credentials", "nothing-fits"],
)
def test_what_plan_refuses_is_refused_before_a_cluster_starts(
    old: str, new: str, says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """These started a cluster, which then failed the job (exit 1, pointing at pod logs of
    pods never made): `ftjob plan` refuses them (exit 2), and so does `run --local`, at once."""
    started: list[object] = []
    monkeypatch.setattr(runner, "_run", lambda *args: started.append(args) or 0)
    path = tmp_path / "job.yaml"
    path.write_text(QUICKSTART.replace(old, new))
    assert runner.run_local(path, data_dir=tmp_path / "c") == runner.EXIT_REFUSED
    assert not started and not (tmp_path / "c").exists()
    assert capsys.readouterr().err.startswith(says)


@pytest.mark.parametrize(
    ("message", "shown"),
    [
        # What every `ftjob run --local` printed among its progress lines.
        (
            "Unresolved resources cannot be served (try creating their CRDs): "
            "Selector(group='kueue.x-k8s.io', version='v1beta2', any_name='workloads')",
            False,
        ),
        (
            "Unresolved resources cannot be served (try creating their CRDs): "
            "Selector(group='finetune.dev', version='v1alpha1', any_name='finetunejobs')",
            True,
        ),
        (
            "Unresolved resources cannot be served (try creating their CRDs): "
            "Selector(group='kueue.x-k8s.io', version='v1beta2', any_name='workloads'), "
            "Selector(group='finetune.dev', version='v1alpha1', any_name='finetunejobs')",
            True,
        ),
        ("Non-watchable resources will not be served: x", True),
    ],
)
def test_the_local_operator_does_not_warn_of_kueue_it_does_not_serve(
    message: str, shown: bool, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    from finetune_local.session import _quiet_kopf

    _quiet_kopf()
    _quiet_kopf()  # once per operator thread: one filter
    logger = logging.getLogger("kopf._core.reactor.observation")
    assert len(logger.filters) == 1
    logger.warning(message)  # a logger's filter runs before any handler sees the record
    assert (message in caplog.messages) is shown


def test_no_namespaces_is_one_line_and_exit_2_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without root (or CAP_SYS_ADMIN) the kubelet's namespace probe fails: that surfaced as a
    traceback and exit 1 (which says the job Failed)."""
    from finetune_local.podrunner import IsolationUnavailableError

    class NoIsolation:
        def __init__(self, *_: Any, **__: Any) -> None:
            pass

        def __enter__(self) -> None:
            raise IsolationUnavailableError("the local kubelet needs mount and UTS namespaces")

        def __exit__(self, *_: Any) -> None:
            pass

    monkeypatch.setattr(runner, "LocalSession", NoIsolation)
    monkeypatch.setenv("FTJOB_LOCAL_DIR", str(tmp_path / "runs"))
    assert main(["run", "--local", str(EXAMPLES / "quickstart.yaml")]) == 2
    err = capsys.readouterr().err
    assert err == "error: the local kubelet needs mount and UTS namespaces\n"
    assert list((tmp_path / "runs").iterdir()) == []  # the run's own directory, removed


@pytest.mark.parametrize(
    ("changes", "flags", "said"),
    [
        (
            {"memory": "64Gi"},
            [],
            "error: a worker pod requests memory 64Gi (spec.resources.memory), more than a "
            "node's allocatable 31.9Gi: it would fit no local node and wait until --timeout. "
            "Lower it, or give the nodes more (--node-capacity memory=...)",
        ),
        (
            {"cpu": "12"},
            [],
            "cpu 12 (spec.resources.cpu), more than a node's allocatable 8",
        ),
        (
            {},
            ["--node-capacity", "ephemeral-storage=30Gi"],
            "ephemeral-storage 32Gi (spec.dataset.cacheSizeLimit)",
        ),
        ({}, ["--node-capacity", "memory=lots"], "--node-capacity memory=lots: quantity 'lots'"),
    ],
    ids=["memory", "cpu", "small-disk", "bad-quantity"],
)
def test_a_worker_no_local_node_could_take_is_refused_at_once(
    changes: dict[str, str],
    flags: list[str],
    said: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker that would fit no node even empty would wait, Pending, until --timeout: it is
    refused before any cluster starts, naming the request, its field and the flag."""
    started: list[object] = []
    monkeypatch.setattr(runner, "_run", lambda *args: started.append(args) or 0)
    doc = yaml.safe_load(QUICKSTART)
    doc["spec"]["resources"].update(changes)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    code = main(["run", "--local", str(path), "--data-dir", str(tmp_path / "c"), *flags])
    err = capsys.readouterr().err
    assert code == runner.EXIT_REFUSED and not started
    assert err.startswith("error: ") and said in err


def test_node_capacity_reaches_the_cluster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    started: list[tuple[Any, ...]] = []
    monkeypatch.setattr(runner, "_run", lambda *args: started.append(args) or 0)
    doc = yaml.safe_load(QUICKSTART)
    doc["spec"]["resources"]["memory"] = "64Gi"
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    argv = ["run", "--local", str(path), "--data-dir", str(tmp_path / "c")]
    assert main([*argv, "--node-capacity", "memory=128Gi", "--node-capacity", "cpu=4"]) == 0
    assert started[0][-1] == {"memory": "128Gi", "cpu": "4"}
    with pytest.raises(SystemExit):
        main([*argv, "--node-capacity", "memory"])
    assert "expected RESOURCE=QUANTITY" in capsys.readouterr().err


def test_the_early_refusal_reads_the_operators_worker_requests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The refusal does not re-derive a worker's requests: a request the operator adds to
    its worker pods (here a made-up one no node advertises) is one the refusal names."""
    from finetune_local import runfit
    from finetune_operator.resources import worker

    def with_extra(spec: Any, gpus_per_node: int) -> dict[str, dict[str, str]]:
        out = worker.pod_resources(spec, gpus_per_node)
        out["requests"]["example.com/widget"] = "1"
        return out

    monkeypatch.setattr(runfit, "pod_resources", with_extra)
    monkeypatch.setattr(runner, "_run", lambda *args: 0)
    path = tmp_path / "job.yaml"
    path.write_text(QUICKSTART)
    code = main(["run", "--local", str(path), "--data-dir", str(tmp_path / "c")])
    err = capsys.readouterr().err
    assert code == runner.EXIT_REFUSED
    assert "example.com/widget 1 (spec.resources.gpusPerNode)" in err


def test_a_default_run_that_succeeded_keeps_the_trained_model_it_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The summary named the trained model, then the run deleted it with its directory: a new
    user's quickstart ended with nothing to show. Now the rest goes, the model stays."""
    monkeypatch.setenv("FTJOB_LOCAL_DIR", str(tmp_path / "runs"))
    job = yaml.safe_load(QUICKSTART)
    job["status"] = {"phase": "Succeeded"}
    uri = job["spec"]["output"]["uri"]
    made: list[Path] = []

    def session(data_dir: Path, **kwargs: Any) -> Any:
        made.append(data_dir)
        (data_dir / "shared" / uri).mkdir(parents=True)
        (data_dir / "shared" / uri / "model.safetensors").write_bytes(b"weights")
        (data_dir / "shared" / "checkpoints" / "step-60").mkdir(parents=True)
        (data_dir / "pods").mkdir()
        (data_dir / "kubeconfig").write_text("")
        return stand_in_session(tmp_path, [], finished=job)(data_dir, **kwargs)

    monkeypatch.setattr(runner, "LocalSession", session)
    assert runner.run_local(EXAMPLES / "quickstart.yaml", out=sys.stdout) == runner.EXIT_SUCCEEDED
    (run,) = made
    model = (run / "shared" / uri).resolve()
    assert f"trained model kept: {model}" in capsys.readouterr().out
    assert (model / "model.safetensors").read_bytes() == b"weights"
    # Nothing else is left: no checkpoints, pod logs, kubeconfig or lock file.
    left = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    assert uri == "output/quickstart"
    assert left == ["shared", "shared/output", "shared/output/quickstart",
                    "shared/output/quickstart/model.safetensors"]  # fmt: skip


def test_trained_model_inside_only_a_succeeded_jobs_local_model_in_the_run(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "shared" / "out").mkdir(parents=True)
    job: dict[str, Any] = {"spec": {"output": {"uri": "out"}}, "status": {"phase": "Succeeded"}}
    assert runner.trained_model_inside(job, run) == (run / "shared" / "out").resolve()
    for output, phase in [("out", "Failed"), ("s3://b/out", "Succeeded"),
                          (str(tmp_path), "Succeeded"), ("missing", "Succeeded"),
                          ("../..", "Succeeded")]:  # fmt: skip
        job = {"spec": {"output": {"uri": output}}, "status": {"phase": phase}}
        assert runner.trained_model_inside(job, run) is None, output
