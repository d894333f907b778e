"""The chart renders, validates against Kubernetes 1.32, and its values schema is strict."""

from __future__ import annotations

import functools
import json
import operator
import re
import shutil
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.chart.conftest import ALL_OPTIONAL, CHART, REPO, Render, kinds, only, run_helm, template

K8S_VERSION = "1.32"

# prometheus-operator and kopf kinds are CRDs, absent from the official schemas that
# kubernetes-validate ships: they get the structural checks below instead.
CRD_KINDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PodMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
    ("kopf.dev/v1", "KopfPeering"),
    ("kopf.dev/v1", "ClusterKopfPeering"),
}

CONFIGURATIONS = {
    "defaults": (),
    "all-optional": ALL_OPTIONAL,
    "namespaced": (
        *ALL_OPTIONAL,
        "operator.clusterWide=false",
        "operator.watchNamespaces={ml,research}",
    ),
    "standalone": ("leaderElection.enabled=false",),
    "ha": ("replicaCount=3",),
    "gang": (
        "gangScheduling.schedulers={coscheduling,volcano}",
        "gangScheduling.default=coscheduling",
        "gangScheduling.schedulerName=scheduler-plugins-scheduler",
    ),
    "no-rbac-no-sa": (
        "rbac.create=false",
        "serviceAccount.create=false",
        "serviceAccount.name=ops",
    ),
}


def check_crd_object(obj: dict[str, Any]) -> None:
    """Structural check for kinds the official schemas do not cover."""
    meta = obj["metadata"]
    assert meta["name"] and len(meta["name"]) <= 63
    assert set(obj) <= {"apiVersion", "kind", "metadata", "spec"}
    kind, spec = obj["kind"], obj.get("spec", {})
    if kind == "ServiceMonitor":
        assert spec["selector"]["matchLabels"]
        assert spec["endpoints"] and all(e["port"] for e in spec["endpoints"])
    elif kind == "PodMonitor":
        assert spec["selector"]["matchLabels"] == {"finetune.dev/role": "worker"}
        ports = [e["port"] for e in spec["podMetricsEndpoints"]]
        assert ports == [f"metrics-{i}" for i in range(len(ports))]
        assert all(len(p) <= 15 for p in ports), "container port names are at most 15 chars"
    elif kind == "PrometheusRule":
        for group in spec["groups"]:
            assert group["name"] and group["rules"]
            for rule in group["rules"]:
                assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}
                assert rule["alert"][0].isupper() and rule["expr"].strip()
                assert rule["labels"]["severity"] in {"critical", "warning", "info"}
                assert {"summary", "description", "runbook_url"} <= set(rule["annotations"])
    else:
        assert kind in {"KopfPeering", "ClusterKopfPeering"} and not spec


def check_objects(docs: list[dict[str, Any]], version: str) -> None:
    """Every rendered object: a custom resource by check_crd_object, the rest against the
    official schemas of Kubernetes `version` (strict: no unknown fields)."""
    for obj in docs:
        if (obj["apiVersion"], obj["kind"]) in CRD_KINDS:
            check_crd_object(obj)
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            where = f"{obj['kind']}/{obj['metadata']['name']}"
            pytest.fail(f"{version} {where}: {err.message} at {list(err.path)}")


@pytest.mark.parametrize("sets", CONFIGURATIONS.values(), ids=CONFIGURATIONS.keys())
def test_every_object_validates(render: Render, sets: tuple[str, ...]) -> None:
    docs = render(*sets, include_crds=True)
    assert docs
    check_objects(docs, K8S_VERSION)


def test_helm_lint(helm: Path) -> None:
    for args in (
        ["lint", "--strict"],
        [
            "lint",
            "--strict",
            *functools.reduce(operator.iadd, (["--set", s] for s in ALL_OPTIONAL), []),
        ],
    ):
        proc = run_helm(helm, *args)
        assert proc.returncode == 0, proc.stdout + proc.stderr


OPTIONAL = {
    "prometheus.serviceMonitor.enabled": "ServiceMonitor",
    "prometheus.podMonitor.enabled": "PodMonitor",
    "prometheus.rules.enabled": "PrometheusRule",
    "grafana.dashboards.enabled": "ConfigMap",
}


def test_defaults_render_only_the_operator(render: Render) -> None:
    assert sorted(kinds(render())) == sorted(
        [
            "ServiceAccount",
            "ServiceAccount",  # the trainer's, bound to no Role
            "ClusterRole",
            "ClusterRoleBinding",
            "Service",
            "Deployment",
            "ClusterKopfPeering",
        ]
    )


