"""What of the host's environment a local pod's process gets (the image's stand-in)."""

from __future__ import annotations

import pathlib

import pytest

from finetune_local.imageenv import image_env
from finetune_local.kubeletconfig import KubeletConfig

POD = {"metadata": {"name": "job-worker-0"}, "spec": {"nodeName": "local-node-0"}}


def config(tmp_path: pathlib.Path) -> KubeletConfig:
    return KubeletConfig(data_dir=tmp_path, api_url="http://127.0.0.1:1", node_names=["n"])


def test_the_step_trace_dir_reaches_the_trainer(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README's way to record a trace for `ftjob stragglers` on the local cluster: no
    FineTuneJob field sets it, and the host's variable stopped at the pod (no trace)."""
    monkeypatch.setenv("FINETUNE_STEP_TRACE_DIR", "trace")
    assert image_env(POD, config(tmp_path))["FINETUNE_STEP_TRACE_DIR"] == "trace"


def test_other_host_variables_stay_on_the_host(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FINETUNE_OTHER", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    env = image_env(POD, config(tmp_path))
    assert "FINETUNE_OTHER" not in env and "AWS_SECRET_ACCESS_KEY" not in env
