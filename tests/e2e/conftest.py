"""End-to-end: the real operator, the local cluster, torchrun and gloo training on CPU."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from finetune_local.session import LocalSession
from tests.conftest import EXAMPLES, json_lines


@pytest.fixture
def quickstart_doc() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((EXAMPLES / "quickstart.yaml").read_text())
    return copy.deepcopy(doc)


def step_records(log: Path) -> list[dict[str, Any]]:
    """The rank-0 JSON step lines of a trainer log, in order (read strictly: a log record fused
    into a step line fails the test)."""
    return [r for r in json_lines(log.read_text(errors="replace")) if "step" in r]


RESUMED = re.compile(r"resumed from checkpoint step (\d+)")


def resumed_steps(log: Path) -> list[int]:
    return [int(m.group(1)) for m in RESUMED.finditer(log.read_text(errors="replace"))]


def committed_steps(root: Path) -> list[int]:
    return sorted(
        int(d.name.removeprefix("step-")) for d in root.glob("step-*") if (d / "COMMITTED").exists()
    )


def slowed_session(
    tmp_path_factory: pytest.TempPathFactory, name: str, nodes: int
) -> Iterator[LocalSession]:
    """A cluster + operator whose trainers sleep 0.2 s a step, so a test can act (kill,
    suspend, restart the operator) between two checkpoints."""
    data = tmp_path_factory.mktemp(name) / "cluster"
    with LocalSession(data, nodes=nodes, extra_env={"FT_STEP_DELAY_SECONDS": "0.2"}) as session:
        yield session
