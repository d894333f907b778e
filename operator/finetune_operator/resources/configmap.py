"""The job's ConfigMap `<job>-config`: `job.json` read by every trainer process, and for a
DeepSpeed plan `deepspeed.json`, the DeepSpeed config at the planned world size, for people to
read (the trainer regenerates it at the world size it runs with)."""

from __future__ import annotations

import json
from typing import Any

from finetune_operator.api.constants import CONFIG_FILE_NAME, ROLE_WORKER, config_map_name
from finetune_operator.api.deepspeed_config import (
    DEEPSPEED_CONFIG_FILE_NAME,
    planned_deepspeed_config,
)
from finetune_operator.api.jobconfig import JobConfig
from finetune_operator.api.plan import Plan
from finetune_operator.api.spec import FineTuneJobSpec
from finetune_operator.resources.common import Owner, object_meta


def render_job_config(owner: Owner, spec: FineTuneJobSpec, plan: Plan) -> str:
    config = JobConfig(
        name=owner.name, namespace=owner.namespace, uid=owner.uid, spec=spec, plan=plan
    )
    # sort_keys: the same job always renders byte-identical JSON, so re-applying is a no-op.
    return json.dumps(config.to_json_dict(), indent=2, sort_keys=True)


def build_config_map(owner: Owner, spec: FineTuneJobSpec, plan: Plan) -> dict[str, Any]:
    data = {CONFIG_FILE_NAME: render_job_config(owner, spec, plan)}
    deepspeed = planned_deepspeed_config(spec, plan)
    if deepspeed is not None:
        data[DEEPSPEED_CONFIG_FILE_NAME] = deepspeed
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        # Role "worker": the config is the workers' input (the rendezvous ignores it).
        "metadata": object_meta(owner, config_map_name(owner.name), ROLE_WORKER),
        "data": data,
    }
