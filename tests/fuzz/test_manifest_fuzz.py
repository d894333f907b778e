"""Fuzz (issue 11.5): malformed manifests through `ftjob plan` and through the local API server.

Every example must end in a clean answer: `ftjob plan` exits 0, 1 or 2 (2 naming the field,
never a traceback); the API server answers 201, 400, 404, 409 or 422 (422 naming the field,
never a 500); and whatever the API server refuses, `ftjob plan` refuses too, so a plan is never
made for a job the cluster would not take. The per-example deadline (conftest) catches hangs;
the process's peak memory is checked at the end.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import resource
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import event, given

from finetune_local.cluster import LocalCluster
from finetune_operator.api.constants import API_VERSION, PLURAL
from finetune_operator.cli import main
from tests.fuzz.mutations import corrupted_bytes, malformed_manifest

# The timeout is for the long `dev` profile; a hung example fails its own 20 s deadline first.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

# "  <field>: <reason>" lines of a refusal: the field is a path into the manifest (JSON-quoted
# when a key holds spaces or control characters), or "file".
_REFUSAL_LINE = re.compile(r'^  ("(?:[^"\\]|\\.)*"|[^\s:]+): \S')
_MAX_RSS_GROWTH = 512 * 2**20


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@pytest.fixture(scope="module")
def api_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with LocalCluster(tmp_path_factory.mktemp("fuzz-api"), kubelet=False) as cluster:
        yield cluster.api_url


@pytest.fixture(scope="module", autouse=True)
def bounded_memory() -> Iterator[None]:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    yield
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert after - before < _MAX_RSS_GROWTH, f"peak RSS grew by {(after - before) / 2**20:.0f} MiB"


def plan(path: Path) -> tuple[int, str]:
    """`ftjob plan` in process: (exit status, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(["plan", str(path), "-o", "json"])
    return status, err.getvalue()


def assert_clean_plan(status: int, err: str) -> None:
    assert "Traceback" not in err, err
    assert status in (0, 1, 2), (status, err)
    if status == 2:
        lines = err.splitlines()
        assert lines and lines[0].startswith("error:"), err
        if len(lines) == 1:  # a planner refusal: "error: spec.<field>: <reason>"
            assert re.match(r"^error: spec\.\S+: \S", lines[0]), err
        else:  # a manifest refusal: one "  <field>: <reason>" line per problem
            assert all(
                _REFUSAL_LINE.match(line) or line.startswith("    ") for line in lines[1:]
            ), err


def create(api_url: str, doc: Any) -> tuple[int, dict[str, Any]]:
    """POST the document as JSON, as kubectl would: with fieldValidation=Strict (its default),
    NaN/inf written as the invalid JSON literals Python emits (a real server refuses them)."""
    body = json.dumps(doc).encode()
    request = urllib.request.Request(
        f"{api_url}/apis/{API_VERSION}/namespaces/default/{PLURAL}?fieldValidation=Strict",
        data=body,
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def _unique_name(doc: Any) -> Any:
    meta = doc.get("metadata") if isinstance(doc, dict) else None
    if isinstance(meta, dict) and meta.get("name") in (
        "quickstart",
        "llama-8b-lora",
        "llama-70b-full",
    ):
        meta["name"] = f"fz-{uuid.uuid4().hex[:10]}"
    return doc


@given(case=malformed_manifest())
def test_malformed_manifests_plan_and_api_server_agree(
    case: tuple[dict[str, Any], str], workdir: Path, api_url: str
) -> None:
    doc, what = case
    doc = _unique_name(doc)
    path = workdir / "job.yaml"
    path.write_text(yaml.safe_dump(doc, allow_unicode=True))
    status, err = plan(path)
    assert_clean_plan(status, err)

    code, body = create(api_url, doc)
    event(f"ftjob plan exit {status}, API server {code}")
    assert code in (201, 400, 404, 409, 422), (what, code, body)
    if code == 422:
        causes = body.get("details", {}).get("causes", [])
        assert causes and all(c.get("field") for c in causes), (what, body)
    if code in (400, 422):
        # What the cluster refuses, the plan refuses: plan and cluster never disagree.
        assert status == 2, (what, code, body.get("message"), err)


@given(data=corrupted_bytes())
def test_corrupted_files_never_crash_ftjob_plan(data: bytes, workdir: Path) -> None:
    path = workdir / "corrupt.yaml"
    path.write_bytes(data)
    status, err = plan(path)
    event(f"ftjob plan exit {status}")
    assert_clean_plan(status, err)
