"""The README's main job, exactly as a user runs it: `ftjob run --local examples/quickstart.yaml`."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import EXAMPLES, REPO
from tests.e2e.conftest import committed_steps, step_records

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def test_quickstart_runs_to_succeeded(tmp_path: Path) -> None:
    data = tmp_path / "cluster"
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "finetune_operator.cli", "run", "--local",
         str(EXAMPLES / "quickstart.yaml"), "--data-dir", str(data), "--timeout", "300"],
        cwd=REPO, capture_output=True, text=True, timeout=360,
    )  # fmt: skip
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "FineTuneJob quickstart: Succeeded" in proc.stdout
    assert elapsed < 300, f"quickstart took {elapsed:.0f} s"
    # The final report carries the last step, from the workers' termination messages.
    assert "steps 60/60" in proc.stdout, proc.stdout[-2000:]

    checkpoints = committed_steps(data / "shared" / "checkpoints" / "quickstart")
    assert len(checkpoints) >= 2 and checkpoints[-1] == 60, checkpoints
    logs = sorted((data / "pods" / "default").glob("quickstart-worker-*/*.log"))
    records = [r for log in logs for r in step_records(log)]
    assert records, "no step lines in the worker logs"
    first, last = records[0]["loss"], records[-1]["loss"]
    assert last < first * 0.8, f"loss did not go down: {first} -> {last}"

    # The trained model, exported by rank 0 once training completed (spec.output).
    output = data / "shared" / "output" / "quickstart"
    assert {"model.safetensors", "config.json", "FINISHED"} <= {p.name for p in output.iterdir()}
    assert json.loads((output / "FINISHED").read_text())["step"] == 60
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(output)
    assert model.config.num_hidden_layers == 2
