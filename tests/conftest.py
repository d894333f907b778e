"""Shared fixtures: repository paths and example manifests."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
CRD_PATH = REPO / "crds" / "finetunejobs.finetune.dev.yaml"


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO
