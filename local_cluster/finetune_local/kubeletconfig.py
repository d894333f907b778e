"""What the local kubelet is configured with: its nodes, their capacity, labels and the
environment their pods get, the gang schedulers beside the default one, its heartbeat."""

from __future__ import annotations

import pathlib
from dataclasses import dataclass, field

from finetune_local.nodes import DEFAULT_CAPACITY, DEFAULT_HEARTBEAT_SECONDS
from finetune_local.podgroups import GangScheduler


@dataclass
class KubeletConfig:
    data_dir: pathlib.Path
    api_url: str
    node_names: list[str]
    node_labels: dict[str, str] = field(default_factory=dict)
    node_capacity: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_CAPACITY))
    # Per node name: capacity over node_capacity (a bigger or a GPU node among the others).
    node_resources: dict[str, dict[str, str]] = field(default_factory=dict)
    extra_env: dict[str, str] = field(default_factory=dict)
    # Per node name: environment its pods' processes get, standing for what that node's hardware
    # does to them (a slow GPU: FT_STEP_DELAY_SECONDS). A pod moved elsewhere runs normally.
    node_env: dict[str, dict[str, str]] = field(default_factory=dict)
    address_scope: str = ""  # claims of this scope only (addresses.py); clusters use the default
    # Gang schedulers running beside the default one (binding.py), e.g. Coscheduling.
    gang_schedulers: list[GangScheduler] = field(default_factory=list)
    heartbeat_seconds: float = DEFAULT_HEARTBEAT_SECONDS  # each node's Lease renewal