@pytest.mark.parametrize(("value", "kind"), OPTIONAL.items(), ids=OPTIONAL.values())
def test_optional_resource_absent_by_default_present_when_enabled(
    render: Render, value: str, kind: str
) -> None:
    assert kind not in kinds(render())
    assert kinds(render(f"{value}=true")).count(kind) == 1


@pytest.mark.parametrize(
    "sets",
    [
        ("nonexistent=1",),
        ("image.tga=latest",),
        ("prometheus.rules.alerts.stragglerDetected.treshold=2",),
        ("prometheus.podMonitor.ranksPerPod=many",),
        ("prometheus.rules.alerts.jobFailing.severity=urgent",),
        ("prometheus.serviceMonitor.interval=30",),
        ("grafana.dashboards.extra=1",),
    ],
    ids=lambda s: s[0],
)
def test_schema_refuses_bad_values(helm: Path, sets: tuple[str, ...]) -> None:
    proc = template(helm, sets)
    assert proc.returncode != 0
    assert "values don't meet the specifications of the schema" in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (("replicaCount=2", "leaderElection.enabled=false"), "requires leaderElection.enabled"),
        (("serviceAccount.create=false",), "serviceAccount.name is required"),
        (
            ("prometheus.serviceMonitor.enabled=true", "metrics.service.enabled=false"),
            "requires metrics.service.enabled",
        ),
    ],
)
def test_inconsistent_values_fail(helm: Path, sets: tuple[str, ...], message: str) -> None:
    proc = template(helm, sets)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr


def _schema_paths(schema: dict[str, Any], prefix: str = "") -> set[str]:
    paths = set()
    for key, sub in schema.get("properties", {}).items():
        path = f"{prefix}{key}"
        paths.add(path)
        if sub.get("additionalProperties") is False:
            paths |= _schema_paths(sub, f"{path}.")
    return paths


def _value_paths(values: dict[str, Any], prefix: str = "") -> set[str]:
    paths = set()
    for key, sub in values.items():
        paths.add(f"{prefix}{key}")
        if (
            isinstance(sub, dict)
            and sub
            and not key.endswith(("Labels", "labels", "Annotations", "annotations", "nodeSelector"))
            and key not in {"resources", "podSecurityContext", "securityContext", "affinity"}
        ):
            paths |= _value_paths(sub, f"{prefix}{key}.")
    return paths


def test_schema_is_strict_everywhere_and_matches_values() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())

    def walk(node: dict[str, Any], where: str) -> None:
        if "properties" in node:
            assert node.get("additionalProperties") is False, f"{where} is not strict"
            for key, sub in node["properties"].items():
                walk(sub, f"{where}.{key}")

    walk(schema, "(root)")
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert _value_paths(values) <= _schema_paths(schema) | {"global"}
    assert _schema_paths(schema) - {"global"} <= _value_paths(values) | {
        "resources.claims",
        "leaderElection.peeringName",
        "serviceAccount.name",
    } | {p for p in _schema_paths(schema) if p.startswith("resources.")}


def _key_lines(text: str) -> dict[str, int]:
    """Dotted path of every key in values.yaml -> its line index (block-style YAML only)."""
    stack: list[tuple[int, str]] = []
    out: dict[str, int] = {}
    for i, line in enumerate(text.splitlines()):
        m = re.match(r"^( *)([A-Za-z_][\w]*):", line)
        if not m:
            continue
        indent = len(m.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, m.group(2)))
        out[".".join(k for _, k in stack)] = i
    return out


def test_every_value_is_documented_and_used() -> None:
    values_text = (CHART / "values.yaml").read_text()
    lines = values_text.splitlines()
    where = _key_lines(values_text)
    templates = "\n".join(p.read_text() for p in (CHART / "templates").iterdir())
    for path in _value_paths(yaml.safe_load(values_text)):
        block = path.count(".") == 0 or any(k.startswith(path + ".") for k in where)
        documented = lines[where[path] - 1].strip().startswith("#")
        # A block of values (`image:`) may go without; each leaf carries its `# --` comment.
        assert block or documented, f"{path} is not documented in values.yaml"
        leaf = path.rsplit(".", 1)[-1]
        assert f".{leaf}" in templates, f"{path} is not used by any template"


