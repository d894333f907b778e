"""What a pod's process gets of the host's environment: the local kubelet ignores images, so
this Python environment stands for the image, plus what a kubelet itself sets."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from finetune_local.kubeletconfig import KubeletConfig

# Which local cluster a process belongs to (finding leftovers; never read by pods).
CLUSTER_ENV = "FTJOB_LOCAL_CLUSTER"
# What of the host environment stands for the pod's image: the Python environment includes
# PYTHONPATH (a source checkout run without installing it, e.g. a git worktree). And the
# trainer's step trace (README: `ftjob stragglers`), which no FineTuneJob field sets:
# `FINETUNE_STEP_TRACE_DIR=/tmp/trace ftjob run --local job.yaml` records one locally.
_PASS_ENV = (
    "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR", "HF_", "TRANSFORMERS_", "TORCH", "OMP_", "GLOO_",
    "PYTHONPATH", "FINETUNE_STEP_TRACE_DIR",
)  # fmt: skip
# The images' own ENV (Dockerfile, trainer_image/Dockerfile) that the processes depend on:
# unbuffered output, so a pod's log interleaves stdout and stderr as in a container.
_IMAGE_ENV = {"PYTHONUNBUFFERED": "1"}


def image_env(pod: Mapping[str, Any], config: KubeletConfig) -> dict[str, str]:
    """The environment a pod's container starts from, before its own `env`: the image's part,
    the service variables a kubelet injects, and the node's (`config.node_env`)."""
    venv_bin = os.path.dirname(sys.executable)
    env = {k: v for k, v in os.environ.items() if k.startswith(_PASS_ENV)} | _IMAGE_ENV
    env["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "/usr/bin:/bin")
    env["HOSTNAME"] = pod.get("spec", {}).get("hostname") or pod["metadata"]["name"]
    host, _, port = config.api_url.removeprefix("http://").partition(":")
    env.update(KUBERNETES_SERVICE_HOST=host, KUBERNETES_SERVICE_PORT=port.rstrip("/"))
    env[CLUSTER_ENV] = str(config.data_dir)
    env.update(config.extra_env)
    env.update(config.node_env.get(pod.get("spec", {}).get("nodeName") or "", {}))
    return env
