"""Upper bounds on every count and size a FineTuneJob may ask for (issue 11.5).

One manifest must never be able to exhaust the operator, which plans every job of the cluster
in its own process: each number the planner or the trainer loops over, allocates by, or sleeps
for is bounded here, and the CRD carries the same bounds (``maximum``/``maxLength``/``maxItems``)
so the API server refuses an out-of-range job before the operator sees it. The bounds are
generous: each is above anything a real fine-tuning job uses today (the reason is beside it),
so they refuse only typos and hostile input.
"""

from __future__ import annotations

import re
from typing import Final

from finetune_operator.api.constants import rendezvous_name, worker_name

# --- cluster shape -------------------------------------------------------------------------
# Largest GPU servers expose 8-16 accelerators; 64 leaves room for partitioned (MIG) devices.
MAX_GPUS_PER_NODE: Final = 64
# Worker pods of one job. Pod host names are `<job>-worker-<index>`: the job-name limit below
# budgets for the widest index.
MAX_NODES: Final = 1000
# DNS-1035 label limit of Services (`<job>`, `<job>-rdzv`) and pod host names (`-worker-999`).
MAX_JOB_NAME: Final = 63 - len(worker_name("", MAX_NODES - 1))
# A Service's name is a DNS-1035 label: a letter first, no dots. The API server takes a
# FineTuneJob named `my.job` or `1job` (a DNS-1123 subdomain), then refuses its Services.
_DNS_1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
# World size: the largest training runs published use ~16-32k GPUs; fine-tuning far fewer.
MAX_GPUS: Final = 65536
MAX_GPU_MEMORY_GIB: Final = 1024.0  # today's largest accelerators carry 192-288 GiB

# --- training loop -------------------------------------------------------------------------
MAX_SEQUENCE_LENGTH: Final = 1_048_576  # 1M-token context models exist
MAX_GLOBAL_BATCH: Final = 1_048_576  # samples per optimizer step (pretraining uses ~4k)
MAX_MICRO_BATCH: Final = 65536
MAX_STEPS: Final = 100_000_000  # 1e8 optimizer steps: years of training at 1 step/s
MAX_EPOCHS: Final = 100_000.0
MAX_LEARNING_RATE: Final = 100.0  # AdamW uses ~1e-5..1e-3; SGD at most a few
MAX_WEIGHT_DECAY: Final = 100.0
MAX_GRAD_NORM: Final = 1e9
MAX_SEED: Final = 2**32 - 1  # numpy's seed range; torch takes more but the sampler uses both

# --- model architecture (largest real values: data/model_configs.json) -----------------------
MAX_HIDDEN_SIZE: Final = 131072  # largest dense models: 16-25k
MAX_LAYERS: Final = 4096  # largest: ~126-160
MAX_HEADS: Final = 4096  # largest: 128
MAX_HEAD_DIM: Final = 4096  # largest: 256
MAX_INTERMEDIATE_SIZE: Final = 1_048_576  # largest: ~53k (Llama 3.1 405B)
MAX_VOCAB_SIZE: Final = 16_777_216  # largest: 262k (Gemma 3)
MAX_POSITIONS: Final = 1 << 30  # Llama 4 Scout: 10M
MAX_EXPERTS: Final = 4096  # largest: 256-384
MAX_PARAMETERS: Final = 100_000_000_000_000  # 1e14; largest published: ~2e12
MAX_LORA_RANK: Final = 4096
MAX_LORA_ALPHA: Final = 1_048_576
MAX_LORA_TARGETS: Final = 256

# --- checkpoints, faults, stragglers -------------------------------------------------------
MAX_CHECKPOINTS_KEPT: Final = 1000
# A user's DeepSpeed config (spec.strategy.deepspeedConfig) as JSON: real ones are ~1-3 KB.
MAX_DEEPSPEED_CONFIG_BYTES: Final = 65536
MAX_INTERVAL_MINUTES: Final = 10080.0  # a week
MAX_RESTARTS: Final = 10000
MAX_BACKOFF_SECONDS: Final = 86400.0  # a day
MAX_STRAGGLER_THRESHOLD: Final = 1000.0
MAX_WINDOW_STEPS: Final = 1_000_000
MAX_CONSECUTIVE_WINDOWS: Final = 10000
MAX_COOLDOWN_SECONDS: Final = 30 * 86400
MAX_EVICTIONS_PER_HOUR: Final = 3600
# Collective timeouts: below 10 s a GC pause or a slow data batch reads as a lost peer; a day
# is the hang timeout's own bound.
MIN_COLLECTIVE_TIMEOUT_SECONDS: Final = 10
MAX_COLLECTIVE_TIMEOUT_SECONDS: Final = 86400
# A worker's toleration of an unreachable or not-ready node: below 10 s a kubelet restart or a
# short network blip re-forms the job; beyond a day, use a toleration of your own.
MIN_NODE_LOST_SECONDS: Final = 10
MAX_NODE_LOST_SECONDS: Final = 86400
# torchrun's agents wait at most this long for late nodes on every re-form.
MAX_LAST_CALL_SECONDS: Final = 600

# --- strings and lists (free text the operator copies into pods, Events and status) ---------
MAX_NAME_LENGTH: Final = 253  # DNS-1123 subdomain: ServiceAccounts, PriorityClasses, resources
MAX_MODEL_NAME_LENGTH: Final = 1024  # hub id, catalog name or path
MAX_URI_LENGTH: Final = 4096  # PATH_MAX
MAX_IMAGE_LENGTH: Final = 4096  # distribution's reference limit is 255 per name + tag/digest
MAX_GANG_TIMEOUT_SECONDS: Final = 86400  # a day: longer is a job that should not wait
MAX_SHORT_STRING: Final = 256  # quantities, model types, field names, revisions
MAX_LIST_ITEMS: Final = 256  # tolerations, pull secrets, selector entries

# --- the manifest itself (ftjob plan; etcd stores at most 1.5 MiB per object) ---------------
MAX_MANIFEST_BYTES: Final = 2**20
MAX_MANIFEST_VALUES: Final = 100_000  # after YAML aliases are expanded
MAX_NESTING: Final = 64  # a FineTuneJob's deepest field (affinity terms) is ~10 levels down


def job_name_problem(name: str) -> str | None:
    """Why the operator cannot run a job of this name (its Services and pod host names derive
    from it), or None. The API server's own check (a DNS-1123 subdomain) comes first."""
    if not _DNS_1035_LABEL.fullmatch(name):
        return (
            f"{name!r} cannot name the job's Services ({name}, {rendezvous_name(name)}): use a "
            "DNS-1035 label, lowercase letters, digits and '-', starting with a letter, no '.'"
        )
    if len(name) > MAX_JOB_NAME:
        return (
            f"{len(name)} characters; the operator accepts at most {MAX_JOB_NAME} (its "
            f"Services and pod host names derive from it: {worker_name('<name>', MAX_NODES - 1)})"
        )
    return None
