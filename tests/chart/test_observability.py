"""Alerts and dashboards query only the metrics of DESIGN.md §6/§8, in PromQL that parses, and
link runbooks and docs that exist."""

from __future__ import annotations

import json
import re
from typing import Any

import promql_parser
import pytest

from tests.chart.conftest import ALL_OPTIONAL, CHART, REPO, Render, only
from tests.chart.metrics_contract import DESIGN_METRICS, HISTOGRAM, queryable_series

DASHBOARD_DIR = CHART / "files" / "dashboards"
DASHBOARDS = sorted(DASHBOARD_DIR.glob("*.json"))
ALERTS_DOC = REPO / "docs" / "alerts.md"
METRICS_DOC = REPO / "docs" / "metrics.md"

# Grafana expands these before the query reaches Prometheus; give them a value PromQL accepts.
GRAFANA_MACROS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}


def selected_metrics(expr: str) -> set[str]:
    """Parse `expr` (fails the test on a syntax error) and return the metric names it selects."""
    for macro, value in GRAFANA_MACROS.items():
        expr = expr.replace(macro, value)
    ast = promql_parser.parse(expr)
    names: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            name = node.name or next(
                (m.value for m in node.matchers.matchers if m.name == "__name__"), None
            )
            assert name, f"selector without a metric name in {expr!r}"
            names.add(name)

    promql_parser.walk(ast, visit)
    return names


def rule_exprs(render: Render) -> dict[str, str]:
    rule = only(render(*ALL_OPTIONAL), "PrometheusRule")
    return {r["alert"]: r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]}


def dashboard_exprs() -> dict[str, str]:
    out: dict[str, str] = {}
    for path in DASHBOARDS:
        dash = json.loads(path.read_text())
        for panel in dash["panels"]:
            for target in panel.get("targets", []):
                out[f"{path.name}: {panel['title']} [{target['refId']}]"] = target["expr"]
        for var in dash["templating"]["list"]:
            if var["type"] == "query":
                query = var["query"]["query"]
                inner = re.fullmatch(r"label_values\((.+),\s*\w+\)", query)
                assert inner, f"{var['name']}: expected label_values(<selector>, <label>)"
                out[f"{path.name}: variable {var['name']}"] = inner.group(1)
    return out


def test_selected_metrics_sees_through_the_whole_tree() -> None:
    expr = 'sum by (le) (rate(a_bucket{x="$v"}[$__rate_interval])) / on() group_left b - time()'
    assert selected_metrics(expr) == {"a_bucket", "b"}
    with pytest.raises(ValueError):
        selected_metrics("sum(rate(a[5m])")


def test_alert_queries_parse_and_use_design_metrics(render: Render) -> None:
    exprs = rule_exprs(render)
    assert len(exprs) == 6
    allowed = queryable_series()
    for alert, expr in exprs.items():
        used = selected_metrics(expr)
        assert used, alert
        assert used <= allowed, f"{alert} uses metrics outside DESIGN.md: {used - allowed}"


def test_dashboard_queries_parse_and_use_design_metrics() -> None:
    exprs = dashboard_exprs()
    assert exprs
    allowed = queryable_series()
    used_overall: set[str] = set()
    for where, expr in exprs.items():
        used = selected_metrics(expr)
        assert used <= allowed, f"{where} uses metrics outside DESIGN.md: {used - allowed}"
        used_overall |= used
    # Every metric the operator and trainer export shows up somewhere on the dashboard.
    shown = {
        re.sub(r"_(bucket|sum|count)$", "", m) if m not in DESIGN_METRICS else m
        for m in used_overall
    }
    assert shown == set(DESIGN_METRICS), set(DESIGN_METRICS) - shown


def test_histograms_are_queried_through_their_series_only() -> None:
    for where, expr in dashboard_exprs().items():
        for name, kind in DESIGN_METRICS.items():
            if kind == HISTOGRAM:
                assert not re.search(rf"\b{name}\b(?!_(bucket|sum|count))", expr), where


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_is_well_formed(path: Any) -> None:
    dash = json.loads(path.read_text())
    assert dash["uid"] and dash["title"] and "id" not in dash
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert {"datasource", "namespace", "finetunejob"} <= set(variables)
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in dash["panels"]:
        assert panel["gridPos"]["x"] >= 0 and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["description"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            # Trainer series are filtered by the job variable; operator series carry finetunejob.
            if "finetune_trainer_" in expr:
                assert 'finetunejob=~"$finetunejob"' in expr, panel["title"]
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for subject in (
        "compute time",
        "wait time",
        "straggler ratio",
        "step rate",
        "tokens",
        "loss",
        "checkpoint blocking",
        "restarts",
        "evictions",
    ):
        assert subject in titles, f"no panel for {subject}"
    assert any(p["type"] == "heatmap" for p in dash["panels"])


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lowercase, punctuation dropped, spaces to dashes."""
    out = set()
    for heading in re.findall(r"^#+\s+(.+?)\s*$", markdown, flags=re.M):
        out.add(re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-"))
    return out


def test_every_alert_links_to_its_runbook(render: Render) -> None:
    anchors = _anchors(ALERTS_DOC.read_text())
    rule = only(render(*ALL_OPTIONAL), "PrometheusRule")
    for group in rule["spec"]["groups"]:
        for r in group["rules"]:
            url = r["annotations"]["runbook_url"]
            assert url.startswith("https://") and url.split("#")[0].endswith("docs/alerts.md")
            assert url.split("#", 1)[1] in anchors, (
                f"{r['alert']}: no runbook section in docs/alerts.md"
            )


def test_metrics_doc_covers_every_metric() -> None:
    text = METRICS_DOC.read_text()
    rows = dict(re.findall(r"^\|\s*`(finetune_\w+)`\s*\|\s*(\w+)\s*\|", text, flags=re.M))
    assert rows == DESIGN_METRICS
