"""`ftjob`: the plan JSON contract of DESIGN.md §4, exit codes, refusals naming the field."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from finetune_operator.cli import main
from tests.conftest import CRD_PATH, EXAMPLES

PLAN_KEYS = {
    "fits", "worldSize", "nodes", "gpusPerNode", "strategy", "offload", "microBatchSize",
    "gradientAccumulationSteps", "activationCheckpointing", "gpuMemoryBytes", "headroom",
    "estimatedStepSeconds", "reason", "memory",
}  # fmt: skip
MEMORY_KEYS = {
    "parameters",
    "gradients",
    "optimizer",
    "activations",
    "buffers",
    "peak",
    "reserved",
    "total",
}


def _write(tmp_path: Path, doc: dict[str, Any]) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def _quickstart() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((EXAMPLES / "quickstart.yaml").read_text())
    return doc


def test_plan_json_has_the_documented_fields(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(EXAMPLES / "quickstart.yaml"), "-o", "json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan.keys() >= PLAN_KEYS and plan["memory"].keys() >= MEMORY_KEYS
    assert plan["fits"] is True and plan["nodes"] == 2 and plan["strategy"] == "ddp"
    memory = plan["memory"]
    assert memory["peak"] <= memory["reserved"] <= memory["total"] <= plan["gpuMemoryBytes"]


def test_plan_table_and_infeasible_exit_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = _quickstart()
    doc["spec"]["model"] = {"name": "meta-llama/Llama-3.1-70B"}
    doc["spec"]["training"]["precision"] = "bf16"
    doc["spec"]["resources"] = {"gpu": {"memoryGiB": 24}, "gpusPerNode": 2, "maxGPUs": 2}
    doc["spec"]["strategy"] = {"type": "auto"}
    assert main(["plan", _write(tmp_path, doc)]) == 1
    out = capsys.readouterr().out
    assert "fits" in out.lower() and "GiB" in out


@pytest.mark.parametrize("command", ["plan", "run"])
def test_invalid_manifest_exit_2_naming_the_field(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = _quickstart()
    doc["spec"]["resources"]["minNodes"] = 5
    argv = [command, _write(tmp_path, doc)] + (["--local"] if command == "run" else [])
    assert main(argv) == 2  # refused before any cluster is started
    err = capsys.readouterr().err
    assert "spec.resources.minNodes" in err and "minNodes must be <= maxNodes" in err


def test_planning_error_names_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = _quickstart()
    doc["spec"]["model"] = {"name": "no-such-model"}
    assert main(["plan", _write(tmp_path, doc)]) == 2
    assert "spec.model" in capsys.readouterr().err


def test_crd_command_prints_the_committed_crd(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["crd"]) == 0
    assert capsys.readouterr().out == CRD_PATH.read_text()


def test_run_local_is_a_plugin_and_says_what_to_install_without_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The operator image has no local cluster: `ftjob run --local` then explains itself."""
    from importlib.metadata import entry_points

    import finetune_operator.cli as cli

    registered = entry_points(group="finetune_operator.run", name="local")
    assert [ep.value for ep in registered] == ["finetune_local.runner:run_local"]
    monkeypatch.setattr(cli, "entry_points", lambda **_: [])
    assert main(["run", "--local", str(EXAMPLES / "quickstart.yaml")]) == 2
    assert "finetune-operator[local]" in capsys.readouterr().err


QUICKSTART_TEXT = (EXAMPLES / "quickstart.yaml").read_text()


