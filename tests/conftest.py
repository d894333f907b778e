"""Shared fixtures: repository paths and example manifests."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.objectstore import CREDENTIALS, MotoServer, moto_server

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
CRD_PATH = REPO / "crds" / "finetunejobs.finetune.dev.yaml"
T = TypeVar("T")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """End-to-end tests last, the straggler module (the most load-sensitive) at the very end.
    `make test` runs the quick tests (`-m "not slow"`) in a second pytest beside the slow ones:
    this order keeps them beside the multi-process tests, long over before the first local
    cluster starts."""

    def rank(item: pytest.Item) -> int:
        if item.get_closest_marker("e2e") is None:
            return 0
        return 2 if item.path.name == "test_stragglers.py" else 1

    items.sort(key=rank)  # stable: collection order within each rank


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


def wait_until(
    fn: Callable[[], T | None],
    what: str,
    timeout: float = 60.0,
    interval: float = 0.2,
    detail: Callable[[], str] | None = None,
) -> T:
    """Poll `fn` until it returns a truthy value and return it; fail naming `what` (and the
    `detail` of the last state) after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out waiting for {what}" + (f"\n{detail()}" if detail else "")
            )
        time.sleep(interval)


def json_lines(text: str) -> list[dict[str, Any]]:
    """A strict JSON-lines reader: every line that starts a JSON object, or holds a step or
    summary record, must be exactly one JSON object (a log record fused into a step line fails
    here, as it would in a log shipper); the other lines are log records."""
    out = []
    for line in text.splitlines():
        if line.startswith('{"') or '{"step"' in line or '{"summary"' in line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise AssertionError(f"not a JSON line ({e}): {line!r}") from None
    return out


@pytest.fixture(scope="session")
def s3_server() -> Iterator[MotoServer]:
    """One S3-compatible server (moto) per test session; each test makes its own bucket."""
    with moto_server() as server:
        yield server


@pytest.fixture
def s3_credentials(monkeypatch: pytest.MonkeyPatch, s3_server: MotoServer) -> MotoServer:
    """The keys in this process's environment, where the kubelet puts them in a worker."""
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    return s3_server
