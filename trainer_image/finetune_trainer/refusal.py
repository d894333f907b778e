"""A refused configuration ends the pod's torchrun at once instead of being retried.

torchrun restarts a failed worker group up to `--max-restarts` times (the job's
`faultTolerance.maxRestarts`, per pod) and has no exit code that means "do not retry". A
refusal (`UnsupportedConfigError`: a dataset that is not there, storage owned by another job,
a strategy this device cannot run) fails the same way on every attempt, each after the
trainer's whole start (imports, data, maybe the model), so the pod would end minutes later
with the report it already had.

So the launcher, which is torchrun's agent process, names a file in the environment its
workers inherit (`arm`). A refusing worker writes its message there and sends the agent
SIGTERM (`refuse`), which torchrun turns into an orderly shutdown of the group; the launcher
then finds the file (`refused`) and exits as a refusal, not as a stop. The operator fails the
job on the worker's termination report either way; this only saves the retries.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from pathlib import Path

ENV = "FT_REFUSAL_FILE"  # "<agent pid>:<path>", set by the launcher for its workers
EXIT_CONFIG_ERROR = 2  # the trainer's and the launcher's exit code for a refusal


def arm() -> Path | None:
    """The file a refusing worker of this agent writes; announced to the workers. None
    where no temporary directory can be made: refusals are then retried, as before."""
    try:
        path = Path(tempfile.mkdtemp(prefix="finetune-refusal-")) / "message"
    except OSError:
        return None
    os.environ[ENV] = f"{os.getpid()}:{path}"
    return path


def disarm(path: Path | None) -> None:
    os.environ.pop(ENV, None)
    if path is not None:
        shutil.rmtree(path.parent, ignore_errors=True)


def refuse(message: str) -> bool:
    """Tell this worker's agent that the configuration was refused; False when not run by
    the launcher (a trainer started on its own, or under a plain torchrun)."""
    agent, _, path = os.environ.get(ENV, "").partition(":")
    # Only the launcher that armed it is signalled: never a parent that merely passed the
    # variable on (a shell, another wrapper).
    if not agent.isdigit() or int(agent) != os.getppid() or not path:
        return False
    try:
        Path(path).write_text(message)
        os.kill(int(agent), signal.SIGTERM)
    except OSError:
        return False
    return True


def refused(path: Path | None) -> str | None:
    """The refusal a worker left, None when none did (a real SIGTERM: a stop)."""
    if path is None:
        return None
    try:
        return path.read_text()
    except OSError:
        return None
