"""`ftjob stragglers`: replay of recorded traces, JSON contract, errors naming file and line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from finetune_operator.cli import main
from finetune_operator.stragglers import StepRecord
from finetune_operator.stragglers.trace import TraceError, parse_trace, record_to_json
from tests.conftest import EXAMPLES
from tests.stragglers.test_detector import slow_rank, sync_job, window_end

VERDICT_KEYS = {"rank", "pod", "node", "detectedAtStep", "ratio", "waitRatio", "window",
                "epochStartStep"}  # fmt: skip


def write_per_rank(directory: Path, records: list[StepRecord]) -> Path:
    """One file per rank, as the trainer writes them."""
    directory.mkdir(parents=True, exist_ok=True)
    for r in records:
        with (directory / f"rank-{r.rank}.jsonl").open("a") as fh:
            fh.write(json.dumps(record_to_json(r)) + "\n")
    return directory


def replay(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["stragglers", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_names_the_straggler_from_a_directory_of_rank_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = write_per_rank(tmp_path / "trace", sync_job(200, slow_rank(2, 1.3)))
    code, out, _ = replay(capsys, str(trace), "-o", "json")
    assert code == 0
    (s,) = json.loads(out)["stragglers"]
    assert s.keys() >= VERDICT_KEYS
    assert (s["rank"], s["pod"], s["node"]) == (2, "pod-2", "node-of-pod-2")
    assert s["detectedAtStep"] == window_end(2) and s["ratio"] == pytest.approx(1.3)


def test_several_files_and_the_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_per_rank(tmp_path / "trace", sync_job(200, slow_rank(1, 1.5)))
    files = [str(p) for p in sorted(trace.glob("*.jsonl"))]
    code, out, _ = replay(capsys, *files)
    assert code == 0
    assert "pod-1" in out and "node-of-pod-1" in out and "1.50x" in out
    assert out.strip().endswith("1 straggler(s) in 800 records (threshold 1.2x, 20-step "
                                "windows, 3 in a row)")  # fmt: skip


def test_quiet_trace_gives_an_empty_list(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = write_per_rank(tmp_path / "t", sync_job(200, lambda r, s: 1.0 + 0.05 * r))
    code, out, _ = replay(capsys, str(trace), "-o", "json")
    assert code == 0 and json.loads(out)["stragglers"] == []
    assert replay(capsys, str(trace))[1].startswith("no straggler in 800 records")


def test_policy_from_a_job_manifest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_per_rank(tmp_path / "t", sync_job(200, slow_rank(2, 1.3)))
    doc = yaml.safe_load((EXAMPLES / "quickstart.yaml").read_text())
    doc["spec"].setdefault("faultTolerance", {})["stragglers"] = {"threshold": 1.4}
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    code, out, _ = replay(capsys, str(trace), "--policy-from", str(job), "-o", "json")
    assert code == 0 and json.loads(out)["stragglers"] == []
    assert json.loads(out)["policy"]["threshold"] == 1.4


GOOD = '{"step": 1, "rank": 0, "computeSeconds": 0.5}'
MALFORMED = [
    ("not-json", "{step: 1}", "not JSON"),
    ("not-an-object", "[1, 2]", "expected a JSON object"),
    ("missing-compute", '{"step": 1, "rank": 0}', "missing required key 'computeSeconds'"),
    ("negative-wait", '{"step": 1, "rank": 0, "computeSeconds": 1, "waitSeconds": -1}',
     "'waitSeconds' must be >= 0"),
    ("rank-as-string", '{"step": 1, "rank": "0", "computeSeconds": 1}', "'rank' must be an integer"),
    ("checkpoint-as-string", '{"step": 1, "rank": 0, "computeSeconds": 1, "checkpoint": "yes"}',
     "'checkpoint' must be true or false"),
    ("pod-as-number", '{"step": 1, "rank": 0, "computeSeconds": 1, "pod": 3}',
     "'pod' must be a string"),
]  # fmt: skip


@pytest.mark.parametrize(("line", "reason"), [(m[1], m[2]) for m in MALFORMED],
                         ids=[m[0] for m in MALFORMED])  # fmt: skip
def test_malformed_line_exits_2_naming_file_and_line(
    line: str, reason: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "rank-0.jsonl"
    trace.write_text(f"{GOOD}\n\n{line}\n{GOOD}\n")
    code, out, err = replay(capsys, str(trace))
    assert code == 2 and out == ""
    assert err.startswith(f"error: {trace}:3: ") and reason in err
    assert "Traceback" not in err


def test_missing_path_and_empty_directory_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = replay(capsys, str(tmp_path / "nope.jsonl"))
    assert code == 2 and "no such file" in err
    (tmp_path / "empty").mkdir()
    code, _, err = replay(capsys, str(tmp_path / "empty"))
    assert code == 2 and "no *.jsonl" in err


def test_trace_files_without_records_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "rank-0.jsonl").write_text("")
    (tmp_path / "rank-1.jsonl").write_text("\n")
    code, out, err = replay(capsys, str(tmp_path))
    assert code == 2 and "no step records" in err and "no straggler" not in out


def test_binary_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "rank-0.jsonl").write_bytes(b"\xff\xfe\x00garbage")
    code, _, err = replay(capsys, str(tmp_path))
    assert code == 2 and "not UTF-8" in err and "Traceback" not in err


def test_records_round_trip_through_the_format() -> None:
    records = sync_job(3, slow_rank(0, 2.0), checkpoint=lambda s: s == 2)
    lines = [json.dumps(record_to_json(r)) for r in records]
    assert parse_trace(lines, "x") == records
    with pytest.raises(TraceError, match=r"^x:1: "):
        parse_trace(["{}"], "x")


def test_a_pipe_is_a_trace_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`ftjob stragglers <(kubectl exec ... cat rank-0.jsonl)` names a pipe, not a regular
    file: it is read like one, not refused as missing."""
    import os
    import threading

    fifo = tmp_path / "trace"
    os.mkfifo(fifo)
    lines = [json.dumps(record_to_json(r)) + "\n" for r in sync_job(40, slow_rank(1, 1.0))]

    def feed() -> None:
        with fifo.open("w") as fh:
            fh.writelines(lines)

    writer = threading.Thread(target=feed)
    writer.start()
    code, out, err = replay(capsys, str(fifo))
    writer.join(timeout=30)
    assert code == 0, err
    assert f"in {len(lines)} records" in out
