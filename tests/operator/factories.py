"""Test data for the operator tests: example specs and hand-made plans (no planner needed)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from finetune_operator.api.plan import MemoryBreakdown, Plan

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "examples" / "quickstart.yaml"
UID = "1b4e28ba-2fa1-11d2-883f-0016d3cca427"

EIGHT_GPU_SPEC: dict[str, Any] = {
    "model": {"name": "meta-llama/Llama-3.1-8B"},
    "dataset": {"uri": "s3://data/chat.jsonl", "messagesField": "messages"},
    "method": {"type": "lora"},
    "training": {"sequenceLength": 4096, "globalBatchSize": 64, "maxSteps": 1000},
    "resources": {
        "gpu": {"product": "H100-80GB"},
        "gpusPerNode": 8,
        "minNodes": 1,
        "maxNodes": 2,
        "cpu": "32",
        "memory": "512Gi",
        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["a"]}]},
                        {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["b"]}]},
                    ]
                }
            }
        },
        "priorityClassName": "training",
        "imagePullSecrets": [{"name": "regcred"}],
        "serviceAccountName": "trainer",
    },
    "checkpoint": {"uri": "s3://ckpt/llama8b", "intervalSteps": 100},
    "faultTolerance": {"maxRestarts": 5, "backoffSeconds": 30},
}


def quickstart_raw() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(QUICKSTART.read_text())
    return copy.deepcopy(doc["spec"])


def make_plan(nodes: int = 2, gpus_per_node: int = 1, *, fits: bool = True) -> Plan:
    gib = 1 << 30
    return Plan(
        fits=fits,
        world_size=nodes * gpus_per_node,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        strategy="ddp",
        micro_batch_size=2,
        gradient_accumulation_steps=2,
        activation_checkpointing=False,
        gpu_memory_bytes=80 * gib,
        headroom=0.3 if fits else -0.5,
        estimated_step_seconds=1.0,
        reason="ddp fits on 2 nodes" if fits else "needs 120 GiB per GPU; 80 GiB available",
        memory=MemoryBreakdown(
            parameters=gib,
            gradients=gib,
            optimizer=2 * gib,
            activations=gib,
            buffers=gib,
            peak=6 * gib,
            reserved=7 * gib,
            total=8 * gib,
        ),
    )
