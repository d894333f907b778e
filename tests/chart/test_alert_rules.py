"""The chart's straggler alert fires on the series the operator really exports: `promtool test
rules` runs the rendered PrometheusRule over input series produced by the operator's own metrics
code (not typed by hand), and stays silent for a rank below the threshold."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from finetune_operator import metrics
from finetune_operator.api import metricnames as mn
from tests.chart.conftest import ALL_OPTIONAL, Render, only

PROMTOOL = shutil.which("promtool")
ALERT = "FineTuneJobStragglerDetected"


def _series(namespace: str, name: str, ratios: dict[int, float]) -> list[tuple[str, float]]:
    """`metric{labels}` and value of each straggler-ratio sample the operator exports."""
    metrics.set_straggler_ratios(namespace, name, ratios)
    try:
        text = generate_latest(metrics.REGISTRY).decode()
    finally:
        metrics.forget_job_series(namespace, name)
    out = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == mn.OPERATOR_STRAGGLER_RATIO.name and s.labels.get("finetunejob") == name:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out.append((f"{s.name}{{{labels}}}", s.value))
    return out


def _fires(labels: dict[str, str], annotations: dict[str, str]) -> dict[str, Any]:
    return {"exp_labels": labels, "exp_annotations": annotations}


def _expand(template: str, labels: dict[str, str], value: str) -> str:
    """What Prometheus' templating makes of the chart's annotation for these labels."""
    for key, text in labels.items():
        template = template.replace(f"{{{{ $labels.{key} }}}}", text)
    return template.replace('{{ $value | printf "%.2f" }}', value)


@pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (make promtool: apt-get install prometheus)"
)
def test_straggler_alert_fires_on_the_operator_series(render: Render, tmp_path: Path) -> None:
    rule = only(render(*ALL_OPTIONAL), "PrometheusRule")
    alert = next(r for g in rule["spec"]["groups"] for r in g["rules"] if r["alert"] == ALERT)
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    slow = _series("ml", "llama", {0: 1.0, 1: 1.02, 2: 1.5})
    # The same job name in another namespace, below the threshold: kept apart, silent.
    other = _series("research", "llama", {0: 1.0, 1: 1.1})
    assert len(slow) == 3 and len(other) == 2, (slow, other)
    labels = {"namespace": "ml", "finetunejob": "llama", "rank": "2"}
    annotations = {k: _expand(v, labels, "1.50") for k, v in alert["annotations"].items()}
    assert annotations["summary"] == "FineTuneJob ml/llama rank 2 is a straggler."
    test = {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": s, "values": f"{v}x30"} for s, v in (*slow, *other)],
                "alert_rule_test": [
                    # `for: 10m` not yet elapsed: nothing fires.
                    {"eval_time": "5m", "alertname": ALERT, "exp_alerts": []},
                    {
                        "eval_time": "15m",
                        "alertname": ALERT,
                        "exp_alerts": [_fires({**labels, "severity": "warning"}, annotations)],
                    },
                ],
            }
        ],
    }
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(test))
    assert PROMTOOL is not None
    for args in (["check", "rules", "rules.yaml"], ["test", "rules", "test.yaml"]):
        proc = subprocess.run(
            [PROMTOOL, *args], cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