@pytest.mark.parametrize(
    ("content", "field", "reason"),
    [
        (b"\xff\xfeapiVersion: x", "file", "not UTF-8"),
        (QUICKSTART_TEXT.replace("metadata:\n  name: quickstart", "metadata: quickstart").encode(),
         "metadata", "must be an object"),
        (QUICKSTART_TEXT.replace("metadata:\n  name: quickstart", "metadata: [a]").encode(),
         "metadata", "must be an object"),
        (QUICKSTART_TEXT.replace("name: quickstart", 'name: "quick\\nstart"').encode(),
         "metadata.name", "RFC 1123"),
        (QUICKSTART_TEXT.replace("learningRate: 3.0e-3", "learningRate: .inf").encode(),
         "spec.training.learningRate", "NaN or infinity"),
        (QUICKSTART_TEXT.replace("learningRate: 3.0e-3", "learningRate: .nan").encode(),
         "spec.training.learningRate", "NaN or infinity"),
        (QUICKSTART_TEXT.replace("maxRestarts: 3", "maxRestarts: 1.0e+55").encode(),
         "spec.faultTolerance.maxRestarts", "less than or equal to 10000"),
        (QUICKSTART_TEXT.replace("sequenceLength: 128", "sequence_length: 32768").encode(),
         "spec.training.sequence_length", "unknown field"),
        (QUICKSTART_TEXT.replace("maxSteps: 60", "maxSteps: !!binary aGVsbG8=").encode(),
         "spec.training.maxSteps", "not a JSON value"),
        ((QUICKSTART_TEXT + "---\n" + QUICKSTART_TEXT).encode(), "file", "holds 2 objects"),
        (b"# nothing here\n---\n", "file", "holds no object"),
        # Not "empty, or only comments and '---'", as it said of a List with no items.
        (b"apiVersion: v1\nkind: List\nitems: []\n", "file", "holds a List with no items"),
        (b"- a\n- b\n", "file", "expected a YAML mapping"),
        (b"a: [\n", "file", "not valid YAML: while parsing a flow node"),
        (QUICKSTART_TEXT.replace("maxSteps: 60", "maxSteps: 60\n    maxSteps: 6000").encode(),
         "file", 'mapping key "maxSteps" already defined at line'),
        (b"a: " + b"[" * 5000 + b"]" * 5000, "file", "nested deeper"),
        (b"a: &a [1,1,1,1,1,1,1,1,1,1]\n" + b"".join(
            b"%c: &%c [*%c,*%c,*%c,*%c,*%c,*%c,*%c,*%c,*%c,*%c]\n" % ((98 + i, 98 + i) + (97 + i,) * 10)
            for i in range(8)
        ), "file", "expands to more than"),
    ],
    ids=[
        "not-utf8", "metadata-string", "metadata-list", "name-newline", "inf", "nan", "huge",
        "snake-case", "binary", "two-docs", "empty", "empty-list", "list", "bad-yaml",
        "duplicate-key", "deep", "billion-laughs",
    ],
)  # fmt: skip
def test_plan_refuses_malformed_files_with_exit_2_naming_the_place(
    content: bytes, field: str, reason: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "job.yaml"
    path.write_bytes(content)
    assert main(["plan", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"  {field}: " in err and reason in err, err
    assert "Traceback" not in err
    assert "<unicode string>" not in err  # PyYAML's name for the text: the file is named above


@pytest.mark.parametrize("target", ["missing.yaml", "."], ids=["missing", "directory"])
def test_plan_refuses_a_missing_file_or_a_directory(
    target: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", str(tmp_path / target)]) == 2
    assert "file: " in capsys.readouterr().err


@pytest.mark.parametrize(
    "content",
    [
        QUICKSTART_TEXT + "---\n",
        "---\n# leading comments\n" + QUICKSTART_TEXT + "\n---\n---\n",
        yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": [yaml.safe_load(QUICKSTART_TEXT)]}),
        QUICKSTART_TEXT.replace("revision", "x").replace("uri: builtin://quickstart",
                                                         "uri: builtin://quickstart\n    # c"),
    ],
    ids=["trailing-separator", "separators-and-comments", "single-item-list", "comments"],
)  # fmt: skip
def test_plan_accepts_what_kubectl_accepts(
    content: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(content)
    assert main(["plan", str(path), "-o", "json"]) == 0, capsys.readouterr().err


def test_plan_does_not_import_the_local_cluster() -> None:
    # The product's plan path validates with api.schema_validation, not the emulator.
    code = (
        "import sys; from finetune_operator.cli import main; "
        f"rc = main(['plan', {str(EXAMPLES / 'quickstart.yaml')!r}, '-o', 'json']); "
        "bad = [m for m in sys.modules if m.startswith('finetune_local')]; "
        "sys.exit(rc or (3 if bad else 0))"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def test_plan_error_names_the_field_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = _quickstart()
    doc["spec"]["training"]["microBatchSize"] = 3
    assert main(["plan", _write(tmp_path, doc)]) == 2
    err = capsys.readouterr().err
    assert err == "error: spec.training.microBatchSize: 3 does not divide globalBatchSize 8\n"


def test_deprecated_field_warns_in_one_line(tmp_path: Path) -> None:
    doc = _quickstart()
    training = doc["spec"]["training"]
    training["gradientCheckpointing"] = training.pop("activationCheckpointing")
    out = subprocess.run(
        [sys.executable, "-m", "finetune_operator.cli", "plan", _write(tmp_path, doc)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stderr == (
        "warning: training.gradientCheckpointing is deprecated: "
        "use training.activationCheckpointing\n"
    )


def test_one_line_warnings_last_only_while_a_command_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """In-process callers of `main` (tests, scripts) keep their own warning format after it,
    whether the command returned or raised."""
    import warnings

    from finetune_operator import cli

    before = warnings.formatwarning
    seen: list[str] = []

    def command(_: Any) -> int:
        seen.append(warnings.formatwarning(UserWarning("m"), UserWarning, "f.py", 1))
        return 0

    def failing(_: Any) -> int:
        raise RuntimeError("boom")

    for func in (command, failing):
        monkeypatch.setattr(cli, "_cmd_crd", func)  # `ftjob crd` runs it
        if func is failing:
            with pytest.raises(RuntimeError, match="boom"):
                cli.main(["crd"])
        else:
            assert cli.main(["crd"]) == 0
        assert warnings.formatwarning is before
    assert seen == ["warning: m\n"]  # one line while the command ran


def test_plan_into_a_closed_pipe_exits_without_a_traceback() -> None:
    """`ftjob plan job.yaml | head -1`: the reader is gone before the plan is written."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        out = subprocess.run(
            [sys.executable, "-m", "finetune_operator.cli", "plan", "-o", "json",
             str(EXAMPLES / "quickstart.yaml")],
            stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120,
        )  # fmt: skip
    finally:
        os.close(write_end)
    assert out.returncode == 141
    assert "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr, out.stderr


def test_operator_without_a_cluster_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kubernetes.config import kube_config

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # not in a pod
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(tmp_path / "none"))
    assert main(["operator", "-A"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no Kubernetes cluster to run against") and "KUBECONFIG" in err


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"training": {"optimizer": "adamw8bit"}}, "spec.training.optimizer"),
        ({"model": {"attention": "flash"}}, "spec.model.attention"),
    ],
    ids=["adamw8bit-on-cpu", "flash-on-cpu"],
)
def test_plan_refuses_what_the_operator_would_fail_as_unsupported(
    change: dict[str, dict[str, str]],
    field: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`ftjob plan` must not say a job fits that the operator ends Failed/Unsupported."""
    doc = _quickstart()
    for section, values in change.items():
        doc["spec"][section].update(values)
    assert main(["plan", _write(tmp_path, doc)]) == 2
    captured = capsys.readouterr()
    assert "Verdict" in captured.out  # the plan is still shown
    assert f"error: {field}: " in captured.err


def test_plan_lists_every_unsupported_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = _quickstart()
    doc["spec"]["training"]["optimizer"] = "adamw8bit"
    doc["spec"]["model"]["attention"] = "flash"
    assert main(["plan", _write(tmp_path, doc)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("error: the trainer cannot run ")
    assert [line.split(":")[0] for line in err[1:]] == [
        "  spec.training.optimizer",
        "  spec.model.attention",
    ]


def test_run_help_states_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: 1800)" in out and "(default: 4)" in out
    # It said "(default: temp dir)": the runs are under the current directory's .ftjob/.
    assert "default: a new .ftjob/run-* in the current directory, or in $FTJOB_LOCAL_DIR" in out


def test_plan_help_points_at_the_policy_flags_where_they_are(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The exit-status epilog, printed after the flags, said "the flags below"."""
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    epilog = out[out.index("exit status:") :]
    assert out.index("--allowed-image") < out.index("exit status:")
    assert "flags above" in epilog and "below" not in epilog


@pytest.mark.parametrize(("checkpoints", "output", "warns"),
                         [(False, None, True), (False, "out", False), (True, None, False)])  # fmt: skip
def test_plan_warns_when_the_trained_model_is_kept_nowhere(
    checkpoints: bool, output: str | None, warns: bool, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    doc = _quickstart()
    doc["spec"]["checkpoint"]["enabled"] = checkpoints
    doc["spec"]["output"] = {"uri": output} if output else {}
    assert main(["plan", _write(tmp_path, doc)]) == 0  # a warning, not a refusal
    err = capsys.readouterr().err
    assert ("warning: spec.output.uri" in err and "kept nowhere" in err) == warns, err


@pytest.mark.parametrize(
    ("spec", "flags", "status", "said"),
    [
        # Against the operator's defaults: a warning that names the field and how to check.
        (
            {"image": "evil.example/miner:1"},
            [],
            0,
            "warning: spec.image 'evil.example/miner:1' is not an allowed trainer image",
        ),
        (
            {"resources": {"serviceAccountName": "admin"}},
            [],
            0,
            "warning: spec.resources.serviceAccountName 'admin' is not an allowed trainer "
            "ServiceAccount (none: leave it unset) under the operator's default job policy",
        ),
        # Against the policy given: what the operator would do (Failed/NotAllowed).
        (
            {"image": "evil.example/miner:1"},
            ["--allowed-image", "registry.example/*"],
            2,
            "error: spec.image 'evil.example/miner:1' is not an allowed trainer image "
            "(ghcr.io/finetune-operator/trainer:0.1.0, registry.example/*): the operator's job "
            "policy refuses it",
        ),
        (
            {"resources": {"serviceAccountName": "admin"}},
            ["--trainer-service-account", "trainer"],
            2,
            "error: spec.resources.serviceAccountName 'admin' is not an allowed trainer "
            "ServiceAccount (trainer)",
        ),
        ({"image": "registry.example/trainer:2"}, ["--allowed-image", "registry.example/*"], 0, ""),
        (
            {"resources": {"serviceAccountName": "trainer"}},
            ["--trainer-service-account", "trainer"],
            0,
            "",
        ),
    ],
    ids=[
        "image-default",
        "account-default",
        "image-given",
        "account-given",
        "image-allowed",
        "account-allowed",
    ],
)
def test_plan_reports_what_the_job_policy_refuses(
    spec: dict[str, Any], flags: list[str], status: int, said: str, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """`spec.image` and `serviceAccountName` that the operator refuses (Failed/NotAllowed)
    passed `ftjob plan` without a word."""
    doc = _quickstart()
    for key, value in spec.items():
        doc["spec"][key] = {**doc["spec"].get(key, {}), **value} if key == "resources" else value
    assert main(["plan", _write(tmp_path, doc), *flags]) == status
    captured = capsys.readouterr()
    assert "Verdict" in captured.out
    if said:
        assert said in captured.err
    else:
        assert "policy" not in captured.err


@pytest.mark.parametrize(
    ("memory", "reason"),
    [
        ("1.2.3Gi", "is not a Kubernetes quantity"),
        (".", "is not a Kubernetes quantity"),
        ("1e999k", "is not a Kubernetes quantity"),  # an exponent or a suffix
        ("10E", "is too large for a memory quantity"),
        ("16Ei", "is too large for a memory quantity"),
    ],
)
def test_plan_refuses_a_malformed_memory_quantity_without_a_traceback(
    memory: str, reason: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = _quickstart()
    doc["spec"]["resources"]["memory"] = memory
    assert main(["plan", _write(tmp_path, doc)]) == 2
    err = capsys.readouterr().err
    assert f"error: spec.resources.memory: {memory!r} {reason}" in err


@pytest.mark.parametrize("cpu", ["thirty", "8 cores", "1.2.3", "-4"])
def test_plan_refuses_a_cpu_that_is_no_quantity(
    cpu: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = _quickstart()
    doc["spec"]["resources"]["cpu"] = cpu
    assert main(["plan", _write(tmp_path, doc)]) == 2  # the API server refuses it on each pod
    err = capsys.readouterr().err
    assert f"error: spec.resources.cpu: {cpu!r} is not a Kubernetes quantity" in err


@pytest.mark.parametrize("cpu", [8, "8", "500m", "1.5", "2e3", ".5"])
def test_plan_accepts_every_cpu_quantity_form(
    cpu: int | str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = _quickstart()
    doc["spec"]["resources"]["cpu"] = cpu
    assert main(["plan", _write(tmp_path, doc)]) == 0, capsys.readouterr().err


def test_operator_against_an_unreachable_cluster_says_so_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import socket

    from kubernetes.config import kube_config

    with socket.socket() as sock:  # a port nothing listens on (bound, never listening)
        sock.bind(("127.0.0.1", 0))
        server = f"https://127.0.0.1:{sock.getsockname()[1]}"
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "c", "cluster": {"server": server}}],
                    "users": [{"name": "u", "user": {"token": "t"}}],
                    "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                    "current-context": "x",
                }
            )
        )
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # not in a pod
        # KUBECONFIG as the client reads it (at import)
        monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
        assert main(["operator", "-A", "--metrics-port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot reach the Kubernetes API server at {server}: "), err
    assert "Connection refused" in err and "Traceback" not in err and len(err.splitlines()) == 1


def test_plan_reasons_give_small_sizes_in_mib_and_the_memory_that_would_fit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import re

    assert main(["plan", str(EXAMPLES / "quickstart.yaml"), "-o", "json"]) == 0
    reason = json.loads(capsys.readouterr().out)["reason"]
    assert "0.0 GiB" not in reason and " MiB of 2.0 GiB per process" in reason
    assert "at minNodes (1 rank, " in reason  # one rank, not "1 ranks"
    doc = _quickstart()
    doc["spec"]["resources"].update(memory="1Mi", gpusPerNode=2)
    assert main(["plan", _write(tmp_path, doc), "-o", "json"]) == 1
    reason = json.loads(capsys.readouterr().out)["reason"]
    # Before: "Nothing fits in 0.0 GiB ... A resources.memory per process of with >= 0 GiB".
    assert reason.startswith("Nothing fits in 0.5 MiB per CPU process"), reason
    hint = re.search(
        r"resources\.memory >= ([0-9.]+) (MiB|GiB) per pod \(([0-9.]+) MiB per process", reason
    )
    assert hint is not None, reason
    per_pod = float(hint[1]) * (1024 if hint[2] == "GiB" else 1)
    per_process = float(hint[3])
    # Each shown rounded up to 0.1 of its unit; a process's runtime (~0.5 GiB) is counted.
    assert 2 * per_process <= per_pod <= 2 * per_process + 0.1 * 1024 and per_process > 400


@pytest.mark.parametrize(("example", "unit"), [("quickstart", "MiB"), ("llama-3.1-8b-lora", "GiB")])
def test_plan_table_shows_a_small_plan_in_mib(
    example: str, unit: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The quickstart's breakdown read 0.00 GiB on every row."""
    assert main(["plan", str(EXAMPLES / f"{example}.yaml")]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("Memory per") and " of " not in line)
    assert header.split()[-1] == unit
    parameters = next(line for line in lines if line.startswith("parameters"))
    assert float(parameters.split()[1]) > 0.1
    facts = next(line for line in lines if line.startswith("Memory per") and " of " in line)
    assert f" {unit} of " in facts


@pytest.mark.parametrize(
    ("example", "header"), [("quickstart", "MiB per proc"), ("llama-3.1-8b-lora", "MiB per GPU")]
)
def test_plan_trace_table_names_the_device(
    example: str, header: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`ftjob plan --trace` of the CPU quickstart headed its table "MiB per GPU"."""
    from types import SimpleNamespace

    from finetune_operator.api.manifest import load_manifest
    from finetune_operator.planner import plan_job
    from finetune_operator.planner.trace_result import format_trace_comparison

    plan = plan_job(load_manifest(EXAMPLES / f"{example}.yaml").spec)
    sizes = dict.fromkeys(("parameters", "gradients", "optimizer", "activations", "buffers"), 1)
    trace = SimpleNamespace(**sizes, peak=5, peak_phase="forward/backward", seconds=1.0, notes=())
    assert format_trace_comparison(plan, trace).splitlines()[0].startswith(header)


def test_plan_trace_does_not_pass_on_the_libraries_deprecation_warnings(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """transformers' "`is_gradient_checkpointing` is deprecated" (a FutureWarning raised while
    the traced model is built) was printed as "warning: ..." beside the manifest's own."""
    import warnings
    from types import SimpleNamespace

    from finetune_operator.planner import trace

    def warning_trace(*_: Any) -> Any:  # the trace itself is tested in tests/planner
        warnings.warn("`is_gradient_checkpointing` is deprecated", FutureWarning, stacklevel=1)
        warnings.warn("a library's deprecation", DeprecationWarning, stacklevel=1)
        sizes = dict.fromkeys(("parameters", "gradients", "optimizer", "activations"), 1)
        return SimpleNamespace(
            **sizes, buffers=1, peak=5, peak_phase="forward/backward", seconds=1.0, notes=()
        )

    monkeypatch.setattr(trace, "trace_plan", warning_trace)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["plan", "--trace", str(EXAMPLES / "quickstart.yaml")]) == 0
    assert [str(w.message) for w in caught] == []
    assert "traced" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("memory", "fits", "warning"),
    [
        (80, False, "'80' has no unit, so it is bytes: did you mean '80Gi'?"),
        ("100Mi", False, None),
        ("2Gi", False, None),  # 256 MiB for each of 8 trainers: under one's runtime
        # 8Gi held the runtimes, not the export: rank 0 gathers the 15 GiB bf16 base (its
        # pod's 8 processes' share: 1.9 GiB each) to write the adapter.
        ("8Gi", False, None),
        ("24Gi", True, None),
    ],
)  # fmt: skip
def test_plan_refuses_a_pod_memory_too_small_to_start(
    memory: int | str,
    fits: bool,
    warning: str | None,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`memory: 80` (80 bytes, meant as 80Gi) planned without a word: the plan counted
    tensors only. Now each process's runtime must fit too, and a unitless slip is named."""
    doc = yaml.safe_load((EXAMPLES / "llama-3.1-8b-lora.yaml").read_text())
    doc["spec"]["resources"]["memory"] = memory
    assert main(["plan", _write(tmp_path, doc)]) == (0 if fits else 1)
    captured = capsys.readouterr()
    assert ("Host RAM per process: the runtime" in captured.out) is not fits
    if warning is None:
        assert "spec.resources.memory" not in captured.err
    else:
        assert f"warning: spec.resources.memory: {warning}" in captured.err


def test_operator_probe_names_a_silent_api_server_after_one_try() -> None:
    """A server that accepts and never answers (a host dropping the packets behaves alike) is
    named after one timeout: urllib3's default three retries made it four."""
    import contextlib
    import socket
    import threading

    import kubernetes.client as k8s

    from finetune_operator.handlers.entry import NoClusterError, _probe_api_server

    accepted: list[socket.socket] = []
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        server.settimeout(0.2)

        def accept() -> None:
            while not stopped.is_set():
                try:
                    accepted.append(server.accept()[0])
                except OSError:
                    continue

        stopped = threading.Event()
        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        config = k8s.Configuration(host=f"http://127.0.0.1:{server.getsockname()[1]}")
        try:
            with pytest.raises(NoClusterError, match="cannot reach the Kubernetes API server"):
                _probe_api_server(k8s.ApiClient(config), timeout_seconds=0.3)
        finally:
            stopped.set()
            thread.join()
            server.setblocking(False)  # a try still in the backlog (a slow accept thread)
            with contextlib.suppress(BlockingIOError):
                while True:
                    accepted.append(server.accept()[0])
            for conn in accepted:
                conn.close()
    assert len(accepted) == 1
