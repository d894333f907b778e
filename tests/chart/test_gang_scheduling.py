"""The chart's gang scheduling values: RBAC on exactly the chosen schedulers' podgroups (in
the ClusterRole, or in each watched namespace's Role), the operator's default as flags the
real CLI parses, and refusals of values that cannot work."""

from __future__ import annotations

from pathlib import Path

import pytest

from finetune_operator.settings import parse_operator_args
from tests.chart.conftest import Render, only, template
from tests.chart.test_chart import _grants

COSCHEDULING = ("scheduling.x-k8s.io", "podgroups")
VOLCANO = ("scheduling.volcano.sh", "podgroups")
# What reconcile/apply.py calls on a PodGroup: create (409: patch), delete on suspend/end, and
# get to read its status (reconcile/gang.py; the status subresource is only for writing it).
VERBS = {"create", "get", "patch", "delete"}


def _args(docs: list[dict]) -> list[str]:
    args: list[str] = only(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    return args


def test_absent_by_default(render: Render) -> None:
    docs = render()
    grants = _grants(docs)
    assert COSCHEDULING not in grants and VOLCANO not in grants
    assert not any(a.startswith("--gang-scheduler") for a in _args(docs))
    assert parse_operator_args(_args(docs)).policy.gang_scheduler is None


@pytest.mark.parametrize(
    ("schedulers", "granted"),
    [
        ("{coscheduling}", {COSCHEDULING}),
        ("{volcano}", {VOLCANO}),
        ("{coscheduling,volcano}", {COSCHEDULING, VOLCANO}),
    ],
    ids=["coscheduling", "volcano", "both"],
)
def test_cluster_role_grants_exactly_the_chosen_podgroups(
    render: Render, schedulers: str, granted: set
) -> None:
    grants = _grants([only(render(f"gangScheduling.schedulers={schedulers}"), "ClusterRole")])
    assert {k for k in grants if k[1] == "podgroups"} == granted
    assert all(grants[k] == VERBS for k in granted)


def test_namespaced_mode_grants_podgroups_in_each_watched_namespace(render: Render) -> None:
    docs = render("operator.clusterWide=false", "operator.watchNamespaces={ml,research}",
                  "gangScheduling.schedulers={volcano}")  # fmt: skip
    assert VOLCANO not in _grants([only(docs, "ClusterRole")])
    roles = [d for d in docs if d["kind"] == "Role"]
    assert len(roles) == 2 and all(_grants([r])[VOLCANO] == VERBS for r in roles)


def test_default_reaches_the_operator_as_flags(render: Render) -> None:
    docs = render("gangScheduling.schedulers={coscheduling}", "gangScheduling.default=coscheduling",
                  "gangScheduling.schedulerName=sp-scheduler")  # fmt: skip
    policy = parse_operator_args(_args(docs)).policy
    assert (policy.gang_scheduler, policy.gang_scheduler_name) == ("coscheduling", "sp-scheduler")


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (("gangScheduling.default=volcano",), "must be one of gangScheduling.schedulers"),
        (
            ("gangScheduling.schedulers={coscheduling}", "gangScheduling.schedulerName=x"),
            "applies to gangScheduling.default",
        ),
        (("gangScheduling.schedulers={kueue}",), "must be one of the following"),
    ],
    ids=["default-not-granted", "name-without-default", "unknown-scheduler"],
)
def test_values_that_cannot_work_fail(helm: Path, sets: tuple[str, ...], message: str) -> None:
    proc = template(helm, sets)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
