"""Fixtures: a LocalCluster with a small test CRD, and clients of it."""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml
from kubernetes import client, config

from finetune_local.cluster import LocalCluster

WIDGET_CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.test.dev"},
    "spec": {
        "group": "test.dev",
        "scope": "Namespaced",
        "names": {
            "kind": "Widget",
            "plural": "widgets",
            "singular": "widget",
            "shortNames": ["wdg"],
        },
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": [
                    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
                    {"name": "Size", "type": "integer", "jsonPath": ".spec.size"},
                    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                ],
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "required": ["size"],
                                "properties": {
                                    "size": {
                                        "type": "integer",
                                        "minimum": 1,
                                        "maximum": 10,
                                        "description": "How many widgets.",
                                    },
                                    "mode": {
                                        "type": "string",
                                        "enum": ["fast", "slow"],
                                        "default": "fast",
                                    },
                                    "minNodes": {"type": "integer"},
                                    "maxNodes": {"type": "integer"},
                                },
                                "x-kubernetes-validations": [
                                    {
                                        "rule": "!has(self.minNodes) || !has(self.maxNodes) || self.minNodes <= self.maxNodes",
                                        "message": "minNodes must be <= maxNodes",
                                        "fieldPath": ".minNodes",
                                    }
                                ],
                            },
                            "status": {
                                "type": "object",
                                "properties": {"phase": {"type": "string"}},
                            },
                        },
                    }
                },
            }
        ],
    },
}


@pytest.fixture(scope="session")
def crds_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    directory = tmp_path_factory.mktemp("crds")
    (directory / "widgets.test.dev.yaml").write_text(yaml.safe_dump(WIDGET_CRD))
    return directory


@pytest.fixture(scope="module")
def api_cluster(
    crds_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    """The API server alone: fast, no processes."""
    with LocalCluster(tmp_path_factory.mktemp("api"), crds_dir=crds_dir, kubelet=False) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def cluster(
    crds_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    """API server + 3 virtual nodes + kubelet."""
    with LocalCluster(tmp_path_factory.mktemp("cluster"), crds_dir=crds_dir, nodes=3) as local:
        yield local


@pytest.fixture(scope="session")
def new_api_client() -> Callable[[LocalCluster], client.ApiClient]:
    """A kubernetes ApiClient for a cluster, from its kubeconfig (as a user would build one)."""

    def build(cluster: LocalCluster) -> client.ApiClient:
        return config.new_client_from_config(config_file=str(cluster.kubeconfig_path))

    return build
