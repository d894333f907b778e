"""A kubeconfig for the local cluster.

Plain ``http://`` with no credentials: ``kubectl`` (v1.32), the ``kubernetes`` Python client and
kopf all accept an http server URL, so no self-signed certificate is needed. kubectl's discovery
cache is keyed by host:port and every cluster gets a fresh port, so stale caches do not bite.
"""

from __future__ import annotations

import pathlib

import yaml

CONTEXT = "finetune-local"


def write_kubeconfig(path: pathlib.Path, api_url: str, namespace: str = "default") -> pathlib.Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": CONTEXT, "cluster": {"server": api_url}}],
        "users": [{"name": CONTEXT, "user": {"token": "local"}}],
        "contexts": [
            {
                "name": CONTEXT,
                "context": {"cluster": CONTEXT, "user": CONTEXT, "namespace": namespace},
            }
        ],
        "current-context": CONTEXT,
        "preferences": {},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path
