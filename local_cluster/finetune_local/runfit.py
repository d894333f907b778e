"""`ftjob run --local`'s nodes: their capacity (`--node-capacity RESOURCE=QUANTITY`) checked, and a
job refused before the cluster starts when a worker pod would fit no node even empty (it would
wait, Pending, until --timeout: 30 minutes by default). Pure."""

from __future__ import annotations

from collections.abc import Mapping

from finetune_local.nodes import DEFAULT_CAPACITY, node_allocatable
from finetune_local.resourcefit import amount, parse_quantity
from finetune_operator.api.spec import FineTuneJobSpec
from finetune_operator.reconcile.unschedulable import ACCELERATOR_FIELD, REQUEST_FIELDS
from finetune_operator.resources.worker import pod_resources


class NodeCapacityError(ValueError):
    """A `--node-capacity` whose quantity is none, named."""


def check_node_capacity(capacity: Mapping[str, str]) -> None:
    """Each `--node-capacity` value a quantity, or NodeCapacityError naming it."""
    for name, value in capacity.items():
        try:
            parse_quantity(value)
        except ValueError as err:
            raise NodeCapacityError(f"--node-capacity {name}={value}: {err}") from None


def worker_requests(spec: FineTuneJobSpec) -> dict[str, tuple[str, str]]:
    """What each worker pod of a CPU job requests, with the spec field behind it: the
    operator's own `pod_resources` (what it sends the scheduler) and the fields its
    unschedulable hint names, so the refusal here and the job's status never disagree."""
    requests = pod_resources(spec, gpus_per_node=1).get("requests", {})
    return {
        name: (value, REQUEST_FIELDS.get(name, ACCELERATOR_FIELD))
        for name, value in requests.items()
    }


def _readable(name: str, value: str) -> str:
    if name in ("memory", "ephemeral-storage"):
        return f"{amount(name, value) / 2**30:.1f}Gi"
    return value


def too_big_for_a_node(spec: FineTuneJobSpec, node_capacity: Mapping[str, str]) -> str | None:
    """Why no local node could ever take a worker pod (None when an empty one can)."""
    allocatable = node_allocatable({**DEFAULT_CAPACITY, **node_capacity})
    short = {
        name: f"{name} {value} ({field}), more than a node's allocatable "
        f"{_readable(name, allocatable.get(name, '0'))}"
        for name, (value, field) in worker_requests(spec).items()
        if amount(name, value) > amount(name, allocatable.get(name, "0"))
    }
    if not short:
        return None
    flags = " ".join(f"--node-capacity {name}=..." for name in short)
    return (
        f"a worker pod requests {'; '.join(short.values())}: it would fit no local node and "
        f"wait until --timeout. Lower it, or give the nodes more ({flags})"
    )