def test_chart_crd_is_a_copy_of_the_generated_crd() -> None:
    generated = REPO / "crds" / "finetunejobs.finetune.dev.yaml"
    packaged = CHART / "crds" / "finetunejobs.finetune.dev.yaml"
    assert packaged.read_bytes() == generated.read_bytes(), (
        "charts/finetune-operator/crds/ is stale: cp crds/finetunejobs.finetune.dev.yaml "
        "charts/finetune-operator/crds/"
    )


def _rules(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for d in docs if d["kind"] in {"ClusterRole", "Role"} for r in d["rules"]]


@pytest.mark.parametrize("sets", CONFIGURATIONS.values(), ids=CONFIGURATIONS.keys())
def test_rbac_has_no_wildcards(render: Render, sets: tuple[str, ...]) -> None:
    for rule in _rules(render(*sets)):
        for field in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule.get(field, []), rule
        assert not rule.get("nonResourceURLs"), rule
        assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"]), rule
        assert "secrets" not in rule["resources"], rule


def _grants(docs: list[dict[str, Any]]) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in _rules(docs):
        for group in rule["apiGroups"]:
            for res in rule["resources"]:
                out.setdefault((group, res), set()).update(rule["verbs"])
    return out


def test_rbac_grants_what_the_operator_needs(render: Render) -> None:
    grants = _grants(render())
    assert grants[("finetune.dev", "finetunejobs")] >= {"get", "list", "watch", "patch", "update"}
    assert grants[("finetune.dev", "finetunejobs/status")] >= {"patch", "update"}
    assert grants[("", "pods")] == {"create", "delete", "get", "list", "watch", "patch"}
    assert grants[("", "events")] == {"create", "patch"}
    assert grants[("kopf.dev", "clusterkopfpeerings")] >= {"list", "watch", "patch"}
    assert grants[("apiextensions.k8s.io", "customresourcedefinitions")] == {"get", "list", "watch"}
    # A terminating pod's node, read by name to tell a lost one (reconcile/nodeloss.py).
    assert grants[("", "nodes")] == {"get"}
    assert ("kopf.dev", "clusterkopfpeerings") not in _grants(
        render("leaderElection.enabled=false")
    )


def test_namespaced_mode_uses_roles_only_for_job_objects(render: Render) -> None:
    docs = render("operator.clusterWide=false", "operator.watchNamespaces={ml,research}")
    cluster_role = only(docs, "ClusterRole")
    assert {r for rule in cluster_role["rules"] for r in rule["resources"]} == {
        "customresourcedefinitions",
        "namespaces",
        "nodes",  # cluster-scoped: a Role cannot grant it
    }
    roles = [d for d in docs if d["kind"] == "Role"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["ml", "research"]
    assert all(("kopf.dev", "kopfpeerings") in _grants([r]) for r in roles)
    bindings = [d for d in docs if d["kind"] == "RoleBinding"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["ml", "research"]
    assert sorted(p["metadata"]["namespace"] for p in docs if p["kind"] == "KopfPeering") == [
        "ml",
        "research",
    ]
    args = only(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=ml" in args and "--namespace=research" in args
    assert "--all-namespaces" not in args
    pod_monitor = only(render(*ALL_OPTIONAL, "operator.clusterWide=false"), "PodMonitor")
    assert pod_monitor["spec"]["namespaceSelector"] == {"matchNames": ["ops"]}


def _container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return only(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]


def test_deployment_runs_the_operator_hardened(render: Render) -> None:
    docs = render()
    pod = only(docs, "Deployment")["spec"]["template"]["spec"]
    c = _container(docs)
    assert c["image"] == "ghcr.io/finetune-operator/operator:0.1.0"
    assert c["command"] == ["ftjob", "operator"]
    assert c["args"] == [
        "--all-namespaces",
        "--liveness=http://0.0.0.0:8080/healthz",
        "--peering=rel-finetune-operator",
        "--metrics-port=9090",
        "--reconcile-interval=10",
        "--scrape-timeout=2",
        "--watch-timeout=60",
        # The job policy: the chart's trainer image and ServiceAccount only, NetworkPolicies.
        "--trainer-image=ghcr.io/finetune-operator/trainer:0.1.0",
        "--trainer-service-account=rel-finetune-operator-trainer",
        "--network-policy",
    ]
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"metrics": 9090, "health": 8080}
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"]
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert pod["securityContext"]["runAsNonRoot"]
    assert c["resources"]["requests"] and c["resources"]["limits"]
    assert only(docs, "Service")["spec"]["ports"] == [
        {"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"}
    ]


def test_standalone_mode_recreates_instead_of_rolling(render: Render) -> None:
    docs = render("leaderElection.enabled=false")
    assert "--standalone" in _container(docs)["args"]
    assert only(docs, "Deployment")["spec"]["strategy"] == {"type": "Recreate"}
    assert "ClusterKopfPeering" not in kinds(docs)


def test_image_digest_and_tag_overrides(render: Render) -> None:
    assert _container(render("image.tag=0.2.0"))["image"].endswith("operator:0.2.0")
    digest = "sha256:" + "a" * 64
    assert _container(render(f"image.digest={digest}"))["image"].endswith(f"operator@{digest}")


def test_pod_monitor_scrapes_every_local_rank(render: Render) -> None:
    default = only(render("prometheus.podMonitor.enabled=true"), "PodMonitor")["spec"]
    assert [e["port"] for e in default["podMetricsEndpoints"]] == [f"metrics-{i}" for i in range(8)]
    assert default["namespaceSelector"] == {"any": True}
    two = only(
        render("prometheus.podMonitor.enabled=true", "prometheus.podMonitor.ranksPerPod=2"),
        "PodMonitor",
    )
    assert len(two["spec"]["podMetricsEndpoints"]) == 2


def test_dashboard_configmap_carries_the_sidecar_label(render: Render) -> None:
    cm = only(render("grafana.dashboards.enabled=true"), "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = (CHART / "files" / "dashboards" / "finetune-jobs.json").read_text()
    assert json.loads(cm["data"]["finetune-jobs.json"]) == json.loads(shipped)
    custom = only(
        render(
            "grafana.dashboards.enabled=true",
            "grafana.dashboards.label=dash",
            "grafana.dashboards.labelValue=yes",
            "grafana.dashboards.namespace=monitoring",
        ),
        "ConfigMap",
    )
    assert custom["metadata"]["labels"]["dash"] == "yes"
    assert custom["metadata"]["namespace"] == "monitoring"


def test_alerts_switch_off_one_by_one(render: Render) -> None:
    base = ("prometheus.rules.enabled=true",)
    names = [
        r["alert"]
        for g in only(render(*base), "PrometheusRule")["spec"]["groups"]
        for r in g["rules"]
    ]
    assert len(names) == 6
    keys = [
        "stragglerDetected",
        "jobFailing",
        "jobRestarting",
        "checkpointStale",
        "planInfeasible",
        "reconcileErrors",
    ]
    for key, name in zip(keys, names, strict=True):
        rule = only(render(*base, f"prometheus.rules.alerts.{key}.enabled=false"), "PrometheusRule")
        left = [r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]]
        assert left == [n for n in names if n != name]
    every_alert_off = [f"prometheus.rules.alerts.{k}.enabled=false" for k in keys]
    assert "PrometheusRule" not in kinds(render(*base, *every_alert_off))


def test_notes_render(helm: Path, tmp_path: Path) -> None:
    # `helm install --dry-run` needs a cluster; render NOTES.txt as a template instead.
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    notes = (chart / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "_notes_check.tpl").write_text(
        '{{- define "notes-check" -}}\n' + notes + "\n{{- end }}\n"
    )
    (chart / "templates" / "notes-check.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\ndata:\n"
        '  notes: {{ include "notes-check" . | toJson }}\n'
    )
    for sets in (
        (),
        (
            "operator.clusterWide=false",
            "leaderElection.enabled=false",
            "prometheus.rules.enabled=true",
        ),
    ):
        proc = template(
            helm, sets, chart=chart, extra=["--show-only", "templates/notes-check.yaml"]
        )
        assert proc.returncode == 0, proc.stderr
        text = yaml.safe_load(proc.stdout)["data"]["notes"]
        assert "rollout status deployment/rel-finetune-operator" in text
        assert "<no value>" not in text


def test_operator_settings_come_from_chart_values(render: Render) -> None:
    """The rendered args are what `ftjob operator` parses into its one settings object (the
    local cluster builds its operator's settings through the same parser)."""
    from finetune_operator.settings import parse_operator_args

    docs = render("operator.reconcileIntervalSeconds=30", "operator.scrapeTimeoutSeconds=5",
                  "operator.clusterWide=false", "operator.watchNamespaces={ml}")  # fmt: skip
    settings = parse_operator_args(_container(docs)["args"])
    assert settings.reconcile_interval_seconds == 30.0
    assert settings.scrape_timeout_seconds == 5.0
    assert settings.watch_timeout_seconds == 60.0
    assert settings.namespaces == ("ml",)
    assert settings.peering == "rel-finetune-operator" and settings.metrics_port == 9090
